"""`python -m bench [--quick] [--write]`: run every benchmark, print one table, optionally
rewrite bench/README.md with it. Each row is a figure beside its baseline measured in the same
run, and the ratio: absolute numbers on a shared 2-vCPU machine mean little, ratios travel."""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))

BENCHES: dict[str, dict[str, list[str]]] = {
    "cni_add": {"full": ["--pods", "200", "--concurrency", "1,16", "--rounds", "3"],
                "quick": ["--pods", "20", "--concurrency", "1,4", "--rounds", "1"]},
    "envoy_path": {"full": ["--pods", "100", "--concurrency", "1,16", "--duration", "10"],
                   "quick": ["--quick"]},
    "xds_build": {"full": ["--services", "1000,10000", "--pods", "110"], "quick": ["--quick"]},
    "agent_scale": {"full": ["--pods", "50000,100000", "--services", "10000",
                             "--remote-pods", "meshpods,pods", "--rounds", "3"],
                    "quick": ["--quick"]},
    "mesh_mtls": {"full": ["--rounds", "3", "--duration", "8"], "quick": ["--quick"]},
    "h2_balance": {"full": ["--rounds", "3", "--duration", "8"], "quick": ["--quick"]},
    "traffic_metrics": {"full": ["--rounds", "4", "--duration", "8"], "quick": ["--quick"]},
    "sidecar_path": {"full": ["--rounds", "3", "--duration", "8", "--pods", "20"],
                     "quick": ["--quick"]},
    "takeover": {"full": ["--takeovers", "10", "--crashes", "3", "--pods", "110"],
                 "quick": ["--quick"]},
    "authz_cost": {"full": ["--rounds", "5", "--duration", "8"], "quick": ["--quick"]},
    "authz_instructions": {"full": ["--rounds", "3", "--duration", "10"], "quick": ["--quick"]},
    "dns": {"full": ["--rounds", "5"], "quick": ["--quick"]},
}


Row = tuple[str, str, str, str, str, str]  # bench, metric, value, baseline, ratio, verdict


def _ms(x: float) -> str:
    return f"{x:.1f} ms"


def rows_cni_add(d: dict[str, Any]) -> list[Row]:
    out: list[Row] = []
    for lv in d["levels"]:
        c = lv["concurrency"]
        mode = "Envoy on, ACK waited" if d.get("envoy", False) else "no Envoy"
        target = lv.get("target", "p50 <= 2x floor").replace("<=", "≤").replace("x floor", "×")
        rr = lv.get("ratio_p50_rounds") or [lv["ratio_p50"]]
        n = lv.get("rounds", 1)
        out.append(("cni_add", f"ADD p50, concurrency {c} ({mode}; median of {n} rounds)",
                    _ms(lv.get("add_p50_ms_median", lv["add"]["p50_ms"])),
                    f"nft -f floor {_ms(lv.get('floor_p50_ms_median', lv['floor']['p50_ms']))}",
                    f"{lv['ratio_p50']:.2f}× (spread {min(rr):.2f}–{max(rr):.2f})",
                    ("PASS" if lv["target_met"] else "MISS") + f" ({target})"))
        out.append(("cni_add", f"ADD p99, concurrency {c} ({mode}; median of {n} rounds)",
                    _ms(lv.get("add_p99_ms_median", lv["add"]["p99_ms"])),
                    f"nft -f floor {_ms(lv['floor']['p99_ms'])}", f"{lv['ratio_p99']:.2f}×", "-"))
    return out


def _ratio_row(label: str, shape: dict[str, Any]) -> Row:
    """An envoy_path shape judged by its captured/direct req/s ratio (median of the pairs)."""
    cap = [r["rps"] for r in shape["runs"] if r["mode"] == "captured"]
    dr = [r["rps"] for r in shape["runs"] if r["mode"] == "direct"]
    ratios = shape["rps_ratios"]
    return ("envoy_path", label, f"{statistics.median(cap):.0f}" if cap else "-",
            f"direct {statistics.median(dr):.0f}" if dr else "-",
            f"{shape['rps_ratio_median']:.2f}× (spread {min(ratios):.2f}–{max(ratios):.2f})"
            if ratios else "-",
            ("PASS" if shape["target_met"] else "MISS") + f" (≥ {shape['target']:g}×)")


