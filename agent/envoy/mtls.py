"""Pure xDS builders for the mesh hop: mTLS between node proxies over HTTP/2 CONNECT.

Outbound (a captured pod calling a Service endpoint)::

    mesh-<ns> Service chain ─▶ svc|<ns>|<name>|<port>  (EDS; endpoints are internal addresses
                               of ``hbone-out`` carrying the pod address and its SPIFFE ID)
    hbone-out (internal listener) ─ set_filter_state: the caller's cluster, the backend SAN
                ─▶ tcp_proxy, tunneling_config: CONNECT <pod ip>:<port>
    hbone|<ns>|<sa> (ORIGINAL_DST, port overridden to 15008, socket in the caller's netns)
                ─▶ TLS: the caller's SVID, the trust bundle, the backend SAN pinned ─▶ h2

Inbound (``inbound-<container id>``, bound on :15008 in every captured pod's netns)::

    TLS (the pod's SVID; a client certificate of the trust domain required) ─▶ HCM (h2)
       CONNECT to one of the pod's own addresses only ─▶ inbound-inner (internal listener)
    inbound-inner: HTTP (detected) ─▶ HCM adding x-forwarded-client-cert; else tcp_proxy
       ─▶ inbound-deliver (ORIGINAL_DST = the CONNECT authority, socket in the pod's netns)

Why CONNECT and a fixed port: the destination pod's port travels in the CONNECT authority,
so one inbound listener per pod serves every port, and the original port never needs a
listener of its own (HBONE's shape). Why per-caller clusters: Envoy picks the client
certificate per cluster, so each ServiceAccount with captured pods on this node gets one
``hbone|<ns>|<sa>`` cluster; the pod listener names it in filter state and ``hbone-out``
hands it to ``tcp_proxy`` (``envoy.tcp_proxy.cluster``). The backend's SAN comes with the
endpoint (metadata passed through the internal upstream) and is enforced per connection
(``envoy.network.upstream_subject_alt_names``) on top of the trust-domain check.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import (
    address_pb2,
    base_pb2,
    config_source_pb2,
    protocol_pb2,
    substitution_format_string_pb2,
)
from envoy.config.endpoint.v3 import endpoint_components_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.config.route.v3 import route_pb2
from envoy.extensions.access_loggers.stream.v3 import stream_pb2
from envoy.extensions.filters.common.set_filter_state.v3 import value_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.http.set_filter_state.v3 import (
    set_filter_state_pb2 as http_sfs_pb2,
)
from envoy.extensions.filters.listener.http_inspector.v3 import http_inspector_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.filters.network.set_filter_state.v3 import set_filter_state_pb2
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
from envoy.extensions.transport_sockets.internal_upstream.v3 import internal_upstream_pb2
from envoy.extensions.transport_sockets.raw_buffer.v3 import raw_buffer_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, secret_pb2, tls_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.matcher.v3 import regex_pb2, string_pb2
from google.protobuf import duration_pb2, struct_pb2

from agent.identity.svid import Svid

SECRET_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
INBOUND_PORT = 15008
TRUST_BUNDLE_SECRET = "trust-bundle"
HBONE_OUT_LISTENER = "hbone-out"
HBONE_CLUSTER_PREFIX = "hbone|"
# Tcp_proxy's default when no caller cluster was named: no such cluster, so the connection
# is closed (fail closed), never sent in plaintext.
NO_IDENTITY_CLUSTER = "hbone|no-identity"
INBOUND_LISTENER_PREFIX = "inbound-"
INBOUND_INNER = "inbound-inner"
INBOUND_DELIVER_CLUSTER = "inbound-deliver"
HTTP_PROTOCOL_OPTIONS_KEY = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"

# Filter state: the caller's hbone cluster (set by the pod listener, transitive), the
# backend SAN (set in hbone-out for its upstream), the caller's and our own SPIFFE IDs on the
# inbound side.
CALLER_CLUSTER_STATE = "aether.hbone_cluster"
PEER_ID_STATE = "aether.peer_id"
LOCAL_ID_STATE = "aether.local_id"
TCP_PROXY_CLUSTER_STATE = "envoy.tcp_proxy.cluster"
UPSTREAM_SAN_STATE = "envoy.network.upstream_subject_alt_names"
ORIGINAL_DST_LOCAL_STATE = "envoy.filters.listener.original_dst.local_ip"
UPSTREAM_NETNS_STATE = "envoy.network.upstream_bind_override.network_namespace"
STRING_FACTORY = "envoy.string"
# Endpoint metadata namespaces: original_dst's (the pod address, read by the original_dst
# listener filter of hbone-out) and ours (the backend SAN).
ORIGINAL_DST_METADATA = "envoy.filters.listener.original_dst"
AETHER_METADATA = "aether"
XFCC = "x-forwarded-client-cert"
# How long the inbound side waits for a first byte to tell HTTP (gets the XFCC header) from
# other TCP; a server-first protocol waits this long for its first byte to arrive.
DETECT_TIMEOUT_S = 0.5


@dataclass(frozen=True)
class MeshTls:
    """What the mesh hop needs: the trust domain, the SVIDs held (by ``<ns>/<sa>``) and the
    trust bundle. Only identities with an SVID get a cluster and an inbound listener."""

    trust_domain: str
    svids: Mapping[str, Svid]
    bundle_pem: str
    inbound_port: int = INBOUND_PORT


def svid_secret_name(identity: str) -> str:
    """``svid|<ns>|<sa>`` for the identity ``<ns>/<sa>``."""
    ns, _, sa = identity.partition("/")
    return f"svid|{ns}|{sa}"


def hbone_cluster_name(identity: str) -> str:
    ns, _, sa = identity.partition("/")
    return f"{HBONE_CLUSTER_PREFIX}{ns}|{sa}"


def inbound_listener_name(uid: str) -> str:
    return f"{INBOUND_LISTENER_PREFIX}{uid}"


def host_port(ip: str, port: int) -> str:
    """``ip:port``, IPv6 bracketed (the CONNECT authority and Envoy's address strings)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


# ---- secrets --------------------------------------------------------------------------------

def build_secrets(tls: MeshTls) -> dict[str, secret_pb2.Secret]:
    """SDS resources: one TLS certificate per identity held, and the trust bundle."""
    out: dict[str, secret_pb2.Secret] = {}
    for identity, svid in sorted(tls.svids.items()):
        name = svid_secret_name(identity)
        s = secret_pb2.Secret(name=name)
        s.tls_certificate.certificate_chain.inline_string = svid.cert_chain_pem
        s.tls_certificate.private_key.inline_string = svid.key_pem
        out[name] = s
    bundle = secret_pb2.Secret(name=TRUST_BUNDLE_SECRET)
    bundle.validation_context.trusted_ca.inline_string = tls.bundle_pem
    out[TRUST_BUNDLE_SECRET] = bundle
    return out


def _sds(name: str) -> secret_pb2.SdsSecretConfig:
    return secret_pb2.SdsSecretConfig(name=name, sds_config=config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(),
        resource_api_version=config_source_pb2.V3))


