"""Pure translation of node state into Envoy xDS resources (no I/O).

Two tiers of listeners, so per-pod config stays constant-size however many Services exist:

* ``capture-<container id>``, one per captured pod, bound on the pod netns loopback (v4/v6,
  port 15001) through ``SocketAddress.network_namespace_filepath``. It only runs the
  ``original_dst`` listener filter and one chain: ``set_filter_state`` (the restored
  destination and source as ``envoy.filters.listener.original_dst.local_ip`` / ``remote_ip``,
  and the pod listener name as ``aether.capture_listener``, all shared with the upstream
  connection once) + ``tcp_proxy`` to the cluster ``mesh-<pod namespace>``. Its size does not
  depend on the Services.
* ``mesh-<namespace>``, one Envoy *internal listener* per namespace that has captured pods on
  this node, reached through the STATIC cluster of the same name whose only endpoint is the
  ``envoy_internal_address`` of that listener and whose transport socket is
  ``internal_upstream`` (it hands the shared filter state to the internal connection). Its
  ``original_dst`` listener filter restores the pod's original destination from that filter
  state, so chain matching, ``%DOWNSTREAM_LOCAL_ADDRESS%`` and the ORIGINAL_DST cluster all
  see the real destination. It holds one filter chain per in-scope (Service, port) matching
  its ClusterIPs (/32, /128) and port, proxying to the EDS cluster ``svc|<ns>|<name>|<port>``
  (the EDS resource has the same name), and the default ``passthrough`` chain: the
  ORIGINAL_DST cluster whose upstream sockets carry SO_MARK, so the pod's redirect rule can
  RETURN Envoy's own traffic. The passthrough chain streams a gRPC access log to the agent
  (dependency learning); the entry's ``listener`` tag is the pod listener name read back from
  filter state. One listener per *caller* namespace leaves room for per-caller route tables
  (GAMMA); while no chain depends on the caller, all of them share one chain table.

The bootstrap must enable the ``envoy.bootstrap.internal_listener`` extension.

``ResourceBuilder`` caches the protos per Service piece (chain, cluster, endpoints), the
chain table, the per-namespace listeners and the per-pod listeners, and returns the *same*
dict objects for resource types whose inputs did not change, so a pod ADD costs one small
listener whatever the number of Services. Callers must treat every returned proto and dict
as immutable (the xDS server memoises hashes by object identity).
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
from dataclasses import dataclass
from typing import Any

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import (
    address_pb2,
    config_source_pb2,
    grpc_service_pb2,
    health_check_pb2,
    socket_option_pb2,
    substitution_format_string_pb2,
)
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2
from envoy.extensions.access_loggers.stream.v3 import stream_pb2
from envoy.extensions.filters.listener.original_dst.v3 import original_dst_pb2
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
from envoy.type.tracing.v3 import custom_tag_pb2
from google.protobuf import duration_pb2, struct_pb2
from google.protobuf.message import Message

from agent.config import CAPTURE_PORT, PASSTHROUGH_MARK
from agent.scope.model import Endpoint, ServiceView
from agent.scope.services import ServicePort

LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"
CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
PASSTHROUGH_CLUSTER = "passthrough"
LISTENER_PREFIX = "capture-"
SERVICE_CLUSTER_PREFIX = "svc|"
# The bootstrap's unix-socket cluster to the agent (ADS and the access log service).
AGENT_GRPC_CLUSTER = "xds"
ALS_LOG_NAME = "aether-passthrough"
# Custom tag on every ALS entry naming the pod listener that accepted the connection.
ALS_LISTENER_TAG = "listener"
METADATA_NAMESPACE = "aether"

log = logging.getLogger("agent.envoy.resources")

SOL_SOCKET = 1
SO_MARK = 36

# %DOWNSTREAM_LOCAL_ADDRESS% is the original destination once original_dst has run.
ACCESS_LOG_FORMAT = (
    "[%START_TIME%] listener=%LISTENER_NAME% %DOWNSTREAM_REMOTE_ADDRESS% -> "
    "%DOWNSTREAM_LOCAL_ADDRESS% upstream=%UPSTREAM_HOST% flags=%RESPONSE_FLAGS% "
    "rx=%BYTES_RECEIVED% tx=%BYTES_SENT% dur=%DURATION%ms\n"
)


@dataclass(frozen=True)
class PodListener:
    """A pod whose outbound TCP is redirected to the capture port in its own netns."""

    uid: str
    netns_path: str
    ipv4: bool = True
    ipv6: bool = True

    @property
    def listener_name(self) -> str:
        return f"{LISTENER_PREFIX}{self.uid}"


@dataclass(frozen=True)
class NodeXdsState:
    """Everything the xDS builder needs; frozen so it can be shared across threads."""

    pods: tuple[PodListener, ...]
    capture_port: int = CAPTURE_PORT
    passthrough_mark: int = PASSTHROUGH_MARK
    connect_timeout_s: float = 5.0
    # In-scope Services (agent.scope.model views): chains, EDS clusters and endpoints.
    services: tuple[ServiceView, ...] = ()
    # Stream passthrough connections to the agent's access log service (dependency learning).
    learn_access_log: bool = True


def service_cluster_name(namespace: str, name: str, port: int) -> str:
    """``svc|<ns>|<name>|<port>``: namespace-aware, unambiguous (no '|' in k8s names)."""
    return f"{SERVICE_CLUSTER_PREFIX}{namespace}|{name}|{port}"


def parse_service_cluster_name(cluster: str) -> tuple[str, str, int] | None:
    """Inverse of ``service_cluster_name`` (stats and status read cluster names back)."""
    parts = cluster.split("|")
    if len(parts) != 4 or parts[0] + "|" != SERVICE_CLUSTER_PREFIX or not parts[3].isdigit():
        return None
    return parts[1], parts[2], int(parts[3])


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(round(seconds * 1e9)))
    return d


def _socket_address(ip: str, port: int, netns_path: str) -> address_pb2.Address:
    return address_pb2.Address(
        socket_address=address_pb2.SocketAddress(
            address=ip, port_value=port, network_namespace_filepath=netns_path
        )
    )


def _access_log() -> accesslog_pb2.AccessLog:
    cfg = stream_pb2.StdoutAccessLog(
        log_format=substitution_format_string_pb2.SubstitutionFormatString(
            text_format_source={"inline_string": ACCESS_LOG_FORMAT}
        )
    )
    log = accesslog_pb2.AccessLog(name="envoy.access_loggers.stdout")
    log.typed_config.Pack(cfg)
    return log


def _grpc_access_log() -> accesslog_pb2.AccessLog:
    """TCP gRPC access log to the agent over the bootstrap's ``xds`` unix-socket cluster.

    The config is identical in every pod listener (the listener name comes from a formatter
    tag, not a literal), so Envoy shares one logger and one stream per worker thread.
    """
    common = als_pb2.CommonGrpcAccessLogConfig(
        log_name=ALS_LOG_NAME,
        transport_api_version=config_source_pb2.V3,
        grpc_service=grpc_service_pb2.GrpcService(
            envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=AGENT_GRPC_CLUSTER)
        ),
        custom_tags=[custom_tag_pb2.CustomTag(tag=ALS_LISTENER_TAG, value="%LISTENER_NAME%")],
    )
    log = accesslog_pb2.AccessLog(name="envoy.access_loggers.tcp_grpc")
    log.typed_config.Pack(als_pb2.TcpGrpcAccessLogConfig(common_config=common))
    return log


def _tcp_proxy_filter(stat_prefix: str, cluster: str, *logs: accesslog_pb2.AccessLog
                      ) -> listener_components_pb2.Filter:
    tcp = tcp_proxy_pb2.TcpProxy(stat_prefix=stat_prefix, cluster=cluster, access_log=logs)
    net_filter = listener_components_pb2.Filter(name="envoy.filters.network.tcp_proxy")
    net_filter.typed_config.Pack(tcp)
    return net_filter


def passthrough_chain(learn_access_log: bool = True) -> listener_components_pb2.FilterChain:
    """The default chain: anything not a Service ClusterIP goes to its original destination."""
    logs = [_access_log()] + ([_grpc_access_log()] if learn_access_log else [])
    return listener_components_pb2.FilterChain(
        name="passthrough",
        filters=[_tcp_proxy_filter("passthrough", PASSTHROUGH_CLUSTER, *logs)],
    )


def _cidr(ip: str) -> address_pb2.CidrRange | None:
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return None
    cidr = address_pb2.CidrRange(address_prefix=str(addr))
    cidr.prefix_len.value = addr.max_prefixlen
    return cidr


def service_chain(view: ServiceView, port: ServicePort) -> listener_components_pb2.FilterChain:
    """Plain TCP chain for one Service port: ClusterIPs (/32, /128) + port -> its EDS cluster.

    Matched on the original destination. The GAMMA work swaps in an HTTP variant (same
    match, HCM instead of tcp_proxy) for appProtocol http; see ``chain_for``.
    """
    cluster = service_cluster_name(view.namespace, view.name, port.port)
    match = listener_components_pb2.FilterChainMatch(
        prefix_ranges=[c for c in map(_cidr, view.cluster_ips) if c is not None],
    )
    match.destination_port.value = port.port
    return listener_components_pb2.FilterChain(
        name=cluster,
        filter_chain_match=match,
        filters=[_tcp_proxy_filter(cluster, cluster, _access_log())],
    )


def chain_for(view: ServiceView, port: ServicePort) -> listener_components_pb2.FilterChain:
    """Chain builder dispatch (one place for L7 variants to hook in by appProtocol)."""
    return service_chain(view, port)


def build_service_cluster(view: ServiceView, port: int, connect_timeout_s: float
                          ) -> cluster_pb2.Cluster:
    """EDS cluster over ADS. Panic mode is off so DRAINING/UNHEALTHY hosts never get
    new connections even when most hosts are out (Kubernetes readiness semantics)."""
    name = service_cluster_name(view.namespace, view.name, port)
    cluster = cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.EDS,
        connect_timeout=_duration(connect_timeout_s),
        lb_policy=cluster_pb2.Cluster.ROUND_ROBIN,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(
            service_name=name,
            eds_config=config_source_pb2.ConfigSource(
                ads=config_source_pb2.AggregatedConfigSource(),
                resource_api_version=config_source_pb2.V3,
            ),
        ),
    )
    cluster.common_lb_config.healthy_panic_threshold.value = 0.0
    return cluster


def endpoint_health(ep: Endpoint) -> int:
    """draining (terminating) -> DRAINING, else ready -> HEALTHY, else UNHEALTHY."""
    if ep.draining:
        return int(health_check_pb2.DRAINING)
    return int(health_check_pb2.HEALTHY if ep.ready else health_check_pb2.UNHEALTHY)


def _lb_endpoint(ep: Endpoint) -> endpoint_components_pb2.LbEndpoint:
    lb = endpoint_components_pb2.LbEndpoint(
        endpoint=endpoint_components_pb2.Endpoint(
            address=address_pb2.Address(
                socket_address=address_pb2.SocketAddress(address=ep.ip, port_value=ep.port)
            )
        ),
        health_status=endpoint_health(ep),
    )
    md = {k: v for k, v in (("identity", ep.sa_identity), ("san", ep.san), ("pod", ep.pod)) if v}
    if md:
        st = struct_pb2.Struct()
        st.update(md)
        lb.metadata.filter_metadata[METADATA_NAMESPACE].CopyFrom(st)
    return lb


def build_load_assignment(cluster_name: str, endpoints: tuple[Endpoint, ...]
                          ) -> endpoint_pb2.ClusterLoadAssignment:
    """One locality, endpoints sorted and de-duplicated by ip:port (Envoy wants unique hosts)."""
    seen: set[tuple[str, int]] = set()
    lbs = []
    for ep in sorted(endpoints, key=lambda e: (e.ip, e.port, e.draining, not e.ready)):
        if (ep.ip, ep.port) in seen:
            continue
        seen.add((ep.ip, ep.port))
        lbs.append(_lb_endpoint(ep))
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster_name)
    if lbs:
        cla.endpoints.add(lb_endpoints=lbs)
    return cla


def build_listener(pod: PodListener, capture_port: int, *,
                   chains: tuple[listener_components_pb2.FilterChain, ...] = (),
                   learn_access_log: bool = True) -> listener_pb2.Listener:
    """Capture listener on loopback of the pod's netns (v4 and/or v6)."""
    template = _listener_template(chains, learn_access_log)
    return _pod_listener(template, pod, capture_port)


