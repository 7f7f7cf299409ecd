"""Small xDS building blocks shared by the capture builder (``resources``) and the mesh hop
(``mtls``): filter state values, tcp_proxy, original_dst, stdout access logs, internal
upstreams. Pure; a leaf module, so both can import it without importing each other."""

from __future__ import annotations

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import (
    base_pb2,
    config_source_pb2,
    grpc_service_pb2,
    substitution_format_string_pb2,
)
from envoy.config.listener.v3 import listener_components_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2
from envoy.extensions.access_loggers.stream.v3 import stream_pb2
from envoy.extensions.filters.common.set_filter_state.v3 import value_pb2
from envoy.extensions.filters.listener.original_dst.v3 import original_dst_pb2
from envoy.extensions.filters.network.set_filter_state.v3 import set_filter_state_pb2
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
from envoy.extensions.transport_sockets.internal_upstream.v3 import internal_upstream_pb2
from envoy.extensions.transport_sockets.raw_buffer.v3 import raw_buffer_pb2
from google.protobuf import duration_pb2
from google.protobuf.message import Message

STRING_STATE_FACTORY = "envoy.string"
# The bootstrap's unix-socket cluster to the agent (ADS and the access log service).
AGENT_GRPC_CLUSTER = "xds"
# The pod's netns path: the clusters' local address selector opens the upstream socket there.
UPSTREAM_NETNS_STATE = "envoy.network.upstream_bind_override.network_namespace"
# The addresses the original_dst listener filter of an internal listener restores (the pod
# listener hands them to its namespace's; the inbound side to a pod's detection listener).
ORIGINAL_DST_LOCAL_STATE = "envoy.filters.listener.original_dst.local_ip"
ORIGINAL_DST_REMOTE_STATE = "envoy.filters.listener.original_dst.remote_ip"

# How a filter state value is shared with the upstream connection.
NOT_SHARED = value_pb2.FilterStateValue.NONE
ONCE = value_pb2.FilterStateValue.ONCE
TRANSITIVE = value_pb2.FilterStateValue.TRANSITIVE


def duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(round(seconds * 1e9)))
    return d


def state_value(key: str, fmt: str, factory: str = "", shared: int = ONCE,
                skip_if_empty: bool = False) -> value_pb2.FilterStateValue:
    """A filter state object ``key`` made from the format string ``fmt`` (``skip_if_empty``:
    none when it formats to nothing)."""
    return value_pb2.FilterStateValue(
        object_key=key,
        factory_key=factory,
        skip_if_empty=skip_if_empty,
        format_string=substitution_format_string_pb2.SubstitutionFormatString(
            text_format_source={"inline_string": fmt}),
        shared_with_upstream=shared,
    )


def set_filter_state(*values: value_pb2.FilterStateValue) -> listener_components_pb2.Filter:
    """The network ``set_filter_state`` filter, run when a connection is accepted."""
    f = listener_components_pb2.Filter(name="envoy.filters.network.set_filter_state")
    f.typed_config.Pack(set_filter_state_pb2.Config(on_new_connection=list(values)))
    return f


def tcp_proxy_filter(stat_prefix: str, cluster: str, *logs: accesslog_pb2.AccessLog,
                     config: tcp_proxy_pb2.TcpProxy | None = None
                     ) -> listener_components_pb2.Filter:
    """tcp_proxy to ``cluster``; ``config`` carries any further settings."""
    tcp = tcp_proxy_pb2.TcpProxy()
    if config is not None:
        tcp.CopyFrom(config)
    tcp.stat_prefix, tcp.cluster = stat_prefix, cluster
    tcp.access_log.extend(logs)
    net_filter = listener_components_pb2.Filter(name="envoy.filters.network.tcp_proxy")
    net_filter.typed_config.Pack(tcp)
    return net_filter


def original_dst_filter() -> listener_components_pb2.ListenerFilter:
    odst = listener_components_pb2.ListenerFilter(name="envoy.filters.listener.original_dst")
    odst.typed_config.Pack(original_dst_pb2.OriginalDst())
    return odst


def stdout_access_log(fmt: str) -> accesslog_pb2.AccessLog:
    """An access log writing ``fmt`` to Envoy's stdout (the agent relays it to its log)."""
    cfg = stream_pb2.StdoutAccessLog(
        log_format=substitution_format_string_pb2.SubstitutionFormatString(
            text_format_source={"inline_string": fmt}))
    log = accesslog_pb2.AccessLog(name="envoy.access_loggers.stdout")
    log.typed_config.Pack(cfg)
    return log


def _grpc_log_common(log_name: str, tags: dict[str, str] | None
                     ) -> als_pb2.CommonGrpcAccessLogConfig:
    from envoy.type.tracing.v3 import custom_tag_pb2
    return als_pb2.CommonGrpcAccessLogConfig(
        log_name=log_name, transport_api_version=config_source_pb2.V3,
        grpc_service=grpc_service_pb2.GrpcService(
            envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=AGENT_GRPC_CLUSTER)),
        custom_tags=[custom_tag_pb2.CustomTag(tag=k, value=v)
                     for k, v in sorted((tags or {}).items())])


def tcp_grpc_access_log(log_name: str, tags: dict[str, str] | None = None
                        ) -> accesslog_pb2.AccessLog:
    """A TCP gRPC access log to the agent (over the bootstrap's unix-socket cluster) under
    ``log_name``, with custom ``tags`` (formatter values); configs that are equal share one
    logger and one stream per worker, so tags must be formats, not per-listener literals."""
    log = accesslog_pb2.AccessLog(name="envoy.access_loggers.tcp_grpc")
    log.typed_config.Pack(als_pb2.TcpGrpcAccessLogConfig(
        common_config=_grpc_log_common(log_name, tags)))
    return log


def http_grpc_access_log(log_name: str, tags: dict[str, str] | None = None,
                         response_headers: tuple[str, ...] = ()) -> accesslog_pb2.AccessLog:
    """An HTTP gRPC access log to the agent under ``log_name`` (one entry per request),
    with custom ``tags`` and the named response headers and trailers."""
    cfg = als_pb2.HttpGrpcAccessLogConfig(
        common_config=_grpc_log_common(log_name, tags),
        additional_response_headers_to_log=list(response_headers),
        additional_response_trailers_to_log=list(response_headers))
    log = accesslog_pb2.AccessLog(name="envoy.access_loggers.http_grpc")
    log.typed_config.Pack(cfg)
    return log


def transport_socket(name: str, msg: Message) -> base_pb2.TransportSocket:
    ts = base_pb2.TransportSocket(name=name)
    ts.typed_config.Pack(msg)
    return ts


def raw_buffer() -> base_pb2.TransportSocket:
    return transport_socket("envoy.transport_sockets.raw_buffer", raw_buffer_pb2.RawBuffer())


def internal_upstream(*host_metadata: str, cluster_metadata: tuple[str, ...] = (),
                      inner: base_pb2.TransportSocket | None = None
                      ) -> base_pb2.TransportSocket:
    """To an internal listener: the shared filter state crosses, and so does the named
    metadata of the chosen host and of the cluster; ``inner`` wraps the bytes (raw by
    default)."""
    iu = internal_upstream_pb2.InternalUpstreamTransport(
        transport_socket=inner if inner is not None else raw_buffer())
    for name in host_metadata:
        iu.passthrough_metadata.add(name=name).kind.host.SetInParent()
    for name in cluster_metadata:
        iu.passthrough_metadata.add(name=name).kind.cluster.SetInParent()
    return transport_socket("envoy.transport_sockets.internal_upstream", iu)
