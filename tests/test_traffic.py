"""Golden traffic metrics: Envoy's tagged stats read back and capped
(agent.envoy.golden), workloads, `top` rows, /metrics."""

from __future__ import annotations

from collections.abc import Sequence

from agent.common.workload import workload_of
from agent.envoy.golden import GoldenFold, Series, parse_prometheus
from agent.envoy.traffic import BUCKETS, OTHER, destination, quantile
from agent.ops.metrics import Metrics
from agent.ops.top import render, table


def prom(requests: Sequence[tuple[str, str, str, str, str, str, Sequence[float]]] = (),
         tcp: Sequence[tuple[str, str, str, int, int, int]] = ()) -> str:
    """What Envoy's admin answers on /stats/prometheus?filter=^aether for these series:
    requests (src, chain, route, code, grpc, flags, their durations in µs), connections
    (src, chain, flags, connections, rx, tx)."""
    from agent.envoy.golden import DURATION_BUCKETS_US
    lines = ["# TYPE envoy_aether_request_duration histogram"]
    for src, chain, route, code, grpc, flags, values in requests:
        tags = f'key="{src};{chain};{route};{code};{grpc};{flags}"'
        for b in DURATION_BUCKETS_US:
            lines.append(f'envoy_aether_request_duration_bucket{{{tags},le="{b}"}} '
                         f"{sum(1 for v in values if v <= b)}")
        lines.append(f'envoy_aether_request_duration_bucket{{{tags},le="+Inf"}} {len(values)}')
        lines.append(f"envoy_aether_request_duration_sum{{{tags}}} {sum(values)}")
        lines.append(f"envoy_aether_request_duration_count{{{tags}}} {len(values)}")
    lines.append("# TYPE envoy_aether_tcp_connections counter")
    for t in tcp:
        lines.append(f'envoy_aether_tcp_connections{{key="{t[0]};{t[1]};{t[2]}"}} {t[3]}')
    lines.append('envoy_cluster_upstream_rq{envoy_cluster_name="x"} 5')  # not ours
    return "\n".join(lines) + "\n"


def test_envoys_series_become_labelled_requests_durations_and_connections() -> None:
    text = prom(
        requests=[("app/a", "svc|app|web|80|http", "r|0|0", "200", "-", "-", [2000, 4000]),
                  ("app/a", "svc|app|web|80|http", "r|0|0", "503", "-", "UF", [200000]),
                  ("app/a", "svc|app|rpc|9000|http", "-", "200", "Unavailable", "-", [1] * 4),
                  ("-", "svc|app|web|80|http", "-", "0", "-", "DC", [5])],
        tcp=[("app/a", "svc|app|db|5432", "-", 3, 10, 20)])
    snap = GoldenFold().snapshot(parse_prometheus(text))
    reqs = {(r["src_workload"], r["dst_service"], r["code"], r["grpc_status"], r["flags"]):
            r["count"] for r in snap["requests"]}  # type: ignore[attr-defined]
    # counted against the Service called (the chain); gRPC names become their numbers;
    # "-" (no value) is empty; an unknown source is "unknown", no response is code ""
    assert reqs == {("a", "web", "200", "", ""): 2, ("a", "web", "503", "", "UF"): 1,
                    ("a", "rpc", "200", "14", ""): 4, ("unknown", "web", "", "", "DC"): 1}
    web = {(d["src_workload"], d["dst_service"]): d for d in snap["durations"]}  # type: ignore[attr-defined]
    d = web[("a", "web")]  # the pair's histogram: every status summed
    assert (sum(d["buckets"]), d["sum_s"]) == (3, 0.206)
    assert d["buckets"][BUCKETS.index(0.0025)] == 1 and d["buckets"][BUCKETS.index(0.25)] == 1
    (t,) = snap["tcp"]  # type: ignore[misc]
    assert (t["dst_service"], t["connections"]) == ("db", 3)


