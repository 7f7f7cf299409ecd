"""Benchmark: the node Envoy on the CNI and data paths.

    python -m bench.envoy_path [--pods 100] [--concurrency 1,16] [--duration 10] [--rounds 3]
                               [--quick] [--json OUT]

1. ADD → listener live. The agent runs WITH Envoy (`--listener-timeout 15`), so the
   `aether-cni` ADD returns only once Envoy has ACKed a config holding the pod's capture
   listener. Sandboxes (netns, lo, bridge + host-local) are made untimed; the exec of the
   ADD is timed (fork → exit, as kubelet sees it) and, the moment it returns, the same worker
   connects from the pod netns to a host server through the capture: a refused or timed-out
   connection is a liveness failure (target: 0). The same number of fresh pods is ADDed
   against a `--no-envoy` agent in the same run; the ratio is the cost of waiting for the ACK.
2. Data path. A second, separate Envoy on the host serves a static 1 KiB `direct_response`.
   `wrk -t2 -c32 --latency` runs inside a captured pod netns (→ capture listener → Envoy
   passthrough → server) and inside a pod that excludes the server address with
   `capture.aether.io/exclude-outbound-ip-ranges` (same bridge, no Envoy). Rounds alternate
   direct/captured (ABBA), each ratio taken within its pair; the median over pairs is the
   figure. Three shapes: keep-alive at saturation (`-c32`; target ≥ 0.65× direct requests/s),
   one request in flight (`-t1 -c1`: the latency the proxy adds, unsaturated; target p50 ≤
   direct + 0.3 ms) and a new connection per request (target ≥ 0.5× direct). The saturated
   p50 is printed too, without a target: at saturation p50 ≈ connections / throughput, so
   it restates the throughput ratio rather than measuring the hop. Both wrk pods run with
   `net.ipv4.tcp_tw_reuse=1` (see `_client_sysctls`).

Root only; needs `wrk` and Envoy ≥ the agent's minimum. Everything made is torn down on exit,
error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import psutil

from agent.envoy.supervisor import admin_request
from agent.netns.pin import release_mounts_under
from agent.testing.netutil import Recorder, dial, host_server
from bench.common import (
    AgentProc,
    Kubelet,
    Pod,
    Stats,
    delete_pods,
    dumps,
    machine_info,
    plugin_env,
    pool_map,
    prepare_pod,
    progress,
    run_dir_on_tmpfs,
    timed_run,
)
from bench.envoy_common import (
    ServerEnvoy,
    WrkResult,
    counter,
    envoy_version,
    run_wrk,
    stats_path,
)

NAMESPACE = "bench"
EXCLUDE_ANNOTATION = "capture.aether.io/exclude-outbound-ip-ranges"
TARGET_RPS_RATIO = 0.65  # issue #15: "L4 keep-alive ≥ 0.65× direct req/s"
TARGET_P50_DELTA_MS = 0.3
TARGET_NEWCONN_RATIO = 0.5
TARGET_ENVOY_KB_PER_POD = 100  # a sidecar costs tens of MB per pod
PROBE_TIMEOUT_S = 2.0
WRK_THREADS, WRK_CONNECTIONS = 2, 32
SHAPES = ("keepalive", "latency", "newconn", "routed")
BODY_BYTES = 1024
# the routed shape: a Service with a GAMMA HTTPRoute whose endpoint is the same server
ROUTED = "routed"
ROUTED_IP, ROUTED_PORT = "10.96.250.10", 80
ROUTED_CLUSTER = f"svc|{NAMESPACE}|{ROUTED}|{ROUTED_PORT}"
TARGET_ROUTED_RATIO = 0.5


def routed_manifest(server_ip: str, server_port: int) -> list[dict[str, Any]]:
    """Service ``routed`` (appProtocol http) with an HTTPRoute attached (parentRef the
    Service, backendRef itself), its one endpoint the benchmark's server: a pod of another
    node whose address is the host's bridge address, where the server listens."""
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": ROUTED, "namespace": NAMESPACE},
         "spec": {"clusterIP": ROUTED_IP, "clusterIPs": [ROUTED_IP], "selector": {"app": ROUTED},
                  "ports": [{"name": "http", "port": ROUTED_PORT, "targetPort": server_port,
                             "appProtocol": "http"}]}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
         "metadata": {"name": ROUTED, "namespace": NAMESPACE,
                      "creationTimestamp": "2026-01-01T00:00:00Z"},
         "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": ROUTED,
                                  "port": ROUTED_PORT}],
                  "rules": [{"backendRefs": [{"name": ROUTED, "port": ROUTED_PORT}]}]}},
        {"apiVersion": "v1", "kind": "Pod",
         "metadata": {"name": "routed-server", "namespace": NAMESPACE, "uid": "u-routed-server",
                      "labels": {"app": ROUTED}},
         "spec": {"nodeName": "server-node", "serviceAccountName": "default"},
         "status": {"phase": "Running", "podIP": server_ip, "podIPs": [{"ip": server_ip}],
                    "conditions": [{"type": "Ready", "status": "True"}]}},
    ]


@dataclass
class Level:
    concurrency: int
    pods: list[Pod]
    confs: dict[str, dict[str, Any]] = field(default_factory=dict)
    add: list[float] = field(default_factory=list)
    probe: list[float] = field(default_factory=list)  # ADD return → first byte via capture
    failures: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    agent_ms: float = float("nan")  # mean agent-side ADD handling (its own histogram)
    ack_ms: float = float("nan")  # mean xDS publish → Envoy ACK (its own histogram)


