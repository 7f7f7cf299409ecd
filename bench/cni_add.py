"""Benchmark: `aether-cni` ADD latency as kubelet sees it, against an `nft -f` floor.

    python -m bench.cni_add [--pods 200] [--concurrency 1,16] [--no-envoy] [--json OUT]

For every concurrency level, fresh pods get a sandbox (netns, loopback, bridge + host-local)
outside the timed region; then only the exec of the `aether-cni` ADD is timed (subprocess
wall time, fork to exit). The floor is measured in the same run: the table
the agent programs (rendered from the decided policy), plain, applied to a fresh netns with
`nsenter --net=<netns> nft -f <file>` — what a pod's first ADD costs the kernel.
The agent runs as production runs it: the node Envoy on, so an ADD returns only once Envoy
has ACKed the pod's listener (``--no-envoy`` for the rules-only figure).
Targets (Envoy on): ADD p50 ≤ 2× floor p50 at concurrency 1, ≤ 1.5× at 16 and p99 at 16 ≤
100 ms. Root only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import psutil

from agent.capture.policy import decide
from agent.capture.rules import policy_hash, render_table
from agent.config import NodeConfig
from agent.netns.pin import release_mounts_under
from agent.source.model import NamespaceMeta, PodMeta
from bench.common import (
    AgentProc,
    Kubelet,
    Pod,
    Stats,
    delete_pods,
    dumps,
    machine_info,
    make_agent,
    plugin_env,
    pool_map,
    prepare_pod,
    progress,
    timed_run,
    write_pods,
)

NAMESPACE = "bench"
SUBNET4 = "10.215.0.0/16"
SUBNET6 = "fd00:a3e5::/64"
TARGET_RATIO = 2.0  # at concurrency 1
TARGET_RATIO_CONCURRENT = 1.5  # at concurrency > 1
TARGET_P99_CONCURRENT_MS = 100.0
BREAKDOWN_SAMPLES = 30


@dataclass
class Level:
    concurrency: int
    pods: list[Pod]
    confs: dict[str, dict[str, Any]] = field(default_factory=dict)  # container_id → netconf
    add: list[float] = field(default_factory=list)
    floor: list[float] = field(default_factory=list)
    add_wall_s: float = 0.0
    floor_wall_s: float = 0.0
    agent_cpu_s: float = 0.0  # the agent process's CPU over the timed ADDs
    envoy_cpu_s: float = 0.0  # the node Envoy's


class Bench:
    def __init__(self, workdir: str, pods: int, levels: list[int], envoy: bool = True) -> None:
        self.workdir = workdir
        self.envoy = envoy
        self._envoy_pid: int | None = None
        self._node: NodeConfig | None = None
        self.bridge = f"aetbn{uuid.uuid4().hex[:8]}"  # ≤ 15 chars (IFNAMSIZ)
        self.agent: AgentProc = make_agent(workdir, NAMESPACE, envoy=envoy)
        self.kubelet = Kubelet(workdir, self.bridge, SUBNET4, SUBNET6, {
            "agent_socket": self.agent.socket,
            "capture_redirect_all_default": True,
        })
        self.aether = os.path.join(self.kubelet.plugin_dir, "aether-cni")
        self.levels = [
            Level(c, [self.kubelet.new_pod(NAMESPACE, f"c{c}-{i:04d}") for i in range(pods)])
            for c in levels
        ]
        self.sandboxes: list[Pod] = []  # every pod whose netns may exist: cleaned at the end
        self.lock = threading.Lock()
        self.rulesets: dict[str, str] = {}  # policy hash → ruleset file

    # -- setup ---------------------------------------------------------------------------
    def start(self) -> None:
        write_pods(self.agent, [p for lv in self.levels for p in lv.pods])
        progress(f"starting agent (run dir {self.agent.run_dir}) …")
        self.agent.start()

    def prepare(self, level: Level) -> None:
        def one(pod: Pod) -> None:
            with self.lock:
                self.sandboxes.append(pod)
            level.confs[pod.container_id] = prepare_pod(self.kubelet, pod)

        progress(f"[c={level.concurrency}] creating {len(level.pods)} sandboxes "
                 "(netns, lo, bridge+host-local; untimed) …")
        pool_map(one, level.pods, min(8, 4 * (os.cpu_count() or 1)), "sandbox")

    def node_config(self) -> NodeConfig:
        """The node settings that shape the rules: the proxy cgroup the running agent found."""
        if self._node is None:
            ci = self.agent.status().get("capture_integrity") or {}
            self._node = NodeConfig(proxy_cgroup=ci.get("cgroup"),
                                    proxy_cgroup_level=int(ci.get("level") or 0))
        return self._node

    def ruleset_file(self, pod: Pod) -> str:
        """The ruleset the agent programs for this pod, from the same decision function."""
        decision = decide(
            PodMeta(namespace=pod.namespace, name=pod.name, uid=pod.uid),
            NamespaceMeta(NAMESPACE, {"aether.io/managed": "true"}),
            self.node_config(),
            redirect_all_default=True,
        )
        if not decision.captured or decision.policy is None:
            raise RuntimeError(f"pod {pod.name} would not be captured: {decision.reason}")
        key = policy_hash(decision.policy)
        with self.lock:
            if key not in self.rulesets:
                path = os.path.join(self.workdir, f"ruleset-{key}.nft")
                with open(path, "w") as f:
                    # the plain table definition into a fresh netns: the least the kernel
                    # must do for a first ADD (the agent's own first ADD creates it so too)
                    f.write(render_table(decision.policy))
                self.rulesets[key] = path
            return self.rulesets[key]

    # -- timed ---------------------------------------------------------------------------
    def time_add(self, level: Level) -> None:
        inputs = {p.container_id: (json.dumps(level.confs[p.container_id]),
                                   plugin_env(self.kubelet, p, "ADD")) for p in level.pods}

        def one(pod: Pod) -> float:
            stdin, env = inputs[pod.container_id]
            elapsed, _ = timed_run([self.aether], stdin, env)
            return elapsed

        progress(f"[c={level.concurrency}] timing aether-cni ADD …")
        cpu0 = self.cpu()
        t0 = time.perf_counter()
        level.add = pool_map(one, level.pods, level.concurrency, "ADD")
        level.add_wall_s = time.perf_counter() - t0
        cpu1 = self.cpu()
        level.agent_cpu_s, level.envoy_cpu_s = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]

    def cpu(self) -> tuple[float, float]:
        """CPU seconds so far of the agent and of its Envoy (0 without one)."""
        def of(pid: int | None) -> float:
            if not pid:
                return 0.0
            try:
                t = psutil.Process(pid).cpu_times()
            except psutil.Error:
                return 0.0
            return float(t.user + t.system)
        assert self.agent.proc is not None
        if self.envoy and self._envoy_pid is None:
            # asked once, before any timing: a status request costs the agent ~1 s of CPU
            # with hundreds of pods (it reads every pod's live table), which must not land
            # in the ADDs' CPU figure
            self._envoy_pid = int((self.agent.status().get("envoy") or {}).get("pid") or 0)
        return of(self.agent.proc.pid), of(self._envoy_pid)

    def time_floor(self, level: Level) -> None:
        """The plain table into a netns that never held one, like a pod's first ADD: one
        fresh netns per pod (made and removed outside the timed region)."""
        files = {p.container_id: self.ruleset_file(p) for p in level.pods}
        fresh = {p.container_id: f"aet-floor-{p.container_id[:10]}" for p in level.pods}
        for name in fresh.values():
            subprocess.run(["ip", "netns", "add", name], check=True)

        def one(pod: Pod) -> float:
            # nsenter, not `ip netns exec`: that remounts /sys, hiding /sys/fs/cgroup where nft
            # resolves the rules' proxy cgroup (and costing a mount namespace the agent never pays)
            elapsed, _ = timed_run(["nsenter", f"--net=/var/run/netns/{fresh[pod.container_id]}",
                                    "nft", "-f", files[pod.container_id]])
            return elapsed

        progress(f"[c={level.concurrency}] timing floor (nsenter --net … nft -f, fresh netns) …")
        try:
            t0 = time.perf_counter()
            level.floor = pool_map(one, level.pods, level.concurrency, "floor")
            level.floor_wall_s = time.perf_counter() - t0
        finally:
            for name in fresh.values():
                subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)

    def verify(self, level: Level) -> None:
        """The agent captured every pod, with the very ruleset the floor applies."""
        counters = self.agent.status().get("counters", {})
        expected = sum(len(lv.add) for lv in self.levels)
        if counters.get("add_ok") != expected:
            raise RuntimeError(f"agent counted {counters} captured ADDs, expected {expected}")
        pod = level.pods[0]
        listing = subprocess.run(["nsenter", f"--net={pod.netns}", "nft", "list", "table",
                                  "inet", "aether"], capture_output=True, text=True, check=True)
        key = os.path.basename(self.ruleset_file(pod))[len("ruleset-"):-len(".nft")]
        if key not in listing.stdout:
            raise RuntimeError(f"agent programmed a different policy than the floor's {key}:\n"
                               f"{listing.stdout}")

    def breakdown(self, pod: Pod) -> dict[str, Stats]:
        """Serial start-up costs that explain ADD and the floor (concurrency 1)."""
        env = plugin_env(self.kubelet, pod, "VERSION")
        cases: dict[str, list[str]] = {
            "python -c pass (same interpreter)": [sys.executable, "-c", "pass"],
            "python -I -S -c pass": [sys.executable, "-I", "-S", "-c", "pass"],
            "aether-cni VERSION (shim start, no agent)": [self.aether],
            "ip netns exec <ns> true": ["ip", "netns", "exec", pod.netns_name, "true"],
            "ip netns exec <ns> nft list tables": ["ip", "netns", "exec", pod.netns_name,
                                                   "nft", "list", "tables"],
        }
        out: dict[str, Stats] = {}
        for name, argv in cases.items():
            samples = [timed_run(argv, "{}", env)[0] for _ in range(BREAKDOWN_SAMPLES)]
            out[name] = Stats.of(samples)
        return out

    # -- teardown ------------------------------------------------------------------------
    def cleanup(self) -> None:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leak
        try:
            if self.sandboxes:
                progress(f"cleaning up {len(self.sandboxes)} pods …")
                delete_pods(self.kubelet, self.sandboxes)
            self.agent.stop()
            subprocess.run(["ip", "link", "del", self.bridge], check=False, capture_output=True)
        finally:
            signal.signal(signal.SIGINT, old)


def _sigterm(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def target_ratio(concurrency: int) -> float:
    return TARGET_RATIO if concurrency <= 1 else TARGET_RATIO_CONCURRENT


def report(levels: list[Level], breakdown: dict[str, Stats], machine: dict[str, str],
           pods: int, envoy: bool = True) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for lv in levels:
        add, floor = Stats.of(lv.add), Stats.of(lv.floor)
        ratio = add.p50_ms / floor.p50_ms
        met = ratio <= target_ratio(lv.concurrency) and (
            lv.concurrency <= 1 or add.p99_ms <= TARGET_P99_CONCURRENT_MS)
        rows.append({
            "concurrency": lv.concurrency,
            "pods": len(lv.add),
            "add": add.to_json(),
            "floor": floor.to_json(),
            "ratio_p50": round(ratio, 3),
            "ratio_p99": round(add.p99_ms / floor.p99_ms, 3),
            "add_throughput_pods_per_s": round(len(lv.add) / lv.add_wall_s, 2),
            "floor_throughput_per_s": round(len(lv.floor) / lv.floor_wall_s, 2),
            "agent_cpu_ms_per_add": round(1000 * lv.agent_cpu_s / len(lv.add), 2),
            "envoy_cpu_ms_per_add": round(1000 * lv.envoy_cpu_s / len(lv.add), 2),
            "target": (f"p50 <= {target_ratio(lv.concurrency):g}x floor" + (
                f", p99 <= {TARGET_P99_CONCURRENT_MS:g} ms" if lv.concurrency > 1 else "")),
            "target_met": met,
        })

    print()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()))
    mode = ("Envoy on: ADD returns after Envoy's ACK of the pod's listener" if envoy
            else "no Envoy: rules only")
    print(f"aether-cni ADD (exec wall time, as kubelet sees it; {mode}) vs floor "
          f"(nsenter --net=<fresh netns> nft -f <the plain table>), {pods} fresh pods per level, ms")
    head = (f"{'conc':>4} | {'ADD p50':>8} {'ADD p99':>8} {'ADD mean':>8} | "
            f"{'floor p50':>9} {'floor p99':>9} {'floor mean':>10} | "
            f"{'ratio p50':>9} | {'ADD pods/s':>10} | target")
    print(head)
    print("-" * len(head))
    for r in rows:
        a, f = r["add"], r["floor"]
        print(f"{r['concurrency']:>4} | {a['p50_ms']:>8.1f} {a['p99_ms']:>8.1f} "
              f"{a['mean_ms']:>8.1f} | {f['p50_ms']:>9.1f} {f['p99_ms']:>9.1f} "
              f"{f['mean_ms']:>10.1f} | {r['ratio_p50']:>8.2f}× | "
              f"{r['add_throughput_pods_per_s']:>10.1f} | "
              f"{'PASS' if r['target_met'] else 'MISS'} ({r['target']})")
    print()
    print("CPU per ADD (the machine's 2 CPUs are what 16 concurrent ADDs share), ms:")
    for r in rows:
        print(f"  concurrency {r['concurrency']:>2}: agent {r['agent_cpu_ms_per_add']:.2f}, "
              f"node Envoy {r['envoy_cpu_ms_per_add']:.2f}")
    print()
    print(f"start-up breakdown (serial, {BREAKDOWN_SAMPLES} runs each), ms:")
    for name, s in breakdown.items():
        print(f"  {name:<44} p50 {s.p50_ms:7.1f}  p99 {s.p99_ms:7.1f}")
    return {
        "benchmark": "cni_add",
        "machine": machine,
        "pods_per_level": pods,
        "envoy": envoy,
        "target": (f"ADD p50 <= {TARGET_RATIO:g}x floor p50 at concurrency 1, <= "
                   f"{TARGET_RATIO_CONCURRENT:g}x and p99 <= {TARGET_P99_CONCURRENT_MS:g} ms above"),
        "floor": "nsenter --net=<netns> nft -f <render_table(decide(...))> (plain table, fresh netns)",
        "levels": rows,
        "breakdown": {k: v.to_json() for k, v in breakdown.items()},
        "all_targets_met": all(r["target_met"] for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cni_add", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=200, help="fresh pods per concurrency level")
    ap.add_argument("--concurrency", default="1,16", help="comma-separated levels")
    ap.add_argument("--json", metavar="OUT", help="write the figures as JSON")
    ap.add_argument("--keep-workdir", action="store_true", help="leave agent log etc. behind")
    ap.add_argument("--no-envoy", action="store_true",
                    help="run the agent without its Envoy (the rules-only figure)")
    args = ap.parse_args(argv)
    levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    if args.pods < 1 or not levels or min(levels) < 1:
        ap.error("--pods and every --concurrency level must be ≥ 1")
    if os.geteuid() != 0:
        ap.error("needs root (netns, bridge, nftables)")

    signal.signal(signal.SIGTERM, _sigterm)
    workdir = tempfile.mkdtemp(prefix="aether-bench-")
    bench = Bench(workdir, args.pods, levels, envoy=not args.no_envoy)
    ok = False
    try:
        bench.start()
        for lv in bench.levels:
            bench.prepare(lv)
            bench.time_add(lv)
            bench.verify(lv)
            bench.time_floor(lv)
        progress("measuring start-up breakdown …")
        breakdown = bench.breakdown(bench.levels[0].pods[0])
        result = report(bench.levels, breakdown, machine_info(), args.pods,
                        envoy=not args.no_envoy)
        if args.json:
            with open(args.json, "w") as f:
                f.write(dumps(result) + "\n")
            progress(f"wrote {args.json}")
        ok = True
    except KeyboardInterrupt:
        progress("interrupted; cleaning up")
        return 130
    except Exception:
        if os.path.exists(bench.agent.log_path):
            progress("agent log tail:\n" + bench.agent.logs()[-2000:])
        raise
    finally:
        bench.cleanup()
        if args.keep_workdir or not ok:
            progress(f"workdir kept: {workdir}")
        else:
            release_mounts_under(workdir)  # the agent's shared <run-dir>/netns mount
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