def rows_envoy_path(d: dict[str, Any]) -> list[Row]:
    out: list[Row] = []
    for lv in d["add"]["levels"]:
        c = lv["concurrency"]
        out.append(("envoy_path", f"ADD → listener live p50, conc {c}",
                    _ms(lv["envoy_add"]["p50_ms"]), f"no-Envoy ADD {_ms(lv['no_envoy_add']['p50_ms'])}",
                    f"{lv['ratio_p50']:.2f}×",
                    f"{lv['liveness_failures']} dead listeners after ADD"))
        out.append(("envoy_path", f"ADD → listener live p99, conc {c}",
                    _ms(lv["envoy_add"]["p99_ms"]), f"no-Envoy ADD {_ms(lv['no_envoy_add']['p99_ms'])}",
                    f"{lv['ratio_p99']:.2f}×", "-"))
    dp = d["data_path"]
    m = dp["mean"]
    rr = dp["rps_ratios"]
    out.append(("envoy_path", "keep-alive -c32, requests/s (1 KB)", f"{m['captured']['rps']:.0f}",
                f"direct {m['direct']['rps']:.0f}",
                f"{dp['rps_ratio']:.2f}× (spread {min(rr):.2f}–{max(rr):.2f})",
                ("PASS" if dp["rps_target_met"] else "MISS") + f" (≥ {dp.get('rps_target', 0.65):g}×)"))
    pd = dp["saturated_p50_deltas_ms"]
    out.append(("envoy_path", "keep-alive -c32 (saturated), p50", _ms(m["captured"]["p50_ms"]),
                f"direct {_ms(m['direct']['p50_ms'])}",
                f"{dp['saturated_p50_delta_ms']:+.2f} ms (spread {min(pd):+.2f}–{max(pd):+.2f})",
                "- (p50 ≈ 32 / throughput)"))
    lat = dp["one_in_flight"]
    ld = lat["p50_deltas_ms"]
    out.append(("envoy_path", "one request in flight (-c1), p50", f"{lat['captured_p50_ms'] * 1000:.0f} µs",
                f"direct {lat['direct_p50_ms'] * 1000:.0f} µs",
                f"{lat['p50_delta_ms_median'] * 1000:+.0f} µs (spread "
                f"{min(ld) * 1000:+.0f}–{max(ld) * 1000:+.0f})",
                ("PASS" if lat["target_met"] else "MISS") + " (≤ +0.3 ms)"))
    em = d.get("envoy_memory")
    if em:
        out.append(("envoy_path", f"node Envoy RSS per captured pod ({em['pods']} pods)",
                    f"{em['per_pod_kb']:.0f} KB", f"no pod: {em['rss0_mb']:.0f} MB", "-",
                    ("PASS" if em["target_met"] else "MISS") + f" (≤ {em['target_kb']} KB)"))
    for key, label in (("new_connection_per_request", "new connection per request, requests/s"),
                       ("routed_http", "HTTP through a GAMMA route, keep-alive -c32, requests/s")):
        if dp.get(key):
            out.append(_ratio_row(label, dp[key]))
    return out


def _full_build_verdict(n: int, smallest: int, seconds: float) -> str:
    """≤ 1 s at 1k Services (the first target) and, since #43, at 10k too."""
    if n != smallest and n < 10000:
        return "-"
    return ("PASS" if seconds <= 1 else "MISS") + f" (≤ 1 s at {n // 1000}k)"