class Phase:
    """One agent (with or without Envoy) on its own bridge, subnet and run dir, plus its pods."""

    def __init__(self, root: str, name: str, envoy: bool, net: int, pods: int,
                 levels: list[int]) -> None:
        self.name = name
        self.envoy = envoy
        self.workdir = os.path.join(root, name)
        os.makedirs(self.workdir)
        self.bridge = f"aet{name[0]}{uuid.uuid4().hex[:8]}"  # ≤ 15 chars (IFNAMSIZ)
        self.gw4 = f"10.{net}.0.1"
        extra = ["--log-level", "info"]
        if envoy:
            extra += ["--listener-timeout", "15"]
        self.agent = run_dir_on_tmpfs(AgentProc(self.workdir, envoy=envoy, extra=extra))
        self.agent.write("bench-namespace.yaml", [
            {"apiVersion": "v1", "kind": "Namespace",
             "metadata": {"name": NAMESPACE, "labels": {"aether.io/managed": "true"}}},
        ])
        self.kubelet = Kubelet(self.workdir, self.bridge, f"10.{net}.0.0/16",
                               f"fd00:a3e{net % 10}:{net}::/64", {
                                   "agent_socket": self.agent.socket,
                                   "capture_redirect_all_default": True,
                               })
        self.aether = os.path.join(self.kubelet.plugin_dir, "aether-cni")
        self.levels = [Level(c, [self.kubelet.new_pod(NAMESPACE, f"c{c}-{i:04d}")
                                 for i in range(pods)]) for c in levels]
        self.manifest: list[tuple[Pod, dict[str, str]]] = [
            (p, {}) for lv in self.levels for p in lv.pods]
        self.sandboxes: list[Pod] = []
        self.lock = threading.Lock()
        self.started = False
        self.cleaned = False

    def extra_pod(self, name: str, annotations: dict[str, str]) -> Pod:
        pod = self.kubelet.new_pod(NAMESPACE, name)
        self.manifest.append((pod, annotations))
        return pod

    # -- setup ---------------------------------------------------------------------------
    def start(self) -> None:
        self.agent.write("bench-pods.yaml", [
            {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": p.name, "namespace": p.namespace, "uid": p.uid,
                          "labels": {}, "annotations": ann},
             "spec": {"nodeName": "test-node", "serviceAccountName": "default"}}
            for p, ann in self.manifest
        ])
        progress(f"[{self.name}] starting agent (run dir {self.agent.run_dir}) …")
        self.started = True
        self.agent.start()
        if self.envoy:
            deadline = time.monotonic() + 30
            while self.admin_get("/ready", quiet=True).strip() != "LIVE":
                if time.monotonic() > deadline:
                    raise RuntimeError("node envoy not ready after 30s")
                time.sleep(0.1)

    def prepare(self, pods: list[Pod]) -> dict[str, dict[str, Any]]:
        confs: dict[str, dict[str, Any]] = {}

        def one(pod: Pod) -> None:
            with self.lock:
                self.sandboxes.append(pod)
            confs[pod.container_id] = prepare_pod(self.kubelet, pod)

        progress(f"[{self.name}] creating {len(pods)} sandboxes (netns, lo, bridge+host-local; "
                 "untimed) …")
        pool_map(one, pods, min(8, 4 * (os.cpu_count() or 1)), "sandbox")
        return confs

    def add_untimed(self, pod: Pod) -> None:
        conf = self.prepare([pod])[pod.container_id]
        timed_run([self.aether], json.dumps(conf), plugin_env(self.kubelet, pod, "ADD"))

    # -- timed ---------------------------------------------------------------------------
    def time_add(self, level: Level, probe: Callable[[Pod], str] | None) -> None:
        level.confs = self.prepare(level.pods)
        inputs = {p.container_id: (json.dumps(level.confs[p.container_id]),
                                   plugin_env(self.kubelet, p, "ADD")) for p in level.pods}

        def one(pod: Pod) -> None:
            stdin, env = inputs[pod.container_id]
            elapsed, _ = timed_run([self.aether], stdin, env)
            with self.lock:
                level.add.append(elapsed)
            if probe is None:
                return
            t0 = time.perf_counter()
            answer = probe(pod)
            took = time.perf_counter() - t0
            with self.lock:
                if answer == "live":
                    level.probe.append(took)
                else:
                    level.failures.append(f"{pod.name}: {answer}")

        what = "ADD + liveness probe" if probe else "ADD"
        progress(f"[{self.name} c={level.concurrency}] timing aether-cni {what} …")
        m0 = self.metrics()
        t0 = time.perf_counter()
        pool_map(one, level.pods, level.concurrency, what)
        level.wall_s = time.perf_counter() - t0
        m1 = self.metrics()
        level.agent_ms = _mean_delta_ms(m0, m1, "aether_cni_request_duration_seconds",
                                        '{command="ADD"}')
        level.ack_ms = _mean_delta_ms(m0, m1, "aether_xds_push_duration_seconds", "")

    def metrics(self) -> dict[str, float]:
        """The agent's Prometheus samples (name{labels} → value)."""
        code, text = self.agent.http("/metrics")
        out: dict[str, float] = {}
        if code != 200:
            return out
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                try:
                    out[key] = float(value)
                except ValueError:
                    continue
        return out

    # -- node Envoy ----------------------------------------------------------------------
    def admin_get(self, path: str, quiet: bool = False) -> str:
        try:
            code, body = admin_request(os.path.join(self.agent.run_dir, "envoy", "admin.sock"),
                                       "GET", path, timeout=5)
            if code != 200:
                raise OSError(f"envoy admin GET {path}: HTTP {code}")
            return body
        except OSError:
            if quiet:
                return ""
            raise

    def stat(self, name: str) -> int:
        return counter(self.admin_get(stats_path(name)), name)

    def listeners(self) -> set[str]:
        return {ln.split("::")[0] for ln in self.admin_get("/listeners").splitlines() if ln}

    def envoy_pid(self) -> int | None:
        pid = self.agent.status().get("envoy", {}).get("pid")
        return int(pid) if pid else None

    def verify(self) -> None:
        counters = self.agent.status().get("counters", {})
        expected = sum(len(lv.add) for lv in self.levels)
        if counters.get("add_ok", 0) < expected:
            raise RuntimeError(f"[{self.name}] agent counted {counters}, expected {expected} ADDs")
        if self.envoy:
            have = self.listeners()
            missing = [p.name for lv in self.levels for p in lv.pods
                       if f"capture-{p.container_id}" not in have]
            if missing:
                raise RuntimeError(f"node envoy lacks listeners for {missing[:5]} …")

    # -- teardown ------------------------------------------------------------------------
    def cleanup(self) -> None:
        """DEL every pod (netns removed even if DEL fails), stop the agent, drop the bridge.
        Run under `_shielded()`: an interrupt here would leak what is left."""
        if self.cleaned:
            return
        if self.sandboxes:
            progress(f"[{self.name}] cleaning up {len(self.sandboxes)} pods …")
            delete_pods(self.kubelet, self.sandboxes)
            self.sandboxes.clear()
        if self.started:
            self.agent.stop()
        subprocess.run(["ip", "link", "del", self.bridge], check=False, capture_output=True)
        self.cleaned = True


