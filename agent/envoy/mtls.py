"""Pure xDS builders for the mesh hop: mTLS between node proxies, one TLS connection per
proxied connection, the destination port in the TLS server name.

Outbound (a captured pod calling a Service endpoint)::

    mesh Service chain ─▶ svc|<ns>|<name>|<port>  (EDS; endpoints are internal addresses
                          of ``mtls-out`` carrying the pod address and its SPIFFE ID)
    mtls-out (internal listener) ─ set_filter_state: the caller's cluster, the backend SAN,
                the SNI "<port>" ─▶ tcp_proxy
    mtls|<ns>|<sa> (ORIGINAL_DST, port overridden to 15008, socket in the caller's netns)
                ─▶ TLS 1.3: the caller's SVID, the trust bundle, the backend SAN pinned

Inbound (``inbound-<container id>``, bound on :15008 in every captured pod's netns)::

    tls_inspector ─▶ TLS (the pod's SVID; a client certificate of the trust domain required)
       ALPN aether-mesh-http (appProtocol HTTP): HCM adding x-forwarded-client-cert ─┐
       ALPN aether-mesh-tcp (another appProtocol): tcp_proxy after the handshake ───┤
       ALPN aether-mesh (none declared): tcp_proxy, once the handshake is done, to   │
          the node's one internal listener inbound-detect, with a PROXY v2 header     │
          carrying the caller's and the pod's SPIFFE IDs (the delivery address and    │
          netns travel as filter state): HTTP (detected) ─▶ HCM adding XFCC; else     │
          tcp_proxy ──────────────────────────────────────────────────────────────────┤
       ─▶ inbound-deliver (ORIGINAL_DST <pod ip>:<port>, socket in the pod's netns) ◀─┘

Why the ALPN carries the protocol: the caller's proxy knows the Service port's appProtocol,
the destination does not. A declared port skips the detection hop and the first-byte wait;
an undeclared one is detected after TLS, which needs the plaintext (listener filters see
the bytes before the TLS socket decrypts them), hence the second, internal, listener. The
ALPN is in the ClientHello, so the destination picks its filter chain before the handshake.
A caller that lies about it only changes how its own bytes are parsed.

Why the port in SNI and not HTTP/2 CONNECT (HBONE's shape, tried first): Envoy 1.40 resets a
CONNECT stream when its upstream closes first (envoyproxy/envoy#28329, #47378), so any
server-closes-first exchange lost its tail; and since a tunnel's pool serves one downstream
connection, HTTP/2 multiplexing bought nothing. TLS over TCP keeps half-close semantics
end to end (tcp_proxy both sides). The server name is part of the TLS 1.3 handshake
transcript, so an on-path attacker cannot change the port without breaking the handshake;
it is visible on the wire, as the port of a plaintext connection is. The destination address
is never taken from the client: it is the pod's own address.

Why per-caller clusters: Envoy picks the client certificate per cluster, so each
ServiceAccount with captured pods on this node gets one ``mtls|<ns>|<sa>`` cluster; the pod
listener names it in filter state and ``mtls-out`` hands it to ``tcp_proxy``
(``envoy.tcp_proxy.cluster``). The backend's SAN comes with the endpoint (metadata passed
through the internal upstream) and is enforced per connection
(``envoy.network.upstream_subject_alt_names``) on top of the trust-domain check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import (
    address_pb2,
    base_pb2,
    config_source_pb2,
)
from envoy.config.endpoint.v3 import endpoint_components_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.common.set_filter_state.v3 import value_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.listener.http_inspector.v3 import http_inspector_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
from envoy.extensions.matching.common_inputs.network.v3 import network_inputs_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, secret_pb2, tls_pb2
from google.protobuf import struct_pb2, wrappers_pb2

from agent.authz.policy import Policy, needs_http
from agent.authz.rbac import (
    DETECTED,
    HTTP_RBAC,
    MTLS_HTTP,
    NETWORK_RBAC,
    PEER_STATE,
    PORT_STATE,
    http_rbac_filters,
    network_rbac_filters,
)
from agent.envoy.golden import inbound_stats_log
from agent.envoy.http_routes import (
    HTTP_HOP_STATE,
    HTTP_PROTOCOL_OPTIONS_KEY,
    upstream_http_protocol_options,
)
from agent.envoy.pieces import (
    NOT_SHARED,
    ONCE,
    ORIGINAL_DST_LOCAL_STATE,
    STRING_STATE_FACTORY,
    TRANSITIVE,
    UPSTREAM_NETNS_STATE,
    duration,
    internal_upstream,
    original_dst_filter,
    raw_buffer,
    set_filter_state,
    state_value,
    stdout_access_log,
    tcp_grpc_access_log,
    tcp_proxy_filter,
    transport_socket,
)
from agent.identity.svid import Svid

SECRET_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
INBOUND_PORT = 15008
TRUST_BUNDLE_SECRET = "trust-bundle"
MTLS_OUT_LISTENER = "mtls-out"
MTLS_CLUSTER_PREFIX = "mtls|"
# Tcp_proxy's default when no caller cluster was named: no such cluster, so the connection
# is closed (fail closed), never sent in plaintext.
NO_IDENTITY_CLUSTER = "mtls|no-identity"
INBOUND_LISTENER_PREFIX = "inbound-"
# After TLS, a pod's mesh connections on an undeclared port cross to this internal listener
# (one for the node: what is per pod travels with the connection), which detects HTTP, adds
# XFCC to it and delivers. An internal listener, not a loopback socket in each pod: no
# socket pair and syscalls per read, nothing a pod's process can connect to, and one
# listener fewer per pod. (A loopback socket was used while Envoy reset internal connections
# closed with data unread; the bootstrap turns that off, see bootstrap.py.)
INBOUND_DETECT = "inbound-detect"
INBOUND_DELIVER_CLUSTER = "inbound-deliver"
# A pod whose AuthorizationPolicies name HTTP attributes (methods, paths, hosts) gets a
# detection listener of its own, ``inbound-detect-<uid>``, that decides after detecting: on
# the requests when HTTP, on the connection otherwise. Its caller's verified ID comes from
# the PROXY header (read into ``PEER_STATE``) and the port the caller named from the
# address the original_dst listener filter restores (``ORIGINAL_DST_LOCAL_STATE``).

# Filter state: the caller's mtls cluster (set by the pod listener, transitive), the
# backend SAN and server name (set in mtls-out for its upstream).
CALLER_CLUSTER_STATE = "aether.mtls_cluster"
# PROXY protocol TLVs from the inbound listener to inbound-detect: the caller's and the
# pod's SPIFFE IDs (PP2 custom range 0xE0-0xEF), read back into filter state. They exist
# only once the handshake is done, after the chain's filter state is set; tcp_proxy formats
# the TLVs when it connects, which waits for the handshake.
PEER_ID_TLV, LOCAL_ID_TLV = 0xE0, 0xE1
# ... and the whole XFCC value, for a pod's own detection listener: a plaintext caller
# judged there (``agent.envoy.judge``) sends no header, so its requests get no XFCC at all
# rather than one naming nobody
XFCC_TLV = 0xE2
PROXY_TLV_STATE = "envoy.network.proxy_protocol.tlv"
UPSTREAM_SNI_STATE = "envoy.network.upstream_server_name"
TCP_PROXY_CLUSTER_STATE = "envoy.tcp_proxy.cluster"
UPSTREAM_SAN_STATE = "envoy.network.upstream_subject_alt_names"
ORIGINAL_DST_ADDRESS_STATE = "envoy.network.transport_socket.original_dst_address"
# Set (transitive) by the inbound listener for inbound-detect: ``<ns>/<workload>|<port>``
# of the pod a mesh connection is delivered to, the label its requests are counted under.
DESTINATION_STATE = "aether.destination"
# Endpoint metadata namespaces: original_dst's (the pod address, read by the original_dst
# listener filter of mtls-out) and ours (the backend SAN).
ORIGINAL_DST_METADATA = "envoy.filters.listener.original_dst"
AETHER_METADATA = "aether"
XFCC = "x-forwarded-client-cert"
# Every connection an inbound listener closes is reported to the agent under this log name
# (the pod's and the caller's URI SANs, bytes): per-caller metrics (``mesh_traffic``).
INBOUND_ALS_LOG_NAME = "aether-inbound"
INBOUND_LISTENER_TAG = "listener"
# How long the inbound side waits for a first byte to tell HTTP (gets the XFCC header) from
# other TCP; a server-first protocol waits this long for its first byte to arrive.
DETECT_TIMEOUT_S = 0.5
# How long the inbound listener waits for a TLS ClientHello before closing.
HELLO_TIMEOUT_S = 5.0


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


def mtls_cluster_name(identity: str) -> str:
    ns, _, sa = identity.partition("/")
    return f"{MTLS_CLUSTER_PREFIX}{ns}|{sa}"


def inbound_listener_name(uid: str) -> str:
    return f"{INBOUND_LISTENER_PREFIX}{uid}"


def pod_detect_name(uid: str) -> str:
    """The detection listener (and its cluster) of a pod whose policies name HTTP fields."""
    return f"{INBOUND_DETECT}-{uid}"


def host_port(ip: str, port: int) -> str:
    """``ip:port``, IPv6 bracketed (Envoy's address strings)."""
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


# The mesh hop's ALPN names what the destination does with the bytes, from the Service
# port's appProtocol as the caller's proxy knows it: HTTP (the inbound side runs the HTTP
# codec on the TLS connection itself and adds XFCC), opaque TCP (relayed as is), or not
# declared (the inbound side detects HTTP after the handshake, in inbound-detect).
MESH_ALPN = "aether-mesh"
MESH_ALPN_HTTP = "aether-mesh-http"
MESH_ALPN_TCP = "aether-mesh-tcp"
MESH_ALPNS = (MESH_ALPN, MESH_ALPN_HTTP, MESH_ALPN_TCP)
HOP_METADATA = "aether.hop"
APPLICATION_PROTOCOLS_STATE = "envoy.network.application_protocols"


def hop_alpn(protocol: str) -> str:
    """The hop's ALPN for a port protocol (``http_routes.port_protocol``: http, tcp, detect)."""
    return {"http": MESH_ALPN_HTTP, "tcp": MESH_ALPN_TCP}.get(protocol, MESH_ALPN)


def _common_tls(identity: str, trust_domain: str, alpns: Sequence[str] = (MESH_ALPN,)
                ) -> tls_pb2.CommonTlsContext:
    """Our SVID, the bundle, peers of our trust domain only (URI SAN prefix), TLS 1.3, and
    our own ALPNs (a mesh hop is not mistaken for any other TLS protocol)."""
    ctx = tls_pb2.CommonTlsContext(
        tls_certificate_sds_secret_configs=[_sds(svid_secret_name(identity))],
        alpn_protocols=list(alpns))
    ctx.tls_params.tls_minimum_protocol_version = common_pb2.TlsParameters.TLSv1_3
    ctx.tls_params.tls_maximum_protocol_version = common_pb2.TlsParameters.TLSv1_3
    combined = ctx.combined_validation_context
    combined.validation_context_sds_secret_config.CopyFrom(_sds(TRUST_BUNDLE_SECRET))
    san = combined.default_validation_context.match_typed_subject_alt_names.add()
    san.san_type = common_pb2.SubjectAltNameMatcher.URI
    san.matcher.prefix = f"spiffe://{trust_domain}/"
    return ctx


# Envoy's default circuit breakers allow 1024 connections per cluster; a node's tunnels and
# deliveries are every mesh connection of its pods, so the thresholds are the node's limits
# (file descriptors), not Envoy's defaults.
UNLIMITED = 0xFFFFFFFF


def unlimited_circuit_breakers(cluster: cluster_pb2.Cluster) -> None:
    t = cluster.circuit_breakers.thresholds.add()
    for f in ("max_connections", "max_pending_requests", "max_requests", "max_retries"):
        getattr(t, f).value = UNLIMITED


def caller_state(identity: str) -> value_pb2.FilterStateValue:
    """Set by a pod's capture listener: which mtls cluster (client certificate) its mesh
    connections use. Transitive: it crosses mesh and the Service cluster to mtls-out."""
    return state_value(CALLER_CLUSTER_STATE, mtls_cluster_name(identity), STRING_STATE_FACTORY,
                       TRANSITIVE)


# ---- outbound -------------------------------------------------------------------------------

def tunnel_transport_socket() -> base_pb2.TransportSocket:
    """A Service cluster's transport in mTLS mode: to ``mtls-out`` with the endpoint's pod
    address and SAN, and the cluster's hop ALPN, passed along as metadata."""
    return internal_upstream(ORIGINAL_DST_METADATA, AETHER_METADATA,
                             cluster_metadata=(HOP_METADATA,))


def set_hop_metadata(cluster: cluster_pb2.Cluster, protocol: str) -> None:
    """A tunnelled Service cluster names its port's hop ALPN (read by ``mtls-out``)."""
    md = struct_pb2.Struct()
    md.update({"alpn": hop_alpn(protocol)})
    cluster.metadata.filter_metadata[HOP_METADATA].CopyFrom(md)


def tunnel_lb_endpoint(ip: str, port: int, san: str, health: int
                       ) -> endpoint_components_pb2.LbEndpoint:
    """A Service endpoint as an internal address of ``mtls-out``: the real ``ip:port`` is its
    endpoint id (distinct hosts) and the original_dst metadata; the SAN pins the backend."""
    target = host_port(ip, port)
    lb = endpoint_components_pb2.LbEndpoint(health_status=health)
    addr = lb.endpoint.address.envoy_internal_address
    addr.server_listener_name = MTLS_OUT_LISTENER
    addr.endpoint_id = target
    # set in place (as resources._lb_endpoint): one per mesh endpoint at cluster scale
    lb.metadata.filter_metadata[ORIGINAL_DST_METADATA].fields["local"].string_value = target
    lb.metadata.filter_metadata[AETHER_METADATA].fields["san"].string_value = san
    return lb


def build_mtls_out_listener() -> listener_pb2.Listener:
    """Internal listener that opens the mesh hop: restores the pod address from the endpoint
    metadata, picks the caller's cluster, pins the backend SAN and names the destination
    port in SNI."""
    def chain(name: str, alpn: str) -> listener_components_pb2.FilterChain:
        state = set_filter_state(
            state_value(TCP_PROXY_CLUSTER_STATE, f"%FILTER_STATE({CALLER_CLUSTER_STATE}:PLAIN)%",
                        shared=NOT_SHARED),
            state_value(UPSTREAM_SAN_STATE, f"%DYNAMIC_METADATA({AETHER_METADATA}:san)%"),
            state_value(UPSTREAM_SNI_STATE, "%DOWNSTREAM_LOCAL_PORT%"),
            state_value(APPLICATION_PROTOCOLS_STATE, alpn),
        )
        return listener_components_pb2.FilterChain(
            name=name, filters=[state, tcp_proxy_filter(MTLS_OUT_LISTENER, NO_IDENTITY_CLUSTER)])

    # HTTP the caller's proxy parsed (HTTP_HOP_STATE) asks for aether-mesh-http; the rest
    # for the ALPN of its cluster's port
    http = chain("mtls-http", MESH_ALPN_HTTP)
    lis = listener_pb2.Listener(
        name=MTLS_OUT_LISTENER, stat_prefix=MTLS_OUT_LISTENER,
        internal_listener=listener_pb2.Listener.InternalListenerConfig(),
        listener_filters=[original_dst_filter()], filter_chains=[http],
        default_filter_chain=chain("mtls", f"%DYNAMIC_METADATA({HOP_METADATA}:alpn)%"))
    tree = lis.filter_chain_matcher.matcher_tree
    tree.input.name = "http-hop"
    tree.input.typed_config.Pack(network_inputs_pb2.FilterStateInput(key=HTTP_HOP_STATE))
    action = tree.exact_match_map.map["1"].action
    action.name = http.name
    action.typed_config.Pack(wrappers_pb2.StringValue(value=http.name))
    return lis


def build_mtls_cluster(identity: str, tls: MeshTls, bind: address_pb2.BindConfig,
                       connect_timeout_s: float) -> cluster_pb2.Cluster:
    """The caller ``identity``'s mesh cluster: to the pod address on the inbound port, from
    the caller's netns (``bind``: the netns selector and the proxy mark), mTLS with its SVID.
    One pool per downstream connection (tcp_proxy: one upstream connection per downstream
    connection anyway)."""
    c = cluster_pb2.Cluster(
        name=mtls_cluster_name(identity),
        type=cluster_pb2.Cluster.ORIGINAL_DST,
        lb_policy=cluster_pb2.Cluster.CLUSTER_PROVIDED,
        connect_timeout=duration(connect_timeout_s),
        upstream_bind_config=bind,
        connection_pool_per_downstream_connection=True,
    )
    c.original_dst_lb_config.upstream_port_override.value = tls.inbound_port
    c.transport_socket.CopyFrom(transport_socket(
        "envoy.transport_sockets.tls",
        tls_pb2.UpstreamTlsContext(common_tls_context=_common_tls(identity, tls.trust_domain))))
    unlimited_circuit_breakers(c)
    return c


# ---- inbound --------------------------------------------------------------------------------

INBOUND_LOG_FORMAT = (
    "[%START_TIME%] inbound listener=%LISTENER_NAME% peer=%DOWNSTREAM_PEER_URI_SAN% "
    "from=%DOWNSTREAM_REMOTE_ADDRESS% -> port %REQUESTED_SERVER_NAME% "
    "flags=%RESPONSE_FLAGS% rx=%BYTES_RECEIVED% tx=%BYTES_SENT% dur=%DURATION%ms\n")


def inbound_access_log() -> accesslog_pb2.AccessLog:
    """One stdout line per mesh connection a pod accepted, naming the caller's SPIFFE ID."""
    return stdout_access_log(INBOUND_LOG_FORMAT)


def _http_filter(name: str, msg: object) -> hcm_pb2.HttpFilter:
    f = hcm_pb2.HttpFilter(name=name)
    f.typed_config.Pack(msg)
    return f


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


def deliver_target(ips: Sequence[str]) -> str:
    """Where mesh connections are delivered: the pod's first address (v4 when dual-stack),
    bracketed for IPv6, never an address the caller names."""
    ip = ips[0]
    return f"[{ip}]" if ":" in ip else ip


def _deliver_state(target: str, port_fmt: str, netns_path: str, shared: int = ONCE,
                   destination: str = "", local: bool = False, port: bool = False
                   ) -> listener_components_pb2.Filter:
    """Filter state for ``inbound-deliver``: ``<target>:<port>``, opened in the pod's netns;
    ``TRANSITIVE`` when an internal listener (``inbound-detect``) lies between, which also
    gets ``destination`` (``DESTINATION_STATE``) and, with ``local``, the same address as
    its connection's local one (``ORIGINAL_DST_LOCAL_STATE``: the port its policies judge)."""
    values = [state_value(ORIGINAL_DST_ADDRESS_STATE, f"{target}:{port_fmt}", shared=shared),
              state_value(UPSTREAM_NETNS_STATE, netns_path, STRING_STATE_FACTORY, shared)]
    if destination:
        values.append(state_value(DESTINATION_STATE, destination, STRING_STATE_FACTORY, shared))
    if local:
        values.append(state_value(ORIGINAL_DST_LOCAL_STATE, f"{target}:{port_fmt}", shared=ONCE))
    if port:  # ``PORT_STATE``, for the RBAC filters here
        values.append(state_value(PORT_STATE, port_fmt, STRING_STATE_FACTORY, NOT_SHARED))
    return set_filter_state(*values)


def _network_filter(name: str, msg: object) -> listener_components_pb2.Filter:
    f = listener_components_pb2.Filter(name=name)
    f.typed_config.Pack(msg)
    return f


XFCC_FORMAT = "By=%DOWNSTREAM_LOCAL_URI_SAN%;URI=%DOWNSTREAM_PEER_URI_SAN%"


def _deliver_hcm(stat_prefix: str, xfcc_fmt: str,
                 logs: Sequence[accesslog_pb2.AccessLog] = (),
                 filters: Sequence[hcm_pb2.HttpFilter] = ()) -> listener_components_pb2.Filter:
    """The HTTP codec delivering to ``inbound-deliver``: every request gets
    ``x-forwarded-client-cert`` formatted by ``xfcc_fmt`` (``By=<pod's id>;URI=<caller's
    id>``; none when it formats to nothing), any XFCC the caller sent removed first."""
    xfcc = base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=XFCC, value=xfcc_fmt),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
    route = rc.Route(name="deliver", match=rc.RouteMatch(prefix="/"),
                     request_headers_to_add=[xfcc])
    route.route.cluster = INBOUND_DELIVER_CLUSTER
    route.route.timeout.CopyFrom(duration(0))
    hcm = hcm_pb2.HttpConnectionManager(
        stat_prefix=stat_prefix,
        codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        forward_client_cert_details=hcm_pb2.HttpConnectionManager.SANITIZE,
        route_config=route_pb2.RouteConfiguration(
            name=stat_prefix, virtual_hosts=[rc.VirtualHost(
                name="deliver", domains=["*"], routes=[route])]),
        http_filters=[*filters, _http_filter("envoy.filters.http.router",
                                             router_pb2.Router(suppress_envoy_headers=True))],
        access_log=list(logs),
    )
    # the last hop before the application: no request id to invent (the caller's passes
    # through; inventing one halved keep-alive throughput), no x-envoy-* headers to add and
    # the app's own Server header kept: per-request work the app never asked for
    hcm.generate_request_id.value = False
    hcm.server_header_transformation = hcm_pb2.HttpConnectionManager.PASS_THROUGH
    f = listener_components_pb2.Filter(name="envoy.filters.network.http_connection_manager")
    f.typed_config.Pack(hcm)
    return f


def _sock(ip: str, port: int, netns_path: str) -> address_pb2.Address:
    return address_pb2.Address(socket_address=address_pb2.SocketAddress(
        address=ip, port_value=port, network_namespace_filepath=netns_path))


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


def build_inbound_deliver_cluster(bind: address_pb2.BindConfig, connect_timeout_s: float
                                  ) -> cluster_pb2.Cluster:
    """ORIGINAL_DST to the restored destination, opened in the destination pod's netns: the
    application sees a connection from its own address, as for a local client."""
    c = cluster_pb2.Cluster(
        name=INBOUND_DELIVER_CLUSTER, type=cluster_pb2.Cluster.ORIGINAL_DST,
        lb_policy=cluster_pb2.Cluster.CLUSTER_PROVIDED,
        connect_timeout=duration(connect_timeout_s), upstream_bind_config=bind,
        connection_pool_per_downstream_connection=True)
    # the caller's HTTP version; idle connections to the application close soon after it
    c.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS_KEY].Pack(
        upstream_http_protocol_options(None))
    unlimited_circuit_breakers(c)
    return c