def _common_tls(identity: str, trust_domain: str) -> tls_pb2.CommonTlsContext:
    """Our SVID, the bundle, peers of our trust domain only (URI SAN prefix), h2, TLS 1.3."""
    ctx = tls_pb2.CommonTlsContext(
        tls_certificate_sds_secret_configs=[_sds(svid_secret_name(identity))],
        alpn_protocols=["h2"])
    ctx.tls_params.tls_minimum_protocol_version = common_pb2.TlsParameters.TLSv1_3
    ctx.tls_params.tls_maximum_protocol_version = common_pb2.TlsParameters.TLSv1_3
    combined = ctx.combined_validation_context
    combined.validation_context_sds_secret_config.CopyFrom(_sds(TRUST_BUNDLE_SECRET))
    san = combined.default_validation_context.match_typed_subject_alt_names.add()
    san.san_type = common_pb2.SubjectAltNameMatcher.URI
    san.matcher.prefix = f"spiffe://{trust_domain}/"
    return ctx


def _transport_socket(name: str, msg: object) -> base_pb2.TransportSocket:
    ts = base_pb2.TransportSocket(name=name)
    ts.typed_config.Pack(msg)
    return ts


# Envoy's default circuit breakers allow 1024 connections per cluster; a node's tunnels and
# deliveries are every mesh connection of its pods, so the thresholds are the node's limits
# (file descriptors), not Envoy's defaults.
UNLIMITED = 0xFFFFFFFF