@contextlib.contextmanager
def _shielded() -> Iterator[None]:
    """SIGINT/SIGTERM are held while tearing down and re-raised (as KeyboardInterrupt) after."""
    caught: list[int] = []

    def hold(signum: int, _frame: FrameType | None) -> None:
        caught.append(signum)

    old = {sig: signal.signal(sig, hold) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if caught:
        raise KeyboardInterrupt


def _mean_delta_ms(m0: dict[str, float], m1: dict[str, float], name: str, labels: str
                   ) -> float:
    n = m1.get(f"{name}_count{labels}", 0.0) - m0.get(f"{name}_count{labels}", 0.0)
    total = m1.get(f"{name}_sum{labels}", 0.0) - m0.get(f"{name}_sum{labels}", 0.0)
    return 1000.0 * total / n if n > 0 else float("nan")


# -- CPU accounting (where the data-path time goes) --------------------------------------
_TICK = os.sysconf("SC_CLK_TCK")


def _rss(pid: int | None) -> float:
    """Resident bytes of a process (0 when it is gone)."""
    try:
        return float(psutil.Process(pid).memory_info().rss) if pid else 0.0
    except psutil.Error:
        return 0.0


def _proc_cpu(pid: int | None) -> float:
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def _sys_cpu() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def _background_busy(seconds: float = 1.0) -> float:
    """Share of the machine busy (%) over `seconds` before we start anything."""
    a = _sys_cpu()
    time.sleep(seconds)
    d = [y - x for x, y in zip(a, _sys_cpu(), strict=True)]
    return 100.0 * (1.0 - (d[3] + d[4]) / (sum(d) or 1))


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


@dataclass
class Run:
    mode: str  # "direct" | "captured"
    wrk: WrkResult
    wall_s: float
    cpu: dict[str, float]  # share of the machine (all CPUs = 100 %)
    passthrough_cx: int
    # "keepalive" (-c32, saturated), "latency" (-c1: one request in flight), "newconn" (a
    # new TCP connection per request) or "routed" (-c32 through a GAMMA route: captured
    # runs dial the Service, direct runs the server as before)
    shape: str = "keepalive"
    routed_rq: int = 0  # requests Envoy sent through the routed Service's cluster


def measure(phase: Phase, server: ServerEnvoy, pod: Pod, mode: str, duration: float,
            shape: str = "keepalive") -> Run:
    envoy_pid = phase.envoy_pid()
    ncpu = os.cpu_count() or 1
    cx0 = phase.stat("cluster.passthrough.upstream_cx_total")
    rq0 = phase.stat(f"cluster.{ROUTED_CLUSTER}.upstream_rq_total")
    agent_pid = phase.agent.proc.pid if phase.agent.proc else None
    node0, srv0 = _proc_cpu(envoy_pid), _proc_cpu(server.proc.pid if server.proc else None)
    agent0 = _proc_cpu(agent_pid)
    kids0, sys0, t0 = _children_cpu(), _sys_cpu(), time.perf_counter()
    threads, conns = (1, 1) if shape == "latency" else (WRK_THREADS, WRK_CONNECTIONS)
    url = f"http://{phase.gw4}:{server.port}/"
    if shape == "routed" and mode == "captured":
        url = f"http://{ROUTED_IP}:{ROUTED_PORT}/"
    result = run_wrk(pod.netns_name, url, duration, threads, conns,
                     new_connection=shape == "newconn")
    wall = time.perf_counter() - t0
    kids1, sys1 = _children_cpu(), _sys_cpu()
    node1, srv1 = _proc_cpu(envoy_pid), _proc_cpu(server.proc.pid if server.proc else None)
    agent1 = _proc_cpu(agent_pid)
    cx1 = phase.stat("cluster.passthrough.upstream_cx_total")
    rq1 = phase.stat(f"cluster.{ROUTED_CLUSTER}.upstream_rq_total")
    d = [b - a for a, b in zip(sys0, sys1, strict=True)]
    total = sum(d) or 1
    # /proc/stat: user nice system idle iowait irq softirq steal
    cpu = {
        "node_envoy": 100.0 * (node1 - node0) / (wall * ncpu),
        "server_envoy": 100.0 * (srv1 - srv0) / (wall * ncpu),
        "wrk": 100.0 * (kids1 - kids0) / (wall * ncpu),
        "agent": 100.0 * (agent1 - agent0) / (wall * ncpu),
        "softirq": 100.0 * (d[5] + d[6]) / total,
        "idle": 100.0 * (d[3] + d[4]) / total,
        "steal": 100.0 * d[7] / total,
    }
    # everything else: other processes, kernel work outside softirq and outside those processes
    cpu["other"] = max(0.0, 100.0 - cpu["idle"] - cpu["steal"] - cpu["softirq"] - cpu["node_envoy"]
                       - cpu["server_envoy"] - cpu["wrk"] - cpu["agent"])
    if result.socket_errors or result.non_2xx:
        progress(f"  warning: {mode}: {result.socket_errors} socket errors, "
                 f"{result.non_2xx} non-2xx")
    return Run(mode, result, wall, cpu, cx1 - cx0, shape, rq1 - rq0)


def _client_sysctls(pod: Pod) -> None:
    """`tcp_tw_reuse=1` in both wrk pods, as a client that opens thousands of connections a
    second to one address is tuned: without it the pod's ephemeral ports fill with TIME_WAIT
    (wrk closes first) within seconds, connect() then searches an exhausted range and the
    new-connection figure measures that search, in both modes, collapsing from round to round
    (measured here: 3.4k → 0.4k req/s direct over four 5 s rounds; 10.6k steady with it)."""
    subprocess.run(["nsenter", f"--net={pod.netns}", "sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1"],
                   check=True, timeout=30)


def data_path(phase: Phase, server: ServerEnvoy, captured: Pod, direct: Pod, duration: float,
              rounds: int) -> list[Run]:
    pods = {"direct": direct, "captured": captured}
    for pod in pods.values():
        _client_sysctls(pod)
    progress("[data] warm-up (1 s each) …")
    for mode in ("direct", "captured"):
        run_wrk(pods[mode].netns_name, f"http://{phase.gw4}:{server.port}/", 1,
                WRK_THREADS, WRK_CONNECTIONS)
    deadline = time.monotonic() + 30
    while True:  # the routed Service in Envoy (the manifest watcher, then a push)
        try:
            w: WrkResult | str = run_wrk(captured.netns_name,
                                         f"http://{ROUTED_IP}:{ROUTED_PORT}/", 1, 1, 1)
        except (RuntimeError, ValueError) as e:  # nothing answered: no latency lines
            w = str(e)
        if isinstance(w, WrkResult) and w.requests > 0 and not w.non_2xx \
                and not w.socket_errors:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the routed Service never answered: {w}")
        time.sleep(0.5)
    order: list[str] = []
    for r in range(rounds):
        order += ["direct", "captured"] if r % 2 == 0 else ["captured", "direct"]
    runs = []
    for shape in SHAPES:
        for i, mode in enumerate(order, 1):
            progress(f"[data] wrk {shape} {mode} ({i}/{len(order)}, {duration:g} s) …")
            runs.append(measure(phase, server, pods[mode], mode, duration, shape))
    def went_as_meant(r: Run) -> bool:
        if r.shape == "routed" and r.mode == "captured":  # the route, not the passthrough
            return r.passthrough_cx == 0 and r.routed_rq >= r.wrk.requests
        return (r.mode == "captured") == (r.passthrough_cx > 0) and r.routed_rq == 0

    bad = [r for r in runs if not went_as_meant(r)]
    if bad:
        seen = [(r.shape, r.mode, r.passthrough_cx, r.routed_rq, r.wrk.requests) for r in bad]
        raise RuntimeError("capture check failed: (shape, mode, passthrough connections, routed "
                           f"requests, wrk requests) per run {seen}")
    return runs


# -- report ------------------------------------------------------------------------------
def _fmt(x: float, width: int, prec: int) -> str:
    return f"{'n/a':>{width}}" if x != x else f"{x:>{width}.{prec}f}"


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _pairs(runs: list[Run]) -> list[tuple[Run, Run]]:
    """(direct, captured) of each ABBA round, in order: ratios are taken within a pair."""
    direct = [r for r in runs if r.mode == "direct"]
    cap = [r for r in runs if r.mode == "captured"]
    return list(zip(direct, cap, strict=True))


def _spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(min(xs))}–{fmt.format(max(xs))}" if xs else "n/a"


