"""The outbound end of the mesh hop (split out of ``agent.envoy.mtls``, which re-exports
it): the caller's filter state, the tunnelled Service cluster's transport and
endpoints, the ``mtls-out`` internal listener and the per-caller ``mtls|<ns>|<sa>``
cluster."""

from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import (
    address_pb2,
    base_pb2,
)
from envoy.config.endpoint.v3 import endpoint_components_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.extensions.filters.common.set_filter_state.v3 import value_pb2
from envoy.extensions.matching.common_inputs.network.v3 import network_inputs_pb2
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2
from google.protobuf import struct_pb2, wrappers_pb2

from agent.envoy.http_routes import HTTP_HOP_STATE
from agent.envoy.mtls_common import (
    AETHER_METADATA,
    APPLICATION_PROTOCOLS_STATE,
    CALLER_CLUSTER_STATE,
    HOP_METADATA,
    MESH_ALPN_HTTP,
    MTLS_OUT_LISTENER,
    NO_IDENTITY_CLUSTER,
    ORIGINAL_DST_METADATA,
    TCP_PROXY_CLUSTER_STATE,
    UPSTREAM_SAN_STATE,
    UPSTREAM_SNI_STATE,
    MeshTls,
    _common_tls,
    hop_alpn,
    host_port,
    mtls_cluster_name,
    unlimited_circuit_breakers,
)
from agent.envoy.pieces import (
    NOT_SHARED,
    STRING_STATE_FACTORY,
    TRANSITIVE,
    duration,
    internal_upstream,
    original_dst_filter,
    set_filter_state,
    state_value,
    tcp_proxy_filter,
    transport_socket,
)


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
    # set in place (as clusters._lb_endpoint): one per mesh endpoint at cluster scale
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

