"""Benchmark: the node-shared Envoy beside the same Envoy as a per-pod sidecar, on the same
traffic — the comparison users make before choosing a node proxy over a sidecar mesh.

    python -m bench.sidecar_path [--rounds 3] [--duration 8] [--pods 20] [--quick] [--json OUT]

Three client pods on one bridge reach the same static 1 KiB Envoy server:
- **direct**: excludes the server's address from capture (no proxy at all: the floor);
- **node**: captured by the real agent (its node Envoy, the production path: the pod
  listener in the pod's netns, the internal `mesh` listener, upstream sockets opened in
  the pod's netns);
- **sidecar**: never ADDed to aether; its own Envoy (the same binary, one worker like the
  node Envoy's default here) runs *inside* the pod's netns with a redirect-all nft table, the
  shape of an Istio sidecar: an `original_dst` listener on 127.0.0.1:15001, the routed
  Service's ClusterIP:port → HTTP connection manager → route → the Service's endpoint, every
  other destination → ORIGINAL_DST passthrough; its upstreams carry SO_MARK 0xAE, which the
  table returns. Its config holds only this one Service, so its memory is a sidecar's floor
  (a real sidecar holds the mesh's Services too).

Shapes: L4 keep-alive (`wrk -c32` to the server's address), one request in flight (`-c1`),
a new connection per request, HTTP through the GAMMA route (`-c32` to the Service
ClusterIP; direct dials the server), and gRPC unary through a GRPCRoute (`h2load`, 4
connections × 8 streams, to a Service with appProtocol `grpc` whose endpoint is an h2c server
answering as a unary method does; direct dials that server). The three modes rotate their
order every round; ratios are taken within a round against direct, the median over rounds
is the figure. Memory: the node Envoy's RSS growth per captured pod (``--pods`` extra pods
ADDed, after the traffic) against the sidecar's whole RSS, which every pod would pay.

No target: this benchmark is the comparison the issue asks to show, not a gate. Root only.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.netns.pin import release_mounts_under
from bench.common import Pod, dumps, machine_info, progress
from bench.envoy_common import (
    ServerEnvoy,
    WrkResult,
    envoy_version,
    grpc_message,
    run_wrk,
)
from bench.envoy_path import (
    BODY_BYTES,
    EXCLUDE_ANNOTATION,
    ROUTED,
    ROUTED_IP,
    ROUTED_PORT,
    Phase,
    _client_sysctls,
    _proc_cpu,
    _reap_leftovers,
    _rss,
    _shielded,
    _sigterm,
    routed_manifest,
)

MODES = ("direct", "node", "sidecar")
SHAPES = ("keepalive", "latency", "newconn", "routed", "grpc")
# the gRPC shape: a Service (appProtocol grpc) with a GRPCRoute on its method, its endpoint
# an h2c server answering like a unary method; h2load keeps GRPC_CONNS × GRPC_STREAMS in flight
GRPC = "routed-grpc"
GRPC_IP, GRPC_PORT = "10.96.250.11", 50051
GRPC_PATH = "/bench.Echo/Unary"
GRPC_CONNS, GRPC_STREAMS = 4, 8
SIDECAR_PORT = 15001
SIDECAR_MARK = 0xAE
WRK_THREADS, WRK_CONNECTIONS = 2, 32
_ROUTER = {"name": "envoy.filters.http.router",
           "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router"
                                     ".v3.Router", "suppress_envoy_headers": True}}
_MARK_OPT = {"description": "SO_MARK", "level": "1", "name": "36", "int_value": str(SIDECAR_MARK)}


def sidecar_nft() -> str:
    """The sidecar's capture: every outbound TCP connection to the listener, except the
    sidecar's own (marked) upstreams and loopback (pure)."""
    return (f"table ip aether_sidecar {{\n chain output {{\n  type nat hook output priority -100;"
            f" policy accept;\n  meta mark {SIDECAR_MARK:#x} return\n  ip daddr 127.0.0.0/8 return\n"
            f"  meta l4proto tcp redirect to :{SIDECAR_PORT}\n }}\n}}\n")