def unlimited_circuit_breakers(cluster: cluster_pb2.Cluster) -> None:
    t = cluster.circuit_breakers.thresholds.add()
    for f in ("max_connections", "max_pending_requests", "max_requests", "max_retries"):
        getattr(t, f).value = UNLIMITED


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(round(seconds * 1e9)))
    return d


def _state(key: str, fmt: str, factory: str = "", shared: str = "") -> value_pb2.FilterStateValue:
    v = value_pb2.FilterStateValue(
        object_key=key, factory_key=factory,
        format_string=substitution_format_string_pb2.SubstitutionFormatString(
            text_format_source={"inline_string": fmt}))
    if shared == "once":
        v.shared_with_upstream = value_pb2.FilterStateValue.ONCE
    elif shared == "transitive":
        v.shared_with_upstream = value_pb2.FilterStateValue.TRANSITIVE
    return v


def _network_state_filter(*values: value_pb2.FilterStateValue) -> listener_components_pb2.Filter:
    f = listener_components_pb2.Filter(name="envoy.filters.network.set_filter_state")
    f.typed_config.Pack(set_filter_state_pb2.Config(on_new_connection=list(values)))
    return f


def caller_state(identity: str) -> value_pb2.FilterStateValue:
    """Set by a pod's capture listener: which hbone cluster (client certificate) its mesh
    connections use. Transitive: it crosses mesh-<ns> and the Service cluster to hbone-out."""
    return _state(CALLER_CLUSTER_STATE, hbone_cluster_name(identity), STRING_FACTORY,
                  "transitive")


# ---- outbound -------------------------------------------------------------------------------

def _internal_upstream(*metadata: str) -> base_pb2.TransportSocket:
    raw = _transport_socket("envoy.transport_sockets.raw_buffer", raw_buffer_pb2.RawBuffer())
    iu = internal_upstream_pb2.InternalUpstreamTransport(transport_socket=raw)
    for name in metadata:
        src = iu.passthrough_metadata.add(name=name)
        src.kind.host.SetInParent()
    return _transport_socket("envoy.transport_sockets.internal_upstream", iu)


def tunnel_transport_socket() -> base_pb2.TransportSocket:
    """A Service cluster's transport in mTLS mode: to ``hbone-out`` with the endpoint's pod
    address and SAN passed along as metadata."""
    return _internal_upstream(ORIGINAL_DST_METADATA, AETHER_METADATA)


def tunnel_lb_endpoint(ip: str, port: int, san: str, health: int,
                       extra: Mapping[str, str] | None = None) -> endpoint_components_pb2.LbEndpoint:
    """A Service endpoint as an internal address of ``hbone-out``: the real ``ip:port`` is its
    endpoint id (distinct hosts) and the original_dst metadata; the SAN pins the backend."""
    target = host_port(ip, port)
    lb = endpoint_components_pb2.LbEndpoint(health_status=health)
    addr = lb.endpoint.address.envoy_internal_address
    addr.server_listener_name = HBONE_OUT_LISTENER
    addr.endpoint_id = target
    odst = struct_pb2.Struct()
    odst.update({"local": target})
    lb.metadata.filter_metadata[ORIGINAL_DST_METADATA].CopyFrom(odst)
    md = struct_pb2.Struct()
    md.update({"san": san, **{k: v for k, v in (extra or {}).items() if v}})
    lb.metadata.filter_metadata[AETHER_METADATA].CopyFrom(md)
    return lb


