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

import hashlib
import ipaddress
import logging
import operator
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any, NamedTuple, TypeAlias

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import (
    address_pb2,
    config_source_pb2,
    grpc_service_pb2,
    health_check_pb2,
    socket_option_pb2,
)
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
from envoy.type.tracing.v3 import custom_tag_pb2
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message import Message

from agent.authz.policy import Policy
from agent.config import CAPTURE_PORT, JUDGE_PORT, PASSTHROUGH_MARK
from agent.envoy import mtls
from agent.envoy.envoy_stats import PASSTHROUGH_STATS
from agent.envoy.golden import SOURCE_STATE, http_stats_log, tcp_stats_log
from agent.envoy.judge import build_judge_listener, judge_listener_name
from agent.envoy.mtls import MeshTls
from agent.envoy.pieces import (
    AGENT_GRPC_CLUSTER,
    STRING_STATE_FACTORY,
    TRANSITIVE,
    UPSTREAM_NETNS_STATE,
    duration,
    http_grpc_access_log,
    internal_upstream,
    original_dst_filter,
    set_filter_state,
    state_value,
    stdout_access_log,
    tcp_grpc_access_log,
    tcp_proxy_filter,
)
from agent.identity.svid import identity_key
from agent.scope.model import Endpoint, ServiceView
from agent.scope.route_tables import GammaResult
from agent.scope.services import ServicePort, TrafficPolicy

LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"
CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
PASSTHROUGH_CLUSTER = "passthrough"
LISTENER_PREFIX = "capture-"
# The STATIC cluster per caller namespace, and the internal listener it reaches: ``mesh``,
# shared by every namespace whose callers see the same chains, or ``mesh-<ns>`` for a
# namespace with consumer routes of its own.
NAMESPACE_LISTENER_PREFIX = "mesh-"
SHARED_MESH_LISTENER = "mesh"
# The caller "namespace" of the shared listener: no real one (not a DNS label), so no
# consumer route applies to it and its table is the one every other namespace sees.
SHARED_CALLERS = "*"
DEFAULT_NAMESPACE = "default"
SERVICE_CLUSTER_PREFIX = "svc|"
ALS_LOG_NAME = "aether-passthrough"
# Access-log records (--access-log, agent.envoy.traffic): every connection a namespace
# listener closes, and every request an HTTP chain answers, reported to the agent.
TRAFFIC_LOG_NAME = "aether-traffic"
REQUEST_LOG_NAME = "aether-requests"
TRAFFIC_TAGS = {"chain": "%FILTER_CHAIN_NAME%", "flags": "%RESPONSE_FLAGS%"}
# Custom tags on every ALS entry: the pod listener that accepted the connection (from filter
# state) and the internal listener that logged it.
ALS_LISTENER_TAG = "listener"
ALS_MESH_LISTENER_TAG = "mesh_listener"

# Filter state handed from a pod listener to its namespace's internal listener.
ORIGINAL_DST_LOCAL_STATE = "envoy.filters.listener.original_dst.local_ip"
ORIGINAL_DST_REMOTE_STATE = "envoy.filters.listener.original_dst.remote_ip"
CAPTURE_LISTENER_STATE = "aether.capture_listener"
CAPTURE_LISTENER_FORMAT = f"%FILTER_STATE({CAPTURE_LISTENER_STATE}:PLAIN)%"
# The clusters' local address selector opens the upstream socket in the netns named by
# UPSTREAM_NETNS_STATE, which the pod listener shares TRANSITIVE (it crosses the internal
# listener).
NETNS_ADDRESS_SELECTOR = "envoy.upstream.local_address_selector.filter_state_override"
NETNS_ADDRESS_SELECTOR_TYPE = ("type.googleapis.com/envoy.extensions.local_address_selectors."
                               "filter_state_override.v3.Config")

log = logging.getLogger("agent.envoy.resources")

SOL_SOCKET = 1
SO_MARK = 36

# HTTP (GAMMA HCM) chains log failed requests only: a 5xx or any response flag (UH no healthy
# upstream, UF connect failure, UC upstream reset, NC no cluster, ...). A healthy request
# costs nothing; a failure names its flags, details, route, cluster and x-request-id.
HTTP_FAILURE_LOG_TAG = "http-failure"
HTTP_FAILURE_LOG_FORMAT = (
    f"[%START_TIME%] {HTTP_FAILURE_LOG_TAG} listener={CAPTURE_LISTENER_FORMAT} "
    "mesh=%LISTENER_NAME% %REQ(:METHOD)% %REQ(:AUTHORITY)%%REQ(:PATH)% -> "
    "%DOWNSTREAM_LOCAL_ADDRESS% status=%RESPONSE_CODE% flags=%RESPONSE_FLAGS% "
    "details=%RESPONSE_CODE_DETAILS% route=%ROUTE_NAME% cluster=%UPSTREAM_CLUSTER% "
    "upstream=%UPSTREAM_HOST% request_id=%REQ(X-REQUEST-ID)% dur=%DURATION%ms "
    "failure=%UPSTREAM_TRANSPORT_FAILURE_REASON%\n"
)


