"""``inbound-detect`` (the node's) and ``inbound-detect-<uid>`` (a pod's whose policies
name HTTP fields): the internal listeners that detect HTTP on mesh connections to
undeclared ports, and the clusters to them (split out of ``agent.envoy.mtls``, which
re-exports them)."""

from __future__ import annotations

from collections.abc import Sequence

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.extensions.filters.listener.http_inspector.v3 import http_inspector_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)

from agent.authz.policy import Policy
from agent.authz.rbac import (
    DETECTED,
    HTTP_RBAC,
    NETWORK_RBAC,
    PEER_STATE,
    PORT_STATE,
    http_rbac_filters,
    network_rbac_filters,
)
from agent.envoy.golden import inbound_stats_log
from agent.envoy.mtls_common import (
    DESTINATION_STATE,
    DETECT_TIMEOUT_S,
    INBOUND_DELIVER_CLUSTER,
    INBOUND_DETECT,
    LOCAL_ID_TLV,
    PEER_ID_TLV,
    PROXY_TLV_STATE,
    XFCC_TLV,
    pod_detect_name,
    unlimited_circuit_breakers,
)
from agent.envoy.mtls_deliver import (
    _deliver_hcm,
    _http_filter,
    _network_filter,
)
from agent.envoy.pieces import (
    NOT_SHARED,
    STRING_STATE_FACTORY,
    duration,
    internal_upstream,
    original_dst_filter,
    raw_buffer,
    set_filter_state,
    state_value,
    tcp_proxy_filter,
    transport_socket,
)


def build_inbound_detect_listener(uid: str = "", policies: Sequence[Policy] = (),
                                  trust_domain: str | None = None) -> listener_pb2.Listener:
    """``inbound-detect``, the node's internal listener for mesh connections on ports with
    no appProtocol: reads the PROXY v2 header the inbound listener sent (both SPIFFE IDs),
    detects HTTP (its requests get ``x-forwarded-client-cert: By=<pod's id>;URI=<caller's
    id>``, any XFCC the caller sent removed first) and delivers everything to the address
    and netns the inbound listener put in filter state: the pod's own address, the port
    the caller named. Internal: no pod can connect to it, so no pod can write the header.

    With ``uid``: the pod's own, ``inbound-detect-<uid>``, enforcing ``policies`` (the pod's
    AuthorizationPolicies, some naming HTTP fields) with the caller's ID from the header:
    HTTP RBAC on the detected requests (a denial is a 403), network RBAC on what is not
    HTTP (L4: an ALLOW needing HTTP matches nothing there)."""
    from envoy.extensions.filters.listener.proxy_protocol.v3 import proxy_protocol_pb2
    pp = proxy_protocol_pb2.ProxyProtocol(tlv_location=proxy_protocol_pb2.ProxyProtocol.FILTER_STATE)
    tlvs = [(PEER_ID_TLV, "peer"), (LOCAL_ID_TLV, "local")] + ([(XFCC_TLV, "xfcc")] if uid else [])
    for tlv_type, key in tlvs:
        rule = pp.rules.add(tlv_type=tlv_type)
        rule.on_tlv_present.key = key
    ppf = listener_components_pb2.ListenerFilter(name="envoy.filters.listener.proxy_protocol")
    ppf.typed_config.Pack(pp)
    inspector = listener_components_pb2.ListenerFilter(
        name="envoy.filters.listener.http_inspector")
    inspector.typed_config.Pack(http_inspector_pb2.HttpInspector())
    name = pod_detect_name(uid) if uid else INBOUND_DETECT
    peer = f"%FILTER_STATE({PROXY_TLV_STATE}:FIELD:peer)%"
    pre: list[listener_components_pb2.Filter] = []
    http_rbac: list[hcm_pb2.HttpFilter] = []
    l4_rbac: list[listener_components_pb2.Filter] = []
    if uid:
        # the caller's ID as a plain string for RBAC to match (the header has been read by
        # now: listener filters run first); unset when the caller sent none
        pre = [set_filter_state(
            state_value(PEER_STATE, peer, STRING_STATE_FACTORY, NOT_SHARED, skip_if_empty=True),
            state_value(PORT_STATE, "%DOWNSTREAM_LOCAL_PORT%", STRING_STATE_FACTORY, NOT_SHARED))]
        http_rbac = [_http_filter(HTTP_RBAC, f)
                     for f in http_rbac_filters(policies, trust_domain, DETECTED)]
        l4_rbac = [_network_filter(NETWORK_RBAC, f) for f in network_rbac_filters(
            policies, DETECTED, scope=uid, trust_domain=trust_domain)]
    # its requests are counted here (the caller's proxy did not parse them: it sent them
    # as bytes on an undeclared port), by the caller's SPIFFE ID and the pod's workload
    xfcc = (f"%FILTER_STATE({PROXY_TLV_STATE}:FIELD:xfcc)%" if uid else
            f"By=%FILTER_STATE({PROXY_TLV_STATE}:FIELD:local)%;URI={peer}")
    hcm_filter = _deliver_hcm(name, xfcc, [inbound_stats_log(
        peer, f"%FILTER_STATE({DESTINATION_STATE}:PLAIN)%")], http_rbac)
    http_chain = listener_components_pb2.FilterChain(
        name="http", filters=[*pre, hcm_filter],
        filter_chain_match=listener_components_pb2.FilterChainMatch(
            application_protocols=["http/1.1", "h2c"]))
    # the pod's own restores the address the caller named (its port is what RBAC judges)
    # after the header's (the inbound listener's own address)
    restore = [original_dst_filter()] if uid else []
    return listener_pb2.Listener(
        name=name, stat_prefix=name,
        internal_listener=listener_pb2.Listener.InternalListenerConfig(),
        listener_filters=[ppf, *restore, inspector],
        listener_filters_timeout=duration(DETECT_TIMEOUT_S),
        continue_on_listener_filters_timeout=True,
        filter_chains=[http_chain],
        default_filter_chain=listener_components_pb2.FilterChain(
            name="tcp", filters=[*pre, *l4_rbac, tcp_proxy_filter(name, INBOUND_DELIVER_CLUSTER)]))


