"""`--access-log`: every captured connection and HTTP request becomes one JSON record, built
from the access-log entry Envoy already streams (agent.envoy.als → agent.envoy.traffic)."""

from __future__ import annotations

import json

from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2

from agent.envoy.als import parse_request_entry, parse_traffic_entry
from agent.envoy.traffic import Report, Source, TrafficTally, access_record


def _common(c: accesslog_pb2.AccessLogCommon, cluster: str, chain: str) -> None:
    c.upstream_cluster = cluster
    c.custom_tags["listener"] = "capture-cid1"
    c.custom_tags["chain"] = chain
    c.custom_tags["flags"] = "-"
    c.downstream_local_address.socket_address.address = "10.96.0.10"
    c.downstream_local_address.socket_address.port_value = 80
    c.upstream_remote_address.socket_address.address = "10.244.0.7"
    c.upstream_remote_address.socket_address.port_value = 8080


def test_a_request_entry_names_method_path_endpoint_and_destination() -> None:
    e = accesslog_pb2.HTTPAccessLogEntry()
    _common(e.common_properties, "svc|app|web-v2|80", "svc|app|web|80|http")
    e.common_properties.route_name = "app/split|0|0"
    e.common_properties.time_to_last_downstream_tx_byte.FromMilliseconds(12)
    e.request.request_method = base_pb2.POST
    e.request.path = "/orders"
    e.request.request_body_bytes = 5
    e.response.response_code.value = 201
    e.response.response_body_bytes = 42
    r = parse_request_entry(e)
    assert (r.method, r.path, r.endpoint, r.dst_ip, r.dst_port) == (
        "POST", "/orders", "10.244.0.7:8080", "10.96.0.10", 80)
    rec = access_record(r, Source("app", "client", "client-7f-x"))
    # the Service called (the chain), not the route's backend; the backend is the cluster
    assert rec == {
        "kind": "request", "listener": "capture-cid1", "src_namespace": "app",
        "src_workload": "client", "src_pod": "client-7f-x", "dst": "10.96.0.10:80",
        "dst_namespace": "app", "dst_service": "web", "cluster": "svc|app|web-v2|80",
        "endpoint": "10.244.0.7:8080", "flags": "", "duration_ms": 12.0,
        "bytes_received": 5, "bytes_sent": 42, "method": "POST", "path": "/orders",
        "route": "app/split|0|0", "code": 201, "grpc_status": ""}
    json.dumps(rec)  # JSON-ready as it is


def test_a_passthrough_connection_is_a_record_but_no_service_count() -> None:
    e = accesslog_pb2.TCPAccessLogEntry()
    _common(e.common_properties, "passthrough", "passthrough")
    e.common_properties.downstream_local_address.socket_address.address = "2001:db8::1"
    e.common_properties.duration.FromMilliseconds(1500)
    e.connection_properties.received_bytes = 10
    e.connection_properties.sent_bytes = 20
    r = parse_traffic_entry(e)
    assert r.duration_s == 1.5 and r.endpoint == "10.244.0.7:8080"
    records: list[dict[str, object]] = []
    t = TrafficTally(resolve=lambda _l: Source("app", "client", "client-0"),
                     access_log=records.append)
    t.add(r)
    (rec,) = records
    assert rec["kind"] == "connection" and rec["dst"] == "[2001:db8::1]:80"
    assert (rec["dst_namespace"], rec["dst_service"], rec["cluster"]) == ("", "", "passthrough")
    assert "code" not in rec and rec["bytes_received"] == 10
    snap = t.snapshot()
    assert snap["tcp"] == [] and snap["requests"] == []  # counted by Envoy's stats instead


def test_an_unknown_caller_is_still_logged() -> None:
    records: list[dict[str, object]] = []
    t = TrafficTally(access_log=records.append)
    t.add(Report("capture-gone", "svc|app|db|5432", chain="svc|app|db|5432"))
    assert records[0]["src_workload"] == "unknown" and records[0]["dst_service"] == "db"