def astuple_shallow(obj: Any) -> tuple[Any, ...]:
    """A dataclass's field values in order, as its generated ``__eq__``/``__hash__`` see
    them (``dataclasses.astuple`` would deep-copy)."""
    return tuple(getattr(obj, f.name) for f in fields(obj))


def namespace_listener_name(namespace: str) -> str:
    """``mesh-<ns>``: the cluster for callers in ``namespace`` (and the internal listener it
    reaches when their chains are their own); ``mesh`` for ``SHARED_CALLERS``."""
    if namespace == SHARED_CALLERS:
        return SHARED_MESH_LISTENER
    return f"{NAMESPACE_LISTENER_PREFIX}{namespace or DEFAULT_NAMESPACE}"


@dataclass(frozen=True)
class PodListener:
    """A pod whose outbound TCP is redirected to the capture port in its own netns."""

    uid: str
    netns_path: str
    ipv4: bool = True
    ipv6: bool = True
    # The pod's namespace: picks the internal listener (caller-namespace chain table).
    namespace: str = DEFAULT_NAMESPACE
    # Its ServiceAccount (the mesh identity it calls and is called as) and addresses (what
    # its inbound mTLS listener delivers to); used only with ``NodeXdsState.mesh_tls``.
    service_account: str = "default"
    ips: tuple[str, ...] = ()
    # Its workload (the owner, not the pod): the source the golden metrics count it under.
    workload: str = ""
    # The pod's name when the golden metrics label the calling pod (--traffic-source-pods)
    source_pod: str = ""
    # The AuthorizationPolicies that select the pod (agent.authz), enforced on its inbound
    # mTLS listener; a change makes another PodListener, so the diff rebuilds just this pod
    authz: tuple[Policy, ...] = ()

    @property
    def source(self) -> str:
        """``<namespace>/<workload>`` (the listener's uid when the workload is unknown), and
        ``/<pod>`` when the metrics label the calling pod."""
        src = f"{self.namespace or DEFAULT_NAMESPACE}/{self.workload or self.uid}"
        return f"{src}/{self.source_pod}" if self.source_pod else src

    # Every publish walks every pod (build, hashes): what it asks of each is computed once
    # per object (these are frozen), not once per pod per ADD.
    @cached_property
    def identity(self) -> str:
        return identity_key(self.namespace or DEFAULT_NAMESPACE, self.service_account)

    @cached_property
    def listener_name(self) -> str:
        return f"{LISTENER_PREFIX}{self.uid}"

    @cached_property
    def _hash(self) -> int:
        return hash(astuple_shallow(self))

    def __hash__(self) -> int:
        return self._hash

    @property
    def mesh_listener_name(self) -> str:
        """The cluster ``mesh-<ns>`` the pod listener hands its connections to (it reaches
        ``mesh`` or the namespace's own internal listener)."""
        return namespace_listener_name(self.namespace)


@dataclass(frozen=True)
class Resilience:
    """What protects callers from a bad endpoint, per Service port cluster (``aether-agent
    run`` flags). kube-proxy has none of it; these are the defaults a platform team expects
    from a mesh, each one switchable off."""

    # passive outlier detection: this many consecutive failures (5xx, refused or timed-out
    # connects) eject an endpoint for ``ejection_s`` (longer each time); 0: off
    outlier_failures: int = 5
    ejection_s: float = 30.0
    # never eject more than this share of a Service's endpoints at once
    max_ejection_percent: int = 50
    # tcp_proxy: a refused or timed-out connect is tried again on another endpoint, this
    # many attempts in all (1: no retry, as kube-proxy)
    connect_attempts: int = 2
    # connections per Service port cluster; 0: no limit (Envoy's default of 1024 is far
    # too few for a node proxy every pod shares)
    max_connections: int = 0
    # requests (HTTP) or connections (L4) waiting for an upstream connection past that
    # limit, and concurrent HTTP requests; None: the same as ``max_connections``; 0: no limit
    max_pending_requests: int | None = None
    max_requests: int | None = None
    # retries (where a GAMMA route asks for them) may add at most this share of requests
    retry_budget_percent: float = 20.0


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


def service_cluster_name(namespace: str, name: str, port: int) -> str:
    """``svc|<ns>|<name>|<port>``: namespace-aware, unambiguous (no '|' in k8s names)."""
    return f"{SERVICE_CLUSTER_PREFIX}{namespace}|{name}|{port}"


POD_CLUSTER_PREFIX = "pod|"


def pod_cluster_name(namespace: str, service: str, ip: str, port: int) -> str:
    """``pod|<ns>|<service>|<ip>|<port>``: one endpoint of a headless Service, dialled by
    its address."""
    return f"{POD_CLUSTER_PREFIX}{namespace}|{service}|{ip}|{port}"