def latency_report(runs: list[Run]) -> dict[str, Any]:
    """One request in flight (`wrk -t1 -c1`): the time the capture hop adds to a request on
    an unsaturated machine; the delta of p50s within each pair, median over pairs."""
    deltas = sorted(c.wrk.p50_ms - d.wrk.p50_ms for d, c in _pairs(runs))
    med = statistics.median(deltas) if deltas else float("nan")
    ok = med <= TARGET_P50_DELTA_MS
    print()
    print("2a. one request in flight (wrk -t1 -c1, keep-alive), same pods and server, ABBA")
    for r in runs:
        w = r.wrk
        print(f"{r.mode:<10} | {w.rps:>9.0f} req/s | p50 {w.p50_ms * 1000:>6.0f} µs p99 "
              f"{w.p99_ms * 1000:>6.0f} µs | errors {w.socket_errors + w.non_2xx}")
    print(f"captured − direct p50 = {med * 1000:+.0f} µs median over {len(deltas)} pair(s) "
          f"(spread {_spread([x * 1000 for x in deltas], '{:+.0f}')} µs; target ≤ "
          f"+{TARGET_P50_DELTA_MS * 1000:.0f} µs): {'PASS' if ok else 'MISS'}")
    return {"runs": [{"mode": r.mode, **r.wrk.to_json()} for r in runs],
            "p50_deltas_ms": [round(x, 4) for x in deltas], "p50_delta_ms_median": round(med, 4),
            "direct_p50_ms": round(statistics.median(
                [r.wrk.p50_ms for r in runs if r.mode == "direct"]), 4),
            "captured_p50_ms": round(statistics.median(
                [r.wrk.p50_ms for r in runs if r.mode == "captured"]), 4),
            "target_ms": TARGET_P50_DELTA_MS, "target_met": ok}