def test_the_cap_holds_under_a_thousand_distinct_callers() -> None:
    """1,200 distinct caller workloads: at most the cap's label sets plus 'other'; the fold
    is counted; nothing is lost; a kept set stays kept (its counter stays monotonic)."""
    callers = 1200
    fold = GoldenFold()  # the default cap: 1000
    text = prom(requests=[(f"app/w{i:04d}", "svc|app|web|80|http", "-", "200", "-", "-",
                           [1000, 1000]) for i in range(callers)])
    snap = fold.snapshot(parse_prometheus(text))
    rows = snap["requests"]  # type: ignore[assignment]
    assert len(rows) == 1000 + 1
    other = [r for r in rows if r["src_workload"] == OTHER]
    assert other[0]["count"] == 2 * (callers - 1000) and snap["folded"] == 2 * (callers - 1000)
    assert sum(r["count"] for r in rows) == 2 * callers  # nothing lost, only folded
    kept = {r["src_workload"] for r in rows} - {OTHER}
    # a later scrape with a new caller ahead in sort order keeps the same sets
    again = fold.snapshot(parse_prometheus(prom(requests=[
        ("app/a-new", "svc|app|web|80|http", "-", "200", "-", "-", [1]),
        *[(f"app/w{i:04d}", "svc|app|web|80|http", "-", "200", "-", "-", [1, 1, 1])
          for i in range(callers)]])))
    assert {r["src_workload"] for r in again["requests"]} - {OTHER} == kept  # type: ignore[attr-defined]


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
    fold = GoldenFold()
    before = fold.snapshot(Series())
    text = prom(requests=[("app/a", "svc|app|web|80|http", "-", "500", "-", "-", [3000] * 2),
                          ("app/a", "svc|app|web|80|http", "-", "200", "-", "-", [3000] * 8)])
    after = fold.snapshot(parse_prometheus(text))
    (row,) = table(before, after, 2.0, "service")
    assert (row.name, row.requests, row.errors, row.rps) == ("app/web", 10, 2, 5.0)
    assert row.success == 0.8 and quantile(row.buckets, 0.5) == 0.005
    assert table(before, after, 2.0, "service", pod="app/nobody") == []
    # --pod: the pod's workload (traffic is counted per workload)
    assert len(table(before, {**after, "pods": {"app/a-7f-x": "app/a"}}, 2.0, "service",
                     pod="app/a-7f-x")) == 1
    screen = render([row], table(before, after, 2.0, "workload"), 2.0, "12:00:00")
    assert "app/web" in screen and "80.0%" in screen and "app/a" in screen
    assert len(BUCKETS) + 1 == len(row.buckets)


def test_the_metrics_export_the_snapshot() -> None:
    text = prom(requests=[("app/a", "svc|app|web|80|http", "-", "200", "-", "-",
                           [10000, 10000])])
    m = Metrics()
    snap = GoldenFold().snapshot(parse_prometheus(text))
    m.traffic_source = lambda: snap
    out = m.render().decode()
    assert ('aether_requests_total{code="200",code_class="2xx",dst_namespace="app",'
            'dst_service="web",dst_workload="",grpc_status="",reporter="source",'
            'response_flags="",route="",src_identity="",src_namespace="app",'
            'src_pod="",src_workload="a"} 2.0') in out
    assert ('aether_request_duration_seconds_count{dst_namespace="app",dst_service="web",'
            'reporter="source",src_namespace="app",src_pod="",src_workload="a"} 2.0') in out
    assert ('aether_request_duration_seconds_bucket{dst_namespace="app",dst_service="web",'
            'le="0.01",reporter="source",src_namespace="app",src_pod="",src_workload="a"} 2.0'
            ) in out


