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

from agent.authz.rbac import DETECTED
from agent.envoy.inbound_detect import (
    build_inbound_detect_cluster,
    build_inbound_detect_listener,
)
from agent.envoy.mtls_common import (
    AETHER_METADATA,
    APPLICATION_PROTOCOLS_STATE,
    CALLER_CLUSTER_STATE,
    DESTINATION_STATE,
    DETECT_TIMEOUT_S,
    HELLO_TIMEOUT_S,
    HOP_METADATA,
    INBOUND_ALS_LOG_NAME,
    INBOUND_DELIVER_CLUSTER,
    INBOUND_DETECT,
    INBOUND_LISTENER_PREFIX,
    INBOUND_LISTENER_TAG,
    INBOUND_PORT,
    LOCAL_ID_TLV,
    MESH_ALPN,
    MESH_ALPN_HTTP,
    MESH_ALPN_TCP,
    MESH_ALPNS,
    MTLS_CLUSTER_PREFIX,
    MTLS_OUT_LISTENER,
    NO_IDENTITY_CLUSTER,
    ORIGINAL_DST_ADDRESS_STATE,
    ORIGINAL_DST_METADATA,
    PEER_ID_TLV,
    PROXY_TLV_STATE,
    SECRET_TYPE,
    TCP_PROXY_CLUSTER_STATE,
    TRUST_BUNDLE_SECRET,
    UNLIMITED,
    UPSTREAM_SAN_STATE,
    UPSTREAM_SNI_STATE,
    XFCC,
    XFCC_TLV,
    MeshTls,
    build_secrets,
    hop_alpn,
    host_port,
    inbound_listener_name,
    mtls_cluster_name,
    pod_detect_name,
    svid_secret_name,
    unlimited_circuit_breakers,
)
from agent.envoy.mtls_deliver import (
    XFCC_FORMAT,
    build_inbound_deliver_cluster,
    deliver_target,
)
from agent.envoy.mtls_inbound import (
    INBOUND_LOG_FORMAT,
    build_inbound_listener,
    inbound_access_log,
    peer_id_filter,
)
from agent.envoy.mtls_out import (
    build_mtls_cluster,
    build_mtls_out_listener,
    caller_state,
    set_hop_metadata,
    tunnel_lb_endpoint,
    tunnel_transport_socket,
)
from agent.envoy.pieces import UPSTREAM_NETNS_STATE

# The builders live in the modules above, by the end of the hop they build: what both ends
# share (mtls_common), the outbound end (mtls_out), the inbound listener (mtls_inbound),
# delivery to the pod (mtls_deliver) and HTTP detection past the hop (inbound_detect);
# everything stays importable from here, as before the split.
__all__ = [
    "AETHER_METADATA",
    "APPLICATION_PROTOCOLS_STATE",
    "CALLER_CLUSTER_STATE",
    "DESTINATION_STATE",
    "DETECTED",
    "DETECT_TIMEOUT_S",
    "HELLO_TIMEOUT_S",
    "HOP_METADATA",
    "INBOUND_ALS_LOG_NAME",
    "INBOUND_DELIVER_CLUSTER",
    "INBOUND_DETECT",
    "INBOUND_LISTENER_PREFIX",
    "INBOUND_LISTENER_TAG",
    "INBOUND_LOG_FORMAT",
    "INBOUND_PORT",
    "LOCAL_ID_TLV",
    "MESH_ALPN",
    "MESH_ALPNS",
    "MESH_ALPN_HTTP",
    "MESH_ALPN_TCP",
    "MTLS_CLUSTER_PREFIX",
    "MTLS_OUT_LISTENER",
    "MeshTls",
    "NO_IDENTITY_CLUSTER",
    "ORIGINAL_DST_ADDRESS_STATE",
    "ORIGINAL_DST_METADATA",
    "PEER_ID_TLV",
    "PROXY_TLV_STATE",
    "SECRET_TYPE",
    "TCP_PROXY_CLUSTER_STATE",
    "TRUST_BUNDLE_SECRET",
    "UNLIMITED",
    "UPSTREAM_NETNS_STATE",
    "UPSTREAM_SAN_STATE",
    "UPSTREAM_SNI_STATE",
    "XFCC",
    "XFCC_FORMAT",
    "XFCC_TLV",
    "build_inbound_deliver_cluster",
    "build_inbound_detect_cluster",
    "build_inbound_detect_listener",
    "build_inbound_listener",
    "build_mtls_cluster",
    "build_mtls_out_listener",
    "build_secrets",
    "caller_state",
    "deliver_target",
    "hop_alpn",
    "host_port",
    "inbound_access_log",
    "inbound_listener_name",
    "mtls_cluster_name",
    "peer_id_filter",
    "pod_detect_name",
    "set_hop_metadata",
    "svid_secret_name",
    "tunnel_lb_endpoint",
    "tunnel_transport_socket",
    "unlimited_circuit_breakers",
]
