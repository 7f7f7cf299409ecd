"""Per-caller inbound mesh counters (agent.envoy.mesh_traffic) and their access log entries."""

from __future__ import annotations

from envoy.data.accesslog.v3 import accesslog_pb2

from agent.envoy import mtls
from agent.envoy.als import AccessLogServicer, parse_inbound_entry
from agent.envoy.mesh_traffic import OTHER, UNAUTHENTICATED, InboundConnection, InboundTally
from agent.ops.metrics import Metrics

SRV = "spiffe://td/ns/app/sa/server"


def _caller(i: int) -> str:
    return f"spiffe://td/ns/app/sa/c{i}"


def test_counts_connections_and_bytes_per_identity_and_caller() -> None:
    t = InboundTally()
    t.add(InboundConnection(SRV, _caller(1), 10, 20))
    t.add(InboundConnection(SRV, _caller(1), 1, 2))
    t.add(InboundConnection(SRV, "", 0, 0))
    rows = {(r.identity, r.caller): (r.connections, r.received_bytes, r.sent_bytes)
            for r in t.rows()}
    assert rows == {("app/server", _caller(1)): (2, 11, 22),
                    ("app/server", UNAUTHENTICATED): (1, 0, 0)}


def test_a_connection_without_the_pods_certificate_is_named_by_its_listener() -> None:
    t = InboundTally(resolve=lambda lis: "app/server" if lis == "inbound-c1" else None)
    t.add(InboundConnection("", "", listener="inbound-c1"))
    t.add(InboundConnection("", "", listener="inbound-gone"))
    assert {(r.identity, r.caller) for r in t.rows()} == {
        ("app/server", UNAUTHENTICATED), ("unknown", UNAUTHENTICATED)}


def test_the_series_cap_folds_new_callers_into_other_and_counts_the_fold() -> None:
    t = InboundTally(max_series=3)
    for i in range(1000):
        t.add(InboundConnection(SRV, _caller(i), 1, 1))
    t.add(InboundConnection(SRV, _caller(0), 1, 1))  # a caller already held stays its own
    rows = {r.caller: r.connections for r in t.rows()}
    assert rows == {_caller(0): 2, _caller(1): 1, _caller(2): 1, OTHER: 997}
    assert t.folded == 997
    assert len(t.rows()) == 4  # the cap plus the one fold series


def test_the_inbound_access_log_entry_becomes_a_connection() -> None:
    e = accesslog_pb2.TCPAccessLogEntry()
    tls = e.common_properties.tls_properties
    tls.local_certificate_properties.subject_alt_name.add(uri=SRV)
    tls.peer_certificate_properties.subject_alt_name.add(dns="x.example")
    tls.peer_certificate_properties.subject_alt_name.add(uri=_caller(7))
    e.connection_properties.received_bytes = 5
    e.connection_properties.sent_bytes = 9
    e.common_properties.custom_tags[mtls.INBOUND_LISTENER_TAG] = "inbound-c1"
    assert parse_inbound_entry(e) == InboundConnection(SRV, _caller(7), 5, 9, "inbound-c1")
    # dispatched by the stream's log name, never to the dependency learner
    got: list[InboundConnection] = []
    learned: list[object] = []
    als = AccessLogServicer(lambda *a: learned.append(a), on_inbound=got.append)
    from envoy.service.accesslog.v3 import als_pb2
    msg = als_pb2.StreamAccessLogsMessage()
    msg.tcp_logs.log_entry.add().CopyFrom(e)
    als.handle(msg, mtls.INBOUND_ALS_LOG_NAME)
    assert got == [parse_inbound_entry(e)] and learned == []


def test_the_metrics_name_the_caller() -> None:
    t = InboundTally(max_series=1)
    t.add(InboundConnection(SRV, _caller(1), 3, 4))
    t.add(InboundConnection(SRV, _caller(2), 3, 4))
    m = Metrics()
    m.mesh_traffic_source = t.status
    text = m.render().decode()
    assert (f'aether_mesh_inbound_connections_total{{caller="{_caller(1)}",identity="app/server"}}'
            " 1.0") in text
    assert 'aether_mesh_inbound_connections_total{caller="other",identity="app/server"} 1.0' in text
    assert f'aether_mesh_inbound_sent_bytes_total{{caller="{_caller(1)}",identity="app/server"}} 4.0' \
        in text
    assert "aether_mesh_inbound_folded_connections_total 1.0" in text