def rows_xds_build(d: dict[str, Any]) -> list[Row]:
    out: list[Row] = []
    res = {r["services"]: r for r in d.get("results", [])}
    small, big = res.get(min(res)) if res else None, res.get(max(res)) if res else None
    for r in d.get("results", []):
        n = r["services"]
        out.append(("xds_build", f"full build + publish, 110 pods × {n} Services",
                    f"{r['full_build_publish_s']:.2f} s", f"{r['total_bytes'] / 1e6:.1f} MB pushed",
                    "-", _full_build_verdict(n, min(res), r["full_build_publish_s"])))
    if small is not None and big is not None:
        out.append(("xds_build", f"one pod ADD at {big['services']} Services",
                    f"{big['pod_add_ms']:.1f} ms", f"at {small['services']}: {small['pod_add_ms']:.1f} ms",
                    f"{big['pod_add_ms'] / max(small['pod_add_ms'], 1e-9):.1f}×",
                    ("PASS" if big["pod_add_ms"] <= 50 else "MISS") + " (≤ 50 ms)"))
        out.append(("xds_build", "pod listener bytes", f"{big['pod_listener_bytes'][1]} B",
                    f"at {small['services']}: {small['pod_listener_bytes'][1]} B",
                    f"{big['pod_listener_bytes'][1] / small['pod_listener_bytes'][1]:.2f}×",
                    "constant"))
        out.append(("xds_build", f"one Service's endpoints change at {big['services']}",
                    f"{big['service_endpoints_change_ms']:.1f} ms",
                    f"at {small['services']}: {small['service_endpoints_change_ms']:.1f} ms",
                    f"{big['service_endpoints_change_ms'] / small['service_endpoints_change_ms']:.1f}×",
                    "-" if big["services"] < 10000 else
                    ("PASS" if big["service_endpoints_change_ms"] <= 20 else "MISS")
                    + " (≤ 20 ms at 10k, #43)"))
        out.append(("xds_build", f"agent RSS at {big['services']} Services",
                    f"{big['rss_total_mb']:.0f} MB", f"bare process {big['rss_before_model_mb']:.0f} MB",
                    f"{big['rss_total_mb'] / big['rss_before_model_mb']:.1f}×",
                    ("PASS" if big["rss_total_mb"] <= 250 else "MISS") + " (≤ 250 MB)"))
    return out


def _k(n: int) -> str:
    return f"{n // 1000}k" if n % 1000 == 0 else str(n)


