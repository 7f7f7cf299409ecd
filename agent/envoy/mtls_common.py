"""What both ends of the mesh hop share (split out of ``agent.envoy.mtls``, which
re-exports it): resource names, filter-state keys, PROXY TLVs and ALPNs, ``MeshTls``,
the SDS secrets and the TLS context every hop socket is built from."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import config_source_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2, secret_pb2, tls_pb2

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
