"""Benchmark: `aether-cni` ADD latency as kubelet sees it, against an `nft -f` floor.

    python -m bench.cni_add [--pods 200] [--concurrency 1,16] [--rounds 3] [--no-envoy]
                            [--json OUT]

For every concurrency level and round, fresh pods get a sandbox (netns, loopback, bridge +
host-local) outside the timed region; then only the exec of the `aether-cni` ADD is timed
(subprocess wall time, fork to exit). The floor is measured in the same rounds: the table
the agent programs (rendered from the decided policy), plain, applied to a fresh netns with
`nsenter --net=<netns> nft -f <file>` — what a pod's first ADD costs the kernel. Each round
times ``--pods`` ADDs and as many floors, in alternating order (ADD first in even rounds,
the floor first in odd ones); a level's figure is the median of its rounds' ratios (ADD p50
over floor p50, each round's own), printed with their spread, and its p99 the median of its
rounds' p99s.
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
import statistics
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
from agent.common.config import NodeConfig
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
    """One round of one concurrency level: its pods, their ADD and floor timings."""

    concurrency: int
    pods: list[Pod]
    round: int = 0
    confs: dict[str, dict[str, Any]] = field(default_factory=dict)  # container_id → netconf
    add: list[float] = field(default_factory=list)
    floor: list[float] = field(default_factory=list)
    add_wall_s: float = 0.0
    floor_wall_s: float = 0.0
    agent_cpu_s: float = 0.0  # the agent process's CPU over the timed ADDs
    envoy_cpu_s: float = 0.0  # the node Envoy's


class Bench:
    def __init__(self, workdir: str, pods: int, levels: list[int], envoy: bool = True,
                 rounds: int = 1) -> None:
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
            Level(c, [self.kubelet.new_pod(NAMESPACE, f"c{c}-r{r}-{i:04d}") for i in range(pods)],
                  round=r)
            for c in levels for r in range(rounds)
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

        progress(f"[c={level.concurrency} round {level.round + 1}] creating {len(level.pods)} sandboxes "
                 "(netns, lo, bridge+host-local; untimed) …")
        pool_map(one, level.pods, min(8, 4 * (os.cpu_count() or 1)), "sandbox")

    def node_config(self) -> NodeConfig:
        """The node settings that shape the rules: the proxy cgroup the running agent found,
        and its DNS capture (on by default: the rules then send port 53 to the pod DNS)."""
        if self._node is None:
            st = self.agent.status()
            ci = st.get("capture_integrity") or {}
            dns = st.get("dns")
            self._node = NodeConfig(proxy_cgroup=ci.get("cgroup"),
                                    proxy_cgroup_level=int(ci.get("level") or 0),
                                    dns_capture=dns is not None,
                                    dns_port=int((dns or {}).get("port") or 15053))
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

        progress(f"[c={level.concurrency} round {level.round + 1}] timing aether-cni ADD …")
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

        progress(f"[c={level.concurrency} round {level.round + 1}] timing floor "
                 "(nsenter --net … nft -f, fresh netns) …")
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

    def release(self, level: Level) -> None:
        """DEL a finished round's pods (untimed): a bridge takes 1024 ports, and a node holds
        about a hundred pods, not every round's; the breakdown keeps the first level's first
        pod."""
        keep = self.levels[0].pods[0]
        gone = [p for p in level.pods if p is not keep]
        progress(f"[c={level.concurrency} round {level.round + 1}] deleting {len(gone)} pods "
                 "(untimed) …")
        delete_pods(self.kubelet, gone)
        with self.lock:
            self.sandboxes = [p for p in self.sandboxes if p not in gone]

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


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def report(levels: list[Level], breakdown: dict[str, Stats], machine: dict[str, str],
           pods: int, envoy: bool = True) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for c in sorted({lv.concurrency for lv in levels}):
        rounds = [lv for lv in levels if lv.concurrency == c and lv.add and lv.floor]
        per = [(Stats.of(lv.add), Stats.of(lv.floor)) for lv in rounds]
        ratios = [a.p50_ms / f.p50_ms for a, f in per]
        p99s = [a.p99_ms for a, _ in per]
        ratio, p99 = _median(ratios), _median(p99s)
        add = Stats.of([x for lv in rounds for x in lv.add])
        floor = Stats.of([x for lv in rounds for x in lv.floor])
        met = ratio <= target_ratio(c) and (c <= 1 or p99 <= TARGET_P99_CONCURRENT_MS)
        n_add = sum(len(lv.add) for lv in rounds)
        rows.append({
            "concurrency": c,
            "rounds": len(rounds),
            "pods": n_add,
            "add": add.to_json(),  # every round's ADDs together
            "floor": floor.to_json(),
            "add_p50_ms_median": round(_median([a.p50_ms for a, _ in per]), 3),
            "floor_p50_ms_median": round(_median([f.p50_ms for _, f in per]), 3),
            "add_p99_ms_median": round(p99, 3),
            "add_p99_ms_rounds": [round(x, 3) for x in p99s],
            "ratio_p50": round(ratio, 3),  # the median of the rounds' own ratios
            "ratio_p50_rounds": [round(x, 3) for x in ratios],
            "ratio_p99": round(add.p99_ms / floor.p99_ms, 3),
            "add_throughput_pods_per_s": round(n_add / sum(lv.add_wall_s for lv in rounds), 2),
            "floor_throughput_per_s": round(sum(len(lv.floor) for lv in rounds)
                                            / sum(lv.floor_wall_s for lv in rounds), 2),
            "agent_cpu_ms_per_add": round(1000 * sum(lv.agent_cpu_s for lv in rounds) / n_add, 2),
            "envoy_cpu_ms_per_add": round(1000 * sum(lv.envoy_cpu_s for lv in rounds) / n_add, 2),
            "target": (f"p50 <= {target_ratio(c):g}x floor" + (
                f", p99 <= {TARGET_P99_CONCURRENT_MS:g} ms" if c > 1 else "")),
            "target_met": met,
        })

    print()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()))
    mode = ("Envoy on: ADD returns after Envoy's ACK of the pod's listener" if envoy
            else "no Envoy: rules only")
    n_rounds = max((r["rounds"] for r in rows), default=0)
    print(f"aether-cni ADD (exec wall time, as kubelet sees it; {mode}) vs floor "
          f"(nsenter --net=<fresh netns> nft -f <the plain table>), {pods} fresh pods per "
          f"round, {n_rounds} round(s) per level in alternating order; medians over the "
          "rounds, ms")
    head = (f"{'conc':>4} | {'ADD p50':>8} {'ADD p99':>8} | {'floor p50':>9} | "
            f"{'ratio p50 (spread)':>20} | {'ADD pods/s':>10} | target")
    print(head)
    print("-" * len(head))
    for r in rows:
        rr = r["ratio_p50_rounds"]
        spread = f"{r['ratio_p50']:.2f}× ({min(rr):.2f}–{max(rr):.2f})"
        print(f"{r['concurrency']:>4} | {r['add_p50_ms_median']:>8.1f} "
              f"{r['add_p99_ms_median']:>8.1f} | {r['floor_p50_ms_median']:>9.1f} | "
              f"{spread:>20} | {r['add_throughput_pods_per_s']:>10.1f} | "
              f"{'PASS' if r['target_met'] else 'MISS'} ({r['target']})")
        if len(rr) > 1:
            print(f"       rounds: ratio {', '.join(f'{x:.2f}' for x in rr)}; ADD p99 "
                  f"{', '.join(f'{x:.0f}' for x in r['add_p99_ms_rounds'])} ms")
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
        "pods_per_round": pods,
        "rounds": n_rounds,
        "envoy": envoy,
        "target": (f"ADD p50 <= {TARGET_RATIO:g}x floor p50 at concurrency 1, <= "
                   f"{TARGET_RATIO_CONCURRENT:g}x and p99 <= {TARGET_P99_CONCURRENT_MS:g} ms above "
                   "(medians over the rounds)"),
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
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds per level (ADD and floor in alternating order)")
    ap.add_argument("--json", metavar="OUT", help="write the figures as JSON")
    ap.add_argument("--keep-workdir", action="store_true", help="leave agent log etc. behind")
    ap.add_argument("--no-envoy", action="store_true",
                    help="run the agent without its Envoy (the rules-only figure)")
    args = ap.parse_args(argv)
    levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    if args.pods < 1 or args.rounds < 1 or not levels or min(levels) < 1:
        ap.error("--pods, --rounds and every --concurrency level must be ≥ 1")
    if os.geteuid() != 0:
        ap.error("needs root (netns, bridge, nftables)")

    signal.signal(signal.SIGTERM, _sigterm)
    workdir = tempfile.mkdtemp(prefix="aether-bench-")
    bench = Bench(workdir, args.pods, levels, envoy=not args.no_envoy, rounds=args.rounds)
    ok = False
    try:
        bench.start()
        for lv in bench.levels:
            bench.prepare(lv)
            if lv.round % 2 == 0:
                bench.time_add(lv)
                bench.time_floor(lv)
            else:
                bench.time_floor(lv)
                bench.time_add(lv)
            bench.verify(lv)
            bench.release(lv)
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