def _ratio_verdict(runs: list[Run], target: float) -> tuple[list[float], float, bool, str]:
    """captured/direct req/s per ABBA pair (sorted), their median, the verdict, the spread."""
    ratios = sorted(c.wrk.rps / d.wrk.rps for d, c in _pairs(runs) if d.wrk.rps > 0)
    med = statistics.median(ratios) if ratios else float("nan")
    spread = f"{ratios[0]:.2f}–{ratios[-1]:.2f}" if ratios else "n/a"
    return ratios, med, med >= target, spread


def newconn_report(runs: list[Run]) -> dict[str, Any]:
    """A new TCP connection per request (`Connection: close`): what capture adds most to —
    the redirect, Envoy's accept in the pod netns, the internal hop, and an upstream socket
    opened in the pod's netns. Ratios per ABBA pair (same round), median and spread."""
    ratios, med, ok, spread = _ratio_verdict(runs, TARGET_NEWCONN_RATIO)
    print()
    print(f"2b. a new connection per request (wrk -H 'Connection: close', -c{WRK_CONNECTIONS}), "
          "same pods and server, ABBA")
    for r in runs:
        w = r.wrk
        print(f"{r.mode:<10} | {w.rps:>9.0f} req/s | p50 {w.p50_ms:>7.3f} ms p99 "
              f"{w.p99_ms:>7.3f} | errors {w.socket_errors + w.non_2xx:>3} | cpu% node-envoy "
              f"{r.cpu['node_envoy']:>5.1f} server {r.cpu['server_envoy']:>5.1f} wrk "
              f"{r.cpu['wrk']:>5.1f} agent {r.cpu['agent']:>5.1f} softirq {r.cpu['softirq']:>5.1f}"
              f" idle {r.cpu['idle']:>5.1f}")
    print(f"captured/direct new-connection req/s = {med:.2f}× median over {len(ratios)} pair(s) "
          f"(spread {spread}; target ≥ {TARGET_NEWCONN_RATIO:g}×): {'PASS' if ok else 'MISS'}")
    return {"runs": [{"mode": r.mode, **r.wrk.to_json(), "passthrough_cx": r.passthrough_cx}
                     for r in runs],
            "rps_ratios": [round(x, 3) for x in ratios], "rps_ratio_median": round(med, 3),
            "target": TARGET_NEWCONN_RATIO, "target_met": ok}


def routed_report(runs: list[Run]) -> dict[str, Any]:
    """HTTP through a GAMMA route (Envoy parses each request, routes it to the Service's
    cluster and pools upstream connections) against the same server reached directly."""
    ratios, med, ok, spread = _ratio_verdict(runs, TARGET_ROUTED_RATIO)
    print()
    print(f"2c. HTTP through a GAMMA HTTPRoute (wrk -t{WRK_THREADS} -c{WRK_CONNECTIONS} keep-alive "
          f"to Service {ROUTED_IP}:{ROUTED_PORT}; direct: the server's own address), ABBA")
    for r in runs:
        w = r.wrk
        print(f"{r.mode:<10} | {w.rps:>9.0f} req/s | p50 {w.p50_ms:>7.3f} ms p99 "
              f"{w.p99_ms:>7.3f} | errors {w.socket_errors + w.non_2xx:>3} | routed "
              f"{r.routed_rq:>7} | cpu% node-envoy {r.cpu['node_envoy']:>5.1f} server "
              f"{r.cpu['server_envoy']:>5.1f} wrk {r.cpu['wrk']:>5.1f}")
    print(f"routed/direct req/s = {med:.2f}× median over {len(ratios)} pair(s) (spread {spread}; "
          f"target ≥ {TARGET_ROUTED_RATIO:g}×): {'PASS' if ok else 'MISS'}")
    return {"runs": [{"mode": r.mode, **r.wrk.to_json(), "routed_rq": r.routed_rq}
                     for r in runs],
            "rps_ratios": [round(x, 3) for x in ratios], "rps_ratio_median": round(med, 3),
            "target": TARGET_ROUTED_RATIO, "target_met": ok}