def parse_service_cluster_name(cluster: str) -> tuple[str, str, int] | None:
    """Inverse of ``service_cluster_name`` (stats and status read cluster names back)."""
    parts = cluster.split("|")
    if len(parts) != 4 or parts[0] + "|" != SERVICE_CLUSTER_PREFIX or not parts[3].isdigit():
        return None
    return parts[1], parts[2], int(parts[3])


def _socket_address(ip: str, port: int, netns_path: str) -> address_pb2.Address:
    return address_pb2.Address(
        socket_address=address_pb2.SocketAddress(
            address=ip, port_value=port, network_namespace_filepath=netns_path
        )
    )


_HTTP_FAILURE_LOG: accesslog_pb2.AccessLog | None = None


def http_failure_access_log() -> accesslog_pb2.AccessLog:
    """Stdout access log for the GAMMA HCM that fires only for failed requests (status >= 500
    or any response flag); built once, shared by every HTTP chain."""
    global _HTTP_FAILURE_LOG
    if _HTTP_FAILURE_LOG is None:
        log = stdout_access_log(HTTP_FAILURE_LOG_FORMAT)
        five_xx = accesslog_pb2.StatusCodeFilter(comparison=accesslog_pb2.ComparisonFilter(
            op=accesslog_pb2.ComparisonFilter.GE))
        five_xx.comparison.value.default_value = 500
        log.filter.or_filter.filters.add().status_code_filter.CopyFrom(five_xx)
        # no flags listed: any response flag matches
        log.filter.or_filter.filters.add().response_flag_filter.SetInParent()
        _HTTP_FAILURE_LOG = log
    return _HTTP_FAILURE_LOG


def _grpc_access_log() -> accesslog_pb2.AccessLog:
    """TCP gRPC access log to the agent over the bootstrap's ``xds`` unix-socket cluster.

    The config is identical in every namespace listener (names come from formatter tags,
    not literals), so Envoy shares one logger and one stream per worker thread. The
    ``listener`` tag is the pod listener (filter state set by it), ``mesh_listener`` the
    internal listener that logged the connection.
    """
    common = als_pb2.CommonGrpcAccessLogConfig(
        log_name=ALS_LOG_NAME,
        transport_api_version=config_source_pb2.V3,
        grpc_service=grpc_service_pb2.GrpcService(
            envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=AGENT_GRPC_CLUSTER)
        ),
        custom_tags=[
            custom_tag_pb2.CustomTag(tag=ALS_LISTENER_TAG, value=CAPTURE_LISTENER_FORMAT),
            custom_tag_pb2.CustomTag(tag=ALS_MESH_LISTENER_TAG, value="%LISTENER_NAME%"),
        ],
    )
    log = accesslog_pb2.AccessLog(name="envoy.access_loggers.tcp_grpc")
    log.typed_config.Pack(als_pb2.TcpGrpcAccessLogConfig(common_config=common))
    return log


def passthrough_chain(learn_access_log: bool = True, connection_log: bool = False
                      ) -> listener_components_pb2.FilterChain:
    """The default chain: anything not a Service ClusterIP goes to its original destination.
    ``connection_log`` reports every connection to the agent (``aether-agent run --access-log``);
    ``learn_access_log`` streams every connection to the agent (see ``learn_chains`` for the
    narrow form the agent uses)."""
    return listener_components_pb2.FilterChain(
        name="passthrough", filters=[_passthrough_proxy(learn_access_log, connection_log,
                                                        PASSTHROUGH_STATS["outside"])])


def _passthrough_proxy(learn: bool, connection_log: bool, stat_prefix: str
                       ) -> listener_components_pb2.Filter:
    """tcp_proxy to the ORIGINAL_DST cluster with the access-log report (``--access-log``:
    the agent writes it as a JSON record) and/or the learning stream."""
    logs = (([traffic_access_log()] if connection_log else [])
            + ([_grpc_access_log()] if learn else []))
    # the stat prefix is the destination class (agent.envoy.envoy_stats counts them)
    return tcp_proxy_filter(stat_prefix, PASSTHROUGH_CLUSTER, *logs)


def learn_chains(targets: Sequence[tuple[str, int]], connection_log: bool = False
                 ) -> tuple[listener_components_pb2.FilterChain, ...]:
    """Passthrough chains that also stream to the agent's access log service, one per port,
    matching the ClusterIPs (/32, /128) learning can act on; every other passthrough
    connection streams nothing (the gRPC entry and its handling in the agent cost as much
    per connection as proxying it). Per port, because chain matching narrows on the port
    first: a port-less chain would lose to any Service chain on the same port."""
    by_port: dict[int, list[address_pb2.CidrRange]] = {}
    for ip, port in sorted(set(targets), key=lambda t: (t[1], t[0])):
        cidr = _cidr(ip)
        if cidr is not None:
            by_port.setdefault(port, []).append(cidr)
    out = []
    for port, cidrs in sorted(by_port.items()):
        match = listener_components_pb2.FilterChainMatch(prefix_ranges=cidrs)
        match.destination_port.value = port
        out.append(listener_components_pb2.FilterChain(
            name=f"learn-{port}", filter_chain_match=match,
            filters=[_passthrough_proxy(True, connection_log, PASSTHROUGH_STATS["mesh"])]))
    return tuple(out)