def build_hbone_out_listener() -> listener_pb2.Listener:
    """Internal listener that opens the tunnel: restores the pod address from the endpoint
    metadata, picks the caller's cluster and pins the backend SAN, then CONNECTs."""
    odst = listener_components_pb2.ListenerFilter(name="envoy.filters.listener.original_dst")
    from envoy.extensions.filters.listener.original_dst.v3 import original_dst_pb2
    odst.typed_config.Pack(original_dst_pb2.OriginalDst())
    state = _network_state_filter(
        _state(TCP_PROXY_CLUSTER_STATE, f"%FILTER_STATE({CALLER_CLUSTER_STATE}:PLAIN)%"),
        _state(UPSTREAM_SAN_STATE, f"%DYNAMIC_METADATA({AETHER_METADATA}:san)%", shared="once"),
    )
    tcp = tcp_proxy_pb2.TcpProxy(
        stat_prefix=HBONE_OUT_LISTENER, cluster=NO_IDENTITY_CLUSTER,
        tunneling_config=tcp_proxy_pb2.TcpProxy.TunnelingConfig(
            hostname="%DOWNSTREAM_LOCAL_ADDRESS%"))
    proxy = listener_components_pb2.Filter(name="envoy.filters.network.tcp_proxy")
    proxy.typed_config.Pack(tcp)
    return listener_pb2.Listener(
        name=HBONE_OUT_LISTENER, stat_prefix=HBONE_OUT_LISTENER,
        internal_listener=listener_pb2.Listener.InternalListenerConfig(),
        listener_filters=[odst],
        default_filter_chain=listener_components_pb2.FilterChain(
            name="tunnel", filters=[state, proxy]))


def build_hbone_cluster(identity: str, tls: MeshTls, bind: address_pb2.BindConfig,
                        connect_timeout_s: float) -> cluster_pb2.Cluster:
    """The caller ``identity``'s tunnel cluster: to the pod address on the inbound port, from
    the caller's netns (``bind``: the netns selector and the proxy mark), mTLS with its SVID,
    HTTP/2. One pool per downstream connection: a pooled tunnel was opened in one pod's netns
    and authenticated as one caller."""
    c = cluster_pb2.Cluster(
        name=hbone_cluster_name(identity),
        type=cluster_pb2.Cluster.ORIGINAL_DST,
        lb_policy=cluster_pb2.Cluster.CLUSTER_PROVIDED,
        connect_timeout=_duration(connect_timeout_s),
        upstream_bind_config=bind,
        connection_pool_per_downstream_connection=True,
    )
    c.original_dst_lb_config.upstream_port_override.value = tls.inbound_port
    c.transport_socket.CopyFrom(_transport_socket(
        "envoy.transport_sockets.tls",
        tls_pb2.UpstreamTlsContext(common_tls_context=_common_tls(identity, tls.trust_domain))))
    opts = http_protocol_options_pb2.HttpProtocolOptions()
    opts.explicit_http_config.http2_protocol_options.CopyFrom(protocol_pb2.Http2ProtocolOptions())
    # one CONNECT per tunnel: a pool serves one downstream connection, so a tunnel can never be
    # reused; closing it with its stream keeps idle tunnels from piling up
    opts.common_http_protocol_options.max_requests_per_connection.value = 1
    c.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS_KEY].Pack(opts)
    unlimited_circuit_breakers(c)
    return c


# ---- inbound --------------------------------------------------------------------------------

