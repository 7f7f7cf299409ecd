"""``inbound-<uid>``, the pod's end of the mesh hop (split out of ``agent.envoy.mtls``,
which re-exports it): terminates mTLS on the inbound port, enforces the pod's
AuthorizationPolicies and hands each connection on by the ALPN its caller chose."""

from __future__ import annotations

from collections.abc import Sequence

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import (
    address_pb2,
    base_pb2,
)
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2

from agent.authz.policy import Policy, needs_http
from agent.authz.rbac import (
    HTTP_RBAC,
    MTLS_HTTP,
    NETWORK_RBAC,
    PEER_STATE,
    http_rbac_filters,
    network_rbac_filters,
)
from agent.envoy.mtls_common import (
    HELLO_TIMEOUT_S,
    INBOUND_ALS_LOG_NAME,
    INBOUND_DELIVER_CLUSTER,
    INBOUND_DETECT,
    INBOUND_LISTENER_TAG,
    LOCAL_ID_TLV,
    MESH_ALPN,
    MESH_ALPN_HTTP,
    MESH_ALPN_TCP,
    MESH_ALPNS,
    NO_IDENTITY_CLUSTER,
    PEER_ID_TLV,
    XFCC_TLV,
    MeshTls,
    _common_tls,
    inbound_listener_name,
    pod_detect_name,
)
from agent.envoy.mtls_deliver import (
    XFCC_FORMAT,
    _deliver_hcm,
    _deliver_state,
    _http_filter,
    _network_filter,
    deliver_target,
)
from agent.envoy.pieces import (
    NOT_SHARED,
    STRING_STATE_FACTORY,
    TRANSITIVE,
    duration,
    state_value,
    stdout_access_log,
    tcp_grpc_access_log,
    tcp_proxy_filter,
    transport_socket,
)

INBOUND_LOG_FORMAT = (
    "[%START_TIME%] inbound listener=%LISTENER_NAME% peer=%DOWNSTREAM_PEER_URI_SAN% "
    "from=%DOWNSTREAM_REMOTE_ADDRESS% -> port %REQUESTED_SERVER_NAME% "
    "flags=%RESPONSE_FLAGS% rx=%BYTES_RECEIVED% tx=%BYTES_SENT% dur=%DURATION%ms\n")


def inbound_access_log() -> accesslog_pb2.AccessLog:
    """One stdout line per mesh connection a pod accepted, naming the caller's SPIFFE ID."""
    return stdout_access_log(INBOUND_LOG_FORMAT)