def _cidr(ip: str) -> address_pb2.CidrRange | None:
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return None
    cidr = address_pb2.CidrRange(address_prefix=str(addr))
    cidr.prefix_len.value = addr.max_prefixlen
    return cidr


def service_chain(view: ServiceView, port: ServicePort, connect_attempts: int = 1,
                  logs: TrafficLogs | None = None) -> listener_components_pb2.FilterChain:
    """Plain TCP chain for one Service port: ClusterIPs (/32, /128) + port -> its EDS cluster.

    Matched on the original destination. The GAMMA work swaps in an HTTP variant (same
    match, HCM instead of tcp_proxy) for appProtocol http; see ``chain_for``.
    """
    cluster = service_cluster_name(view.namespace, view.name, port.port)
    match = listener_components_pb2.FilterChainMatch(
        prefix_ranges=[c for c in map(_cidr, view.cluster_ips) if c is not None],
    )
    match.destination_port.value = port.port
    tcp = tcp_proxy_pb2.TcpProxy()
    if connect_attempts > 1:
        tcp.max_connect_attempts.value = connect_attempts  # the next try: another endpoint
    if view.traffic.client_ip_affinity:
        # sessionAffinity: ClientIP: the cluster hashes (Maglev) on the caller pod's address,
        # restored on the namespace listener, so one pod keeps its endpoint across connections
        tcp.hash_policy.add().source_ip.SetInParent()
    return listener_components_pb2.FilterChain(
        name=cluster,
        filter_chain_match=match,
        # no per-chain access log: at 10k Services it was most of each chain's bytes; the
        # passthrough chain keeps its log (learning) and cluster stats cover Service traffic
        filters=[tcp_proxy_filter(cluster, cluster,
                                  *tcp_traffic_logs(logs), config=tcp)],
    )


ChainResult: TypeAlias = (
    "listener_components_pb2.FilterChain | Sequence[listener_components_pb2.FilterChain]")


def chain_varies_by_caller(view: ServiceView, port: ServicePort, gamma: GammaResult | None = None) -> bool:
    """Whether ``chain_for`` can differ by caller namespace for this Service port.

    False: the chain is built once (``caller_ns=None``) and shared by every namespace
    listener. True: built once per namespace listener — a consumer route (GEP-1294) gives
    the callers in its namespace their own table for this target.
    """
    return gamma is not None and bool(gamma.consumer_namespaces(view.key, port.port))


def chain_for(view: ServiceView, port: ServicePort, caller_ns: str | None = None,
              gamma: GammaResult | None = None, connect_attempts: int = 1,
              logs: TrafficLogs | None = None) -> ChainResult:
    """Chain builder dispatch: the L4 chain, or the GAMMA HTTP chain(s) when route tables
    attach to this Service port (by appProtocol; http_inspector detection when unset).

    ``caller_ns`` is the namespace of the calling pods (``SHARED_CALLERS`` for ``mesh``), or None
    for a chain shared by all callers (see ``chain_varies_by_caller``). May return one chain
    or several (HTTP + L4 fallback); all match only this Service port.
    """
    from agent.envoy.http_routes import balances_per_request, service_port_chains

    def tcp_chain(v: ServiceView, p: ServicePort) -> listener_components_pb2.FilterChain:
        return service_chain(v, p, connect_attempts, logs)

    if gamma is None and not balances_per_request(port):
        return tcp_chain(view, port)
    table = (None if gamma is None
             else gamma.table_for(view.key, port.port, caller_ns) if caller_ns is not None
             else gamma.tables.get((view.key, port.port, None)))
    return service_port_chains(view, port, table, tcp_chain=tcp_chain,
                               cluster_name=service_cluster_name,
                               access_log=(http_failure_access_log(), *http_traffic_logs(logs)))


def gamma_signature(gamma: GammaResult | None, key: str) -> tuple[Any, ...]:
    """What of the GAMMA result one Service's chains depend on (compared by value)."""
    if gamma is None:
        return ()
    return tuple(sorted(((p, s or ""), t) for (k, p, s), t in gamma.tables.items() if k == key))


def detect_ports(gamma: GammaResult | None, services: Sequence[ServiceView]) -> tuple[int, ...]:
    """Destination ports where http_inspector must run: routed ports with no appProtocol."""
    if gamma is None:
        return ()
    from agent.envoy.http_routes import port_protocol

    routed = {(k, p) for (k, p, _s) in gamma.tables}
    out = {sp.port for v in services for sp in v.ports
           if (v.key, sp.port) in routed and port_protocol(sp) == "detect"}
    return tuple(sorted(out))


