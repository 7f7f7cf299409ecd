"""`--access-log`: every captured connection and HTTP request becomes one JSON record, built
from the access-log entry Envoy already streams (agent.envoy.als → agent.envoy.traffic)."""

from __future__ import annotations

import json

from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2

from agent.envoy.als import parse_request_entry, parse_traffic_entry
from agent.envoy.traffic import AccessRecorder, Report, Source, access_record


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


def test_a_passthrough_connection_is_a_record() -> None:
    e = accesslog_pb2.TCPAccessLogEntry()
    _common(e.common_properties, "passthrough", "passthrough")
    e.common_properties.downstream_local_address.socket_address.address = "2001:db8::1"
    e.common_properties.duration.FromMilliseconds(1500)
    e.connection_properties.received_bytes = 10
    e.connection_properties.sent_bytes = 20
    r = parse_traffic_entry(e)
    assert r.duration_s == 1.5 and r.endpoint == "10.244.0.7:8080"
    records: list[dict[str, object]] = []
    rec_ = AccessRecorder(records.append, resolve=lambda _l: Source("app", "client", "client-0"))
    rec_.add(r)
    (rec,) = records
    assert rec["kind"] == "connection" and rec["dst"] == "[2001:db8::1]:80"
    assert (rec["dst_namespace"], rec["dst_service"], rec["cluster"]) == ("", "", "passthrough")
    assert "code" not in rec and rec["bytes_received"] == 10 and rec["src_pod"] == "client-0"


def test_an_unknown_caller_is_still_logged() -> None:
    records: list[dict[str, object]] = []
    AccessRecorder(records.append).add(Report("capture-gone", "svc|app|db|5432",
                                              chain="svc|app|db|5432"))
    assert records[0]["src_workload"] == "unknown" and records[0]["dst_service"] == "db"


def test_records_arrive_over_the_real_als_stream() -> None:
    """The servicer hands every entry of the traffic logs to the recorder, whole."""
    from envoy.service.accesslog.v3 import als_pb2

    from agent.envoy.als import AccessLogServicer
    from agent.envoy.resources import REQUEST_LOG_NAME, TRAFFIC_LOG_NAME

    got: list[Report] = []
    servicer = AccessLogServicer(on_traffic=got.append)
    msg = als_pb2.StreamAccessLogsMessage()
    for i in range(3):
        e = msg.http_logs.log_entry.add()
        _common(e.common_properties, "svc|app|web|80", "svc|app|web|80|http")
        e.response.response_code.value = 200 + i
    servicer.handle(msg, REQUEST_LOG_NAME)
    tcp = als_pb2.StreamAccessLogsMessage()
    _common(tcp.tcp_logs.log_entry.add().common_properties, "passthrough", "passthrough")
    servicer.handle(tcp, TRAFFIC_LOG_NAME)
    assert [r.code for r in got] == [200, 201, 202, 0] and got[-1].cluster == "passthrough"
    assert servicer.entries == 4
