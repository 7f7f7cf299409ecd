"""The running agent's options (``AgentOptions``), in a module of their own.

``agent.runtime.app`` composes the agent and re-exports them; the collaborators split out of
it (the status document, the take-over handshake, the probes, reconcile) take them too, and
must not import the composition (the layers: it sits above them).
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.runtime.takeover import Peer


@dataclass
class AgentOptions:
    """Everything beyond the node basics; defaults fit a standalone node."""

    manifests: str | None = None
    kubeconfig: str | None = None
    kube: bool = False  # metadata from the Kubernetes API (in-cluster when kubeconfig is None)
    mesh: bool = True
    mesh_domain: str = "aether.internal"
    trust_domain: str = "cluster.local"
    # AuthorizationPolicies in this namespace select pods mesh-wide (Istio's root namespace)
    root_namespace: str = "aether-system"
    scope_all: bool = False
    # where other nodes' pods come from: "meshpods" (their agents' MeshPod records; this
    # node's Pods only from the Pod API) or "pods" (every Pod of the cluster)
    remote_pods: str = "meshpods"
    learn_ttl: float = 600.0
    repair: str = "report"
    cni_conf_dir: str = "/etc/cni/net.d"
    cni_bin_dir: str = "/opt/cni/bin"
    daemonset_name: str = "aether-agent"
    daemonset_namespace: str = "aether-system"
    node_loops: bool = True  # readiness taint + repair (only with the Kubernetes API)
    gamma_controller_name: str = "aether.io/mesh"
    xmesh_create: bool = True  # keep an XMesh named "aether" when the CRD is installed
    envoy_on_exit: str = "auto"  # auto: keep Envoy unless stopping for good; stop; keep
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = None  # None or 0: no metrics server
    live_enrollment: bool = True  # capture/release running pods as labels change
    release_on_removal: bool = True  # our DaemonSet deleted: release every pod before exit
    # take-overs (agent.runtime.takeover): this agent's name (its control socket), the agent it
    # replaces (found at start), and how long a replaced agent's connections get after SIGTERM
    instance: str = ""
    peer: Peer | None = None
    drain_seconds: float = 30.0
