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

import logging
import operator
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from google.protobuf.message import Message

from agent.authz.policy import needs_http
from agent.common.config import CAPTURE_PORT, JUDGE_PORT, PASSTHROUGH_MARK
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
from agent.envoy.judge import build_judge_listener, judge_listener_name
from agent.envoy.mtls import MeshTls
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
from agent.envoy.pieces import (
    ORIGINAL_DST_LOCAL_STATE,
    ORIGINAL_DST_REMOTE_STATE,
    tcp_proxy_filter,
)
from agent.envoy.pod_listener import (
    PodListener,
    build_listener,
)
from agent.envoy.raw import (
    RawResource,
    encode_chains,
    resource_hash,
)
from agent.envoy.service_chains import (
    ChainResult,
    TrafficLogs,
    _cidr,
    _namespace_head,
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
from agent.scope.model import Endpoint, ServiceView
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

log = logging.getLogger("agent.envoy.resources")


@dataclass(frozen=True)
class NodeXdsState:
    """Everything the xDS builder needs; frozen so it can be shared across threads."""

    pods: tuple[PodListener, ...]
    capture_port: int = CAPTURE_PORT
    passthrough_mark: int = PASSTHROUGH_MARK
    connect_timeout_s: float = 5.0
    # In-scope Services (agent.scope.model views): chains, EDS clusters and endpoints. Pass
    # the same tuple (or the same view objects) when they did not change: the builder then
    # skips them entirely.
    services: tuple[ServiceView, ...] = ()
    # Stream passthrough connections to the agent's access log service (dependency learning).
    learn_access_log: bool = True
    # Which passthrough destinations to stream: (ClusterIP, port) of the in-mesh Services
    # not in scope (``MeshModel.learnable_targets``), the only ones learning can act on; each
    # port gets a chain of its own. None: stream every passthrough connection (no model).
    learn_targets: tuple[tuple[str, int], ...] | None = None
    # One stdout line per passthrough connection (``--access-log``): off by default, since
    # writing and relaying it costs more per connection than proxying it does.
    connection_log: bool = False
    # GAMMA route tables (agent.scope.route_tables.GammaResult) for the in-scope route targets; the
    # same object while routes are unchanged, so unchanged chains are reused.
    gamma: GammaResult | None = None
    # Mesh identity (agent.envoy.mtls.MeshTls): Service traffic becomes mTLS to the endpoint
    # pod's inbound port, every captured pod gets its inbound listeners. None:
    # no identity provider, Service traffic goes to the endpoints in plaintext.
    mesh_tls: MeshTls | None = None
    resilience: Resilience = Resilience()
    # Golden metrics: Service and HTTP chains count every connection and request in Envoy's
    # stats (agent.envoy.golden); off: nothing counted per connection or request.
    traffic_metrics: bool = True


def _as_chains(result: ChainResult) -> tuple[listener_components_pb2.FilterChain, ...]:
    if isinstance(result, listener_components_pb2.FilterChain):
        return (result,)
    return tuple(result)


@dataclass
class _ServiceEntry:
    """Cached protos for one Service; each piece is keyed by exactly what it depends on."""

    view: ServiceView
    chain_key: tuple[Any, ...]
    # per TCP port: (ClusterIP:port claims, shared chain bytes or None when caller-specific)
    ports: tuple[tuple[ServicePort, tuple[tuple[str, int], ...], bytes | None], ...]
    cluster_key: tuple[Any, ...]
    # (name, resource) pairs, one per TCP port mostly: a 1-key dict each was 184 bytes
    clusters: tuple[tuple[str, RawResource], ...]
    eds: tuple[tuple[str, tuple[tuple[Endpoint, ...], RawResource]], ...]
    # caller namespace -> port -> chain bytes, for ports whose chains vary by caller
    per_caller: dict[str, dict[int, bytes]] = field(default_factory=dict)


@dataclass
class _ServiceTables:
    """The outcome of one pass over the Services (reused while they are the same objects)."""

    views: tuple[ServiceView, ...]
    # (connect timeout, passthrough mark, tunnel, resilience, traffic metrics): what every
    # Service's cluster and chains are built with
    timeout: tuple[float, int, bool, Resilience, TrafficLogs]
    clusters: dict[str, Message]
    assignments: dict[str, Message]
    # (entry, port, shared chain bytes or None) in table order, clash-free
    rows: list[tuple[_ServiceEntry, ServicePort, bytes | None]]
    shared: bytes | None  # every row's chains; None: some rows are per caller
    gamma: GammaResult | None = None
    claimed: frozenset[tuple[str, int]] = frozenset()  # (ClusterIP, port) with a chain


def _raw(msg: Message, name: str) -> RawResource:
    """Per-Service clusters and endpoints are kept serialized: 10k of them as upb protos
    cost ~80 MB, as bytes ~5 MB."""
    return RawResource(type(msg), name, msg.SerializeToString(deterministic=True))


def _same(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _same_dict(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(map(operator.is_, a.values(), b.values()))


class ResourceBuilder:
    """Incremental ``build_resources``: unchanged Services, chain tables, namespace listeners
    and pod listeners are reused, so protos (and their identities, and the dicts holding
    them) stay put unless their inputs changed."""

    def __init__(self) -> None:
        self._services: dict[str, _ServiceEntry] = {}
        self._tables: _ServiceTables | None = None
        # caller namespace -> (chain table bytes, learn flag, listener)
        self._ns_listeners: dict[str, tuple[bytes, tuple[bool, bool, tuple[int, ...]],
                                             RawResource, bytes]] = {}
        self._ns_clusters: dict[tuple[str, float, str], cluster_pb2.Cluster] = {}
        # (the tables it was computed from, namespaces with consumer routes of their own)
        self._own: tuple[_ServiceTables | None, frozenset[str]] = (None, frozenset())
        # caller namespace -> the internal listener key its cluster reached in the last
        # build; the keys of the internal listeners that build emitted; the namespaces
        # with a listener of their own (kept while they have pods: see ``build``)
        self._reach: dict[str, str] = {}
        self._emitted: frozenset[str] = frozenset()
        self._sticky: frozenset[str] = frozenset()
        #: True when a cluster still reaches its old listener because the one it moves to
        #: is new in this build: build again once this one is pushed (``XdsServer`` does)
        self.pending_switch = False
        # Pod listeners, kept up to date by difference (``_pod_part``): an ADD or DEL
        # touches its own pod's entries, not every pod's. pod -> its (name, listener) pairs
        self._pod_entries: dict[PodListener, tuple[tuple[str, Any], ...]] = {}
        self._pod_set: frozenset[PodListener] | None = None
        self._pod_key: tuple[Any, ...] = ()
        self._pod_out: dict[str, Any] = {}  # every pod's listeners by name
        self._pod_uids: set[str] = set()
        # uid -> (connect timeout, the cluster to the pod's own detection listener); kept
        # while the pod is on the node, so a listener still naming it never finds it gone
        self._detect_clusters: dict[str, tuple[float, cluster_pb2.Cluster]] = {}
        self._ns_count: Counter[str] = Counter()  # pods per caller namespace
        self._by_identity: dict[str, set[PodListener]] = {}  # pods per identity
        self._held: frozenset[str] = frozenset()  # identities with an SVID, last build
        # listener name -> resource_hash, for the xDS server (``prehashed``)
        self._listener_hashes: dict[str, str] = {}
        self._listeners_out: dict[str, Any] | None = None
        self._shared_names: set[str] = set()
        #: type -> (an output dict, {name: resource_hash}) for the dicts this builder hashed
        #: itself as it built them (the xDS server uses them for that very dict only)
        self.prehashed: dict[str, tuple[dict[str, Any], dict[str, str]]] = {}
        self._passthrough: tuple[tuple[int, float], cluster_pb2.Cluster] | None = None
        # (key of object ids, output, the keyed objects): a key of ids is valid only while
        # its objects live (a freed object's id is reused), so the entry holds them
        self._cluster_out: tuple[tuple[Any, ...], dict[str, Message], Any] | None = None
        self._gamma: GammaResult | None = None
        self._detect: tuple[int, ...] = ()
        # (targets, connection log, claimed) -> the learn chains' bytes
        self._learn: tuple[tuple[Any, ...], bytes] = ((), b"")
        # resources that depend only on their key (mTLS listeners and clusters)
        self._fixed_cache: dict[Any, Any] = {}
        self._fixed_used: set[Any] = set()
        self._secrets: tuple[Any, dict[str, Message], Any] = ((), {}, ())

    # ---- Services ------------------------------------------------------------------------

    def _service(self, view: ServiceView, timeout: tuple[float, int, bool, Resilience, TrafficLogs]
                 ) -> _ServiceEntry:
        old = self._services.get(view.key)
        sig = gamma_signature(self._gamma, view.key)
        if old is not None and old.view is view and old.cluster_key[-1] == timeout \
                and old.chain_key[-1] == sig:
            return old
        if not view.cluster_ips:
            return self._headless(view, timeout)
        tcp_ports = tuple(p for p in view.ports if p.protocol.upper() == "TCP")
        attempts, logs = timeout[3].connect_attempts, timeout[4]
        chain_key = (view.namespace, view.name, view.cluster_ips, tcp_ports, view.traffic,
                     attempts, logs, sig)
        per_caller: dict[str, dict[int, bytes]] = {}
        if old is not None and old.chain_key == chain_key and not old.per_caller \
                and all(c is not None for _, _, c in old.ports):
            ports = old.ports
        else:
            cidrs = [c for c in map(_cidr, view.cluster_ips) if c is not None]
            rows = []
            for p in tcp_ports if cidrs else ():
                claims = tuple((c.address_prefix, p.port) for c in cidrs)
                shared = (None if chain_varies_by_caller(view, p, self._gamma)
                          else encode_chains(_as_chains(chain_for(view, p, None, self._gamma,
                                                                  attempts, logs))))
                rows.append((p, claims, shared))
            ports = tuple(rows)
        cluster_key = (view.namespace, view.name,
                       tuple((p.port, p.app_protocol) for p in tcp_ports),
                       view.traffic, timeout)
        if old is not None and old.cluster_key == cluster_key:
            clusters = old.clusters
        else:
            clusters = tuple((n, _raw(build_service_cluster(view, p.port, *timeout[:4]), n))
                             for p in tcp_ports
                             for n in [service_cluster_name(view.namespace, view.name, p.port)])
        eds = {}
        old_eds = dict(old.eds) if old is not None and old.cluster_key[-1] == timeout else {}
        for p in tcp_ports:
            name = service_cluster_name(view.namespace, view.name, p.port)
            eps = view.endpoints.get(p.port, ())
            prev = old_eds.get(name)
            eds[name] = prev if prev is not None and prev[0] == eps else (
                eps, _raw(build_load_assignment(name, eps, timeout[2]), name))
        entry = _ServiceEntry(view, chain_key, ports, cluster_key, clusters, tuple(eds.items()),
                              per_caller)
        self._services[view.key] = entry
        return entry

    def _headless(self, view: ServiceView, timeout: tuple[float, int, bool, Resilience, TrafficLogs]
                  ) -> _ServiceEntry:
        """A headless Service: clients dial its pods' addresses (from DNS) on the target
        port, so each endpoint address and port gets a chain of its own and a cluster of one
        host, a mesh hop to exactly that pod (mTLS when identity is on) instead of the
        passthrough. Readiness does not gate it: a pod dialled by address is reached as it
        would be without the mesh."""
        tcp_ports = tuple(p for p in view.ports if p.protocol.upper() == "TCP")
        rows = []
        clusters: dict[str, RawResource] = {}
        eds: dict[str, tuple[tuple[Endpoint, ...], RawResource]] = {}
        seen: set[tuple[str, int]] = set()
        for p in tcp_ports:
            # the Service as a whole stays a cluster too: a GAMMA route may name it a backend
            svc_name = service_cluster_name(view.namespace, view.name, p.port)
            clusters[svc_name] = _raw(build_service_cluster(view, p.port, *timeout[:4]), svc_name)
            all_eps = view.endpoints.get(p.port, ())
            eds[svc_name] = (all_eps, _raw(build_load_assignment(svc_name, all_eps, timeout[2]),
                                           svc_name))
            chains = []
            claims = []
            for ep in sorted(all_eps, key=lambda e: (e.ip, e.port)):
                cidr = _cidr(ep.ip)
                if cidr is None or (ep.ip, ep.port) in seen:
                    continue
                seen.add((ep.ip, ep.port))
                name = pod_cluster_name(view.namespace, view.name, ep.ip, ep.port)
                cluster = build_service_cluster(view, p.port, *timeout[:4])
                cluster.name = name
                cluster.eds_cluster_config.service_name = name
                cluster.ClearField("outlier_detection")  # one host: nothing to eject it for
                clusters[name] = _raw(cluster, name)
                one = (ep.evolve(always_ready=True, draining=False),)
                eds[name] = (one, _raw(build_load_assignment(name, one, timeout[2]), name))
                match = listener_components_pb2.FilterChainMatch(prefix_ranges=[cidr])
                match.destination_port.value = ep.port
                logs = tcp_traffic_logs(timeout[4])
                chains.append(listener_components_pb2.FilterChain(
                    name=name, filter_chain_match=match,
                    filters=[tcp_proxy_filter(name, name, *logs)]))
                claims.append((cidr.address_prefix, ep.port))
            if chains:
                rows.append((p, tuple(claims), encode_chains(chains)))
        key = ("headless", view.namespace, view.name, tuple(sorted(seen)), view.traffic,
               timeout)
        entry = _ServiceEntry(view, (*key, gamma_signature(self._gamma, view.key)), tuple(rows),
                              key, tuple(clusters.items()), tuple(eds.items()))
        self._services[view.key] = entry
        return entry

    def _service_tables(self, state: NodeXdsState) -> _ServiceTables:
        old = self._tables
        opts = (state.connect_timeout_s, state.passthrough_mark, state.mesh_tls is not None,
                state.resilience, TrafficLogs(state.traffic_metrics, state.connection_log))
        if old is not None and old.timeout == opts \
                and _same(old.views, state.services) and old.gamma is state.gamma:
            return old
        clusters: dict[str, Message] = {}
        assignments: dict[str, Message] = {}
        rows: list[tuple[_ServiceEntry, ServicePort, bytes | None]] = []
        claimed: dict[tuple[str, int], str] = {}
        live: set[str] = set()
        for view in sorted(state.services, key=lambda v: v.key):
            if view.key in live:
                raise ValueError(f"duplicate service {view.key}")
            live.add(view.key)
            entry = self._service(view, opts)
            clusters.update(entry.clusters)
            assignments.update((n, cla) for n, (_, cla) in entry.eds)
            for port, claims, chains in entry.ports:
                clash = sorted({claimed[k] for k in claims if k in claimed})
                if clash:  # two Services claiming one ClusterIP:port would NACK the listener
                    log.warning("service %s: %s already served by %s; chain skipped", view.key,
                                service_cluster_name(view.namespace, view.name, port.port),
                                ",".join(clash))
                    continue
                claimed.update((k, view.key) for k in claims)
                rows.append((entry, port, chains))
        for key in [k for k in self._services if k not in live]:
            del self._services[key]
        shared: bytes | None = None
        if all(c is not None for _, _, c in rows):
            flat = b"".join(c or b"" for _, _, c in rows)
            prev = old.shared if old is not None else None
            shared = prev if prev is not None and prev == flat else flat
        tables = _ServiceTables(tuple(state.services), opts,
                                dict(sorted(clusters.items())), dict(sorted(assignments.items())),
                                rows, shared, state.gamma, frozenset(claimed))
        if old is not None:  # same objects: keep the dict identity too (cheap to publish)
            if _same_dict(old.assignments, tables.assignments):
                tables.assignments = old.assignments
            if _same_dict(old.clusters, tables.clusters):
                tables.clusters = old.clusters
        self._tables = tables
        return tables

    def _caller_table(self, tables: _ServiceTables, ns: str) -> bytes:
        if tables.shared is not None:
            return tables.shared
        out: list[bytes] = []
        for entry, port, chains in tables.rows:
            if chains is None:
                mine = entry.per_caller.setdefault(ns, {})
                got = mine.get(port.port)
                if got is None:
                    got = mine[port.port] = encode_chains(
                        _as_chains(chain_for(entry.view, port, ns, self._gamma,
                                             entry.cluster_key[-1][3].connect_attempts,
                                             entry.cluster_key[-1][4])))
                chains = got
            out.append(chains)
        table = b"".join(out)
        prev = self._ns_listeners.get(ns)
        return prev[0] if prev is not None and prev[0] == table else table

    # ---- listeners -----------------------------------------------------------------------

    def _own_namespaces(self, tables: _ServiceTables) -> frozenset[str]:
        """Caller namespaces whose chain table is not everyone's: those with a consumer
        route (GEP-1294) on a row of the table. Every other namespace reaches the shared
        listener, so the node holds (and Envoy parses) the table once, not per namespace."""
        if self._own[0] is tables:
            return self._own[1]
        own: frozenset[str] = frozenset()
        if tables.shared is None and tables.gamma is not None:
            varying = {(e.view.key, p.port) for e, p, c in tables.rows if c is None}
            own = frozenset(s for (t, p, s) in tables.gamma.tables
                            if s is not None and (t, p) in varying)
        self._own = (tables, own)
        return own

    def seed(self, reach: Mapping[str, str], listeners: Iterable[str]) -> None:
        """What an Envoy this builder did not build holds (an agent restarted, Envoy adopted):
        ``reach``, each caller namespace's cluster's internal listener (``mesh`` or
        ``mesh-<ns>``, from ``adopted.namespace_reach``), and the internal listeners it
        has. The first build then moves no cluster to a listener Envoy lacks and keeps
        every namespace's own listener it finds (removing one closes the connections it
        carries), exactly as if this builder had made them."""
        def key(listener: str) -> str | None:
            if listener == SHARED_MESH_LISTENER:
                return SHARED_CALLERS
            if listener.startswith(NAMESPACE_LISTENER_PREFIX):
                return listener.removeprefix(NAMESPACE_LISTENER_PREFIX)
            return None

        self._reach = {ns: k for ns, lis in reach.items()
                       if (k := key(lis)) in (SHARED_CALLERS, ns)}
        self._sticky = frozenset(ns for ns, k in self._reach.items() if k == ns)
        self._emitted = frozenset(k for lis in listeners if (k := key(lis)) is not None)

    def hold_moves(self) -> None:
        """Envoy refused the push that carried the listeners clusters were about to move
        to: forget it carried them, so the clusters stay where they are (the next build
        offers those listeners again and asks for another build)."""
        self._emitted = frozenset(self._reach.values())
        self.pending_switch = False

    def _learn_bytes(self, state: NodeXdsState, tables: _ServiceTables) -> bytes:
        """The learn chains (empty when learning is off or streams everything), cached."""
        if not state.learn_access_log or state.learn_targets is None:
            return b""
        key = (state.learn_targets, state.connection_log, tables.claimed)
        if self._learn[0] != key:
            targets = [t for t in state.learn_targets if t not in tables.claimed]
            self._learn = (key, encode_chains(learn_chains(targets, state.connection_log)))
        return self._learn[1]

    def _namespace_listener(self, ns: str, table: bytes, learn_all: bool, conn_log: bool,
                            learn: bytes) -> RawResource:
        prev = self._ns_listeners.get(ns)
        flags = (learn_all, conn_log, self._detect)
        if prev is not None and prev[0] is table and prev[1] == flags and prev[3] is learn:
            return prev[2]
        lis = RawResource(listener_pb2.Listener, namespace_listener_name(ns),
                          _namespace_head(ns, learn_all, self._detect, conn_log) + table + learn)
        self._ns_listeners[ns] = (table, flags, lis, learn)
        return lis

    def build(self, state: NodeXdsState) -> dict[str, dict[str, Any]]:
        """type_url -> {resource name: proto}; ordered by name so output is deterministic."""
        if state.gamma is not self._gamma:
            self._gamma = state.gamma
            self._detect = detect_ports(state.gamma, state.services)
        tables = self._service_tables(state)

        tls = state.mesh_tls
        held = tls.svids if tls is not None else {}
        pods_changed = self._pod_part(state, held)
        namespaces = sorted(self._ns_count)
        own = self._own_namespaces(tables)
        # A namespace that got a listener of its own keeps it while it has pods on the node,
        # routes or not, and the shared one stays while any namespace does: removing a
        # listener closes the connections it carries (after Envoy's drain time), so a
        # route change must only ever change chains, as it did when every namespace had
        # its own. Moves therefore go one way, shared to own.
        sticky = frozenset(ns for ns in namespaces if ns in own or ns in self._sticky)
        # caller namespace -> the key of the internal listener its cluster reaches. A
        # cluster moves to a listener only once an earlier build emitted it: pushes go
        # out CDS before LDS, so a cluster and a listener new in the same push would leave
        # the namespace's connections without a listener until the LDS lands. Until then
        # it keeps the old one, and ``pending_switch`` asks for the next build.
        reach: dict[str, str] = {}
        pending = False
        for ns in namespaces:
            want = ns if ns in sticky else SHARED_CALLERS
            was = self._reach.get(ns)
            reach[ns] = want if was is None or want in self._emitted else was
            pending = pending or reach[ns] != want
        # every listener a cluster reaches is among these: a namespace only ever waits on
        # the shared one, and one that reached its own is still sticky
        keys = sorted({SHARED_CALLERS, *sticky}) if namespaces else []
        ns_listeners: dict[str, RawResource] = {}
        learn = self._learn_bytes(state, tables)
        learn_all = state.learn_access_log and state.learn_targets is None
        for key in keys:
            table = self._caller_table(tables, key)
            ns_listeners[namespace_listener_name(key)] = self._namespace_listener(
                key, table, learn_all, state.connection_log, learn)
        for key in [k for k in self._ns_listeners if k not in keys]:
            del self._ns_listeners[key]
        for e in self._services.values():
            for key in [k for k in e.per_caller if k not in keys]:
                del e.per_caller[key]
        shared = dict(ns_listeners)
        if tls is not None:
            shared[mtls.MTLS_OUT_LISTENER] = self._fixed("mtls-out", mtls.build_mtls_out_listener)
            shared[mtls.INBOUND_DETECT] = self._fixed("inbound-detect",
                                                      mtls.build_inbound_detect_listener)
        listeners = self._listeners(shared, pods_changed)

        pt_key = (state.passthrough_mark, state.connect_timeout_s)
        if self._passthrough is None or self._passthrough[0] != pt_key:
            self._passthrough = (pt_key, build_passthrough_cluster(*pt_key))
        ns_clusters = {}
        used = set()
        for ns in namespaces:
            ck = (ns, state.connect_timeout_s, namespace_listener_name(reach[ns]))
            c = self._ns_clusters.get(ck)
            if c is None:
                c = self._ns_clusters[ck] = build_namespace_cluster(ns, state.connect_timeout_s,
                                                                    ck[2])
            ns_clusters[c.name] = c
            used.add(ck)
        self._ns_clusters = {k: c for k, c in self._ns_clusters.items() if k in used}
        if tls is not None:
            mark, t = state.passthrough_mark, state.connect_timeout_s
            bind_key = (mark, t)

            def bound(build: Callable[..., cluster_pb2.Cluster], *args: Any
                      ) -> Callable[[], cluster_pb2.Cluster]:
                """``build`` with the mesh clusters' bind config, made on a cache miss only."""
                return lambda: build(*args, bind=upstream_bind_config(mark), connect_timeout_s=t)

            for identity in sorted(i for i in self._by_identity if i in held):
                ns_clusters[mtls.mtls_cluster_name(identity)] = self._fixed(
                    ("mtls", identity, tls.trust_domain, tls.inbound_port, bind_key),
                    bound(mtls.build_mtls_cluster, identity, tls))
            ns_clusters[mtls.INBOUND_DETECT] = self._fixed(
                ("inbound-detect", t), lambda: mtls.build_inbound_detect_cluster(t))
            self._detect_clusters = {u: tc for u, tc in self._detect_clusters.items()
                                     if u in self._pod_uids}
            for _t, c in self._detect_clusters.values():
                ns_clusters[c.name] = c
            ns_clusters[mtls.INBOUND_DELIVER_CLUSTER] = self._fixed(
                ("inbound-deliver", bind_key), bound(mtls.build_inbound_deliver_cluster))
            secrets = self._secrets_for(tls)
        else:
            secrets = {}
        self._fixed_cache = {k: v for k, v in self._fixed_cache.items() if k in self._fixed_used}
        self._fixed_used = set()
        out_key = (id(tables.clusters), id(self._passthrough[1]),
                   tuple(id(c) for c in ns_clusters.values()))
        if self._cluster_out is None or self._cluster_out[0] != out_key:
            clusters = dict(tables.clusters)
            clusters[PASSTHROUGH_CLUSTER] = self._passthrough[1]
            clusters.update(ns_clusters)
            self._cluster_out = (out_key, dict(sorted(clusters.items())), tables.clusters)
        # recorded only now that the build is complete (a build that raised left nothing
        # behind for the next one to move a cluster to)
        self._reach, self._emitted, self._sticky = reach, frozenset(keys), sticky
        self.pending_switch = pending
        return {
            mtls.SECRET_TYPE: secrets,
            CLUSTER_TYPE: self._cluster_out[1],
            ENDPOINT_TYPE: tables.assignments,
            LISTENER_TYPE: listeners,
        }

    # ---- pod listeners -------------------------------------------------------------------

    def _pod_part(self, state: NodeXdsState, held: Mapping[str, Any]) -> bool:
        """Bring the pod listeners up to ``state.pods`` by difference with the last build:
        only pods that came or went are built or dropped (a DEL or ADD is O(1) here, not
        O(pods)); a change of what every pod listener depends on (capture port, mTLS
        settings, the connection log) rebuilds them all, an identity's SVID coming or going
        the pods of that identity. True when anything changed."""
        tls = state.mesh_tls
        key = (state.capture_port, state.connection_log,
               (tls.inbound_port, tls.trust_domain) if tls is not None else None)
        pods = state.pods if isinstance(state.pods, frozenset) else frozenset(state.pods)
        if len(pods) != len(state.pods):
            self._pod_set = None  # rebuilt in full next time
            raise ValueError("duplicate pods in the xDS state")
        now_held = frozenset(held)
        flipped = self._held ^ now_held
        self._held = now_held
        if key != self._pod_key or self._pod_set is None:
            gone, new = tuple(self._pod_entries), pods
            self._pod_key = key
        else:
            # the pods whose listeners name an SVID that came or went are built again
            again = frozenset(p for i in flipped for p in self._by_identity.get(i, ()))
            if pods == self._pod_set and not again:
                return False
            gone = tuple((self._pod_set - pods) | (again & pods))
            new = (pods - self._pod_set) | (again & pods)
        for pod in gone:
            self._drop_pod(pod)
        try:
            for pod in sorted(new, key=lambda p: p.uid):
                if pod.uid in self._pod_uids:
                    raise ValueError(f"duplicate pod uid {pod.uid}")
                self._add_pod(pod, state, held)
        except BaseException:
            self._pod_set = None
            for pod in tuple(self._pod_entries):
                self._drop_pod(pod)
            raise
        self._pod_set = pods
        return True

    def _add_pod(self, pod: PodListener, state: NodeXdsState, held: Mapping[str, Any]) -> None:
        tls = state.mesh_tls
        has_id = pod.identity in held
        entries: list[tuple[str, Any]] = [
            (pod.listener_name, build_listener(pod, state.capture_port, has_id))]
        workload = f"{pod.namespace or DEFAULT_NAMESPACE}/{pod.workload or pod.uid}"
        # its policies name HTTP fields: its undeclared ports and plaintext callers are
        # judged past detection, in a listener of its own
        own_detect = tls is not None and has_id and bool(pod.ips) and needs_http(pod.authz)
        if tls is not None and has_id and pod.ips:
            entries.append((mtls.inbound_listener_name(pod.uid), mtls.build_inbound_listener(
                pod.uid, pod.netns_path, pod.identity, pod.ips, tls, pod.ipv4, pod.ipv6,
                forbidden_ports=(state.capture_port,), access_log=state.connection_log,
                workload=workload, policies=pod.authz)))
        if tls is not None and own_detect:
            entries.append((mtls.pod_detect_name(pod.uid), mtls.build_inbound_detect_listener(
                pod.uid, pod.authz, tls.trust_domain)))
            t = state.connect_timeout_s
            if self._detect_clusters.get(pod.uid, (None,))[0] != t:
                self._detect_clusters[pod.uid] = (
                    t, mtls.build_inbound_detect_cluster(t, pod.uid))
        if tls is not None and pod.authz and pod.ips:
            # its plaintext callers, steered here by its rules while a policy selects it
            entries.append((judge_listener_name(pod.uid), build_judge_listener(
                pod.uid, pod.netns_path, pod.ips, pod.authz, JUDGE_PORT, pod.ipv4, pod.ipv6,
                access_log=state.connection_log, detect=own_detect, workload=workload)))
        self._pod_entries[pod] = tuple(entries)
        for name, lis in entries:
            self._pod_out[name] = lis
            self._listener_hashes[name] = resource_hash(lis)
        self._pod_uids.add(pod.uid)
        self._ns_count[pod.namespace or DEFAULT_NAMESPACE] += 1
        self._by_identity.setdefault(pod.identity, set()).add(pod)

    def _drop_pod(self, pod: PodListener) -> None:
        if pod not in self._pod_entries:
            return
        for name, _lis in self._pod_entries.pop(pod):
            self._pod_out.pop(name, None)
            self._listener_hashes.pop(name, None)
        self._pod_uids.discard(pod.uid)
        ns = pod.namespace or DEFAULT_NAMESPACE
        self._ns_count[ns] -= 1
        if self._ns_count[ns] <= 0:
            del self._ns_count[ns]
        same = self._by_identity.get(pod.identity)
        if same is not None:
            same.discard(pod)
            if not same:
                del self._by_identity[pod.identity]

    def _listeners(self, shared: dict[str, Any], pods_changed: bool) -> dict[str, Any]:
        """Every listener: the pods' and the shared ones (namespace listeners, mtls-out).
        The same dict (and hashes) as last time when none of them changed, so the xDS server
        skips the type; otherwise a copy, with hashes kept per listener as they are built."""
        prev = self._listeners_out
        if prev is not None and not pods_changed and len(prev) == len(self._pod_out) + len(
                shared) and all(prev.get(n) is lis for n, lis in shared.items()):
            return prev
        for name in self._shared_names - shared.keys():
            self._listener_hashes.pop(name, None)
        self._shared_names = set(shared)
        for name, lis in shared.items():
            if prev is None or prev.get(name) is not lis or name not in self._listener_hashes:
                self._listener_hashes[name] = resource_hash(lis)
        out = dict(self._pod_out)
        out.update(shared)
        self._listeners_out = out
        self.prehashed[LISTENER_TYPE] = (out, dict(self._listener_hashes))
        return out

    def _fixed(self, key: Any, make: Callable[[], Any]) -> Any:
        """A resource that depends only on ``key``: built once, the same object while used."""
        self._fixed_used.add(key)
        got = self._fixed_cache.get(key)
        if got is None:
            got = self._fixed_cache[key] = make()
        return got

    def _secrets_for(self, tls: MeshTls) -> dict[str, Message]:
        """SDS resources, the same dict while the SVIDs and bundle are the same objects. The
        entry holds the SVIDs its key names by id: a renewed SVID allocated where a freed one
        was would otherwise match the old key and never reach Envoy."""
        key = (tuple(sorted((k, id(v)) for k, v in tls.svids.items())), tls.bundle_pem)
        if self._secrets[0] != key:
            self._secrets = (key, dict(mtls.build_secrets(tls)), tuple(tls.svids.values()))
        return self._secrets[1]


def build_resources(state: NodeXdsState, builder: ResourceBuilder | None = None
                    ) -> dict[str, dict[str, Any]]:
    """type_url -> {resource name: proto}; pass a long-lived ``builder`` to reuse protos."""
    return (builder or ResourceBuilder()).build(state)
