"""Benchmark: the real `aether-agent run` process at cluster scale, its Envoy connected.

    python -m bench.agent_scale [--pods 50000,100000] [--services 10000] [--nodes 300]
                                [--local 110] [--remote-pods meshpods,pods] [--rounds 3]
                                [--quick] [--json OUT]

For each size, the project's test API server (``bench.scale_api``, a process of its own)
holds a cluster: 50 managed namespaces, ``--services`` Services each with one EndpointSlice,
and ``--pods`` realistic Pods (``bench.scale_objects``: env, probes, volumes, managedFields,
full status; ~4.4 KB of JSON each) spread over ``--nodes`` nodes, ``--local`` of them on
ours, and beside every pod of another node the MeshPod record its node's agent would have
published (``agent.meshpods``). The agent runs as production runs it (``--kubeconfig``,
Envoy on, ``--remote-pods meshpods``: this node's Pods from the Pod API, the others from
their records), with ``--scope all`` so every Service reaches its Envoy: the heaviest
configuration. ``--remote-pods meshpods,pods`` also runs each size with every Pod of the
cluster listed (the way before MeshPods), as the baseline of the same run, alternating
which mode goes first. ``--rounds N`` repeats every (size, mode) N times, the order of the
modes alternating by round too; each figure is reported as the median of its rounds with
their spread, the ratio against the every-Pod mode as the median of the per-round ratios, and
the targets are judged on the medians (one run of a size spread 26–37 s to ready).

Figures: time from the agent's start to ready (every kind listed into the model and Envoy
holding a cluster per Service, read from Envoy's own stats), the agent's RSS and USS then
(psutil; Envoy's RSS apart), and one Service's endpoints changing (one of its pods deleted
through the API): the time until Envoy's membership of that cluster changes, and the agent
CPU it cost. Targets:
ready ≤ 30 s and agent RSS ≤ 300 MB at 100k Pods + 10k Services. The growth per 10k pods is
the slope between the sizes run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from typing import Any

import psutil

from agent.cni import protocol
from agent.envoy.supervisor import admin_request
from agent.netns.pin import release_mounts_under
from bench.common import dumps, machine_info, progress
from bench.scale_objects import LOCAL_NODE, namespace_of
from integration.conftest import free_port

TARGET_READY_S = 30.0
TARGET_RSS_MB = 300.0
TARGET_AT_PODS = 100_000
READY_TIMEOUT_S = 600.0
CHANGED_SERVICE = 1


def _status(run_dir: str) -> dict[str, Any] | None:
    try:
        answer = protocol.call(os.path.join(run_dir, "status.sock"), {"command": "status"}, 5)
    except (OSError, ValueError):
        return None
    st = answer.get("status")
    return st if isinstance(st, dict) else None


def _envoy_stat(run_dir: str, name: str) -> int | None:
    sock = os.path.join(run_dir, "envoy", "admin.sock")
    try:
        body = admin_request(sock, "GET", f"/stats?filter=^{name}$", timeout=5)[1]
    except OSError:
        return None
    for line in body.splitlines():
        k, _, v = line.partition(": ")
        if k == name and v.strip().isdigit():
            return int(v)
    return None


def _envoy_hosts(run_dir: str, cluster: str) -> int | None:
    """How many hosts Envoy's cluster ``cluster`` has (None: no such cluster, or no answer).
    Read from ``/clusters?filter=`` (~16 ms with 10k clusters), not ``/stats?filter=``: the
    stats filter walks every stat of every cluster (~1 s at 10k on this machine) on Envoy's
    main thread, so polling it delays the very config updates being timed."""
    sock = os.path.join(run_dir, "envoy", "admin.sock")
    pattern = "^" + cluster.replace("|", "\\|").replace(".", "\\.") + "$"
    try:
        body = admin_request(sock, "GET", "/clusters?filter=" + urllib.parse.quote(pattern),
                             timeout=5)[1]
    except OSError:
        return None
    hosts = {line.split("::")[1] for line in body.splitlines()
             if line.startswith(cluster + "::") and "::health_flags::" in line}
    seen = any(line.startswith(cluster + "::") for line in body.splitlines())
    return len(hosts) if seen else None


def _service_cluster(svc: int) -> str:
    return f"svc|{namespace_of(svc)}|svc-{svc:05d}|80"


def _cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


class Cluster:
    """The API server process and the agent process for one size."""

    #: how the agent is started (``bench.agent_census`` wraps it to count its objects)
    entry: tuple[str, ...] = ("-m", "agent.cli")

    def __init__(self, root: str, pods: int, services: int, nodes: int, local: int,
                 remote_pods: str = "meshpods", tag: str = "") -> None:
        self.remote_pods = remote_pods
        self.dir = os.path.join(root, f"p{pods}-{remote_pods}{tag}")
        os.makedirs(self.dir)
        self.pods, self.services, self.nodes, self.local = pods, services, nodes, local
        self.api: subprocess.Popen[str] | None = None
        self.agent: subprocess.Popen[bytes] | None = None
        self.run_dir = os.path.join(self.dir, "run")
        self.url = ""

    def start_api(self) -> float:
        started = time.monotonic()
        self.api = subprocess.Popen(
            [sys.executable, "-m", "bench.scale_api", "--pods", str(self.pods), "--services",
             str(self.services), "--nodes", str(self.nodes), "--local", str(self.local),
             "--dir", self.dir], stdout=subprocess.PIPE, text=True)
        assert self.api.stdout is not None
        line = self.api.stdout.readline()
        if not line.startswith("READY"):
            raise RuntimeError(f"the scale API server did not start: {line!r}")
        self.url = line.rsplit(" ", 1)[1].strip()
        return time.monotonic() - started

    def start_agent(self) -> float:
        """Start the agent; returns seconds to ready (see the module docstring)."""
        for d in ("cni", "bin"):
            os.makedirs(os.path.join(self.dir, d), exist_ok=True)
        cmd = [sys.executable, *self.entry, "run",
               "--kubeconfig", os.path.join(self.dir, "kubeconfig"),
               "--node-name", LOCAL_NODE, "--run-dir", self.run_dir, "--scope", "all",
               "--cni-conf-dir", os.path.join(self.dir, "cni"),
               "--cni-bin-dir", os.path.join(self.dir, "bin"),
               "--metrics-port", str(free_port()), "--metrics-host", "127.0.0.1",
               "--log-format", "json", "--log-level", "info", "--envoy-on-exit", "stop",
               "--no-xmesh-create", "--remote-pods", self.remote_pods]
        log = open(os.path.join(self.dir, "agent.log"), "ab")  # noqa: SIM115 - child's
        started = time.monotonic()
        self.agent = subprocess.Popen(cmd, stdout=log, stderr=log)
        last_line = ""
        listed = False
        while time.monotonic() - started < READY_TIMEOUT_S:
            if self.agent.poll() is not None:
                raise RuntimeError(f"the agent exited {self.agent.returncode}: {self.log()}")
            if not listed:
                # the agent's status, until every kind is in its model; from then on only
                # Envoy is polled: a status call waits for the agent's busy interpreter
                # (seconds at 100k), which would be measured as time to ready
                st = _status(self.run_dir)
                if st is None:
                    time.sleep(0.25)
                    continue
                kinds = (st.get("mesh") or {}).get("objects_by_kind") or {}
                # this node's Pods + the other nodes' records (or every Pod with --remote-pods pods)
                held = kinds.get("Pod", 0) + kinds.get("MeshPod", 0)
                listed = held >= self.pods and kinds.get("Service", 0) >= self.services \
                    and kinds.get("EndpointSlice", 0) >= self.services
            # the last Service's cluster in Envoy: the one push holding them all applied
            last = _envoy_hosts(self.run_dir, _service_cluster(self.services - 1))
            now = (f"pods {held}/{self.pods}, services "
                   f"{kinds.get('Service', 0)}/{self.services}, Envoy has the last "
                   f"Service's cluster: {'yes' if last is not None else 'no'}")
            if now != last_line:
                progress(f"  [{self.pods} pods] {time.monotonic() - started:5.1f} s: {now}")
                last_line = now
            if listed and last is not None:
                took = time.monotonic() - started
                clusters = _envoy_stat(self.run_dir, "cluster_manager.active_clusters") or 0
                if clusters >= self.services:  # checked once: the stat costs Envoy ~1 s
                    return took
            time.sleep(0.1 if listed else 0.25)
        raise RuntimeError(f"not ready after {READY_TIMEOUT_S:.0f} s: {last_line}")

    def memory(self) -> dict[str, float]:
        assert self.agent is not None
        p = psutil.Process(self.agent.pid)
        full = p.memory_full_info()
        st = _status(self.run_dir) or {}
        envoy_rss = (st.get("envoy") or {}).get("rss_bytes") or 0
        return {"agent_rss_mb": full.rss / 1e6, "agent_uss_mb": full.uss / 1e6,
                "envoy_rss_mb": float(envoy_rss) / 1e6}

    def endpoint_change(self) -> dict[str, float]:
        """One endpoint of one Service goes (its pod is deleted through the API): the time
        until Envoy's membership of that cluster shows it, and the agent CPU spent meanwhile."""
        assert self.agent is not None
        svc = CHANGED_SERVICE
        ns, app = namespace_of(svc), f"svc-{svc:05d}"
        cluster = _service_cluster(svc)
        before = _envoy_hosts(self.run_dir, cluster)
        if not before:
            raise RuntimeError(f"Envoy has no hosts in {cluster}")
        path = f"/api/v1/namespaces/{ns}/pods/{app}-7d9f8c6b5-{svc:06d}"  # pod #1: svc 1's
        cpu0 = _cpu_s(self.agent.pid)
        started = time.monotonic()
        req = urllib.request.Request(self.url + path, method="DELETE")
        urllib.request.urlopen(req, timeout=10).read()
        deleted = time.monotonic() - started  # the API server's own part
        while time.monotonic() - started < 60:
            if _envoy_hosts(self.run_dir, cluster) == before - 1:
                took = time.monotonic() - started
                return {"seconds": took, "agent_cpu_s": _cpu_s(self.agent.pid) - cpu0,
                        "api_delete_s": deleted}
            time.sleep(0.01)
        raise RuntimeError(f"{cluster} never went from {before} to {before - 1} hosts")

    def log(self) -> str:
        try:
            with open(os.path.join(self.dir, "agent.log"), errors="replace") as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def stop(self) -> None:
        for p in (self.agent, self.api):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def run_size(root: str, pods: int, mode: str, a: argparse.Namespace, rnd: int = 1
             ) -> dict[str, Any]:
    c = Cluster(root, pods, a.services, a.nodes, a.local, mode, f"-r{rnd}")
    try:
        progress(f"[round {rnd}, {pods} pods, --remote-pods {mode}] loading the API server …")
        load_s = c.start_api()
        progress(f"[{pods} pods] API server ready in {load_s:.1f} s; starting the agent "
                 f"(--remote-pods {mode}) …")
        ready_s = c.start_agent()
        assert c.agent is not None and c.api is not None
        cpu_ready = {"agent_cpu_s": _cpu_s(c.agent.pid), "api_cpu_s": _cpu_s(c.api.pid)}
        mem_ready = c.memory()
        time.sleep(5.0)  # settled: the first publish behind it
        mem = c.memory()
        change = c.endpoint_change()
        return {"round": rnd, "pods": pods, "remote_pods": mode, "services": a.services,
                "ready_s": ready_s,
                **cpu_ready,
                "at_ready": mem_ready, **mem, "endpoint_change": change}
    except Exception:
        progress(f"[{pods} pods] agent log tail:\n{c.log()}")
        raise
    finally:
        c.stop()