def rows_agent_scale(d: dict[str, Any]) -> list[Row]:
    """The production mode (--remote-pods meshpods) per size, the median of its rounds with
    their spread, beside the every-Pod mode of the same rounds where it ran (the ratio: the
    median of the per-round ratios); the targets on the largest size's medians."""
    out: list[Row] = []
    results = d.get("results", [])
    target = d.get("targets", {})
    mode_of = [r.get("remote_pods", "pods") for r in results]
    headline = [r for r, m in zip(results, mode_of, strict=True) if m == "meshpods"] or results
    pods_mode = {r["pods"]: r for r, m in zip(results, mode_of, strict=True) if m == "pods"}

    def spread(r: dict[str, Any], f: str, fmt: str) -> str:
        lo, hi = r.get(f + "_spread") or [r[f], r[f]]
        return f" ({fmt.format(lo)}–{fmt.format(hi)})" if r.get("rounds", 1) > 1 else ""

    def ratio(r: dict[str, Any], base: dict[str, Any] | None, name: str, f: str) -> str:
        if base is None:
            return "-"
        if f"vs_pods_{name}" in r:
            lo, hi = r[f"vs_pods_{name}_spread"]
            return f"{r[f'vs_pods_{name}']:.2f}× (spread {lo:.2f}–{hi:.2f})"
        return f"{r[f] / base[f]:.2f}×"

    for r in headline:
        big = r is headline[-1] and target.get("checked")
        base = pods_mode.get(r["pods"]) if r.get("remote_pods") == "meshpods" else None
        n = r.get("rounds", 1)
        of = f"median of {n} rounds, " if n > 1 else ""
        cpu = f"agent CPU {r['agent_cpu_s']:.0f} s, API server CPU {r['api_cpu_s']:.0f} s"
        mode = f"--remote-pods {r.get('remote_pods', 'pods')}"
        out.append(("agent_scale", f"ready, {_k(r['pods'])} Pods + {_k(r['services'])} "
                    f"Services ({of}{mode}, --scope all)",
                    f"{r['ready_s']:.1f} s{spread(r, 'ready_s', '{:.1f}')}",
                    f"every Pod listed: {base['ready_s']:.1f} s; {cpu}" if base else cpu,
                    ratio(r, base, "ready", "ready_s"),
                    (("PASS" if target.get("ready_ok") else "MISS") + " (≤ 30 s at 100k)")
                    if big else "-"))
        uss = f"USS {r['agent_uss_mb']:.0f} MB; Envoy {r['envoy_rss_mb']:.0f} MB"
        out.append(("agent_scale", f"agent RSS, {_k(r['pods'])} Pods ({of}{mode})",
                    f"{r['agent_rss_mb']:.0f} MB{spread(r, 'agent_rss_mb', '{:.0f}')}",
                    f"every Pod listed: {base['agent_rss_mb']:.0f} MB; {uss}" if base else uss,
                    ratio(r, base, "rss", "agent_rss_mb"),
                    (("PASS" if target.get("rss_ok") else "MISS") + " (≤ 300 MB at 100k)")
                    if big else "-"))
        ch = r["endpoint_change"]
        out.append(("agent_scale", f"one endpoint gone → Envoy, {_k(r['pods'])} Pods",
                    f"{ch['seconds'] * 1000:.0f} ms", f"agent CPU {ch['agent_cpu_s'] * 1000:.0f} ms",
                    "-", "-"))
    if d.get("rss_mb_per_10k_pods") is not None:
        out.append(("agent_scale", "agent RSS growth per 10k Pods",
                    f"{d['rss_mb_per_10k_pods']:.0f} MB", "-", "-", "-"))
    return out


MTLS_MODE_LABELS = {"http": "appProtocol http (XFCC)", "tcp": "appProtocol tcp",
                    "detect": "no appProtocol (detected, XFCC)",
                    "floor-tcp": "tcp_proxy at both ends",
                    "floor-http": "HTTP codec at both ends, XFCC"}