def _listener_template(chains: tuple[listener_components_pb2.FilterChain, ...],
                       learn_access_log: bool) -> listener_pb2.Listener:
    """Everything pod-independent; copied per pod (C-level CopyFrom, no Python rebuild)."""
    odst = listener_components_pb2.ListenerFilter(name="envoy.filters.listener.original_dst")
    odst.typed_config.Pack(original_dst_pb2.OriginalDst())
    listener = listener_pb2.Listener(
        listener_filters=[odst],
        filter_chains=chains,
        default_filter_chain=passthrough_chain(learn_access_log),
    )
    listener.bind_to_port.value = True
    return listener


def _pod_listener(template: listener_pb2.Listener, pod: PodListener, capture_port: int
                  ) -> listener_pb2.Listener:
    ips = ([("127.0.0.1")] if pod.ipv4 else []) + (["::1"] if pod.ipv6 else [])
    if not ips:
        raise ValueError(f"pod {pod.uid}: at least one of ipv4/ipv6 must be enabled")
    addrs = [_socket_address(ip, capture_port, pod.netns_path) for ip in ips]
    listener = listener_pb2.Listener()
    listener.CopyFrom(template)
    listener.name = pod.listener_name
    listener.stat_prefix = pod.listener_name
    listener.address.CopyFrom(addrs[0])
    for a in addrs[1:]:
        listener.additional_addresses.add().address.CopyFrom(a)
    return listener