def test_a_thousand_distinct_callers_over_the_real_als_stream_hold_the_cap(tmp_path: object
                                                                           ) -> None:
    """1,200 distinct caller pods report requests over the agent's real gRPC access-log
    service (the path Envoy uses): /metrics holds at most the default cap of label sets (1000)
    plus the one 'other' set, the fold is counted, and no request is lost."""
    import os
    import re

    import grpc
    from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

    from agent.envoy.resources import REQUEST_LOG_NAME
    from agent.envoy.xds import XdsServer
    from agent.metrics import Metrics

    sock = os.path.join(str(tmp_path), "xds.sock")
    xds = XdsServer(sock)
    callers = 1200
    xds.traffic.resolve = lambda listener: Source("app", listener.removeprefix("capture-"),
                                                  listener)
    xds.start()
    try:
        def messages() -> object:
            for batch in range(0, callers, 100):
                msg = als_pb2.StreamAccessLogsMessage()
                if batch == 0:
                    msg.identifier.log_name = REQUEST_LOG_NAME
                for i in range(batch, batch + 100):
                    e = msg.http_logs.log_entry.add()
                    _common(e.common_properties, "svc|app|web|80", "svc|app|web|80|http")
                    e.common_properties.custom_tags["listener"] = f"capture-w{i}"
                    e.response.response_code.value = 200
                yield msg
        with grpc.insecure_channel("unix:" + sock) as ch:
            als_pb2_grpc.AccessLogServiceStub(ch).StreamAccessLogs(messages(), timeout=10)
        m = Metrics()
        m.traffic_source = xds.traffic.snapshot
        text = m.render().decode()
    finally:
        xds.stop()
    series = re.findall(r'^aether_requests_total\{.*src_workload="([^"]*)".*\} (\S+)$', text, re.M)
    assert len(series) == 1000 + 1
    assert sum(float(n) for _w, n in series) == callers  # nothing lost, only folded
    assert dict(series)["other"] == str(float(callers - 1000))
    assert f"aether_traffic_folded_reports_total {float(callers - 1000)}" in text


def test_the_batch_path_counts_what_the_full_parse_counts() -> None:
    """The per-request fast path (raw keys, no Report) and the full parse agree, entry for
    entry, on requests (status, gRPC status, flags, route, duration) and connections."""
    from envoy.service.accesslog.v3 import als_pb2

    from agent.envoy.als import AccessLogServicer
    from agent.envoy.resources import REQUEST_LOG_NAME, TRAFFIC_LOG_NAME

    def src(listener: str) -> Source:
        return Source("app", listener[-1], listener)

    msg = als_pb2.StreamAccessLogsMessage()
    for i in range(60):
        e = msg.http_logs.log_entry.add()
        _common(e.common_properties, f"svc|app|v{i % 2}|80", "svc|app|web|80|http")
        e.common_properties.custom_tags["listener"] = f"capture-{i % 3}"
        e.common_properties.custom_tags["flags"] = "UF" if i % 7 == 0 else "-"
        e.common_properties.route_name = f"r{i % 2}"
        e.common_properties.time_to_last_downstream_tx_byte.FromMicroseconds(300 * i)
        e.response.response_code.value = 503 if i % 5 == 0 else 200
        if i % 4 == 0:
            e.response.response_trailers["grpc-status"] = "14"
    tcp = als_pb2.StreamAccessLogsMessage()
    for i in range(9):
        e = tcp.tcp_logs.log_entry.add()
        _common(e.common_properties, "svc|app|db|5432" if i % 3 else "passthrough",
                "svc|app|db|5432" if i % 3 else "passthrough")
        e.connection_properties.received_bytes = i
        e.connection_properties.sent_bytes = 2 * i
    fast = TrafficTally(resolve=src)
    servicer = AccessLogServicer(tally=fast)
    servicer.handle(msg, REQUEST_LOG_NAME)
    servicer.handle(tcp, TRAFFIC_LOG_NAME)
    full = TrafficTally(resolve=src)
    for e in msg.http_logs.log_entry:
        full.add(parse_request_entry(e))
    for t in tcp.tcp_logs.log_entry:
        full.add(parse_traffic_entry(t))

    def key(snap: dict[str, object]) -> object:
        return {k: sorted(map(repr, v)) if isinstance(v, list) else v for k, v in snap.items()}
    assert key(fast.snapshot()) == key(full.snapshot())
    assert sum(r["count"] for r in fast.snapshot()["requests"]) == 60  # type: ignore[union-attr, index]
    assert servicer.entries == 69
