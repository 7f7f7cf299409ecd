"""Golden traffic metrics: the tally (agent.envoy.traffic), workloads, `top` rows, /metrics."""

from __future__ import annotations

from agent.envoy.traffic import (
    BUCKETS,
    OTHER,
    Report,
    Source,
    TrafficTally,
    destination,
    quantile,
)
from agent.metrics import Metrics
from agent.top import render, table
from agent.workload import workload_of


def _src(listener: str) -> Source | None:
    return Source("app", listener.removeprefix("capture-").split("-")[0], listener)


def test_requests_connections_and_what_is_not_counted() -> None:
    t = TrafficTally(resolve=_src)
    for code, dur in ((200, 0.002), (200, 0.004), (503, 0.2)):
        t.add(Report("capture-a-1", "svc|app|v2|80", http=True, code=code, duration_s=dur,
                     chain="svc|app|web|80|http", route="r|0|0"))
    t.add(Report("capture-a-1", "svc|app|db|5432", received=10, sent=20, chain="svc|app|db|5432"))
    t.add(Report("capture-a-1", "svc|app|web|80", chain="svc|app|web|80|http"))  # its requests count
    t.add(Report("capture-a-1", "passthrough", chain="passthrough"))  # not a Service
    snap = t.snapshot()
    reqs = {(r["dst_service"], r["code"]): r for r in snap["requests"]}
    # counted against the Service called (the chain), not the route's backend
    assert set(reqs) == {("web", "200"), ("web", "503")}
    assert reqs[("web", "200")]["count"] == 2 and reqs[("web", "200")]["src_workload"] == "a"
    assert sum(reqs[("web", "200")]["buckets"]) == 2
    assert [r["connections"] for r in snap["tcp"]] == [1]
    assert snap["tcp"][0]["received_bytes"] == 10 and snap["tcp"][0]["dst_service"] == "db"


def test_the_cap_holds_under_a_thousand_distinct_callers() -> None:
    t = TrafficTally(max_series=100, resolve=_src)
    for i in range(1500):
        t.add(Report(f"capture-w{i}-x", "svc|app|web|80", http=True, code=200,
                     chain="svc|app|web|80|http"))
    snap = t.snapshot()
    assert len(snap["requests"]) == 101  # the cap, and the one "other" series
    other = [r for r in snap["requests"] if r["src_workload"] == OTHER]
    assert other[0]["count"] == 1400 and snap["folded"] == 1400
    assert sum(r["count"] for r in snap["requests"]) == 1500  # nothing lost, only folded


def test_workload_names_and_destinations() -> None:
    rs = {"metadata": {"labels": {"pod-template-hash": "7d9f"},
                       "ownerReferences": [{"kind": "ReplicaSet", "name": "web-7d9f",
                                            "controller": True}]}}
    assert workload_of("web-7d9f-x1", rs) == "web"
    sts = {"metadata": {"ownerReferences": [{"kind": "StatefulSet", "name": "db",
                                             "controller": True}]}}
    assert workload_of("db-0", sts) == "db"
    assert workload_of("lonely", None) == "lonely"
    assert destination("svc|ns|web|80|http") == ("ns", "web")
    assert destination("pod|ns|db|10.0.0.1|5432") == ("ns", "db")
    assert destination("passthrough") == ("", "passthrough")


def test_top_rates_success_and_latency() -> None:
    t = TrafficTally(resolve=_src)
    before = t.snapshot()
    for i in range(10):
        t.add(Report("capture-a-1", "svc|app|web|80", http=True, code=500 if i < 2 else 200,
                     duration_s=0.003, chain="svc|app|web|80|http"))
    after = t.snapshot()
    (row,) = table(before, after, 2.0, "service")
    assert (row.name, row.requests, row.errors, row.rps) == ("app/web", 10, 2, 5.0)
    assert row.success == 0.8 and quantile(row.buckets, 0.5) == 0.005
    assert table(before, after, 2.0, "service", pod="app/nobody") == []
    screen = render([row], table(before, after, 2.0, "workload"), 2.0, "12:00:00")
    assert "app/web" in screen and "80.0%" in screen and "app/a" in screen
    assert len(BUCKETS) + 1 == len(row.buckets)