def build_service_cluster(view: ServiceView, port: int, connect_timeout_s: float,
                          mark: int = PASSTHROUGH_MARK, tunnel: bool = False,
                          resilience: Resilience = Resilience()) -> cluster_pb2.Cluster:
    """EDS cluster over ADS. Panic mode is off so DRAINING/UNHEALTHY hosts never get
    new connections even when most hosts are out (Kubernetes readiness semantics). It also
    carries the upstream HTTP protocol for when a GAMMA route sends HTTP here (h2c for gRPC
    backends); tcp_proxy ignores it. Upstream sockets are opened in the calling pod's netns
    with the mark, pooled per downstream connection (``upstream_bind_config``).
    ``tunnel`` (mesh identity on): the endpoints are ``mtls-out`` internal addresses instead
    and the pod's netns travels there in filter state (``agent.envoy.mtls``)."""
    from agent.envoy.http_routes import HTTP_PROTOCOL_OPTIONS_KEY, upstream_http_protocol_options

    name = service_cluster_name(view.namespace, view.name, port)
    cluster = cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.EDS,
        connect_timeout=duration(connect_timeout_s),
        lb_policy=cluster_pb2.Cluster.ROUND_ROBIN,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(
            service_name=name,
            eds_config=config_source_pb2.ConfigSource(
                ads=config_source_pb2.AggregatedConfigSource(),
                resource_api_version=config_source_pb2.V3,
            ),
        ),
        connection_pool_per_downstream_connection=True,
    )
    apply_resilience(cluster, resilience, view.traffic)
    if tunnel:
        cluster.transport_socket.CopyFrom(mtls.tunnel_transport_socket())
    else:
        cluster.upstream_bind_config.CopyFrom(upstream_bind_config(mark))
    cluster.common_lb_config.healthy_panic_threshold.value = 0.0
    # host health changes (an outlier ejection, its end) reach the workers' load balancers
    # at once; Envoy's default merge window (1 s) kept sending an ejected endpoint its share
    # for up to a second after it was ejected
    cluster.common_lb_config.update_merge_window.CopyFrom(duration(0.0))
    if view.traffic.client_ip_affinity:
        # consistent hashing on the caller's address (tcp_proxy / route hash policies);
        # Maglev moves few callers when an endpoint comes or goes
        cluster.lb_policy = cluster_pb2.Cluster.MAGLEV
    sp = next((p for p in view.ports if p.port == port), None)
    if tunnel:
        from agent.envoy.http_routes import port_protocol
        mtls.set_hop_metadata(cluster, port_protocol(sp) if sp is not None else "detect")
    cluster.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS_KEY].Pack(
        upstream_http_protocol_options(sp.app_protocol if sp is not None else None))
    return cluster


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def apply_resilience(cluster: cluster_pb2.Cluster, r: Resilience,
                     traffic: TrafficPolicy | None = None) -> None:
    """Outlier detection, connection limits and the retry budget on a Service cluster (the
    Service's XBackendTrafficPolicy budget, when it has one, over the agent's default)."""
    t = cluster.circuit_breakers.thresholds.add()
    for f, n in (("max_connections", r.max_connections),
                 ("max_pending_requests", _or(r.max_pending_requests, r.max_connections)),
                 ("max_requests", _or(r.max_requests, r.max_connections))):
        getattr(t, f).value = n if n > 0 else mtls.UNLIMITED
    budget = traffic.retry_budget_percent if traffic is not None else None
    floor = traffic.min_retry_concurrency if traffic is not None else None
    t.retry_budget.budget_percent.value = r.retry_budget_percent if budget is None else budget
    t.retry_budget.min_retry_concurrency.value = 3 if floor is None else floor
    if r.outlier_failures > 0:
        od = cluster.outlier_detection
        # a refused or timed-out connect counts as a 5xx (local-origin errors are not split)
        od.consecutive_5xx.value = r.outlier_failures
        od.consecutive_gateway_failure.value = r.outlier_failures
        od.enforcing_consecutive_gateway_failure.value = 100
        od.interval.CopyFrom(duration(5.0))
        od.base_ejection_time.CopyFrom(duration(r.ejection_s))
        od.max_ejection_percent.value = r.max_ejection_percent
        od.enforcing_success_rate.value = 0  # only consecutive failures eject


def endpoint_health(ep: Endpoint) -> int:
    """Ready (or published whatever its state) → HEALTHY; terminating but still serving
    (Ready) → HEALTHY, in the fallback priority (see ``endpoint_priority``); terminating and
    not serving → DRAINING; not ready → UNHEALTHY. Never sent new connections unless
    HEALTHY (panic mode is off)."""
    if ep.always_ready or ep.ready:
        return int(health_check_pb2.HEALTHY)
    return int(health_check_pb2.DRAINING if ep.draining else health_check_pb2.UNHEALTHY)