def build_inbound_detect_cluster(connect_timeout_s: float, uid: str = "") -> cluster_pb2.Cluster:
    """To ``inbound-detect`` (with ``uid``: the pod's own), with a PROXY v2 header carrying
    the TLVs the inbound listener set; the shared filter state (where to deliver) crosses
    with the connection."""
    from envoy.config.core.v3 import proxy_protocol_pb2
    from envoy.extensions.transport_sockets.proxy_protocol.v3 import upstream_proxy_protocol_pb2
    pp = transport_socket("envoy.transport_sockets.upstream_proxy_protocol",
                          upstream_proxy_protocol_pb2.ProxyProtocolUpstreamTransport(
                              config=proxy_protocol_pb2.ProxyProtocolConfig(
                                  version=proxy_protocol_pb2.ProxyProtocolConfig.V2,
                                  pass_through_tlvs=proxy_protocol_pb2.ProxyProtocolPassThroughTLVs(
                                      match_type=proxy_protocol_pb2.ProxyProtocolPassThroughTLVs.INCLUDE,
                                      tlv_type=[PEER_ID_TLV, LOCAL_ID_TLV,
                                                *([XFCC_TLV] if uid else [])])),
                              transport_socket=raw_buffer()))
    name = pod_detect_name(uid) if uid else INBOUND_DETECT
    c = cluster_pb2.Cluster(name=name, type=cluster_pb2.Cluster.STATIC,
                            connect_timeout=duration(connect_timeout_s),
                            transport_socket=internal_upstream(inner=pp))
    c.load_assignment.cluster_name = name
    c.load_assignment.endpoints.add().lb_endpoints.add().endpoint.address \
        .envoy_internal_address.server_listener_name = name
    unlimited_circuit_breakers(c)
    return c