def _med(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _rounds(n: int) -> str:
    return f"{n} round{'s' if n != 1 else ''}"


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every (size, mode) over its rounds (pure): the median of each figure with its spread,
    and against the every-Pod mode the median of the per-round ratios (the two modes of a
    round ran back to back, so each ratio compares neighbours)."""
    keys: list[tuple[int, str]] = []
    for r in runs:
        if (r["pods"], r["remote_pods"]) not in keys:
            keys.append((r["pods"], r["remote_pods"]))
    keys.sort(key=lambda k: (k[0], k[1] != "meshpods"))
    by_round = {(r["pods"], r["remote_pods"], r.get("round", 1)): r for r in runs}
    out: list[dict[str, Any]] = []
    for pods, mode in keys:
        rs = [r for r in runs if r["pods"] == pods and r["remote_pods"] == mode]
        s: dict[str, Any] = {"pods": pods, "remote_pods": mode, "services": rs[0]["services"],
                             "rounds": len(rs)}
        for f in ("ready_s", "agent_cpu_s", "api_cpu_s", "agent_rss_mb", "agent_uss_mb",
                  "envoy_rss_mb"):
            xs = [float(r[f]) for r in rs]
            s[f], s[f + "_spread"] = _med(xs), [min(xs), max(xs)]
        s["at_ready_rss_mb"] = _med([float(r["at_ready"]["agent_rss_mb"]) for r in rs])
        s["endpoint_change"] = {
            f: _med([float(r["endpoint_change"][f]) for r in rs])
            for f in ("seconds", "agent_cpu_s")}
        if mode != "pods":
            pairs = [(r, by_round.get((pods, "pods", r.get("round", 1)))) for r in rs]
            pairs = [(r, b) for r, b in pairs if b is not None]
            if pairs:
                for f, name in (("ready_s", "ready"), ("agent_rss_mb", "rss")):
                    ratios = [r[f] / b[f] for r, b in pairs]
                    s[f"vs_pods_{name}"] = _med(ratios)
                    s[f"vs_pods_{name}_spread"] = [min(ratios), max(ratios)]
        out.append(s)
    return out


def report(runs: list[dict[str, Any]], a: argparse.Namespace) -> dict[str, Any]:
    print(f"\nagent at cluster scale: {a.services} Services (one EndpointSlice each), realistic "
          f"Pods over {a.nodes} nodes ({a.local} on ours), --scope all, Envoy on")
    head = (f"{'round':>5} {'pods':>7} {'--remote-pods':>13} | {'ready s':>7} {'agent CPU':>9} "
            f"{'API CPU':>7} | {'agent RSS MB':>12} {'USS MB':>7} | "
            f"{'Envoy RSS MB':>12} | {'1 Service endpoints → Envoy':>28}")
    print(head)
    print("-" * len(head))
    for r in runs:
        ch = r["endpoint_change"]
        print(f"{r.get('round', 1):>5} {r['pods']:>7} {r['remote_pods']:>13} | "
              f"{r['ready_s']:>7.1f} {r['agent_cpu_s']:>8.1f}s "
              f"{r['api_cpu_s']:>6.1f}s | {r['agent_rss_mb']:>12.0f} "
              f"{r['agent_uss_mb']:>7.0f} | {r['envoy_rss_mb']:>12.0f} | "
              f"{ch['seconds'] * 1000:>8.0f} ms, agent CPU {ch['agent_cpu_s'] * 1000:>5.0f} ms")
    results = summarize(runs)
    print("\nmedian of the rounds (spread):")
    for s in results:
        lo, hi = s["ready_s_spread"]
        rlo, rhi = s["agent_rss_mb_spread"]
        vs = ""
        if "vs_pods_ready" in s:
            vs = (f"; vs every Pod listed, same rounds: ready {s['vs_pods_ready']:.2f}×, "
                  f"RSS {s['vs_pods_rss']:.2f}×")
        print(f"  {s['pods']:>7} {s['remote_pods']:>9} ({_rounds(s['rounds'])}): ready "
              f"{s['ready_s']:.1f} s ({lo:.1f}–{hi:.1f}), agent RSS {s['agent_rss_mb']:.0f} MB "
              f"({rlo:.0f}–{rhi:.0f}){vs}")
    slope = None
    headline = [r for r in results if r["remote_pods"] == "meshpods"] or results
    if len(headline) >= 2:
        lo_r, hi_r = headline[0], headline[-1]
        slope = ((hi_r["agent_rss_mb"] - lo_r["agent_rss_mb"])
                 / ((hi_r["pods"] - lo_r["pods"]) / 10_000))
        print(f"agent RSS growth: {slope:.1f} MB per 10k pods (between {lo_r['pods']} and "
              f"{hi_r['pods']}, medians)")
    print("  (ready = start → every kind in the model and a cluster per Service in Envoy; agent/API "
          "CPU = seconds each process used until then, on the same 2 CPUs: the test API server "
          "is Python and serializes every page, which a real API server does elsewhere)")
    at = [r for r in headline if r["pods"] >= TARGET_AT_PODS]
    verdict: dict[str, Any] = {"checked": bool(at)}
    if at:
        r = at[-1]
        verdict.update(ready_ok=r["ready_s"] <= TARGET_READY_S,
                       rss_ok=r["agent_rss_mb"] <= TARGET_RSS_MB, rounds=r["rounds"])
        print(f"at {r['pods']} pods (--remote-pods {r['remote_pods']}, "
              f"{'median of ' if r['rounds'] > 1 else ''}{_rounds(r['rounds'])}): ready "
              f"{r['ready_s']:.1f} s (target ≤ {TARGET_READY_S:g} s): "
              f"{'PASS' if verdict['ready_ok'] else 'MISS'}; agent RSS "
              f"{r['agent_rss_mb']:.0f} MB (target ≤ {TARGET_RSS_MB:g} MB): "
              f"{'PASS' if verdict['rss_ok'] else 'MISS'}")
    return {"benchmark": "agent_scale", "machine": machine_info(), "services": a.services,
            "nodes": a.nodes, "local": a.local, "runs": runs, "results": results,
            "rss_mb_per_10k_pods": slope, "targets": verdict}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.agent_scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", default="50000,100000", help="comma-separated cluster sizes")
    ap.add_argument("--services", type=int, default=10_000)
    ap.add_argument("--nodes", type=int, default=300)
    ap.add_argument("--local", type=int, default=110)
    ap.add_argument("--remote-pods", default="meshpods",
                    help="comma-separated agent modes: meshpods (the default: this node's Pods + "
                         "the other nodes' MeshPod records), pods (every Pod of the cluster); "
                         "with both, each size runs both, alternating which goes first")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs of every (size, mode), modes alternating; medians reported")
    ap.add_argument("--quick", action="store_true", help="CI smoke: --pods 5000 --services 500")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--keep-workdir", action="store_true",
                    help="leave the agents' logs (timelines) and the API server's behind")
    a = ap.parse_args(argv)
    if a.quick:
        a.pods, a.services = "5000", 500
    sizes = [int(x) for x in str(a.pods).split(",") if x.strip()]
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    if os.geteuid() != 0:
        ap.error("needs root (the agent pins netns and runs Envoy)")
    root = tempfile.mkdtemp(prefix="aether-bench-scale-")
    ok = False
    try:
        modes = [m.strip() for m in str(a.remote_pods).split(",") if m.strip()]
        if not modes or set(modes) - {"meshpods", "pods"}:
            ap.error("--remote-pods takes meshpods and/or pods")
        runs = []
        for rnd in range(1, a.rounds + 1):
            for i, n in enumerate(sizes):
                for mode in (modes if (i + rnd) % 2 == 1 else modes[::-1]):
                    runs.append(run_size(root, n, mode, a, rnd))
        out = report(runs, a)
        if a.json:
            with open(a.json, "w") as f:
                f.write(dumps(out) + "\n")
        ok = True
    finally:
        if ok:
            release_mounts_under(root)  # the agents' shared <run-dir>/netns mounts
            if not a.keep_workdir:
                shutil.rmtree(root, ignore_errors=True)
            else:
                progress(f"workdir kept: {root}")
        else:
            progress(f"workdir kept: {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