def _authority_regex(ips: Sequence[str], forbidden_ports: Sequence[int]) -> str:
    """The pod's own addresses with any port but ours: CONNECT may only reach the pod itself
    (never another address: the inbound side is not a relay), never the proxy's own ports."""
    hosts = "|".join(re.escape(f"[{ip}]" if ":" in ip else ip) for ip in ips)
    return f"^({hosts}):([0-9]{{1,5}})$"


def _deny_ports_regex(forbidden_ports: Sequence[int]) -> str:
    return ".*:(" + "|".join(str(p) for p in sorted(set(forbidden_ports))) + ")$"


def _connect_route_config(uid: str, ips: Sequence[str], forbidden_ports: Sequence[int]
                          ) -> route_pb2.RouteConfiguration:
    def header(pattern: str) -> rc.HeaderMatcher:
        return rc.HeaderMatcher(name=":authority", string_match=string_pb2.StringMatcher(
            safe_regex=regex_pb2.RegexMatcher(regex=pattern)))

    deny = rc.Route(name="own-port", match=rc.RouteMatch(
        connect_matcher=rc.RouteMatch.ConnectMatcher(),
        headers=[header(_deny_ports_regex(forbidden_ports))]))
    deny.direct_response.status = 403
    allow = rc.Route(name="deliver", match=rc.RouteMatch(
        connect_matcher=rc.RouteMatch.ConnectMatcher(),
        headers=[header(_authority_regex(ips, forbidden_ports))]))
    allow.route.cluster = INBOUND_INNER
    allow.route.timeout.CopyFrom(_duration(0))
    allow.route.upgrade_configs.add(upgrade_type="CONNECT").connect_config.SetInParent()
    other = rc.Route(name="not-this-pod", match=rc.RouteMatch(
        connect_matcher=rc.RouteMatch.ConnectMatcher()))
    other.direct_response.status = 403
    return route_pb2.RouteConfiguration(
        name=f"inbound-{uid}",
        virtual_hosts=[rc.VirtualHost(name="inbound", domains=["*"],
                                      routes=[deny, allow, other])])


def _http_filter(name: str, msg: object) -> hcm_pb2.HttpFilter:
    f = hcm_pb2.HttpFilter(name=name)
    f.typed_config.Pack(msg)
    return f


INBOUND_LOG_FORMAT = (
    "[%START_TIME%] inbound listener=%LISTENER_NAME% peer=%DOWNSTREAM_PEER_URI_SAN% "
    "from=%DOWNSTREAM_REMOTE_ADDRESS% -> %REQ(:AUTHORITY)% status=%RESPONSE_CODE% "
    "flags=%RESPONSE_FLAGS% rx=%BYTES_RECEIVED% tx=%BYTES_SENT% dur=%DURATION%ms\n")


def inbound_access_log() -> accesslog_pb2.AccessLog:
    """One stdout line per mesh connection a pod accepted, naming the caller's SPIFFE ID."""
    cfg = stream_pb2.StdoutAccessLog(
        log_format=substitution_format_string_pb2.SubstitutionFormatString(
            text_format_source={"inline_string": INBOUND_LOG_FORMAT}))
    log = accesslog_pb2.AccessLog(name="envoy.access_loggers.stdout")
    log.typed_config.Pack(cfg)
    return log