def report(base: Phase, env: Phase, runs: list[Run], machine: dict[str, str], args: Any
           ) -> dict[str, Any]:
    newconn = [r for r in runs if r.shape == "newconn"]
    routed = [r for r in runs if r.shape == "routed"]
    latency = [r for r in runs if r.shape == "latency"]
    runs = [r for r in runs if r.shape == "keepalive"]
    print()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()))
    print(f"background before the run: {machine['background_busy_pct']} % of the machine busy "
          f"(loadavg {machine['loadavg']}); other work on the box skews every figure below")
    print(f"note: {machine['nproc']} vCPU(s) shared by wrk, the server Envoy, the node Envoy, "
          "the agent and the kernel's network stack: figures are relative, not capacity.")
    print()
    print(f"1. aether-cni ADD → listener live ({args.pods} fresh pods per level; ADD exec wall "
          "time, ms; probe = connect from the pod netns through the capture right after ADD)")
    head = (f"{'conc':>4} | {'envoy p50':>9} {'p99':>7} {'max':>7} | {'no-envoy p50':>12} "
            f"{'p99':>7} | {'ratio p50':>9} {'p99':>6} | {'agent env':>9} {'no-env':>6} "
            f"{'ACK':>5} | {'probe p50':>9} {'p99':>6} | {'live fail':>9} | "
            f"{'pods/s env':>10} {'no-env':>7}")
    print(head)
    print("-" * len(head))
    levels = []
    for lv_e, lv_b in zip(env.levels, base.levels, strict=True):
        e, b = Stats.of(lv_e.add), Stats.of(lv_b.add)
        pr = Stats.of(lv_e.probe) if lv_e.probe else None
        row = {
            "concurrency": lv_e.concurrency,
            "envoy_add": e.to_json(),
            "no_envoy_add": b.to_json(),
            "ratio_p50": round(e.p50_ms / b.p50_ms, 3),
            "ratio_p99": round(e.p99_ms / b.p99_ms, 3),
            "probe": pr.to_json() if pr else None,
            "liveness_failures": len(lv_e.failures),
            "failure_samples": lv_e.failures[:5],
            "envoy_agent_mean_ms": round(lv_e.agent_ms, 3),
            "no_envoy_agent_mean_ms": round(lv_b.agent_ms, 3),
            "xds_ack_mean_ms": None if lv_e.ack_ms != lv_e.ack_ms else round(lv_e.ack_ms, 3),
            "envoy_pods_per_s": round(len(lv_e.add) / lv_e.wall_s, 2),
            "no_envoy_pods_per_s": round(len(lv_b.add) / lv_b.wall_s, 2),
        }
        levels.append(row)
        print(f"{lv_e.concurrency:>4} | {e.p50_ms:>9.1f} {e.p99_ms:>7.1f} {e.max_ms:>7.1f} | "
              f"{b.p50_ms:>12.1f} {b.p99_ms:>7.1f} | {row['ratio_p50']:>8.2f}× "
              f"{row['ratio_p99']:>5.2f}× | {lv_e.agent_ms:>9.1f} {lv_b.agent_ms:>6.1f} "
              f"{_fmt(lv_e.ack_ms, 5, 1)} | "
              f"{(pr.p50_ms if pr else float('nan')):>9.2f} "
              f"{(pr.p99_ms if pr else float('nan')):>6.2f} | "
              f"{len(lv_e.failures):>4} {'PASS' if not lv_e.failures else 'MISS'} | "
              f"{row['envoy_pods_per_s']:>10.1f} {row['no_envoy_pods_per_s']:>7.1f}")
    print("  agent = mean time the agent spent handling an ADD (its CNI histogram); ACK = mean "
          "xDS publish → Envoy ACK (its push histogram); the rest of an exec is the shim.")
    if all(lv.ack_ms != lv.ack_ms for lv in env.levels):  # NaN: histogram never observed
        print("  ACK n/a: the agent's aether_xds_push_duration_seconds histogram stayed empty; "
              "the agent-time difference (env − no-env) bounds the ACK wait instead.")
    for lv in env.levels:
        for f in lv.failures[:5]:
            print(f"  liveness failure (c={lv.concurrency}): {f}")

    print()
    print(f"2. data path: wrk -t{WRK_THREADS} -c{WRK_CONNECTIONS} -d{args.duration:g}s from a pod "
          f"netns → static Envoy server on the host ({BODY_BYTES} B body), {args.rounds} "
          "round(s) ABBA")
    head = (f"{'run':<10} | {'req/s':>9} | {'p50 ms':>7} {'p75':>6} {'p90':>6} {'p99':>6} | "
            f"{'errors':>6} | cpu%: {'node-envoy':>10} {'server':>6} {'wrk':>5} "
            f"{'agent':>5} {'softirq':>7} {'other':>5} {'idle':>5}")
    print(head)
    print("-" * len(head))
    for r in runs:
        w = r.wrk
        print(f"{r.mode:<10} | {w.rps:>9.0f} | {w.p50_ms:>7.3f} {w.p75_ms:>6.3f} "
              f"{w.p90_ms:>6.3f} {w.p99_ms:>6.3f} | {w.socket_errors + w.non_2xx:>6} | "
              f"      {r.cpu['node_envoy']:>10.1f} {r.cpu['server_envoy']:>6.1f} "
              f"{r.cpu['wrk']:>5.1f} {r.cpu['agent']:>5.1f} {r.cpu['softirq']:>7.1f} "
              f"{r.cpu['other']:>5.1f} "
              f"{r.cpu['idle']:>5.1f}")
    agg: dict[str, dict[str, float]] = {}
    for mode in ("direct", "captured"):
        rs = [r for r in runs if r.mode == mode]
        agg[mode] = {"rps": _mean([r.wrk.rps for r in rs]),
                     "p50_ms": _mean([r.wrk.p50_ms for r in rs]),
                     "p99_ms": _mean([r.wrk.p99_ms for r in rs]),
                     "errors": sum(r.wrk.socket_errors + r.wrk.non_2xx for r in rs)}
    d, c = agg["direct"], agg["captured"]
    rps_ratios = sorted(cr.wrk.rps / dr.wrk.rps for dr, cr in _pairs(runs) if dr.wrk.rps > 0)
    rps_ratio = statistics.median(rps_ratios)
    p50_deltas = sorted(cr.wrk.p50_ms - dr.wrk.p50_ms for dr, cr in _pairs(runs))
    p50_delta = statistics.median(p50_deltas)
    rps_ok = rps_ratio >= TARGET_RPS_RATIO
    noisy = [r for r in runs if r.cpu["other"] > 5.0]
    if noisy:
        which = ", ".join(f"{r.mode} {r.cpu['other']:.0f} %" for r in noisy)
        print(f"  warning: {len(noisy)} run(s) had > 5 % of the machine busy outside wrk, both "
              f"Envoys, the agent and softirq (other processes on the box?): {which}")
    print("-" * len(head))
    print(f"{'mean dir':<10} | {d['rps']:>9.0f} | {d['p50_ms']:>7.3f} {'':>6} {'':>6} "
          f"{d['p99_ms']:>6.3f} |")
    print(f"{'mean cap':<10} | {c['rps']:>9.0f} | {c['p50_ms']:>7.3f} {'':>6} {'':>6} "
          f"{c['p99_ms']:>6.3f} |")
    print(f"captured/direct req/s = {rps_ratio:.2f}× median over {len(rps_ratios)} pair(s) "
          f"(spread {_spread(rps_ratios)}; target ≥ {TARGET_RPS_RATIO:g}×): "
          f"{'PASS' if rps_ok else 'MISS'}")
    print(f"captured − direct p50 = {p50_delta:+.3f} ms median (spread "
          f"{_spread(p50_deltas, '{:+.3f}')}; no target: saturated, p50 ≈ {WRK_CONNECTIONS} "
          "connections / throughput; the hop's latency is 2a)")
    print(f"captured − direct p99 = {c['p99_ms'] - d['p99_ms']:+.3f} ms  (no target)")
    print()
    print("CPU time per request (µs; from per-process and /proc/stat accounting over each run):")
    parts = ("node_envoy", "server_envoy", "wrk", "agent", "softirq", "other")
    head = f"{'mode':<10} | " + " ".join(f"{p:>12}" for p in parts) + f" | {'total busy':>10}"
    print(head)
    print("-" * len(head))
    per_req: dict[str, dict[str, float]] = {}
    for mode in ("direct", "captured"):
        rs = [r for r in runs if r.mode == mode]
        ncpu = int(machine["nproc"]) or 1

        def us(r: Run, key: str, n: int = ncpu) -> float:
            return 1e6 * r.cpu[key] / 100.0 * n * r.wall_s / max(1, r.wrk.requests)

        cost = {p: _mean([us(r, p) for r in rs]) for p in parts}
        cost["busy"] = _mean([1e6 * (100.0 - r.cpu["idle"]) / 100.0 * ncpu * r.wall_s
                             / max(1, r.wrk.requests) for r in rs])
        per_req[mode] = cost
        print(f"{mode:<10} | " + " ".join(f"{cost[p]:>12.1f}" for p in parts)
              + f" | {cost['busy']:>10.1f}")
    live_ok = all(not lv.failures for lv in env.levels)
    lat = latency_report(latency)
    p50_ok = lat["target_met"]
    nc = newconn_report(newconn)
    rt = routed_report(routed)
    return {
        "benchmark": "envoy_path",
        "machine": machine,
        "pods_per_level": args.pods,
        "add": {"levels": levels, "liveness_target_met": live_ok},
        "data_path": {
            "wrk": f"-t{WRK_THREADS} -c{WRK_CONNECTIONS} -d{args.duration:g}s --latency",
            "body_bytes": BODY_BYTES,
            "rounds": args.rounds,
            "runs": [{"mode": r.mode, **r.wrk.to_json(), "wall_s": round(r.wall_s, 2),
                      "cpu_pct": {k: round(v, 1) for k, v in r.cpu.items()},
                      "passthrough_cx": r.passthrough_cx} for r in runs],
            "mean": {k: {kk: round(vv, 3) for kk, vv in v.items()} for k, v in agg.items()},
            "cpu_us_per_request": {k: {kk: round(vv, 2) for kk, vv in v.items()}
                                   for k, v in per_req.items()},
            "rps_ratio": round(rps_ratio, 3),
            "rps_ratios": [round(x, 3) for x in rps_ratios],
            "saturated_p50_delta_ms": round(p50_delta, 3),
            "saturated_p50_deltas_ms": [round(x, 3) for x in p50_deltas],
            "rps_target": TARGET_RPS_RATIO,
            "rps_target_met": rps_ok,
            "p50_target_met": p50_ok,
            "one_in_flight": lat,
            "new_connection_per_request": nc,
            "routed_http": rt,
        },
        "all_targets_met": live_ok and rps_ok and p50_ok and nc["target_met"] and rt["target_met"],
    }