def endpoint_priority(ep: Endpoint) -> int:
    """Not terminating (or published regardless) before terminating: as kube-proxy does, a
    terminating endpoint that still serves gets traffic only when no ready endpoint is left.
    Within each, the endpoints trafficDistribution prefers (this zone / this node) before
    the others, which take over when no preferred one is left. Compressed to contiguous
    priorities by ``build_load_assignment``."""
    terminating = 0 if ep.always_ready or not ep.draining else 1
    return 2 * terminating + (0 if ep.preferred else 1)


# Envoy spills a priority's load to the next one as its healthy share drops below
# 100/1.4 %; Kubernetes does not spill while any ready endpoint exists. A factor this large
# keeps every request at priority 0 while one of its hosts is healthy.
OVERPROVISIONING_FACTOR = 1_000_000


def _lb_endpoint(ep: Endpoint, tunnel: bool = False) -> endpoint_components_pb2.LbEndpoint:
    """A host: its address and health, nothing else. The node Envoy holds every endpoint of
    the cluster, and per-host metadata is a Struct per host there: naming each host's pod,
    identity and SAN cost the node Envoy ~560 MB at 100k endpoints (bench/README.md, twelfth
    session), for config dumps only: nothing in Envoy read it. The mesh hop's host keeps
    what ``mtls-out`` reads (its SAN and address)."""
    if tunnel:
        return mtls.tunnel_lb_endpoint(ep.ip, ep.port, ep.san, endpoint_health(ep))
    # fields set in place, not built as messages and copied in: one per remote pod at
    # cluster scale, 8.7 -> 3.6 us each (measured)
    lb = endpoint_components_pb2.LbEndpoint(health_status=endpoint_health(ep))
    sa = lb.endpoint.address.socket_address
    sa.address, sa.port_value = ep.ip, ep.port
    return lb


def build_load_assignment(cluster_name: str, endpoints: tuple[Endpoint, ...],
                          tunnel: bool = False) -> endpoint_pb2.ClusterLoadAssignment:
    """Endpoints sorted and de-duplicated by ip:port (Envoy wants unique hosts), one
    priority per tier of ``endpoint_priority`` that has endpoints, contiguous from 0."""
    seen: set[tuple[str, int]] = set()
    lbs = []
    for ep in sorted(endpoints, key=lambda e: (e.ip, e.port, e.draining, not e.ready)):
        if (ep.ip, ep.port) in seen:
            continue
        seen.add((ep.ip, ep.port))
        lbs.append((endpoint_priority(ep), _lb_endpoint(ep, tunnel)))
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster_name)
    for priority in sorted(set(p for p, _ in lbs)):
        cla.endpoints.add(priority=len(cla.endpoints),  # contiguous from 0
                          lb_endpoints=[lb for p, lb in lbs if p == priority])
    if len(cla.endpoints) > 1:
        cla.policy.overprovisioning_factor.value = OVERPROVISIONING_FACTOR
    return cla


def _capture_chain(pod: PodListener, mesh_identity: bool = False
                   ) -> listener_components_pb2.FilterChain:
    """Hand the connection, its original destination/source and the pod listener name to
    the pod namespace's internal listener (filter state shared with the upstream once), and
    the pod's netns path to every hop after it (transitive), so the final upstream socket is
    opened inside the pod's netns (see ``upstream_bind_config``)."""
    state_filter = set_filter_state(
        state_value(ORIGINAL_DST_LOCAL_STATE, "%DOWNSTREAM_LOCAL_ADDRESS%"),
        state_value(ORIGINAL_DST_REMOTE_STATE, "%DOWNSTREAM_REMOTE_ADDRESS%"),
        state_value(CAPTURE_LISTENER_STATE, pod.listener_name, STRING_STATE_FACTORY),
        state_value(SOURCE_STATE, pod.source, STRING_STATE_FACTORY),
        state_value(UPSTREAM_NETNS_STATE, pod.netns_path, STRING_STATE_FACTORY, TRANSITIVE),
        *([mtls.caller_state(pod.identity)] if mesh_identity else []),
    )
    return listener_components_pb2.FilterChain(
        name="capture",
        filters=[state_filter, tcp_proxy_filter("capture", pod.mesh_listener_name)],
    )


def build_listener(pod: PodListener, capture_port: int, mesh_identity: bool = False
                   ) -> listener_pb2.Listener:
    """The pod's capture listener on the loopbacks of its netns (v4 and/or v6): constant
    size, independent of the Services (they live in the namespace's internal listener).
    ``mesh_identity``: the pod's SVID is held, its mesh connections carry its identity."""
    ips = (["127.0.0.1"] if pod.ipv4 else []) + (["::1"] if pod.ipv6 else [])
    if not ips:
        raise ValueError(f"pod {pod.uid}: at least one of ipv4/ipv6 must be enabled")
    addrs = [_socket_address(ip, capture_port, pod.netns_path) for ip in ips]
    listener = listener_pb2.Listener(
        name=pod.listener_name,
        stat_prefix=pod.listener_name,
        address=addrs[0],
        listener_filters=[original_dst_filter()],
        default_filter_chain=_capture_chain(pod, mesh_identity),
    )
    for a in addrs[1:]:
        listener.additional_addresses.add().address.CopyFrom(a)
    listener.bind_to_port.value = True
    return listener