def test_the_metrics_sum_pods_into_workloads() -> None:
    t = TrafficTally(resolve=_src)
    for pod in ("capture-a-1", "capture-a-2"):
        t.add(Report(pod, "svc|app|web|80", http=True, code=200, duration_s=0.01,
                     chain="svc|app|web|80|http"))
    m = Metrics()
    m.traffic_source = t.snapshot
    text = m.render().decode()
    assert ('aether_requests_total{code="200",code_class="2xx",dst_namespace="app",'
            'dst_service="web",grpc_status="",response_flags="",route="",src_namespace="app",'
            'src_workload="a"} 2.0') in text
    assert ('aether_request_duration_seconds_count{dst_namespace="app",dst_service="web",'
            'src_namespace="app",src_workload="a"} 2.0') in text


def test_envoy_stats_give_passthrough_classes_and_active_connections() -> None:
    from agent.envoy import envoy_stats
    doc = {"stats": [
        {"name": "tcp.passthrough_outside.downstream_cx_total", "value": 7},
        {"name": "tcp.passthrough_outside.downstream_cx_active", "value": 1},
        {"name": "tcp.passthrough_mesh.downstream_cx_total", "value": 2},
        {"name": "cluster.svc|app|web|80.upstream_cx_active", "value": 3},
        {"name": "cluster.svc|app|web|8080.upstream_cx_active", "value": 1},
        {"name": "cluster.pod|app|db|10.0.0.5|5432.upstream_cx_active", "value": 2},
        {"name": "cluster.passthrough.upstream_cx_active", "value": 9},  # not a Service
        {"name": "tcp.capture.downstream_cx_total", "value": 99},  # not a class
        {"histograms": {}}]}
    got = envoy_stats.parse(doc)
    assert got["passthrough"] == {"mesh": {"total": 2, "active": 0},
                                  "outside": {"total": 7, "active": 1}}
    assert got["active"] == {"app/web": 4, "app/db": 2}  # ports (and pods) summed
    assert envoy_stats.parse({}) == envoy_stats.empty()
    m = Metrics()
    m.envoy_traffic_source = lambda: got
    text = m.render().decode()
    assert 'aether_passthrough_connections_total{class="outside"} 7.0' in text
    assert 'aether_passthrough_active_connections{class="outside"} 1.0' in text
    assert 'aether_service_active_connections{dst_namespace="app",dst_service="web"} 4.0' in text

    def down() -> dict[str, object]:
        raise OSError("admin gone")
    m.envoy_traffic_source = down  # type: ignore[assignment]
    assert "aether_passthrough_connections" not in m.render().decode()  # left out, not 0


def test_top_shows_active_connections_and_passthrough() -> None:
    from agent.top import passthrough
    t = TrafficTally(resolve=_src)
    t.add(Report("capture-a-1", "svc|app|db|5432", chain="svc|app|db|5432"))
    before = {**t.snapshot(), "envoy": {"passthrough": {"outside": {"total": 10, "active": 0}},
                                        "active": {}}}
    after = {**t.snapshot(), "envoy": {"passthrough": {"outside": {"total": 14, "active": 2}},
                                       "active": {"app/db": 1, "other/cache": 3}}}
    rows = {r.name: r for r in table(before, after, 2.0, "service")}
    # a Service with only a long-lived connection (nothing closed yet) still shows
    assert rows["app/db"].active == 1 and rows["other/cache"].active == 3
    assert set(r.name for r in table(before, after, 2.0, "service", namespace="app")) == {"app/db"}
    assert all(r.active is None for r in table(before, after, 2.0, "workload"))
    through = passthrough(before, after, 2.0)
    assert through == {"outside": {"connections": 14, "cps": 2.0, "active": 2}}
    screen = render(list(rows.values()), [], 2.0, "12:00:00", through)
    assert "outside: 14 connections, 2.0/s, 2 open" in screen and "ACTIVE" in screen