def build_inbound_listener(uid: str, netns_path: str, identity: str, ips: Sequence[str],
                           tls: MeshTls, ipv4: bool = True, ipv6: bool = True,
                           forbidden_ports: Sequence[int] = (),
                           access_log: bool = False) -> listener_pb2.Listener:
    """``inbound-<uid>``: the pod's end of the mesh hop, bound on the inbound port of every
    address in its netns. Terminates mTLS (a peer certificate of the trust domain required),
    accepts CONNECT to the pod's own addresses and hands the stream, the caller's SPIFFE ID
    and the pod's netns to ``inbound-inner``."""
    if not ips:
        raise ValueError(f"pod {uid}: no address to deliver to")
    downstream = tls_pb2.DownstreamTlsContext(
        common_tls_context=_common_tls(identity, tls.trust_domain))
    downstream.require_client_certificate.value = True
    state = http_sfs_pb2.Config(on_request_headers=[
        _state(ORIGINAL_DST_LOCAL_STATE, "%REQ(:AUTHORITY)%", shared="once"),
        _state(PEER_ID_STATE, "%DOWNSTREAM_PEER_URI_SAN%", STRING_FACTORY, "once"),
        _state(LOCAL_ID_STATE, "%DOWNSTREAM_LOCAL_URI_SAN%", STRING_FACTORY, "once"),
        _state(UPSTREAM_NETNS_STATE, netns_path, STRING_FACTORY, "transitive"),
    ])
    hcm = hcm_pb2.HttpConnectionManager(
        stat_prefix=inbound_listener_name(uid),
        codec_type=hcm_pb2.HttpConnectionManager.HTTP2,
        route_config=_connect_route_config(uid, ips, (tls.inbound_port, *forbidden_ports)),
        http_filters=[_http_filter("envoy.filters.http.set_filter_state", state),
                      _http_filter("envoy.filters.http.router", router_pb2.Router())],
        upgrade_configs=[hcm_pb2.HttpConnectionManager.UpgradeConfig(upgrade_type="CONNECT")],
    )
    hcm.http2_protocol_options.allow_connect = True
    if access_log:
        hcm.access_log.append(inbound_access_log())
    net = listener_components_pb2.Filter(name="envoy.filters.network.http_connection_manager")
    net.typed_config.Pack(hcm)
    chain = listener_components_pb2.FilterChain(
        name="mtls", filters=[net],
        transport_socket=_transport_socket("envoy.transport_sockets.tls", downstream))
    addrs = ([("0.0.0.0", tls.inbound_port)] if ipv4 else []) + \
        ([("::", tls.inbound_port)] if ipv6 else [])
    if not addrs:
        raise ValueError(f"pod {uid}: at least one of ipv4/ipv6 must be enabled")

    def sock(ip: str, port: int) -> address_pb2.Address:
        return address_pb2.Address(socket_address=address_pb2.SocketAddress(
            address=ip, port_value=port, network_namespace_filepath=netns_path))

    lis = listener_pb2.Listener(
        name=inbound_listener_name(uid), stat_prefix=inbound_listener_name(uid),
        address=sock(*addrs[0]), filter_chains=[chain])
    for a in addrs[1:]:
        lis.additional_addresses.add().address.CopyFrom(sock(*a))
    if ipv4 and ipv6:
        lis.address.socket_address.ipv4_compat = False
    return lis


