"""Pure translation of node state into Envoy xDS resources (no I/O).

One capture listener per pod, each opened inside the pod's network namespace through
``SocketAddress.network_namespace_filepath``, so a single node-shared Envoy serves every
pod on the same port (15001) without port clashes. Captured TCP goes through the
``passthrough`` ORIGINAL_DST cluster whose upstream sockets carry SO_MARK, so the pod's
redirect rule can RETURN Envoy's own traffic instead of looping it back.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import (
    address_pb2,
    socket_option_pb2,
    substitution_format_string_pb2,
)
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.extensions.access_loggers.stream.v3 import stream_pb2
from envoy.extensions.filters.listener.original_dst.v3 import original_dst_pb2
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2
from google.protobuf import duration_pb2
from google.protobuf.message import Message

from agent.config import CAPTURE_PORT, PASSTHROUGH_MARK

LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"
CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
PASSTHROUGH_CLUSTER = "passthrough"
LISTENER_PREFIX = "capture-"

SOL_SOCKET = 1
SO_MARK = 36

# %DOWNSTREAM_LOCAL_ADDRESS% is the original destination once original_dst has run.
ACCESS_LOG_FORMAT = (
    "[%START_TIME%] listener=%LISTENER_NAME% %DOWNSTREAM_REMOTE_ADDRESS% -> "
    "%DOWNSTREAM_LOCAL_ADDRESS% upstream=%UPSTREAM_HOST% flags=%RESPONSE_FLAGS% "
    "rx=%BYTES_RECEIVED% tx=%BYTES_SENT% dur=%DURATION%ms\n"
)


@dataclass(frozen=True)
class PodListener:
    """A pod whose outbound TCP is redirected to the capture port in its own netns."""

    uid: str
    netns_path: str
    ipv4: bool = True
    ipv6: bool = True

    @property
    def listener_name(self) -> str:
        return f"{LISTENER_PREFIX}{self.uid}"


@dataclass(frozen=True)
class NodeXdsState:
    """Everything the xDS builder needs; frozen so it can be shared across threads."""

    pods: tuple[PodListener, ...]
    capture_port: int = CAPTURE_PORT
    passthrough_mark: int = PASSTHROUGH_MARK
    connect_timeout_s: float = 5.0


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(round(seconds * 1e9)))
    return d


def _socket_address(ip: str, port: int, netns_path: str) -> address_pb2.Address:
    return address_pb2.Address(
        socket_address=address_pb2.SocketAddress(
            address=ip, port_value=port, network_namespace_filepath=netns_path
        )
    )


def _access_log() -> accesslog_pb2.AccessLog:
    cfg = stream_pb2.StdoutAccessLog(
        log_format=substitution_format_string_pb2.SubstitutionFormatString(
            text_format_source={"inline_string": ACCESS_LOG_FORMAT}
        )
    )
    log = accesslog_pb2.AccessLog(name="envoy.access_loggers.stdout")
    log.typed_config.Pack(cfg)
    return log


def build_listener(pod: PodListener, capture_port: int) -> listener_pb2.Listener:
    """Capture listener on loopback of the pod's netns (v4 and/or v6)."""
    ips = ([("127.0.0.1")] if pod.ipv4 else []) + (["::1"] if pod.ipv6 else [])
    if not ips:
        raise ValueError(f"pod {pod.uid}: at least one of ipv4/ipv6 must be enabled")
    addrs = [_socket_address(ip, capture_port, pod.netns_path) for ip in ips]

    tcp = tcp_proxy_pb2.TcpProxy(stat_prefix="passthrough", cluster=PASSTHROUGH_CLUSTER)
    tcp.access_log.append(_access_log())
    net_filter = listener_components_pb2.Filter(name="envoy.filters.network.tcp_proxy")
    net_filter.typed_config.Pack(tcp)

    odst = listener_components_pb2.ListenerFilter(name="envoy.filters.listener.original_dst")
    odst.typed_config.Pack(original_dst_pb2.OriginalDst())

    listener = listener_pb2.Listener(
        name=pod.listener_name,
        address=addrs[0],
        additional_addresses=[listener_pb2.AdditionalAddress(address=a) for a in addrs[1:]],
        listener_filters=[odst],
        default_filter_chain=listener_components_pb2.FilterChain(
            name="passthrough", filters=[net_filter]
        ),
        stat_prefix=pod.listener_name,
    )
    listener.bind_to_port.value = True
    return listener


def build_passthrough_cluster(mark: int, connect_timeout_s: float) -> cluster_pb2.Cluster:
    """ORIGINAL_DST cluster whose upstream sockets are SO_MARKed before bind/connect.

    The mark rides in ``upstream_bind_config.socket_options`` *without* a source_address:
    Envoy then applies the options but does not bind, so IPv4 and IPv6 upstreams both work.
    """
    opt = socket_option_pb2.SocketOption(
        description="SO_MARK passthrough",
        level=SOL_SOCKET,
        name=SO_MARK,
        int_value=mark,
        state=socket_option_pb2.SocketOption.STATE_PREBIND,
    )
    cluster = cluster_pb2.Cluster(
        name=PASSTHROUGH_CLUSTER,
        type=cluster_pb2.Cluster.ORIGINAL_DST,
        lb_policy=cluster_pb2.Cluster.CLUSTER_PROVIDED,
        connect_timeout=_duration(connect_timeout_s),
        upstream_bind_config=address_pb2.BindConfig(socket_options=[opt]),
    )
    return cluster


def build_resources(state: NodeXdsState) -> dict[str, dict[str, Any]]:
    """type_url -> {resource name: proto}; ordered by name so output is deterministic."""
    seen: set[str] = set()
    listeners: dict[str, Message] = {}
    for pod in sorted(state.pods, key=lambda p: p.uid):
        if pod.uid in seen:
            raise ValueError(f"duplicate pod uid {pod.uid}")
        seen.add(pod.uid)
        listeners[pod.listener_name] = build_listener(pod, state.capture_port)
    cluster = build_passthrough_cluster(state.passthrough_mark, state.connect_timeout_s)
    return {
        CLUSTER_TYPE: {PASSTHROUGH_CLUSTER: cluster},
        LISTENER_TYPE: listeners,
    }


def resource_hash(msg: Message) -> str:
    """Stable content hash used as the per-resource version in delta xDS."""
    return hashlib.sha256(msg.SerializeToString(deterministic=True)).hexdigest()[:16]
