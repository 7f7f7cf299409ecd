"""Node-wide defaults shared by the CNI handler, the rule renderer and the xDS builder.

The passthrough mark is the one value that two sides must agree on: Envoy stamps it on its
upstream sockets in the pod netns (SO_MARK) and the pod rules RETURN it ahead of the redirect,
but only for sockets of the proxy's cgroup: a pod process may set the mark too.
0xAE under mask 0xFF lives in the low byte, clear of kube-proxy (0x4000/0x8000),
Calico (0xffff0000) and Cilium (0x0f00) marks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

CAPTURE_PORT = 15001
MESH_PORT = 18081
#: Where a captured pod's DNS (UDP and TCP to port 53) is redirected: the pod DNS's sockets
#: on the loopback of the pod's netns (agent/dns/).
DNS_PORT = 15053
# Where a pod selected by an AuthorizationPolicy has its plaintext inbound judged (#41)
JUDGE_PORT = 15006
PASSTHROUGH_MARK = 0xAE
PASSTHROUGH_MARK_MASK = 0xFF
DEFAULT_RUN_DIR = "/var/run/aether"
DEFAULT_SYSTEM_NAMESPACES = ("kube-system", "kube-public", "kube-node-lease", "aether-system")


class PeerProxy:
    """The other agent's proxy cgroup while two agents overlap on a node (a take-over,
    ``agent.runtime.takeover``): both Envoys' upstream sockets must RETURN in every pod's rules until
    the old one has exited. Shared by reference, so every holder of the node config renders
    the same rules."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value: tuple[str, int] | None = None

    def get(self) -> tuple[str, int] | None:
        with self._lock:
            return self._value

    def set(self, value: tuple[str, int] | None) -> None:
        with self._lock:
            self._value = value


class AuthzSelection:
    """Whether an AuthorizationPolicy selects a pod (namespace, labels): such a pod has its
    plaintext inbound steered to the proxy to be judged, even PERMISSIVE. Set once the mesh
    runtime holds the policies; shared by reference like ``PeerProxy``, so the ADD, the live
    enrollment pass and the repair loop decide alike."""

    def __init__(self) -> None:
        self._selects: Callable[[str, Mapping[str, str]], bool] | None = None

    def set(self, selects: Callable[[str, Mapping[str, str]], bool] | None) -> None:
        self._selects = selects

    def selects(self, namespace: str, labels: Mapping[str, str]) -> bool:
        fn = self._selects
        return bool(fn(namespace, labels)) if fn is not None else False


@dataclass(frozen=True)
class NodeConfig:
    """What the agent was started with; plain data so pure code can take it."""

    node_name: str = "localhost"
    run_dir: str = DEFAULT_RUN_DIR
    capture_port: int = CAPTURE_PORT
    mesh_port: int = MESH_PORT
    passthrough_mark: int = PASSTHROUGH_MARK
    passthrough_mark_mask: int = PASSTHROUGH_MARK_MASK
    system_namespaces: tuple[str, ...] = DEFAULT_SYSTEM_NAMESPACES
    agent_namespace: str = "aether-system"
    agent_labels: dict[str, str] = field(default_factory=lambda: {"app.kubernetes.io/name": "aether-agent"})
    # The node proxy's cgroup v2 (nft path relative to /sys/fs/cgroup) and its level: pod
    # rules RETURN the passthrough mark only for sockets of that cgroup (agent.netns.cgroup).
    proxy_cgroup: str | None = None
    proxy_cgroup_level: int = 0
    # Why there is no proxy cgroup match on this host (None when there is one): the node is
    # reported degraded, since pods could then forge the mark.
    proxy_cgroup_problem: str | None = None
    # (nft name, level) of the other agent's proxy cgroup during a take-over, else None
    peer_proxy: PeerProxy = field(default_factory=PeerProxy, compare=False, hash=False)
    # The node's own addresses (its netns at agent start): STRICT pods accept plaintext from
    # these only, which is where kubelet's health probes come from.
    node_addresses: tuple[str, ...] = ()
    # Where captured pods accept the mesh hop (mTLS, the destination port in SNI).
    inbound_port: int = 15008
    # Where the proxy judges the plaintext inbound of pods an AuthorizationPolicy selects
    judge_port: int = JUDGE_PORT
    authz: AuthzSelection = field(default_factory=AuthzSelection, compare=False, hash=False)
    # DNS capture (#42): the node default (a pod annotation opts out) and the port
    dns_capture: bool = False
    dns_port: int = DNS_PORT

    @property
    def cni_socket(self) -> str:
        return f"{self.run_dir}/cni.sock"