def test_the_calling_pod_is_a_label_where_wanted() -> None:
    """With --traffic-source-pods the capture listener's source is <ns>/<workload>/<pod>:
    the pod becomes the src_pod label (one series per pod), the workload stays the workload;
    without it src_pod is empty (no value in PromQL) and pods of a workload share series."""
    from agent.envoy.resources import PodListener
    assert PodListener("c1", "/n", namespace="app", workload="web").source == "app/web"
    assert PodListener("c1", "/n", namespace="app", workload="web",
                       source_pod="web-7d-x1").source == "app/web/web-7d-x1"
    text = prom(requests=[("app/web/web-7d-x1", "svc|app|db|80|http", "-", "200", "-", "-", [5]),
                          ("app/web/web-7d-x2", "svc|app|db|80|http", "-", "503", "-", "-", [5])],
                tcp=[("app/web/web-7d-x1", "svc|app|pg|5432", "-", 2, 0, 0)])
    snap = GoldenFold().snapshot(parse_prometheus(text))
    rows = {(r["src_workload"], r["src_pod"], r["code"]) for r in snap["requests"]}  # type: ignore[attr-defined]
    assert rows == {("web", "web-7d-x1", "200"), ("web", "web-7d-x2", "503")}
    assert {d["src_pod"] for d in snap["durations"]} == {"web-7d-x1", "web-7d-x2"}  # type: ignore[attr-defined]
    (t,) = snap["tcp"]  # type: ignore[misc]
    assert (t["src_workload"], t["src_pod"]) == ("web", "web-7d-x1")
    m = Metrics()
    m.traffic_source = lambda: snap
    out = m.render().decode()
    assert 'src_pod="web-7d-x2",src_workload="web"} 1.0' in out


def test_envoy_stats_give_passthrough_classes_and_active_connections() -> None:
    from agent.envoy import envoy_stats
    doc = {"stats": [
        {"name": "tcp.passthrough_outside.downstream_cx_total", "value": 7},
        {"name": "tcp.passthrough_outside.downstream_cx_active", "value": 1},
        {"name": "tcp.passthrough_mesh.downstream_cx_total", "value": 2},
        {"name": "cluster.svc|app|web|80.upstream_cx_active", "value": 3},
        {"name": "cluster.svc|app|web|8080.upstream_cx_active", "value": 1},
        {"name": "cluster.pod|app|db|10.0.0.5|5432.upstream_cx_active", "value": 2},
        {"name": "cluster.svc|app|web|80.upstream_cx_tx_bytes_total", "value": 100},
        {"name": "cluster.svc|app|web|80.upstream_cx_rx_bytes_total", "value": 900},
        {"name": "cluster.pod|app|db|10.0.0.5|5432.upstream_cx_tx_bytes_total", "value": 5},
        {"name": "cluster.passthrough.upstream_cx_active", "value": 9},  # not a Service
        {"name": "tcp.capture.downstream_cx_total", "value": 99},  # not a class
        {"histograms": {}}]}
    got = envoy_stats.parse(doc)
    assert got["passthrough"] == {"mesh": {"total": 2, "active": 0},
                                  "outside": {"total": 7, "active": 1}}
    assert got["active"] == {"app/web": 4, "app/db": 2}  # ports (and pods) summed
    assert got["bytes"] == {"app/web": [100, 900], "app/db": [5, 0]}
    import re

    from agent.envoy.envoy_stats import STATS_FILTER
    assert re.search(STATS_FILTER, "cluster.pod|app|db|10.0.0.5|5432.upstream_cx_active")
    assert not re.search(STATS_FILTER, "cluster.passthrough.upstream_cx_active")
    assert envoy_stats.parse({}) == envoy_stats.empty()
    # a served Service whose cluster never carried a connection has no traffic stats yet
    # (Envoy makes them on first use): it is there, at zero; stats still sum on top
    seeded = envoy_stats.parse(doc, ["app/idle", "app/web"])
    assert seeded["active"] == {"app/idle": 0, "app/web": 4, "app/db": 2}
    assert seeded["bytes"] == {"app/idle": [0, 0], "app/web": [100, 900], "app/db": [5, 0]}
    m = Metrics()
    m.envoy_traffic_source = lambda: got
    text = m.render().decode()
    assert 'aether_passthrough_connections_total{class="outside"} 7.0' in text
    assert 'aether_passthrough_active_connections{class="outside"} 1.0' in text
    assert 'aether_service_active_connections{dst_namespace="app",dst_service="web"} 4.0' in text
    assert 'aether_service_sent_bytes_total{dst_namespace="app",dst_service="web"} 100.0' in text
    assert 'aether_service_received_bytes_total{dst_namespace="app",dst_service="web"} 900.0' in text

    def down() -> dict[str, object]:
        raise OSError("admin gone")
    m.envoy_traffic_source = down  # type: ignore[assignment]
    assert "aether_passthrough_connections" not in m.render().decode()  # left out, not 0


