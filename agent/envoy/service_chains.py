"""The filter chains of the namespace listeners (``mesh``, ``mesh-<ns>``): one per
(Service, port), the passthrough and dependency-learning chains, and their access logs."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple, TypeAlias

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import (
    address_pb2,
    config_source_pb2,
    grpc_service_pb2,
)
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
from envoy.type.tracing.v3 import custom_tag_pb2

from agent.envoy.envoy_stats import PASSTHROUGH_STATS
from agent.envoy.golden import http_stats_log, tcp_stats_log
from agent.envoy.names import (
    ALS_LISTENER_TAG,
    ALS_LOG_NAME,
    ALS_MESH_LISTENER_TAG,
    CAPTURE_LISTENER_FORMAT,
    HTTP_FAILURE_LOG_FORMAT,
    PASSTHROUGH_CLUSTER,
    REQUEST_LOG_NAME,
    TRAFFIC_LOG_NAME,
    TRAFFIC_TAGS,
    namespace_listener_name,
    service_cluster_name,
)
from agent.envoy.pieces import (
    AGENT_GRPC_CLUSTER,
    http_grpc_access_log,
    original_dst_filter,
    stdout_access_log,
    tcp_grpc_access_log,
    tcp_proxy_filter,
)
from agent.envoy.raw import (
    encode_chains,
)
from agent.scope.model import ServiceView
from agent.scope.route_tables import GammaResult
from agent.scope.services import ServicePort

log = logging.getLogger("agent.envoy.resources")


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


def _canonical_v4(ip: str) -> bool:
    """``ip`` is an IPv4 address already in its canonical dotted form (what
    ``ipaddress`` would print): checked without it, which cost ~20 µs an address, a quarter
    of a full build at 10k Services."""
    parts = ip.split(".")
    return len(parts) == 4 and all(
        0 < len(o) <= 3 and o.isdigit() and o.isascii() and (o == "0" or o[0] != "0")
        and int(o) <= 255 for o in parts)


def _cidr(ip: str) -> address_pb2.CidrRange | None:
    if _canonical_v4(ip):
        cidr = address_pb2.CidrRange(address_prefix=ip)
        cidr.prefix_len.value = 32
        return cidr
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
