"""Pure translation of node state into Envoy xDS resources (no I/O).

Two tiers of listeners, so per-pod config stays constant-size however many Services exist:

* ``capture-<container id>``, one per captured pod, bound on the pod netns loopback (v4/v6,
  port 15001) through ``SocketAddress.network_namespace_filepath``. It only runs the
  ``original_dst`` listener filter and one chain: ``set_filter_state`` (the restored
  destination and source as ``envoy.filters.listener.original_dst.local_ip`` / ``remote_ip``,
  and the pod listener name as ``aether.capture_listener``, all shared with the upstream
  connection once) + ``tcp_proxy`` to the cluster ``mesh-<pod namespace>``. Its size does not
  depend on the Services.
* ``mesh``, the Envoy *internal listener* of every caller namespace without consumer routes
  of its own, and ``mesh-<namespace>`` for each namespace with some. Each namespace with
  captured pods has a STATIC cluster ``mesh-<namespace>`` whose only endpoint is the
  ``envoy_internal_address`` of its listener and whose transport socket is
  ``internal_upstream`` (it hands the shared filter state to the internal connection). Its
  ``original_dst`` listener filter restores the pod's original destination from that filter
  state, so chain matching, ``%DOWNSTREAM_LOCAL_ADDRESS%`` and the ORIGINAL_DST cluster all
  see the real destination. It holds one filter chain per in-scope (Service, port) matching
  its ClusterIPs (/32, /128) and port, proxying to the EDS cluster ``svc|<ns>|<name>|<port>``
  (the EDS resource has the same name), and the default ``passthrough`` chain: the
  ORIGINAL_DST cluster whose upstream sockets carry SO_MARK, so the pod's redirect rule can
  RETURN Envoy's own traffic. The passthrough chain streams a gRPC access log to the agent
  (dependency learning); the entry's ``listener`` tag is the pod listener name read back from
  filter state. A cluster per *caller* namespace leaves room for per-caller route tables
  (GAMMA): a namespace with a consumer route gets a listener of its own, built before its
  cluster moves to it (``ResourceBuilder.pending_switch``).

The bootstrap must enable the ``envoy.bootstrap.internal_listener`` extension.

Big or numerous resources (namespace listeners, per-Service clusters and endpoints) are held
serialized as ``RawResource`` (``.message()`` parses one back).

``ResourceBuilder`` caches the pieces per Service (chain, cluster, endpoints), the
chain table, the per-namespace listeners and the per-pod listeners, and returns the *same*
dict objects for resource types whose inputs did not change, so a pod ADD costs one small
listener whatever the number of Services. Callers must treat every returned proto and dict
as immutable (the xDS server memoises hashes by object identity).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from envoy.config.cluster.v3 import cluster_pb2
from google.protobuf.message import Message

from agent.envoy import mtls
from agent.envoy.clusters import (
    OVERPROVISIONING_FACTOR,
    Resilience,
    apply_resilience,
    build_load_assignment,
    build_namespace_cluster,
    build_passthrough_cluster,
    build_service_cluster,
    endpoint_health,
    endpoint_priority,
    upstream_bind_config,
)
from agent.envoy.hop_resources import HopResources
from agent.envoy.names import (
    ALS_LISTENER_TAG,
    ALS_LOG_NAME,
    ALS_MESH_LISTENER_TAG,
    CAPTURE_LISTENER_FORMAT,
    CAPTURE_LISTENER_STATE,
    CLUSTER_TYPE,
    DEFAULT_NAMESPACE,
    ENDPOINT_TYPE,
    HTTP_FAILURE_LOG_FORMAT,
    HTTP_FAILURE_LOG_TAG,
    LISTENER_PREFIX,
    LISTENER_TYPE,
    NAMESPACE_LISTENER_PREFIX,
    NETNS_ADDRESS_SELECTOR,
    NETNS_ADDRESS_SELECTOR_TYPE,
    PASSTHROUGH_CLUSTER,
    POD_CLUSTER_PREFIX,
    REQUEST_LOG_NAME,
    SERVICE_CLUSTER_PREFIX,
    SHARED_CALLERS,
    SHARED_MESH_LISTENER,
    SO_MARK,
    SOL_SOCKET,
    TRAFFIC_LOG_NAME,
    TRAFFIC_TAGS,
    astuple_shallow,
    namespace_listener_name,
    parse_service_cluster_name,
    pod_cluster_name,
    service_cluster_name,
)
from agent.envoy.namespace_tier import NamespaceTier
from agent.envoy.node_state import NodeXdsState
from agent.envoy.pieces import (
    ORIGINAL_DST_LOCAL_STATE,
    ORIGINAL_DST_REMOTE_STATE,
)
from agent.envoy.pod_listener import (
    PodListener,
    build_listener,
)
from agent.envoy.pod_table import PodTable
from agent.envoy.raw import (
    RawResource,
    encode_chains,
    resource_hash,
)
from agent.envoy.service_chains import (
    ChainResult,
    TrafficLogs,
    build_namespace_listener,
    chain_for,
    chain_varies_by_caller,
    detect_ports,
    gamma_signature,
    http_failure_access_log,
    http_traffic_logs,
    learn_chains,
    passthrough_chain,
    request_access_log,
    service_chain,
    tcp_traffic_logs,
    traffic_access_log,
)
from agent.envoy.service_tables import ServiceCache
from agent.scope.model import ServiceView
from agent.scope.route_tables import GammaResult
from agent.scope.services import ServicePort

# what the builders above hold, importable from here as before the split
__all__ = [
    "ALS_LISTENER_TAG",
    "ALS_LOG_NAME",
    "ALS_MESH_LISTENER_TAG",
    "CAPTURE_LISTENER_FORMAT",
    "CAPTURE_LISTENER_STATE",
    "CLUSTER_TYPE",
    "ChainResult",
    "DEFAULT_NAMESPACE",
    "ENDPOINT_TYPE",
    "HTTP_FAILURE_LOG_FORMAT",
    "HTTP_FAILURE_LOG_TAG",
    "LISTENER_PREFIX",
    "LISTENER_TYPE",
    "NAMESPACE_LISTENER_PREFIX",
    "NETNS_ADDRESS_SELECTOR",
    "NETNS_ADDRESS_SELECTOR_TYPE",
    "NodeXdsState",
    "ORIGINAL_DST_LOCAL_STATE",
    "ORIGINAL_DST_REMOTE_STATE",
    "OVERPROVISIONING_FACTOR",
    "PASSTHROUGH_CLUSTER",
    "POD_CLUSTER_PREFIX",
    "PodListener",
    "REQUEST_LOG_NAME",
    "RawResource",
    "Resilience",
    "ResourceBuilder",
    "SERVICE_CLUSTER_PREFIX",
    "SHARED_CALLERS",
    "SHARED_MESH_LISTENER",
    "SOL_SOCKET",
    "SO_MARK",
    "TRAFFIC_LOG_NAME",
    "TRAFFIC_TAGS",
    "TrafficLogs",
    "apply_resilience",
    "astuple_shallow",
    "build_listener",
    "build_load_assignment",
    "build_namespace_cluster",
    "build_namespace_listener",
    "build_passthrough_cluster",
    "build_resources",
    "build_service_cluster",
    "chain_for",
    "chain_varies_by_caller",
    "detect_ports",
    "encode_chains",
    "endpoint_health",
    "endpoint_priority",
    "gamma_signature",
    "http_failure_access_log",
    "http_traffic_logs",
    "learn_chains",
    "namespace_listener_name",
    "parse_service_cluster_name",
    "passthrough_chain",
    "pod_cluster_name",
    "request_access_log",
    "resource_hash",
    "service_chain",
    "service_cluster_name",
    "tcp_traffic_logs",
    "traffic_access_log",
    "upstream_bind_config",
]


def _chain_for(view: ServiceView, port: ServicePort, caller_ns: str | None,
               gamma: GammaResult | None, connect_attempts: int, logs: TrafficLogs | None
               ) -> ChainResult:
    """``chain_for``, looked up in this module at each call, as when the Service tier
    lived here (a test swaps ``resources.chain_for``)."""
    return chain_for(view, port, caller_ns, gamma, connect_attempts, logs)


class ResourceBuilder:
    """Incremental ``build_resources``: unchanged Services, chain tables, namespace listeners
    and pod listeners are reused, so protos (and their identities, and the dicts holding
    them) stay put unless their inputs changed.

    It drives one builder per tier and puts their output together: the Services' chains,
    clusters and endpoints (``service_tables``), the namespaces' internal listeners and
    clusters (``namespace_tier``), the pods' listeners (``pod_table``) and the mesh hop's
    node-wide resources (``hop_resources``)."""

    def __init__(self) -> None:
        self._services = ServiceCache(_chain_for)
        self._namespaces = NamespaceTier()
        self._pods = PodTable()
        self._hop = HopResources()
        #: True when a cluster still reaches its old listener because the one it moves to
        #: is new in this build: build again once this one is pushed (``XdsServer`` does)
        self.pending_switch = False
        #: type -> (an output dict, {name: resource_hash}) for the dicts this builder hashed
        #: itself as it built them (the xDS server uses them for that very dict only)
        self.prehashed: dict[str, tuple[dict[str, Any], dict[str, str]]] = {}
        self._passthrough: tuple[tuple[int, float], cluster_pb2.Cluster] | None = None
        # (key of object ids, output, the keyed objects): a key of ids is valid only while
        # its objects live (a freed object's id is reused), so the entry holds them
        self._cluster_out: tuple[tuple[Any, ...], dict[str, Message], Any] | None = None
        self._gamma: GammaResult | None = None
        self._detect: tuple[int, ...] = ()

    def seed(self, reach: Mapping[str, str], listeners: Iterable[str]) -> None:
        """What an Envoy this builder did not build holds (an agent restarted, Envoy
        adopted): ``NamespaceTier.seed``."""
        self._namespaces.seed(reach, listeners)

    def hold_moves(self) -> None:
        """Envoy refused the push that carried the listeners clusters were about to move
        to: forget it carried them, so the clusters stay where they are (the next build
        offers those listeners again and asks for another build)."""
        self._namespaces.hold_moves()
        self.pending_switch = False

    def build(self, state: NodeXdsState) -> dict[str, dict[str, Any]]:
        """type_url -> {resource name: proto}; ordered by name so output is deterministic."""
        moved = state.mesh_port != self._services.mesh_port
        if moved:  # the detected ports below depend on it
            self._services.mesh_port = state.mesh_port
        if moved or state.gamma is not self._gamma:
            self._gamma = state.gamma
            self._detect = detect_ports(state.gamma, state.services)
            if self._detect and self._services.mesh_port is not None:
                # the mesh port stands for HTTP ports, some of which are detected
                self._detect = tuple(sorted({*self._detect, self._services.mesh_port}))
        opts = (state.connect_timeout_s, state.passthrough_mark, state.mesh_tls is not None,
                state.resilience, TrafficLogs(state.traffic_metrics, state.connection_log))
        tables = self._services.tables(state.services, opts, state.gamma)
        self.prehashed[ENDPOINT_TYPE] = (tables.assignments, self._services.hashes(tables))

        tls = state.mesh_tls
        held = tls.svids if tls is not None else {}
        pods_changed = self._pods.update(state, held)
        namespaces = sorted(self._pods.ns_count)
        reach, keys, sticky, pending = self._namespaces.plan(
            namespaces, self._namespaces.own_namespaces(tables))
        shared: dict[str, Any] = dict(self._namespaces.listeners(
            state, tables, self._services, keys, self._detect))
        if tls is not None:
            shared.update(self._hop.listeners())
        listeners = self._pods.listeners(shared, pods_changed)
        if self._pods.hashed is not None:
            self.prehashed[LISTENER_TYPE] = self._pods.hashed

        pt_key = (state.passthrough_mark, state.connect_timeout_s)
        if self._passthrough is None or self._passthrough[0] != pt_key:
            self._passthrough = (pt_key, build_passthrough_cluster(*pt_key))
        ns_clusters: dict[str, Any] = self._namespaces.clusters(reach, state.connect_timeout_s)
        if tls is not None:
            self._hop.add_clusters(ns_clusters, tls,
                                   sorted(i for i in self._pods.by_identity if i in held),
                                   state.passthrough_mark, state.connect_timeout_s,
                                   self._pods.detect_clusters())
            secrets = self._hop.secrets(tls)
        else:
            secrets = {}
        self._hop.sweep()
        out_key = (id(tables.clusters), id(self._passthrough[1]),
                   tuple(id(c) for c in ns_clusters.values()))
        if self._cluster_out is None or self._cluster_out[0] != out_key:
            clusters = dict(tables.clusters)
            clusters[PASSTHROUGH_CLUSTER] = self._passthrough[1]
            clusters.update(ns_clusters)
            self._cluster_out = (out_key, dict(sorted(clusters.items())), tables.clusters)
        # recorded only now that the build is complete (a build that raised left nothing
        # behind for the next one to move a cluster to)
        self._namespaces.commit(reach, keys, sticky)
        self.pending_switch = pending
        return {
            mtls.SECRET_TYPE: secrets,
            CLUSTER_TYPE: self._cluster_out[1],
            ENDPOINT_TYPE: tables.assignments,
            LISTENER_TYPE: listeners,
        }


def build_resources(state: NodeXdsState, builder: ResourceBuilder | None = None
                    ) -> dict[str, dict[str, Any]]:
    """type_url -> {resource name: proto}; pass a long-lived ``builder`` to reuse protos."""
    return (builder or ResourceBuilder()).build(state)