def build_inbound_inner_listener() -> listener_pb2.Listener:
    """Internal listener after the CONNECT: the pod address and port restored, HTTP detected
    (the request gets ``x-forwarded-client-cert`` with the caller's SPIFFE ID; a caller's own
    XFCC is dropped first), anything else relayed as TCP; both to ``inbound-deliver``."""
    from envoy.extensions.filters.listener.original_dst.v3 import original_dst_pb2
    odst = listener_components_pb2.ListenerFilter(name="envoy.filters.listener.original_dst")
    odst.typed_config.Pack(original_dst_pb2.OriginalDst())
    inspector = listener_components_pb2.ListenerFilter(
        name="envoy.filters.listener.http_inspector")
    inspector.typed_config.Pack(http_inspector_pb2.HttpInspector())
    xfcc = base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(
            key=XFCC, value=(f"By=%FILTER_STATE({LOCAL_ID_STATE}:PLAIN)%;"
                             f"URI=%FILTER_STATE({PEER_ID_STATE}:PLAIN)%")),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
    route = rc.Route(name="deliver", match=rc.RouteMatch(prefix="/"),
                     request_headers_to_add=[xfcc])
    route.route.cluster = INBOUND_DELIVER_CLUSTER
    route.route.timeout.CopyFrom(_duration(0))
    hcm = hcm_pb2.HttpConnectionManager(
        stat_prefix=INBOUND_INNER,
        codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        forward_client_cert_details=hcm_pb2.HttpConnectionManager.SANITIZE,
        route_config=route_pb2.RouteConfiguration(
            name=INBOUND_INNER, virtual_hosts=[rc.VirtualHost(
                name="deliver", domains=["*"], routes=[route])]),
        http_filters=[_http_filter("envoy.filters.http.router", router_pb2.Router())],
    )
    hcm_filter = listener_components_pb2.Filter(name="envoy.filters.network.http_connection_manager")
    hcm_filter.typed_config.Pack(hcm)
    http_chain = listener_components_pb2.FilterChain(
        name="http", filters=[hcm_filter],
        filter_chain_match=listener_components_pb2.FilterChainMatch(
            application_protocols=["http/1.1", "h2c"]))
    tcp = listener_components_pb2.Filter(name="envoy.filters.network.tcp_proxy")
    tcp.typed_config.Pack(tcp_proxy_pb2.TcpProxy(stat_prefix=INBOUND_INNER,
                                                 cluster=INBOUND_DELIVER_CLUSTER))
    lis = listener_pb2.Listener(
        name=INBOUND_INNER, stat_prefix=INBOUND_INNER,
        internal_listener=listener_pb2.Listener.InternalListenerConfig(),
        listener_filters=[odst, inspector],
        listener_filters_timeout=_duration(DETECT_TIMEOUT_S),
        continue_on_listener_filters_timeout=True,
        filter_chains=[http_chain],
        default_filter_chain=listener_components_pb2.FilterChain(name="tcp", filters=[tcp]))
    return lis


def build_inbound_inner_cluster(connect_timeout_s: float) -> cluster_pb2.Cluster:
    """STATIC cluster whose one host is ``inbound-inner``; hands the filter state along."""
    c = cluster_pb2.Cluster(name=INBOUND_INNER, type=cluster_pb2.Cluster.STATIC,
                            connect_timeout=_duration(connect_timeout_s),
                            transport_socket=_internal_upstream())
    c.load_assignment.cluster_name = INBOUND_INNER
    c.load_assignment.endpoints.add().lb_endpoints.add().endpoint.address \
        .envoy_internal_address.server_listener_name = INBOUND_INNER
    unlimited_circuit_breakers(c)
    return c


def build_inbound_deliver_cluster(bind: address_pb2.BindConfig, connect_timeout_s: float
                                  ) -> cluster_pb2.Cluster:
    """ORIGINAL_DST to the CONNECT authority, opened in the destination pod's netns: the
    application sees a connection from its own address, as for a local client."""
    c = cluster_pb2.Cluster(
        name=INBOUND_DELIVER_CLUSTER, type=cluster_pb2.Cluster.ORIGINAL_DST,
        lb_policy=cluster_pb2.Cluster.CLUSTER_PROVIDED,
        connect_timeout=_duration(connect_timeout_s), upstream_bind_config=bind,
        connection_pool_per_downstream_connection=True)
    opts = http_protocol_options_pb2.HttpProtocolOptions()
    cfg = opts.use_downstream_protocol_config
    cfg.http_protocol_options.CopyFrom(protocol_pb2.Http1ProtocolOptions())
    cfg.http2_protocol_options.CopyFrom(protocol_pb2.Http2ProtocolOptions())
    # HTTP deliveries: the pool lives as long as its downstream (one tunnel); do not keep the
    # connection to the application open past it
    opts.common_http_protocol_options.idle_timeout.CopyFrom(_duration(5.0))
    c.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS_KEY].Pack(opts)
    unlimited_circuit_breakers(c)
    return c