def _hcm(name: str, cluster: str) -> dict[str, Any]:
    return {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager"
                 ".v3.HttpConnectionManager",
        "stat_prefix": f"sidecar_{name}", "generate_request_id": False,
        "route_config": {"name": name, "virtual_hosts": [{
            "name": name, "domains": ["*"],
            "routes": [{"match": {"prefix": "/"}, "route": {"cluster": cluster, "timeout": "0s"}}]}]},
        "http_filters": [_ROUTER],
    }


def sidecar_bootstrap(admin: str, server_ip: str, server_port: int,
                      grpc_port: int | None = None) -> dict[str, Any]:
    """A lean sidecar Envoy: the routed Service (and the gRPC one) on their own HTTP chains,
    everything else passthrough (pure)."""
    bind = {"source_address": {"address": "0.0.0.0", "port_value": 0},
            "socket_options": [_MARK_OPT]}

    def chain(name: str, ip: str, port: int) -> dict[str, Any]:
        return {"name": name,
                "filter_chain_match": {"prefix_ranges": [{"address_prefix": ip, "prefix_len": 32}],
                                       "destination_port": port},
                "filters": [{"name": "envoy.filters.network.http_connection_manager",
                             "typed_config": _hcm(name, name)}]}

    def static(name: str, port: int) -> dict[str, Any]:
        return {"name": name, "type": "STATIC", "connect_timeout": "5s",
                "upstream_bind_config": bind,
                "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{
                    "endpoint": {"address": {"socket_address": {
                        "address": server_ip, "port_value": port}}}}]}]}}

    chains = [chain(ROUTED, ROUTED_IP, ROUTED_PORT)]
    clusters = [static(ROUTED, server_port)]
    if grpc_port is not None:
        chains.append(chain(GRPC, GRPC_IP, GRPC_PORT))
        h2 = static(GRPC, grpc_port)
        h2["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3"
                         ".HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}}
        clusters.append(h2)
    return {
        "admin": {"address": {"pipe": {"path": admin, "mode": 0o600}}},
        "static_resources": {
            "listeners": [{
                "name": "sidecar",
                "address": {"socket_address": {"address": "127.0.0.1",
                                               "port_value": SIDECAR_PORT}},
                "listener_filters": [{
                    "name": "envoy.filters.listener.original_dst",
                    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters"
                                              ".listener.original_dst.v3.OriginalDst"}}],
                "filter_chains": chains,
                "default_filter_chain": {
                    "name": "passthrough",
                    "filters": [{"name": "envoy.filters.network.tcp_proxy", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network"
                                 ".tcp_proxy.v3.TcpProxy",
                        "stat_prefix": "passthrough", "cluster": "passthrough"}}]},
            }],
            "clusters": [
                {"name": "passthrough", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                 "connect_timeout": "5s", "upstream_bind_config": bind},
                *clusters,
            ],
        },
    }


class Sidecar:
    """An Envoy started inside one pod's netns (the benchmark's Envoy runner, with the
    sidecar's bootstrap), and the nft table that sends it the pod's outbound TCP."""

    def __init__(self, workdir: str, pod: Pod, server_ip: str, server_port: int,
                 grpc_port: int) -> None:
        self.pod = pod
        self.envoy = ServerEnvoy(workdir, netns_name=pod.netns_name, name="sidecar",
                                 bootstrap=lambda admin: sidecar_bootstrap(
                                     admin, server_ip, server_port, grpc_port))

    def start(self) -> None:
        self.envoy.start()
        # rules last: until the listener is up, the pod's traffic goes direct
        subprocess.run(["ip", "netns", "exec", self.pod.netns_name, "nft", "-f", "-"],
                       input=sidecar_nft(), text=True, check=True, timeout=30)

    def pid(self) -> int | None:
        """The Envoy process (`ip netns exec` execs it, so the Popen pid is Envoy's)."""
        proc = self.envoy.proc
        return proc.pid if proc and proc.poll() is None else None

    def stat(self, name: str) -> int:
        return self.envoy.stat(name)

    def stop(self) -> None:
        self.envoy.stop()


@dataclass
class Run:
    shape: str
    mode: str
    wrk: WrkResult
    proxy_cpu_us: float  # the proxy's CPU per request (node Envoy or sidecar); 0 direct
    proxied: int  # connections (L4) or requests (routed) the proxy counted