def rows_mesh_mtls(d: dict[str, Any]) -> list[Row]:
    out: list[Row] = []
    for shape, label in (("keepalive", "keep-alive -c32, req/s"),
                         ("newconn", "new connection per request, req/s")):
        # the mesh's modes, then the floor's (the JSON has them sorted by name)
        modes = dict(sorted(d["shapes"].get(shape, {}).get("modes", {}).items(),
                            key=lambda kv: kv[0].startswith("floor-")))
        for mode, s in modes.items():
            lo, hi = (s["spread"] + [0.0, 0.0])[:2]
            verdict = "- (a TLS handshake each)" if shape == "newconn" else "-"
            if "target" in s:
                verdict = ("PASS" if s["target_met"] else "MISS") + f" (≥ {s['target']:g}×)"
            what = (f"the floor: a plain Envoy's mTLS hop, {MTLS_MODE_LABELS.get(mode, mode)}"
                    if mode.startswith("floor-") else
                    f"mTLS hop, {MTLS_MODE_LABELS.get(mode, mode)}")
            out.append(("mesh_mtls", f"{what}, {label}",
                        f"{s['mesh_rps_median']:.0f}", f"direct {s['direct_rps_median']:.0f}",
                        f"{s['rps_ratio_median']:.2f}× (spread {lo:.2f}–{hi:.2f})", verdict))
        for mode, s in modes.items():
            if "floor_mode" in s and s["floor_mode"] in modes:
                lo, hi = (s["vs_floor_spread"] + [0.0, 0.0])[:2]
                floor = modes[s["floor_mode"]]
                out.append(("mesh_mtls", f"mTLS hop, {MTLS_MODE_LABELS.get(mode, mode)}, vs the "
                            f"plain Envoy's hop ({MTLS_MODE_LABELS[s['floor_mode']]}), {label}",
                            f"{s['mesh_rps_median']:.0f}", f"floor {floor['mesh_rps_median']:.0f}",
                            f"{s['vs_floor_median']:.2f}× (spread {lo:.2f}–{hi:.2f})", "-"))
    for shape, per in (("keepalive", "keep-alive request"), ("newconn", "new connection")):
        for mode, s in sorted(d["shapes"].get(shape, {}).get("modes", {}).items(),
                              key=lambda kv: kv[0].startswith("floor-")):
            if not s.get("node_envoy_cpu_us_per_request_median"):
                continue
            whose = "the plain Envoy's" if mode.startswith("floor-") else "node Envoy"
            out.append(("mesh_mtls", f"{whose} CPU per {per}, both ends of the "
                        f"hop, {MTLS_MODE_LABELS.get(mode, mode)}",
                        f"{s['node_envoy_cpu_us_per_request_median']:.0f} µs",
                        f"{d.get('node_envoy_workers', '?')} worker(s), "
                        f"{s['node_envoy_cpu_share_median']:.2f} CPUs busy", "-", "-"))
    return out


def rows_h2_balance(d: dict[str, Any]) -> list[Row]:
    lo, hi = (d["spread"] + [0.0, 0.0])[:2]
    verdict = ("PASS" if d["target_met"] else "MISS") + f" (≥ {d['target']:g}×)"
    return [
        ("h2_balance", f"h2c per-request balancing, {d['connections']} conn × {d['streams']} "
                       "streams, req/s", f"{d['per_request_rps_median']:.0f}",
         f"L4 {d['l4_rps_median']:.0f}", f"{d['ratio_median']:.2f}× (spread {lo:.2f}–{hi:.2f})",
         verdict),
        ("h2_balance", "smaller backend's share of requests (2 backends)",
         f"{d['per_request_min_backend_share_median']:.2f}",
         f"L4 {d['l4_min_backend_share_median']:.2f}", "-", "-"),
        *([("h2_balance", "the floor: a plain Envoy (no mesh config), its HTTP/2 router, req/s",
            f"{d['plain_h2_rps_median']:.0f}", f"its tcp_proxy {d['plain_l4_rps_median']:.0f}",
            f"{d['plain_ratio_median']:.2f}× (spread {d['plain_spread'][0]:.2f}–"
            f"{d['plain_spread'][1]:.2f})", "-"),
           ("h2_balance", "aether per-request balancing vs the plain Envoy's HTTP/2 router, req/s",
            f"{d['per_request_rps_median']:.0f}", f"plain {d['plain_h2_rps_median']:.0f}",
            f"{d['vs_plain_ratio_median']:.2f}× (spread {d['vs_plain_spread'][0]:.2f}–"
            f"{d['vs_plain_spread'][1]:.2f})", "-")] if d.get("vs_plain_spread") else []),
    ]


def rows_traffic_metrics(d: dict[str, Any]) -> list[Row]:
    labels = {"http_keepalive": "HTTP Service, keep-alive (-c32), req/s",
              "tcp_newconn": "L4 Service, new connection per request, req/s"}
    out: list[Row] = []
    for shape, label in labels.items():
        s = d[shape]
        lo, hi = (s["spread"] + [0.0, 0.0])[:2]
        ok = s["ratio_median"] >= d["target"] and s["errors"] == 0
        out.append(("traffic_metrics", f"traffic metrics on: {label}", f"{s['on_rps_median']:.0f}",
                    f"off {s['off_rps_median']:.0f}",
                    f"{s['ratio_median']:.3f}× (spread {lo:.3f}–{hi:.3f})",
                    ("PASS" if ok else "MISS") + f" (≥ {d['target']:g}×)"))
    out.append(("traffic_metrics", "HTTP requests counted by the metrics / sent by wrk (on)",
                f"{d['http_requests_counted']:.0f}", f"sent {d['http_requests_sent']}", "-", "-"))
    return out