def build_inbound_listener(uid: str, netns_path: str, identity: str, ips: Sequence[str],
                           tls: MeshTls, ipv4: bool = True, ipv6: bool = True,
                           forbidden_ports: Sequence[int] = (),
                           access_log: bool = False, workload: str = "",
                           policies: Sequence[Policy] = ()) -> listener_pb2.Listener:
    """``inbound-<uid>``: the pod's end of the mesh hop, bound on the inbound port of every
    address in its netns. Terminates mTLS (a peer certificate of the trust domain and one of
    our ALPNs required); then, by the ALPN the caller's proxy chose from the Service port's
    appProtocol:

    * ``aether-mesh-http``: the HTTP codec on the TLS connection itself, adding
      ``x-forwarded-client-cert`` (the caller's URI SAN), delivering to ``<pod ip>:<port>``;
    * ``aether-mesh-tcp``: relayed as is to ``<pod ip>:<port>`` once the handshake is done;
    * ``aether-mesh`` (not declared): relayed to the internal listener ``inbound-detect``,
      which detects HTTP; both SPIFFE IDs go in a PROXY v2 header, the delivery address
      and netns in filter state, and ``workload`` (``<ns>/<workload>``, what the
      requests detected there are counted under) with the port.

    The port is the server name. A server name that is one of the proxy's ports (a loop)
    matches a closing chain; one that is not a port is refused where it is delivered.

    ``policies``: the AuthorizationPolicies that select the pod (agent.authz), enforced here
    with the peer certificate's identity: RBAC network filters ahead of the relay on the L4
    chains (a denial closes the connection before a byte is relayed; an undeclared port is
    judged as L4 too, its HTTP detected only past this point), HTTP RBAC ahead of the router
    on the HTTP chain (a denial is a 403)."""
    if not ips:
        raise ValueError(f"pod {uid}: no address to deliver to")
    forbidden = {str(p) for p in (tls.inbound_port, *forbidden_ports)}
    logs = [inbound_access_log()] if access_log else []
    addrs = ([("0.0.0.0", tls.inbound_port)] if ipv4 else []) + \
        ([("::", tls.inbound_port)] if ipv6 else [])
    if not addrs:
        raise ValueError(f"pod {uid}: at least one of ipv4/ipv6 must be enabled")
    name = inbound_listener_name(uid)
    target = deliver_target(ips)
    td = tls.trust_domain
    l4_rbac = [_network_filter(NETWORK_RBAC, f)
               for f in network_rbac_filters(policies, scope=uid, trust_domain=td)]
    http_rbac = [_http_filter(HTTP_RBAC, f) for f in http_rbac_filters(policies, td, MTLS_HTTP)]
    if http_rbac:
        http_rbac.insert(0, peer_id_filter())

    def match(family: str, **kw: object) -> listener_components_pb2.FilterChainMatch:
        # every chain names its destination range: Envoy narrows on the destination address
        # before the server name, so a chain without one would compete at that step
        m = listener_components_pb2.FilterChainMatch(transport_protocol="tls", **kw)
        cidr = m.prefix_ranges.add(address_prefix="::" if family == "6" else "0.0.0.0")
        cidr.prefix_len.value = 0
        return m

    def terminate(alpns: Sequence[str] = MESH_ALPNS) -> base_pb2.TransportSocket:
        downstream = tls_pb2.DownstreamTlsContext(
            common_tls_context=_common_tls(identity, tls.trust_domain, alpns))
        downstream.require_client_certificate.value = True
        return transport_socket("envoy.transport_sockets.tls", downstream)

    def after_handshake() -> tcp_proxy_pb2.TcpProxy:
        # the peer's identity exists only once the handshake is done, and an unauthenticated
        # caller must not make the proxy open a connection: the upstream waits for it
        tcp = tcp_proxy_pb2.TcpProxy(
            upstream_connect_mode=tcp_proxy_pb2.ON_DOWNSTREAM_TLS_HANDSHAKE)
        tcp.max_early_data_bytes.value = 0  # nothing is read before the handshake is done
        return tcp

    own_detect = needs_http(policies)

    def detect(family: str) -> listener_components_pb2.FilterChain:
        # where inbound-detect delivers, crossing it (transitive): the pod's own address
        # and netns, the port the caller named. With a detection listener of its own, the
        # policies are decided there, after detection (the address it restores names the
        # port); here they would judge HTTP requests as bytes.
        state = _deliver_state(target, "%REQUESTED_SERVER_NAME%", netns_path, TRANSITIVE,
                               destination=f"{workload or uid}|%REQUESTED_SERVER_NAME%",
                               local=own_detect)
        tcp = after_handshake()
        tlvs = [(PEER_ID_TLV, "%DOWNSTREAM_PEER_URI_SAN%"),
                (LOCAL_ID_TLV, "%DOWNSTREAM_LOCAL_URI_SAN%")]
        if own_detect:
            tlvs.append((XFCC_TLV, XFCC_FORMAT))
        for tlv_type, fmt in tlvs:
            tlv = tcp.proxy_protocol_tlvs.add(type=tlv_type)
            tlv.format_string.text_format_source.inline_string = fmt
        return listener_components_pb2.FilterChain(
            name=f"mtls-v{family}", filter_chain_match=match(family, application_protocols=[MESH_ALPN]),
            filters=[state, *([] if own_detect else l4_rbac),
                     tcp_proxy_filter(name, pod_detect_name(uid) if own_detect else INBOUND_DETECT,
                                      *logs, config=tcp)],
            transport_socket=terminate())

    def direct_state() -> listener_components_pb2.Filter:
        return _deliver_state(target, "%REQUESTED_SERVER_NAME%", netns_path)

    def http(family: str) -> listener_components_pb2.FilterChain:
        hcm = _deliver_hcm(f"{name}-http", XFCC_FORMAT, logs, http_rbac)
        # the port the caller named, for the RBAC's principals (known at accept: the name)
        state = _deliver_state(target, "%REQUESTED_SERVER_NAME%", netns_path,
                               port=bool(http_rbac))
        return listener_components_pb2.FilterChain(
            name=f"mtls-http-v{family}",
            filter_chain_match=match(family, application_protocols=[MESH_ALPN_HTTP]),
            # the chain is picked by the ALPN the caller offers, but none is negotiated: the
            # HTTP codec takes a negotiated ALPN as the protocol and would read h2c as HTTP/1;
            # with none it tells HTTP/2 from HTTP/1.1 by the connection preface
            filters=[state, hcm], transport_socket=terminate(alpns=()))

    def tcp(family: str) -> listener_components_pb2.FilterChain:
        return listener_components_pb2.FilterChain(
            name=f"mtls-tcp-v{family}",
            filter_chain_match=match(family, application_protocols=[MESH_ALPN_TCP]),
            filters=[direct_state(), *l4_rbac,
                     tcp_proxy_filter(name, INBOUND_DELIVER_CLUSTER, *logs,
                                      config=after_handshake())],
            transport_socket=terminate())

    def deny(family: str) -> listener_components_pb2.FilterChain:
        return listener_components_pb2.FilterChain(
            name=f"own-ports-v{family}", filter_chain_match=match(family, server_names=sorted(forbidden)),
            filters=[tcp_proxy_filter(name, NO_IDENTITY_CLUSTER)])

    inspector = listener_components_pb2.ListenerFilter(name="envoy.filters.listener.tls_inspector")
    from envoy.extensions.filters.listener.tls_inspector.v3 import tls_inspector_pb2
    inspector.typed_config.Pack(tls_inspector_pb2.TlsInspector())
    lis = listener_pb2.Listener(
        name=name, stat_prefix=name,
        address=_sock(*addrs[0], netns_path), listener_filters=[inspector],
        # a peer proxy sends its ClientHello at once; anything else (plaintext steered here
        # from a STRICT pod's ports) is not held for Envoy's default 15 s
        listener_filters_timeout=duration(HELLO_TIMEOUT_S),
        filter_chains=[c for f, on in (("4", ipv4), ("6", ipv6)) if on
                       for c in (deny(f), detect(f), http(f), tcp(f))])
    for a in addrs[1:]:
        lis.additional_addresses.add().address.CopyFrom(_sock(*a, netns_path))
    if ipv4 and ipv6:
        lis.address.socket_address.ipv4_compat = False
    # the listener's own log: once per connection whatever its chain (HTTP ones included),
    # and for handshakes that failed too; one config for every pod, so one stream
    lis.access_log.append(tcp_grpc_access_log(INBOUND_ALS_LOG_NAME,
                                              {INBOUND_LISTENER_TAG: "%LISTENER_NAME%"}))
    return lis


def peer_id_filter() -> hcm_pb2.HttpFilter:
    """Per request, ``PEER_STATE`` from the verified peer certificate's URI SAN (none
    without one), for the RBAC filters after it."""
    from envoy.extensions.filters.http.set_filter_state.v3 import set_filter_state_pb2
    return _http_filter("envoy.filters.http.set_filter_state", set_filter_state_pb2.Config(
        on_request_headers=[state_value(PEER_STATE, "%DOWNSTREAM_PEER_URI_SAN%",
                                        STRING_STATE_FACTORY, NOT_SHARED, skip_if_empty=True)]))


def _sock(ip: str, port: int, netns_path: str) -> address_pb2.Address:
    return address_pb2.Address(socket_address=address_pb2.SocketAddress(
        address=ip, port_value=port, network_namespace_filepath=netns_path))