def _url(shape: str, mode: str, gw: str, port: int, grpc_port: int = 0) -> str:
    if shape == "grpc":
        return (f"http://{GRPC_IP}:{GRPC_PORT}" if mode != "direct"
                else f"http://{gw}:{grpc_port}") + GRPC_PATH
    if shape == "routed" and mode != "direct":
        return f"http://{ROUTED_IP}:{ROUTED_PORT}/"
    return f"http://{gw}:{port}/"


def grpc_manifest(server_ip: str, server_port: int) -> list[dict[str, Any]]:
    """Service ``routed-grpc`` (appProtocol grpc) with a GRPCRoute matching the benchmark's
    method, its one endpoint the gRPC server on the host's bridge address."""
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": GRPC, "namespace": "bench"},
         "spec": {"clusterIP": GRPC_IP, "clusterIPs": [GRPC_IP], "selector": {"app": GRPC},
                  "ports": [{"name": "grpc", "port": GRPC_PORT, "targetPort": server_port,
                             "appProtocol": "grpc"}]}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GRPCRoute",
         "metadata": {"name": GRPC, "namespace": "bench",
                      "creationTimestamp": "2026-01-01T00:00:00Z"},
         "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": GRPC,
                                  "port": GRPC_PORT}],
                  "rules": [{"matches": [{"method": {"service": "bench.Echo",
                                                     "method": "Unary"}}],
                             "backendRefs": [{"name": GRPC, "port": GRPC_PORT}]}]}},
        {"apiVersion": "v1", "kind": "Pod",
         "metadata": {"name": "grpc-server", "namespace": "bench", "uid": "u-grpc-server",
                      "labels": {"app": GRPC}},
         "spec": {"nodeName": "server-node", "serviceAccountName": "default"},
         "status": {"phase": "Running", "podIP": server_ip, "podIPs": [{"ip": server_ip}],
                    "conditions": [{"type": "Ready", "status": "True"}]}},
    ]


def _pct(sorted_us: list[int], q: float) -> float:
    return sorted_us[min(len(sorted_us) - 1, int(q * len(sorted_us)))] / 1000.0 \
        if sorted_us else float("nan")


def parse_h2load(out: str, log_lines: list[str]) -> WrkResult:
    """h2load's summary plus its per-request log (start µs, status, µs to the end of the
    response) → the same figures wrk gives (pure)."""
    rps = re.search(r"finished in [\d.]+\w*, ([\d.]+) req/s", out)
    done = re.search(r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded, "
                     r"(\d+) failed, (\d+) errored", out)
    if rps is None or done is None:
        raise ValueError(f"unexpected h2load output:\n{out[-1500:]}")
    times = sorted(int(f[2]) for f in (ln.split("\t") for ln in log_lines) if len(f) >= 3)
    non_2xx = sum(1 for ln in log_lines if ln.split("\t")[1:2] not in (["200"], []))
    return WrkResult(int(done.group(1)), float(rps.group(1)), _pct(times, 0.5),
                     _pct(times, 0.75), _pct(times, 0.9), _pct(times, 0.99),
                     int(done.group(3)) + int(done.group(4)), non_2xx, out)


def run_grpc(workdir: str, netns: str, url: str, duration: float) -> WrkResult:
    """Unary gRPC calls with h2load (h2c prior knowledge): GRPC_CONNS connections ×
    GRPC_STREAMS concurrent streams, each a POST of one length-prefixed message."""
    body = os.path.join(workdir, "grpc-request.bin")
    with open(body, "w", encoding="latin-1") as f:
        f.write(grpc_message(64))
    log = os.path.join(workdir, "h2load.log")
    argv = ["ip", "netns", "exec", netns, "h2load", "-c", str(GRPC_CONNS), "-t", "1",
            "-m", str(GRPC_STREAMS), "-D", f"{max(1, round(duration))}", "-d", body,
            "-H", "content-type: application/grpc", "-H", "te: trailers",
            f"--log-file={log}", url]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 60, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"h2load failed ({r.returncode}): {(r.stdout + r.stderr)[-1500:]}")
    with open(log) as f:
        lines = f.read().splitlines()
    return parse_h2load(r.stdout + r.stderr, lines)