SIDECAR_LABELS = {"keepalive": "L4 keep-alive -c32", "latency": "one request in flight -c1",
                  "newconn": "new connection per request", "routed": "HTTP through the route -c32",
                  "grpc": "gRPC unary through a GRPCRoute, 4 conn × 8 streams"}


def rows_sidecar_path(d: dict[str, Any]) -> list[Row]:
    """Node-shared against the same Envoy as a sidecar in the client pod: the peer's shape."""
    out: list[Row] = []
    for shape, label in SIDECAR_LABELS.items():
        s = d["shapes"].get(shape)
        if not s or "node_over_sidecar" not in s:
            continue
        m = s["modes"]
        ns, sd = s["node_over_sidecar"], s["sidecar_over_direct"]
        if shape == "latency":
            add = s["p50_added_ms_median"]
            out.append(("sidecar_path", f"node-shared vs sidecar: {label}, p50 added",
                        f"{add['node'] * 1000:+.0f} µs", f"sidecar {add['sidecar'] * 1000:+.0f} µs",
                        "-", "-"))
            continue
        out.append(("sidecar_path", f"node-shared vs sidecar: {label}, req/s",
                    f"{m['node']['rps_median']:.0f}",
                    f"sidecar {m['sidecar']['rps_median']:.0f} ({sd['median']:.2f}× direct "
                    f"{m['direct']['rps_median']:.0f})",
                    f"{ns['median']:.2f}× (spread {ns['spread'][0]:.2f}–{ns['spread'][1]:.2f})",
                    "-"))
    mem = d["memory"]
    out.append(("sidecar_path", "Envoy memory per pod: node-shared (growth) vs a sidecar",
                f"{mem['node_kb_per_pod']:.0f} KB", f"sidecar {mem['sidecar_rss_mb']:.0f} MB",
                f"{mem['node_kb_per_pod'] / (mem['sidecar_rss_mb'] * 1e3):.4f}×", "-"))
    return out


def _spread(m: dict[str, Any], unit: str = " s") -> str:
    return f"{m['median']:.1f}{unit} (spread {m['spread'][0]:.1f}–{m['spread'][1]:.1f})"


def rows_authz_cost(d: dict[str, Any]) -> list[Row]:
    out: list[Row] = []
    for shape, s in d["shapes"].items():
        lo, hi = (s["spread"] + [0.0, 0.0])[:2]
        verdict = ("PASS" if s["target_met"] else "MISS") + f" (≤ {d['target']:g}×)"
        out.append(("authz_cost", f"mTLS hop, {MTLS_MODE_LABELS.get(shape, shape)}, keep-alive "
                    f"-c32: node Envoy CPU per request with {d['policies']} AuthorizationPolicies "
                    f"selecting the server (median of {d['rounds']} rounds)",
                    f"{s['cpu_us_with']:.0f} µs", f"no policy {s['cpu_us_without']:.0f} µs",
                    f"{s['cpu_ratio_median']:.2f}× (spread {lo:.2f}–{hi:.2f})", verdict))
    return out


