"""Delivery to the destination pod, past the inbound hop (split out of
``agent.envoy.mtls``, which re-exports it): where a connection is delivered (filter
state for ``inbound-deliver``), the HTTP codec adding XFCC, and the ``inbound-deliver``
cluster; shared by the inbound listener, ``inbound-detect`` and the judge."""

from __future__ import annotations

from collections.abc import Sequence

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import (
    address_pb2,
    base_pb2,
)
from envoy.config.listener.v3 import listener_components_pb2
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)

from agent.authz.rbac import PORT_STATE
from agent.envoy.http_routes import (
    HTTP_PROTOCOL_OPTIONS_KEY,
    upstream_http_protocol_options,
)
from agent.envoy.mtls_common import (
    DESTINATION_STATE,
    INBOUND_DELIVER_CLUSTER,
    ORIGINAL_DST_ADDRESS_STATE,
    XFCC,
    unlimited_circuit_breakers,
)
from agent.envoy.pieces import (
    NOT_SHARED,
    ONCE,
    ORIGINAL_DST_LOCAL_STATE,
    STRING_STATE_FACTORY,
    UPSTREAM_NETNS_STATE,
    duration,
    set_filter_state,
    state_value,
)


def _http_filter(name: str, msg: object) -> hcm_pb2.HttpFilter:
    f = hcm_pb2.HttpFilter(name=name)
    f.typed_config.Pack(msg)
    return f


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