def order(rounds: int) -> list[list[str]]:
    """Each round's mode order: rotated, and reversed every other round, so no mode always
    runs first or after the same neighbour (pure)."""
    out = []
    for r in range(rounds):
        k = r % len(MODES)
        rot = list(MODES[k:] + MODES[:k])
        out.append(rot if r % 2 == 0 else rot[::-1])
    return out


def summarize(runs: list[Run]) -> dict[str, Any]:
    """Per shape: each mode's median req/s, p50 and p99, proxy CPU per request, and the
    node/direct, sidecar/direct and node/sidecar ratios per round with median and spread
    (pure; runs come in rounds of the three modes, in run order)."""
    out: dict[str, Any] = {}
    for shape in SHAPES:
        rs = [r for r in runs if r.shape == shape]
        rounds = [rs[i:i + len(MODES)] for i in range(0, len(rs), len(MODES))]
        per = [{r.mode: r for r in rd} for rd in rounds]
        s: dict[str, Any] = {"modes": {}}
        for mode in MODES:
            mine = [p[mode] for p in per if mode in p]
            if not mine:
                continue
            s["modes"][mode] = {
                "rps_median": round(statistics.median(r.wrk.rps for r in mine), 1),
                "p50_ms_median": round(statistics.median(r.wrk.p50_ms for r in mine), 4),
                "p99_ms_median": round(statistics.median(r.wrk.p99_ms for r in mine), 4),
                "proxy_cpu_us_per_request_median": round(
                    statistics.median(r.proxy_cpu_us for r in mine), 1),
                "errors": sum(r.wrk.socket_errors + r.wrk.non_2xx for r in mine),
                "runs": [r.wrk.to_json() for r in mine],
            }
        for a, b in (("node", "direct"), ("sidecar", "direct"), ("node", "sidecar")):
            xs = sorted(p[a].wrk.rps / p[b].wrk.rps for p in per
                        if a in p and b in p and p[b].wrk.rps > 0)
            if xs:
                s[f"{a}_over_{b}"] = {"median": round(statistics.median(xs), 3),
                                      "spread": [round(xs[0], 3), round(xs[-1], 3)]}
        lat = [(p["node"].wrk.p50_ms - p["direct"].wrk.p50_ms,
                p["sidecar"].wrk.p50_ms - p["direct"].wrk.p50_ms)
               for p in per if all(m in p for m in MODES)]
        if lat:
            s["p50_added_ms_median"] = {
                "node": round(statistics.median(x for x, _ in lat), 4),
                "sidecar": round(statistics.median(y for _, y in lat), 4)}
        out[shape] = s
    return out


def _until_answered(what: str, deadline: float, attempt: Callable[[], WrkResult]) -> None:
    """Retry ``attempt`` (a 1 s load run) until it completes requests without errors."""
    while True:
        try:
            w = attempt()
            if w.requests and not w.non_2xx and not w.socket_errors:
                return
        except (RuntimeError, ValueError):  # nothing answered: no figures to parse
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} never answered through the node Envoy")
        time.sleep(0.5)


def measure(shape: str, mode: str, pod: Pod, url: str, duration: float, proxy_pid: int | None,
            proxied: Any, workdir: str) -> Run:
    threads, conns = (1, 1) if shape == "latency" else (WRK_THREADS, WRK_CONNECTIONS)
    c0, n0 = _proc_cpu(proxy_pid), proxied()
    if shape == "grpc":
        w = run_grpc(workdir, pod.netns_name, url, duration)
    else:
        w = run_wrk(pod.netns_name, url, duration, threads, conns,
                    new_connection=shape == "newconn")
    c1, n1 = _proc_cpu(proxy_pid), proxied()
    if w.socket_errors or w.non_2xx:
        progress(f"  warning: {shape} {mode}: {w.socket_errors} socket errors, "
                 f"{w.non_2xx} non-2xx")
    return Run(shape, mode, w, 1e6 * (c1 - c0) / max(1, w.requests) if proxy_pid else 0.0,
               n1 - n0)