# -- main --------------------------------------------------------------------------------
def _sigterm(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _reap_leftovers(root: str) -> None:
    """Any process still running whose command line names our workdir was started by us
    (agent, Envoy keeper, Envoy): end it by pid."""
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid != os.getpid() and any(root in a for a in proc.info["cmdline"] or []):
                progress(f"leftover process {proc.pid} {' '.join(proc.info['cmdline'])[:120]}; "
                         "killing")
                proc.kill()
        except psutil.Error:
            continue


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.envoy_path", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=100, help="fresh pods per concurrency level")
    ap.add_argument("--concurrency", default="1,16", help="comma-separated ADD levels")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per wrk run")
    ap.add_argument("--rounds", type=int, default=3, help="direct/captured wrk round pairs")
    ap.add_argument("--quick", action="store_true",
                    help="CI smoke: --pods 10 --duration 2 --rounds 1")
    ap.add_argument("--json", metavar="OUT", help="write the figures as JSON")
    ap.add_argument("--keep-workdir", action="store_true", help="leave agent logs etc. behind")
    args = ap.parse_args(argv)
    if args.quick:
        args.pods, args.duration, args.rounds = 10, 2.0, 1
    levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    if args.pods < 1 or not levels or min(levels) < 1 or args.rounds < 1 or args.duration < 1:
        ap.error("--pods, --rounds, --duration and every --concurrency level must be ≥ 1")
    if os.geteuid() != 0:
        ap.error("needs root (netns, bridge, nftables)")
    if not shutil.which("wrk"):
        ap.error("wrk not found (apt-get install wrk)")

    signal.signal(signal.SIGTERM, _sigterm)
    t_start = time.monotonic()
    background = _background_busy()
    root = tempfile.mkdtemp(prefix="aether-bench-envoy-")
    base = Phase(root, "base", envoy=False, net=218, pods=args.pods, levels=levels)
    env = Phase(root, "envoy", envoy=True, net=219, pods=args.pods, levels=levels)
    cap_pod = env.extra_pod("wrk-captured", {"aether.io/dependencies": ROUTED})
    dir_pod = env.extra_pod("wrk-direct", {EXCLUDE_ANNOTATION: f"{env.gw4}/32"})
    server = ServerEnvoy(os.path.join(root), BODY_BYTES)
    env.agent.write("bench-routed.yaml", routed_manifest(env.gw4, server.port))
    recorder: Recorder | None = None
    ok = False
    try:
        # no-Envoy baseline first, torn down before the Envoy phase so they never overlap
        base.start()
        for lv in base.levels:
            base.time_add(lv, None)
        base.verify()
        with _shielded():
            base.cleanup()

        recorder, probe_port = host_server(tag=b"live")

        def probe(pod: Pod) -> str:
            return dial(pod.netns, env.gw4, probe_port, timeout=PROBE_TIMEOUT_S)

        env.start()
        envoy_before = env.envoy_pid()
        rss0 = _rss(envoy_before)
        for lv in env.levels:
            env.time_add(lv, probe)
        env.verify()
        captured_n = sum(len(lv.pods) for lv in env.levels)
        envoy_mem = {"pods": captured_n, "rss0_mb": rss0 / 1e6,
                     "rss_mb": _rss(env.envoy_pid()) / 1e6}
        envoy_mem["per_pod_kb"] = (envoy_mem["rss_mb"] - envoy_mem["rss0_mb"]) * 1e3 / captured_n
        if env.envoy_pid() != envoy_before:  # its counters restarted at zero with it
            e = env.agent.status().get("envoy", {})
            raise RuntimeError(f"the node Envoy restarted during the ADD phase (pid "
                               f"{envoy_before} -> {env.envoy_pid()}, netns_restarts="
                               f"{e.get('netns_restarts')}, hang_kills={e.get('hang_kills')}, "
                               f"restarts={e.get('restarts')})")
        # upstreams leave from the pod's own address now: judge by Envoy's per-pod listener
        # counter instead (every probe that reached the server passed a capture listener)
        carried = sum(env.stat(f"listener.capture-{p.container_id}.downstream_cx_total")
                      for lv in env.levels for p in lv.pods)
        if carried < len(recorder.seen):
            raise RuntimeError(f"{len(recorder.seen)} probe connections reached the server but "
                               f"the capture listeners accepted only {carried}: some bypassed "
                               "Envoy")

        progress("[data] starting the server Envoy, adding the two wrk pods …")
        server.start()
        env.add_untimed(cap_pod)
        env.add_untimed(dir_pod)
        runs = data_path(env, server, cap_pod, dir_pod, args.duration, args.rounds)

        machine = {**machine_info(), "envoy": envoy_version(),
                   "background_busy_pct": f"{background:.0f}", "loadavg": _loadavg()}
        result = report(base, env, runs, machine, args)
        ok_mem = envoy_mem["per_pod_kb"] <= TARGET_ENVOY_KB_PER_POD
        print(f"\nnode Envoy RSS: {envoy_mem['rss0_mb']:.1f} MB with no pod, "
              f"{envoy_mem['rss_mb']:.1f} MB with {captured_n} captured pods: "
              f"{envoy_mem['per_pod_kb']:.0f} KB per pod (target ≤ {TARGET_ENVOY_KB_PER_POD} KB): "
              f"{'PASS' if ok_mem else 'MISS'}")
        result["envoy_memory"] = {**{k: round(v, 2) for k, v in envoy_mem.items()},
                                  "target_kb": TARGET_ENVOY_KB_PER_POD, "target_met": ok_mem}
        result["elapsed_s"] = round(time.monotonic() - t_start, 1)
        print(f"\n(total {result['elapsed_s']:.0f} s)")
        if args.json:
            with open(args.json, "w") as f:
                f.write(dumps(result) + "\n")
            progress(f"wrote {args.json}")
        ok = True
    except KeyboardInterrupt:
        progress("interrupted; cleaning up")
        return 130
    except Exception:
        for ph in (base, env):
            if os.path.exists(ph.agent.log_path):
                text = ph.agent.logs()
                bad = [ln[:600] for ln in text.splitlines()  # Envoy's info lines fill any tail
                       if '"level": "error"' in ln or '"level": "warning"' in ln
                       or "][critical]" in ln or "][error]" in ln]
                if bad:
                    progress(f"[{ph.name}] agent warnings and errors (last 20):\n"
                             + "\n".join(bad[-20:]))
                progress(f"[{ph.name}] agent log tail:\n" + text[-2000:])
        raise
    finally:
        try:
            with _shielded():  # a second Ctrl-C must not leak anything
                for ph in (base, env):
                    try:
                        ph.cleanup()
                    except Exception as e:  # noqa: BLE001 - keep tearing down the rest
                        progress(f"[{ph.name}] cleanup error: {e}")
                server.stop()
                if recorder is not None:
                    recorder.close()
                _reap_leftovers(root)
        except KeyboardInterrupt:
            progress("interrupt during cleanup held until it finished")
        if args.keep_workdir or not ok:
            progress(f"workdir kept: {root}")
        else:
            release_mounts_under(root)  # the agents' shared <run-dir>/netns mounts
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