def build_passthrough_cluster(mark: int, connect_timeout_s: float) -> cluster_pb2.Cluster:
    """ORIGINAL_DST cluster whose upstream sockets are SO_MARKed before bind/connect.

    The mark rides in ``upstream_bind_config.socket_options`` *without* a source_address:
    Envoy then applies the options but does not bind, so IPv4 and IPv6 upstreams both work.
    """
    opt = socket_option_pb2.SocketOption(
        description="SO_MARK passthrough",
        level=SOL_SOCKET,
        name=SO_MARK,
        int_value=mark,
        state=socket_option_pb2.SocketOption.STATE_PREBIND,
    )
    cluster = cluster_pb2.Cluster(
        name=PASSTHROUGH_CLUSTER,
        type=cluster_pb2.Cluster.ORIGINAL_DST,
        lb_policy=cluster_pb2.Cluster.CLUSTER_PROVIDED,
        connect_timeout=_duration(connect_timeout_s),
        upstream_bind_config=address_pb2.BindConfig(socket_options=[opt]),
    )
    return cluster


@dataclass
class _ServiceEntry:
    """Cached protos for one Service; each piece is keyed by exactly what it depends on."""

    view: ServiceView
    chain_key: tuple[Any, ...]
    chains: tuple[listener_components_pb2.FilterChain, ...]
    cluster_key: tuple[Any, ...]
    clusters: dict[str, cluster_pb2.Cluster]
    eds: dict[str, tuple[tuple[Endpoint, ...], endpoint_pb2.ClusterLoadAssignment]]