def print_report(summary: dict[str, Any], mem: dict[str, float]) -> None:
    labels = {"keepalive": "L4 keep-alive -c32", "latency": "one request in flight -c1",
              "newconn": "new connection per request -c32",
              "routed": "HTTP through the route, keep-alive -c32",
              "grpc": f"gRPC unary via GRPCRoute, {GRPC_CONNS}×{GRPC_STREAMS} streams"}
    head = (f"{'shape':<40} | {'mode':<8} | {'req/s':>8} | {'p50 ms':>7} {'p99 ms':>7} | "
            f"{'proxy µs/req':>12} | {'errors':>6}")
    print()
    print(head)
    print("-" * len(head))
    for shape, s in summary.items():
        for mode, m in s["modes"].items():
            print(f"{labels[shape]:<40} | {mode:<8} | {m['rps_median']:>8.0f} | "
                  f"{m['p50_ms_median']:>7.3f} {m['p99_ms_median']:>7.3f} | "
                  f"{m['proxy_cpu_us_per_request_median']:>12.1f} | {m['errors']:>6}")
        parts = []
        for key in ("node_over_direct", "sidecar_over_direct", "node_over_sidecar"):
            if key in s:
                lo, hi = s[key]["spread"]
                parts.append(f"{key.replace('_over_', '/')} {s[key]['median']:.2f}× "
                             f"({lo:.2f}–{hi:.2f})")
        print(f"{'':<40}   req/s ratios, median (spread): " + ", ".join(parts))
    print()
    print(f"memory: node Envoy {mem['node_rss0_mb']:.1f} → {mem['node_rss_mb']:.1f} MB over "
          f"{mem['pods']:.0f} more captured pods = {mem['node_kb_per_pod']:.0f} KB per pod; "
          f"a sidecar Envoy {mem['sidecar_rss_mb']:.1f} MB per pod (its config: one Service)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sidecar_path", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=8.0, help="seconds per wrk run")
    ap.add_argument("--pods", type=int, default=20, help="extra pods for the node's memory")
    ap.add_argument("--quick", action="store_true", help="CI smoke: 1 round × 2 s, 4 pods")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.duration, args.pods = 1, 2.0, 4
    if args.rounds < 1 or args.duration < 1 or args.pods < 1:
        ap.error("--rounds, --duration and --pods must be ≥ 1")
    if os.geteuid() != 0:
        ap.error("needs root (netns, bridge, nftables)")
    for tool, pkg in (("wrk", "wrk"), ("h2load", "nghttp2-client")):
        if not shutil.which(tool):
            ap.error(f"{tool} not found (apt-get install {pkg})")
    signal.signal(signal.SIGTERM, _sigterm)
    t0 = time.monotonic()
    root = tempfile.mkdtemp(prefix="aether-bench-sidecar-")
    node = Phase(root, "node", envoy=True, net=217, pods=args.pods, levels=[1])
    cap = node.extra_pod("wrk-node", {"aether.io/dependencies": f"{ROUTED},{GRPC}"})
    direct = node.extra_pod("wrk-direct", {EXCLUDE_ANNOTATION: f"{node.gw4}/32"})
    side_pod = node.kubelet.new_pod("bench", "wrk-sidecar")  # never ADDed to aether
    server = ServerEnvoy(root, BODY_BYTES)
    grpc_server = ServerEnvoy(root, BODY_BYTES, codec="AUTO", name="grpc-server", grpc=True)
    sidecar = Sidecar(root, side_pod, node.gw4, server.port, grpc_server.port)
    node.agent.write("bench-routed.yaml", routed_manifest(node.gw4, server.port)
                     + grpc_manifest(node.gw4, grpc_server.port))
    ok = False
    try:
        node.start()
        server.start()
        grpc_server.start()
        node.add_untimed(cap)
        node.add_untimed(direct)
        node.prepare([side_pod])
        sidecar.start()
        pods = {"direct": direct, "node": cap, "sidecar": side_pod}
        for pod in pods.values():
            _client_sysctls(pod)
        progress("[data] warm-up and route check …")
        deadline = time.monotonic() + 30
        # both Services reach the node Envoy through the manifest watcher, then a push
        _until_answered("the routed Service", deadline, lambda: run_wrk(
            cap.netns_name, _url("routed", "node", node.gw4, server.port), 1, 1, 1))
        _until_answered("the gRPC Service (its GRPCRoute)", deadline, lambda: run_grpc(
            root, cap.netns_name, _url("grpc", "node", node.gw4, 0), 1))
        for mode, pod in pods.items():
            run_wrk(pod.netns_name, _url("routed", mode, node.gw4, server.port), 1,
                    WRK_THREADS, WRK_CONNECTIONS)
        node_pid = node.envoy_pid()
        counters = {
            ("node", False): lambda: node.stat("cluster.passthrough.upstream_cx_total"),
            ("node", True): lambda: node.stat(f"cluster.svc|bench|{ROUTED}|{ROUTED_PORT}"
                                              ".upstream_rq_total"),
            ("sidecar", False): lambda: sidecar.stat("cluster.passthrough.upstream_cx_total"),
            ("sidecar", True): lambda: sidecar.stat(f"cluster.{ROUTED}.upstream_rq_total"),
            ("node", "grpc"): lambda: node.stat(f"cluster.svc|bench|{GRPC}|{GRPC_PORT}"
                                                ".upstream_rq_total"),
            ("sidecar", "grpc"): lambda: sidecar.stat(f"cluster.{GRPC}.upstream_rq_total"),
        }
        runs: list[Run] = []
        plan = order(args.rounds)
        for shape in SHAPES:
            for r, modes in enumerate(plan, 1):
                for mode in modes:
                    progress(f"[data] {shape} {mode} (round {r}/{args.rounds}, "
                             f"{args.duration:g} s) …")
                    pid = {"node": node_pid, "sidecar": sidecar.pid()}.get(mode)
                    key: tuple[str, Any] = (mode, "grpc" if shape == "grpc"
                                            else shape == "routed")
                    count = counters.get(key, lambda: 0)
                    runs.append(measure(shape, mode, pods[mode],
                                        _url(shape, mode, node.gw4, server.port,
                                             grpc_server.port),
                                        args.duration, pid, count, root))
        # every proxied run went through its proxy, every direct one around both
        bad = [(r.shape, r.mode, r.proxied, r.wrk.requests) for r in runs
               if (r.mode != "direct") != (r.proxied > 0)
               or (r.shape in ("routed", "grpc") and r.mode != "direct"
                   and r.proxied < r.wrk.requests)]
        if bad:
            raise RuntimeError(f"capture check failed (shape, mode, proxied, requests): {bad}")
        if node.envoy_pid() != node_pid:
            raise RuntimeError("the node Envoy restarted during the runs")
        mem = {"pods": float(args.pods), "node_rss0_mb": _rss(node_pid) / 1e6,
               "sidecar_rss_mb": _rss(sidecar.pid()) / 1e6}
        node.time_add(node.levels[0], None)
        mem["node_rss_mb"] = _rss(node.envoy_pid()) / 1e6
        mem["node_kb_per_pod"] = (mem["node_rss_mb"] - mem["node_rss0_mb"]) * 1e3 / args.pods
        summary = summarize(runs)
        machine = {**machine_info(), "envoy": envoy_version()}
        print("\nmachine: " + ", ".join(f"{k}={v}" for k, v in machine.items()))
        print(f"wrk -t{WRK_THREADS} from each client pod to a static Envoy ({BODY_BYTES} B body); "
              f"{args.rounds} round(s) × {args.duration:g} s, mode order rotated per round; "
              "proxy µs/req = the node Envoy's or the sidecar's CPU per request")
        print_report(summary, mem)
        result = {"benchmark": "sidecar_path", "machine": machine, "rounds": args.rounds,
                  "duration_s": args.duration, "shapes": summary,
                  "memory": {k: round(v, 2) for k, v in mem.items()},
                  "elapsed_s": round(time.monotonic() - t0, 1)}
        if args.json:
            with open(args.json, "w") as f:
                f.write(dumps(result) + "\n")
        ok = True
    except KeyboardInterrupt:
        progress("interrupted; cleaning up")
        return 130
    finally:
        with _shielded():
            sidecar.stop()
            try:
                node.cleanup()
            except Exception as e:  # noqa: BLE001 - keep tearing down the rest
                progress(f"[node] cleanup error: {e}")
            server.stop()
            grpc_server.stop()
            _reap_leftovers(root)
        if ok:
            release_mounts_under(root)
            shutil.rmtree(root, ignore_errors=True)
        else:
            progress(f"workdir kept: {root}")
    return 0



if __name__ == "__main__":
    sys.exit(main())
