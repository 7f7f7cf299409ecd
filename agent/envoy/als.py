"""Envoy access log service (ALS) sink: passthrough connections -> dependency learning.

The passthrough chain of every pod listener streams a TCP gRPC access log entry per
connection (``envoy.access_loggers.tcp_grpc``, log name ``aether-passthrough``) over the
same unix socket as ADS. Each entry's ``downstream_local_address`` is the original
destination (the ``original_dst`` listener filter restored it), and the ``listener`` custom
tag names the pod listener (``capture-<container id>``). The agent only needs (ip, port)
to learn a Service dependency, so everything else in the entry is ignored.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from agent.envoy.mesh_traffic import InboundConnection
from agent.envoy.mtls import INBOUND_ALS_LOG_NAME, INBOUND_LISTENER_TAG
from agent.envoy.resources import ALS_LISTENER_TAG, ALS_LOG_NAME, REQUEST_LOG_NAME, TRAFFIC_LOG_NAME
from agent.envoy.traffic import Report

# on_access(listener_name, dst_ip, dst_port); listener_name is "" if Envoy sent none.
AccessCallback = Callable[[str, str, int], None]
InboundCallback = Callable[[InboundConnection], None]
TrafficCallback = Callable[[Report], None]


@dataclass(frozen=True)
class AccessEntry:
    """One logged passthrough connection, reduced to what learning needs."""

    listener_name: str
    dst_ip: str
    dst_port: int
    src_ip: str = ""


def parse_tcp_entry(entry: accesslog_pb2.TCPAccessLogEntry) -> AccessEntry | None:
    """None when the entry has no IP destination (e.g. a pipe), which cannot be a Service."""
    common = entry.common_properties
    dst = common.downstream_local_address.socket_address
    if not dst.address or not dst.port_value:
        return None
    src = common.downstream_remote_address.socket_address
    return AccessEntry(
        listener_name=common.custom_tags.get(ALS_LISTENER_TAG, ""),
        dst_ip=dst.address,
        dst_port=int(dst.port_value),
        src_ip=src.address,
    )


def _uri_san(props: Any) -> str:
    return next((s.uri for s in props.subject_alt_name if s.uri), "")


def parse_inbound_entry(entry: accesslog_pb2.TCPAccessLogEntry) -> InboundConnection:
    """An inbound listener's connection: the pod's and the caller's URI SANs, bytes."""
    tls = entry.common_properties.tls_properties
    conn = entry.connection_properties
    return InboundConnection(_uri_san(tls.local_certificate_properties),
                             _uri_san(tls.peer_certificate_properties),
                             int(conn.received_bytes), int(conn.sent_bytes),
                             entry.common_properties.custom_tags.get(INBOUND_LISTENER_TAG, ""))


def _tag(tags: Any, key: str) -> str:
    value = str(tags.get(key, ""))
    return "" if value == "-" else value  # the formatters' "no value"


def _endpoint(c: Any) -> str:
    """The upstream host of an entry's common properties ("ip:port", "[ip6]:port", "")."""
    a = c.upstream_remote_address
    if a.HasField("socket_address") and a.socket_address.address:
        ip, port = a.socket_address.address, a.socket_address.port_value
        return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
    if a.HasField("envoy_internal_address"):
        return str(a.envoy_internal_address.server_listener_name)
    return ""


def _duration_s(c: Any) -> float:
    if c.HasField("duration"):
        return float(c.duration.ToNanoseconds() / 1e9)
    if c.HasField("time_to_last_downstream_tx_byte"):
        return float(c.time_to_last_downstream_tx_byte.ToNanoseconds() / 1e9)
    return 0.0


def parse_traffic_entry(entry: accesslog_pb2.TCPAccessLogEntry) -> Report:
    """A namespace listener's connection: the calling pod, chain, cluster, bytes, flags."""
    c = entry.common_properties
    dst = c.downstream_local_address.socket_address
    return Report(listener=_tag(c.custom_tags, ALS_LISTENER_TAG), cluster=c.upstream_cluster,
                  chain=_tag(c.custom_tags, "chain"), flags=_tag(c.custom_tags, "flags"),
                  received=int(entry.connection_properties.received_bytes),
                  sent=int(entry.connection_properties.sent_bytes),
                  dst_ip=dst.address, dst_port=int(dst.port_value), endpoint=_endpoint(c),
                  duration_s=_duration_s(c))