# Listener.filter_chains is field 3, length-delimited: tag byte 3 << 3 | 2.
_FILTER_CHAINS_TAG = bytes([3 << 3 | 2])


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_chains(chains: Sequence[listener_components_pb2.FilterChain]) -> bytes:
    """``chains`` as the wire bytes of ``Listener.filter_chains`` entries (deterministic).

    Protobuf wire format lets repeated fields be appended in any position, so a namespace
    listener is its small head serialized + the concatenated chain bytes of every Service:
    the 10k-chain listener is assembled with one ``bytes.join`` and never exists as a proto.
    """
    out = []
    for c in chains:
        data = c.SerializeToString(deterministic=True)
        out += [_FILTER_CHAINS_TAG, _varint(len(data)), data]
    return b"".join(out)


class RawResource:
    """A resource held as its serialized bytes (the big namespace listeners).

    Quacks enough like the proto for the xDS server (``SerializeToString``, ``ByteSize``,
    ``name``); ``message()`` parses a fresh proto (and attribute access falls back to it,
    for tests and debugging: each access parses, so do not use it on hot paths).
    """

    __slots__ = ("name", "data", "cls", "_digest")

    def __init__(self, cls: type[Message], name: str, data: bytes) -> None:
        self.cls = cls
        self.name = name
        self.data = data
        self._digest: str | None = None

    def digest(self) -> str:
        """``resource_hash``, computed once: the bytes never change (the xDS server needs no
        memo of it, which at 10k Services was ~3 MB)."""
        if self._digest is None:
            self._digest = hashlib.sha256(self.data).hexdigest()[:16]
        return self._digest

    def SerializeToString(self, deterministic: bool = False) -> bytes:  # noqa: N802 - proto API
        return self.data

    def ByteSize(self) -> int:  # noqa: N802 - proto API
        return len(self.data)

    def message(self) -> Any:
        msg = self.cls()
        msg.ParseFromString(self.data)
        return msg

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.message(), attr)

    def __repr__(self) -> str:
        return f"RawResource({self.cls.__name__}, {self.name!r}, {len(self.data)} bytes)"


class TrafficLogs(NamedTuple):
    """What a Service chain logs: ``metrics``, the golden metrics' stats loggers (counted in
    Envoy, agent.envoy.golden); ``records``, an access-log entry per connection or request
    to the agent (``--access-log``)."""

    metrics: bool = True
    records: bool = False


def tcp_traffic_logs(logs: TrafficLogs | None) -> list[accesslog_pb2.AccessLog]:
    if logs is None:
        return []
    return (([tcp_stats_log()] if logs.metrics else [])
            + ([traffic_access_log()] if logs.records else []))


def http_traffic_logs(logs: TrafficLogs | None) -> list[accesslog_pb2.AccessLog]:
    if logs is None:
        return []
    return (([http_stats_log()] if logs.metrics else [])
            + ([request_access_log()] if logs.records else []))


def traffic_access_log() -> accesslog_pb2.AccessLog:
    """A Service chain's log: one entry per connection (the calling pod, the chain, the
    upstream cluster, bytes, response flags). Per chain, because Envoy emits no
    listener-level access log for connections of an internal listener."""
    return tcp_grpc_access_log(TRAFFIC_LOG_NAME,
                               {ALS_LISTENER_TAG: CAPTURE_LISTENER_FORMAT, **TRAFFIC_TAGS})


def request_access_log() -> accesslog_pb2.AccessLog:
    """One entry per request on an HTTP chain (status, duration, route, gRPC status)."""
    return http_grpc_access_log(REQUEST_LOG_NAME,
                                {ALS_LISTENER_TAG: CAPTURE_LISTENER_FORMAT, **TRAFFIC_TAGS},
                                response_headers=("grpc-status",))


def _namespace_head(namespace: str, learn_access_log: bool, detect: Sequence[int] = (),
                    connection_log: bool = False) -> bytes:
    """Everything of ``mesh-<ns>`` but its Service chains, serialized."""
    name = namespace_listener_name(namespace)
    filters = [original_dst_filter()]
    if detect:
        from agent.envoy.http_routes import http_inspector_listener_filter

        inspector = http_inspector_listener_filter(detect)
        if inspector is not None:
            filters.append(inspector)
    lis = listener_pb2.Listener(
        name=name,
        stat_prefix=name,
        internal_listener=listener_pb2.Listener.InternalListenerConfig(),
        listener_filters=filters,
        default_filter_chain=passthrough_chain(learn_access_log, connection_log),
    )
    if detect:
        lis.continue_on_listener_filters_timeout = True
    data: bytes = lis.SerializeToString(deterministic=True)
    return data