def rows_authz_instructions(d: dict[str, Any]) -> list[Row]:
    out: list[Row] = []
    for shape, s in d["shapes"].items():
        lo, hi = (s["spread"] + [0.0, 0.0])[:2]
        verdict = ("PASS" if s["target_met"] else "MISS") + f" (≤ {d['target']:g}×)"
        out.append(("authz_instructions", f"mTLS hop, {MTLS_MODE_LABELS.get(shape, shape)}, "
                    f"keep-alive: node Envoy instructions per request (callgrind) with "
                    f"{d['policies']} AuthorizationPolicies selecting the server (median of "
                    f"{d['rounds']} rounds)", f"{s['instructions_with'] / 1e3:.0f}k",
                    f"no policy {s['instructions_without'] / 1e3:.0f}k",
                    f"{s['instructions_ratio_median']:.3f}× (spread {lo:.3f}–{hi:.3f})",
                    verdict))
    return out


def rows_dns(d: dict[str, Any]) -> list[Row]:
    n, q = d["rounds"], d["queries_per_kind"]
    direct = d["direct"]["median_us"]["median"]
    out: list[Row] = []
    for kind, what, ratio in (("forwarded", "a forwarded name (the pod DNS relays it from the "
                               "pod's netns)", "forwarded_over_direct"),
                              ("mesh", "a mesh name (answered by the pod DNS)",
                               "mesh_over_direct")):
        k, r = d[kind], d[ratio]
        out.append(("dns", f"UDP query latency, {what}; median of {n} rounds of {q}",
                    f"{k['median_us']['median']:.0f} µs (p99 {k['p99_us']['median']:.0f})",
                    f"cluster DNS direct {direct:.0f} µs",
                    f"{r['median']:.2f}× (spread {r['spread'][0]:.2f}–{r['spread'][1]:.2f})",
                    "-"))
        out.append(("dns", f"CPU per query, {what}", f"pod DNS {k['pod_dns_cpu_us']['median']:.0f}"
                    f" µs, agent {k['agent_cpu_us']['median']:.0f} µs", "-", "-", "-"))
    added = d["forwarded_added_us"]
    out.append(("dns", "latency the pod DNS adds to a forwarded query",
                f"{added['median']:.0f} µs", f"spread {added['spread'][0]:.0f}–"
                f"{added['spread'][1]:.0f}", "-", "-"))
    return out


def rows_takeover(d: dict[str, Any]) -> list[Row]:
    t, c = d["takeover"], d.get("crash")
    n, pods = len(d["takeovers"]), d["pods"]
    crash_n = len(d.get("crashes", []))
    out: list[Row] = []
    for what, fails, total in (("new connections", "new_connection_failures", "new_connections"),
                               ("HTTP requests", "http_failures", "http_requests")):
        base = (f"crash of the whole pod: {c[fails]} of {c[total]} failed ({crash_n} crashes)"
                if c else "-")
        out.append(("takeover", f"failed {what} over {n} take-overs under load, {pods} pods",
                    f"{t[fails]} of {t[total]}", base, "-",
                    ("PASS" if t[fails] == 0 else "MISS") + " (0)"))
    ov = t["overlap_s"]
    out.append(("takeover", f"overlap: new agent started → old one exited (--drain-seconds "
                f"{d['drain_seconds']:g}; median of {n})", _spread(ov),
                f"new agent ready {_spread(t['ready_s'])}", "-", "-"))
    cpu, env = t["agent_cpu_s"], t["envoy_cpu_s"]
    out.append(("takeover", "new agent's CPU from its start to the old one's exit",
                f"{cpu['median']:.2f} s (its Envoy {env['median']:.2f} s)",
                f"overlap {ov['median']:.1f} s wall",
                f"{cpu['median'] / ov['median']:.2f} core", "-"))
    if c:
        out.append(("takeover", f"crash of the whole pod: all {pods} listeners live "
                    f"(restart → status live; median of {crash_n})", _spread(c["live_s"]),
                    f"take-over: new agent ready {t['ready_s']['median']:.1f} s",
                    f"{c['live_s']['median'] / t['ready_s']['median']:.2f}×", "-"))
    return out