def parse_request_entry(entry: accesslog_pb2.HTTPAccessLogEntry) -> Report:
    """An HTTP chain's request: status, gRPC status, route, duration, the rest as above."""
    c = entry.common_properties
    resp = entry.response
    grpc = resp.response_trailers.get("grpc-status") or resp.response_headers.get("grpc-status", "")
    duration = (c.time_to_last_downstream_tx_byte.ToNanoseconds() / 1e9
                if c.HasField("time_to_last_downstream_tx_byte") else 0.0)
    dst = c.downstream_local_address.socket_address
    return Report(listener=_tag(c.custom_tags, ALS_LISTENER_TAG), cluster=c.upstream_cluster,
                  http=True, code=int(resp.response_code.value), grpc_status=grpc,
                  route=c.route_name, flags=_tag(c.custom_tags, "flags"),
                  duration_s=duration, chain=_tag(c.custom_tags, "chain"),
                  received=int(entry.request.request_body_bytes),
                  sent=int(resp.response_body_bytes),
                  dst_ip=dst.address, dst_port=int(dst.port_value), endpoint=_endpoint(c),
                  method=base_pb2.RequestMethod.Name(entry.request.request_method)
                  if entry.request.request_method else "",
                  path=entry.request.path)


def parse_message(msg: als_pb2.StreamAccessLogsMessage) -> list[AccessEntry]:
    """The TCP entries of one stream message (HTTP entries are not ours yet)."""
    out = []
    for e in msg.tcp_logs.log_entry:
        parsed = parse_tcp_entry(e)
        if parsed is not None:
            out.append(parsed)
    return out


class AccessLogServicer(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]  # untyped stubs
    """Reads ALS streams and calls ``on_access`` per entry; a failing callback is logged,
    never allowed to break the stream (Envoy would reconnect and buffer meanwhile)."""

    def __init__(self, on_access: AccessCallback | None = None,
                 log: logging.Logger | None = None,
                 on_inbound: InboundCallback | None = None,
                 on_traffic: TrafficCallback | None = None) -> None:
        self._cb = on_access
        self._inbound = on_inbound
        self._traffic = on_traffic
        self._lock = threading.Lock()
        self.log = log or logging.getLogger("agent.envoy.als")
        self.entries = 0
        self.streams = 0

    def set_callback(self, on_access: AccessCallback | None) -> None:
        with self._lock:
            self._cb = on_access

    def handle(self, msg: als_pb2.StreamAccessLogsMessage, log_name: str) -> None:
        """Dispatch one message (``log_name`` is the stream's, sent only in its first)."""
        if log_name == INBOUND_ALS_LOG_NAME:
            self._handle_inbound(msg)
            return
        if log_name in (TRAFFIC_LOG_NAME, REQUEST_LOG_NAME):
            self._handle_traffic(msg)
            return
        if log_name and log_name != ALS_LOG_NAME:
            return
        with self._lock:
            cb = self._cb
        for e in parse_message(msg):
            self.entries += 1
            if cb is None:
                continue
            try:
                cb(e.listener_name, e.dst_ip, e.dst_port)
            except Exception:
                self.log.exception("access callback failed for %s:%d", e.dst_ip, e.dst_port)

    def _handle_inbound(self, msg: als_pb2.StreamAccessLogsMessage) -> None:
        cb = self._inbound
        for e in msg.tcp_logs.log_entry:
            self.entries += 1
            if cb is None:
                continue
            try:
                cb(parse_inbound_entry(e))
            except Exception:
                self.log.exception("inbound access callback failed")

    def _handle_traffic(self, msg: als_pb2.StreamAccessLogsMessage) -> None:
        cb = self._traffic
        reports = ([parse_traffic_entry(e) for e in msg.tcp_logs.log_entry]
                   + [parse_request_entry(e) for e in msg.http_logs.log_entry])
        self.entries += len(reports)
        if cb is None:
            return
        for r in reports:
            try:
                cb(r)
            except Exception:
                self.log.exception("access record callback failed")

    def StreamAccessLogs(  # noqa: N802 - grpc naming
        self, request_iterator: Iterator[Any], context: grpc.ServicerContext
    ) -> als_pb2.StreamAccessLogsResponse:
        self.streams += 1
        log_name = ""
        try:
            for msg in request_iterator:
                if msg.HasField("identifier"):
                    log_name = msg.identifier.log_name
                self.handle(msg, log_name)
        except grpc.RpcError as e:  # Envoy went away or the server is stopping
            self.log.debug("access log stream ended: %s", e)
        finally:
            self.streams -= 1
        return als_pb2.StreamAccessLogsResponse()


def add_access_log_servicer(servicer: AccessLogServicer, server: grpc.Server) -> None:
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(servicer, server)