def test_top_shows_active_connections_and_passthrough() -> None:
    from agent.ops.top import passthrough
    snap = GoldenFold().snapshot(parse_prometheus(prom(tcp=[("app/a", "svc|app|db|5432", "-",
                                                                1, 0, 0)])))
    before = {**snap, "envoy": {"passthrough": {"outside": {"total": 10, "active": 0}},
                                "active": {}}}
    after = {**snap, "envoy": {"passthrough": {"outside": {"total": 14, "active": 2}},
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


def test_envoys_one_tag_packs_every_label_and_a_stray_series_is_skipped() -> None:
    from envoy.extensions.access_loggers.stats.v3 import stats_pb2

    from agent.envoy.golden import KEY_SEP, REQUEST_FIELDS, http_stats_log
    cfg = stats_pb2.Config()
    http_stats_log().typed_config.Unpack(cfg)
    (tag,) = cfg.histograms[0].stat.tags  # one tag: Envoy encodes each tag per sample
    assert tag.value_format.split(KEY_SEP) == [fmt for _, fmt in REQUEST_FIELDS]
    text = prom(requests=[("app/a", "svc|app|web|80|http", "", "200", "", "-", [10])])
    text += 'envoy_aether_request_duration_bucket{key="app/a;svc|app|web|80|http",le="+Inf"} 7\n'
    text += 'envoy_aether_tcp_connections{key="app/a"} 3\n'
    series = parse_prometheus(text)
    # an empty field (Envoy omits empty values) and "-" both read as no value; a key of the
    # wrong shape is no series of ours
    assert list(series.requests) == [("app/a", "svc|app|web|80|http", "", "200", "", "")]
    assert series.tcp == {}


def _inbound(caller: str, dst: str, code: str, values: Sequence[float]) -> str:
    """Envoy's answer for one series of the destination's detection HCM."""
    from agent.envoy.golden import DURATION_BUCKETS_US, INBOUND_STAT
    tags = f'key="{caller};{dst};{code};-;-"'
    lines = [f'envoy_aether_{INBOUND_STAT}_bucket{{{tags},le="{b}"}} '
             f"{sum(1 for v in values if v <= b)}" for b in DURATION_BUCKETS_US]
    lines += [f'envoy_aether_{INBOUND_STAT}_bucket{{{tags},le="+Inf"}} {len(values)}',
              f"envoy_aether_{INBOUND_STAT}_sum{{{tags}}} {sum(values)}"]
    return "\n".join(lines) + "\n"


def test_requests_counted_by_the_destination_carry_the_callers_identity() -> None:
    """What the destination's proxy counted (an undeclared port: the caller relayed bytes)
    is reporter=destination, by the caller's identity and the pod's workload, its Service
    named where this node holds it (one Service backed by that workload port) and "" where
    it does not; requests the caller counted stay reporter=source; nothing is summed across."""
    from types import SimpleNamespace

    from agent.envoy.golden import service_resolver
    from agent.scope.model import Endpoint
    text = prom(requests=[("app/a", "svc|app|web|80|http", "-", "200", "-", "-", [5])])
    text += _inbound("spiffe://td/ns/app/sa/client", "app/echo|8080", "200", [1000] * 30)
    text += _inbound("spiffe://td/ns/app/sa/client", "app/echo|8080", "503", [1000] * 2)
    text += _inbound("spiffe://td/ns/app/sa/client", "app/other|9000", "200", [1000])
    pods = [SimpleNamespace(ips=("10.0.0.5",), namespace="app", workload="echo", uid="u1"),
            SimpleNamespace(ips=("10.0.0.6",), namespace="app", workload="other", uid="u2")]
    views = [SimpleNamespace(namespace="app", name="echo",
                             endpoints={80: (Endpoint("10.0.0.5", 8080, "app/server", True, False),)})]
    snap = GoldenFold().snapshot(parse_prometheus(text), service_resolver(views, pods))
    rows = {(r["reporter"], r["src_identity"], r["src_workload"], r["dst_service"],
             r["dst_workload"], r["code"]): r["count"] for r in snap["requests"]}  # type: ignore[attr-defined]
    assert rows == {("source", "", "a", "web", "", "200"): 1,
                    ("destination", "app/client", "", "echo", "echo", "200"): 30,
                    ("destination", "app/client", "", "echo", "echo", "503"): 2,
                    ("destination", "app/client", "", "", "other", "200"): 1}
    pairs = {(d["reporter"], d["dst_service"]): sum(d["buckets"])
             for d in snap["durations"]}  # type: ignore[attr-defined]
    assert pairs == {("source", "web"): 1, ("destination", "echo"): 32, ("destination", ""): 1}
    m = Metrics()
    m.traffic_source = lambda: snap
    out = m.render().decode()
    assert ('aether_requests_total{code="503",code_class="5xx",dst_namespace="app",'
            'dst_service="echo",dst_workload="echo",grpc_status="",reporter="destination",'
            'response_flags="",route="",src_identity="app/client",src_namespace="app",'
            'src_pod="",src_workload=""} 2.0') in out
    # a malformed key (no port) is counted, as unknown, not dropped
    odd = parse_prometheus(_inbound("", "garbage", "200", [1]))
    (r,) = GoldenFold().snapshot(odd)["requests"]  # type: ignore[misc]
    assert (r["dst_workload"], r["src_identity"], r["count"]) == ("unknown", "unauthenticated", 1)


def test_the_destinations_logger_counts_what_the_caller_did_not_parse() -> None:
    """The detection HCM of inbound-detect carries the destination's stats logger (keyed by
    the caller's SPIFFE ID and the pod's workload|port, which the inbound listener sets for
    it); every HTTP chain of the capture path marks its connections so mtls-out asks for
    aether-mesh-http (the destination does not parse, nor count, them again)."""
    from envoy.extensions.access_loggers.stats.v3 import stats_pb2
    from envoy.extensions.filters.network.http_connection_manager.v3 import (
        http_connection_manager_pb2 as hcm_pb2,
    )

    from agent.envoy import mtls
    from agent.envoy.golden import INBOUND_FIELDS, INBOUND_STAT, KEY_SEP
    from agent.envoy.http_routes import HTTP_HOP_STATE, http_filter_chain
    lis = mtls.build_inbound_detect_listener()
    (chain,) = lis.filter_chains
    hcm = hcm_pb2.HttpConnectionManager()
    chain.filters[0].typed_config.Unpack(hcm)
    (log,) = hcm.access_log
    cfg = stats_pb2.Config()
    log.typed_config.Unpack(cfg)
    (hist,) = cfg.histograms
    assert hist.stat.name == INBOUND_STAT
    fields = hist.stat.tags[0].value_format.split(KEY_SEP)
    assert len(fields) == len(INBOUND_FIELDS)
    assert fields[0] == f"%FILTER_STATE({mtls.PROXY_TLV_STATE}:FIELD:peer)%"
    assert fields[1] == f"%FILTER_STATE({mtls.DESTINATION_STATE}:PLAIN)%"
    out = mtls.build_mtls_out_listener()
    tree = out.filter_chain_matcher.matcher_tree
    assert dict(tree.exact_match_map.map)["1"].action.name == "mtls-http"
    assert b"aether-mesh-http" in out.filter_chains[0].SerializeToString()
    assert HTTP_HOP_STATE.encode() in tree.input.typed_config.value
    chain = http_filter_chain("c", chain.filter_chain_match, hcm)
    assert HTTP_HOP_STATE.encode() in chain.filters[0].typed_config.value