ROWS = {"cni_add": rows_cni_add, "envoy_path": rows_envoy_path, "xds_build": rows_xds_build,
        "agent_scale": rows_agent_scale, "mesh_mtls": rows_mesh_mtls,
        "h2_balance": rows_h2_balance, "traffic_metrics": rows_traffic_metrics,
        "sidecar_path": rows_sidecar_path, "takeover": rows_takeover, "dns": rows_dns,
        "authz_cost": rows_authz_cost, "authz_instructions": rows_authz_instructions}


def machine() -> str:
    from bench.common import machine_info
    info = machine_info()
    return f"{info['nproc']} vCPU ({info['cpu']}), kernel {info['kernel']}, Python {info['python']}"


def table(rows: list[Row]) -> str:
    head = ("benchmark", "figure", "value", "baseline (same run)", "ratio", "target")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(6)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
              for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small smoke sizes (CI)")
    ap.add_argument("--only", help="comma-separated benchmarks to run")
    ap.add_argument("--write", action="store_true", help="rewrite bench/README.md's results")
    ap.add_argument("--from-dir", help="rebuild the table from a previous run's JSON files")
    args = ap.parse_args(argv)
    mode = "quick" if args.quick else "full"
    names = [n for n in BENCHES if not args.only or n in args.only.split(",")]
    rows: list[Row] = []
    commands: list[str] = []
    failed: list[str] = []
    outdir = args.from_dir or tempfile.mkdtemp(prefix="aether-bench-")
    print(f"figures (JSON) in {outdir}", file=sys.stderr)
    for name in names:
        if importlib.util.find_spec(f"bench.{name}") is None:
            print(f"== {name}: not present, skipped", file=sys.stderr)
            continue
        out = os.path.join(outdir, f"{name}.json")
        cmd = [sys.executable, "-m", f"bench.{name}", *BENCHES[name][mode], "--json", out]
        shown = "python3 -m bench." + name + " " + " ".join(BENCHES[name][mode])
        commands.append(shown)
        if args.from_dir:
            rc = 0
        else:
            print(f"== {shown}", file=sys.stderr, flush=True)
            rc = subprocess.run(cmd, check=False).returncode
        if not os.path.exists(out):  # no figures at all: the benchmark itself failed
            failed.append(name)
            continue
        # a benchmark that ran but missed a target may exit non-zero (xds_build does): its
        # figures still belong in the table, where the miss shows as MISS
        with open(out) as f:
            rows += ROWS[name](json.load(f))
        if rc != 0 and not any(r[0] == name and str(r[5]).startswith("MISS") for r in rows):
            failed.append(name)  # non-zero without a miss to show for it
    text = table(rows)
    print()
    print(f"machine: {machine()}")
    print(text)
    if args.write:
        write_readme(text, commands, mode)
    if failed:
        print(f"benchmarks that failed to run: {', '.join(failed)}", file=sys.stderr)
        return 1
    missed = [f"{r[0]}: {r[1]}" for r in rows if str(r[5]).startswith("MISS")]
    if missed and mode == "full":  # targets hold at full sizes only (--quick is a smoke run)
        print("targets missed:\n  " + "\n  ".join(missed), file=sys.stderr)
        return 2
    return 0


def write_readme(text: str, commands: list[str], mode: str) -> None:
    path = os.path.join(HERE, "README.md")
    with open(path) as f:
        doc = f.read()
    start, end = "<!-- results:start -->", "<!-- results:end -->"
    stamp = datetime.date.today().isoformat()
    block = (f"{start}\nRun on {stamp}, {machine()}, `python3 -m bench"
             f"{' --quick' if mode == 'quick' else ''} --write` ({mode} sizes), which ran:\n\n"
             + "\n".join(f"    {c}" for c in commands) + "\n\n" + text + f"\n{end}")
    if start in doc and end in doc:
        doc = doc[:doc.index(start)] + block + doc[doc.index(end) + len(end):]
    else:
        doc += "\n" + block + "\n"
    with open(path, "w") as f:
        f.write(doc)


if __name__ == "__main__":
    sys.exit(main())