class ResourceBuilder:
    """Incremental ``build_resources``: unchanged Services and the shared chain table are
    reused, so protos (and their identities) stay put unless their inputs changed."""

    def __init__(self) -> None:
        self._services: dict[str, _ServiceEntry] = {}
        self._table_key: tuple[Any, ...] | None = None
        self._template: listener_pb2.Listener | None = None
        self._listeners: dict[tuple[PodListener, int], listener_pb2.Listener] = {}
        self._passthrough: tuple[tuple[int, float], cluster_pb2.Cluster] | None = None

    def _service(self, view: ServiceView, timeout: float) -> _ServiceEntry:
        old = self._services.get(view.key)
        if old is not None and old.view is view and old.cluster_key[-1] == timeout:
            return old
        tcp_ports = tuple(p for p in view.ports if p.protocol.upper() == "TCP")
        chain_key = (view.namespace, view.name, view.cluster_ips, tcp_ports)
        if old is not None and old.chain_key == chain_key:
            chains = old.chains
        else:
            chains = tuple(chain_for(view, p) for p in tcp_ports) if view.cluster_ips else ()
        cluster_key = (view.namespace, view.name, tuple(p.port for p in tcp_ports), timeout)
        if old is not None and old.cluster_key == cluster_key:
            clusters = old.clusters
        else:
            clusters = {service_cluster_name(view.namespace, view.name, p.port):
                        build_service_cluster(view, p.port, timeout) for p in tcp_ports}
        eds = {}
        for p in tcp_ports:
            name = service_cluster_name(view.namespace, view.name, p.port)
            eps = view.endpoints.get(p.port, ())
            prev = old.eds.get(name) if old is not None else None
            eds[name] = prev if prev is not None and prev[0] == eps else (
                eps, build_load_assignment(name, eps))
        entry = _ServiceEntry(view, chain_key, chains, cluster_key, clusters, eds)
        self._services[view.key] = entry
        return entry

    def build(self, state: NodeXdsState) -> dict[str, dict[str, Any]]:
        """type_url -> {resource name: proto}; ordered by name so output is deterministic."""
        clusters: dict[str, Message] = {}
        assignments: dict[str, Message] = {}
        chains: list[listener_components_pb2.FilterChain] = []
        claimed: dict[tuple[str, int], str] = {}
        live: set[str] = set()
        for view in sorted(state.services, key=lambda v: v.key):
            if view.key in live:
                raise ValueError(f"duplicate service {view.key}")
            live.add(view.key)
            entry = self._service(view, state.connect_timeout_s)
            clusters.update(entry.clusters)
            assignments.update((n, cla) for n, (_, cla) in entry.eds.items())
            for chain in entry.chains:
                m = chain.filter_chain_match
                keys = [(r.address_prefix, m.destination_port.value) for r in m.prefix_ranges]
                clash = sorted({claimed[k] for k in keys if k in claimed})
                if clash:  # two Services claiming one ClusterIP:port would NACK every listener
                    log.warning("service %s: %s already served by %s; chain skipped",
                                view.key, chain.name, ",".join(clash))
                    continue
                claimed.update((k, view.key) for k in keys)
                chains.append(chain)
        for key in [k for k in self._services if k not in live]:
            del self._services[key]

        pt_key = (state.passthrough_mark, state.connect_timeout_s)
        if self._passthrough is None or self._passthrough[0] != pt_key:
            self._passthrough = (pt_key, build_passthrough_cluster(*pt_key))
        clusters[PASSTHROUGH_CLUSTER] = self._passthrough[1]

        table_key = (tuple(id(c) for c in chains), state.learn_access_log)
        if table_key != self._table_key or self._template is None:
            self._template = _listener_template(tuple(chains), state.learn_access_log)
            self._table_key = table_key
            self._listeners = {}
        seen: set[str] = set()
        listeners: dict[str, Message] = {}
        cache: dict[tuple[PodListener, int], listener_pb2.Listener] = {}
        for pod in sorted(state.pods, key=lambda p: p.uid):
            if pod.uid in seen:
                raise ValueError(f"duplicate pod uid {pod.uid}")
            seen.add(pod.uid)
            k = (pod, state.capture_port)
            lis = self._listeners.get(k)
            if lis is None:
                lis = _pod_listener(self._template, pod, state.capture_port)
            cache[k] = lis
            listeners[pod.listener_name] = lis
        self._listeners = cache
        return {
            CLUSTER_TYPE: dict(sorted(clusters.items())),
            ENDPOINT_TYPE: dict(sorted(assignments.items())),
            LISTENER_TYPE: listeners,
        }


def build_resources(state: NodeXdsState, builder: ResourceBuilder | None = None
                    ) -> dict[str, dict[str, Any]]:
    """type_url -> {resource name: proto}; pass a long-lived ``builder`` to reuse protos."""
    return (builder or ResourceBuilder()).build(state)


def resource_hash(msg: Message) -> str:
    """Stable content hash used as the per-resource version in delta xDS."""
    return hashlib.sha256(msg.SerializeToString(deterministic=True)).hexdigest()[:16]