def build_namespace_listener(namespace: str,
                             chains: Sequence[listener_components_pb2.FilterChain] = (),
                             learn_access_log: bool = True,
                             connection_log: bool = False) -> listener_pb2.Listener:
    """Internal listener ``mesh-<ns>``: Service chains on the restored destination, then
    the passthrough default chain (parsed from the same bytes the builder serves)."""
    return listener_pb2.Listener.FromString(
        _namespace_head(namespace, learn_access_log, connection_log=connection_log)
        + encode_chains(chains))


def build_namespace_cluster(namespace: str, connect_timeout_s: float,
                            listener: str | None = None) -> cluster_pb2.Cluster:
    """STATIC cluster ``mesh-<ns>`` whose only host is an internal listener: ``listener``
    (the shared ``mesh``), or ``mesh-<ns>`` when None; ``internal_upstream`` passes the pod
    listener's shared filter state along."""
    name = namespace_listener_name(namespace)
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
    cla.endpoints.add().lb_endpoints.add().endpoint.address.envoy_internal_address \
        .server_listener_name = listener or name
    return cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.STATIC,
        connect_timeout=duration(connect_timeout_s),
        load_assignment=cla,
        transport_socket=internal_upstream(),
    )


def _register_selector_config() -> None:
    """xds-protos does not ship the (empty) selector config message; register it in the
    default pool so JSON views of our clusters (bootstrap validation, config dumps) resolve
    its ``@type``. The wire form needs nothing: an Any with the type URL and no bytes."""
    name = NETNS_ADDRESS_SELECTOR_TYPE.rsplit("/", 1)[1]
    pool = descriptor_pool.Default()
    try:
        pool.FindMessageTypeByName(name)
        return
    except KeyError:
        pass
    package, _, message = name.rpartition(".")
    fdp = descriptor_pb2.FileDescriptorProto(
        name=package.replace(".", "/") + "/config.proto", package=package, syntax="proto3")
    fdp.message_type.add(name=message)
    pool.Add(fdp)


_register_selector_config()


def upstream_bind_config(mark: int) -> address_pb2.BindConfig:
    """Upstream sockets of captured traffic: opened in the pod's netns, stamped with the mark.

    The ``filter_state_override`` local address selector moves the bind address into the netns
    named by the ``UPSTREAM_NETNS_STATE`` filter state (set by the pod listener, shared
    transitively); it only overrides an address that exists, hence the wildcard source
    addresses (IPv4, and IPv6 as an extra address picked for IPv6 endpoints). Port 0 and the
    wildcard IP leave the source to the kernel in that netns, as for the pod's own sockets, so
    the destination sees the pod's address and the pod's routes and policies apply. SO_MARK
    is set before bind; the pod's rules RETURN the mark only for the proxy's cgroup.
    Connections without that filter state (none today) would leave from Envoy's own netns.
    """
    opt = socket_option_pb2.SocketOption(
        description="SO_MARK passthrough",
        level=SOL_SOCKET,
        name=SO_MARK,
        int_value=mark,
        state=socket_option_pb2.SocketOption.STATE_PREBIND,
    )
    bind = address_pb2.BindConfig(
        source_address=address_pb2.SocketAddress(address="0.0.0.0", port_value=0),
        socket_options=[opt],
    )
    bind.extra_source_addresses.add().address.CopyFrom(
        address_pb2.SocketAddress(address="::", port_value=0))
    bind.local_address_selector.name = NETNS_ADDRESS_SELECTOR
    bind.local_address_selector.typed_config.type_url = NETNS_ADDRESS_SELECTOR_TYPE
    return bind


def build_passthrough_cluster(mark: int, connect_timeout_s: float) -> cluster_pb2.Cluster:
    """ORIGINAL_DST cluster: the restored original destination, reached from the pod's netns.

    Used from the internal listeners, where the destination is the one ``original_dst``
    restored from filter state. One connection pool per downstream connection: a pooled
    upstream connection was opened in one pod's netns and must never carry another's bytes.
    """
    return cluster_pb2.Cluster(
        name=PASSTHROUGH_CLUSTER,
        type=cluster_pb2.Cluster.ORIGINAL_DST,
        lb_policy=cluster_pb2.Cluster.CLUSTER_PROVIDED,
        connect_timeout=duration(connect_timeout_s),
        upstream_bind_config=upstream_bind_config(mark),
        connection_pool_per_downstream_connection=True,
    )


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
        own_detect = tls is not None and has_id and bool(pod.ips) and mtls.detects_own(pod.authz)
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


def resource_hash(msg: Message | RawResource) -> str:
    """Stable content hash used as the per-resource version in delta xDS."""
    if type(msg) is RawResource:
        return msg.digest()
    return hashlib.sha256(msg.SerializeToString(deterministic=True)).hexdigest()[:16]
