"""`python -m bench.takeover`: the hitless upgrade at 110 pods, under load (#40).

One node: the real ``aether-agent run`` with its Envoy, 110 captured pods (a client, a web
and a raw server, fillers), each agent in a cgroup v2 of its own as a container runtime puts
it. The load of integration/test_takeover.py runs throughout: a new connection every 25 ms to
a passthrough destination and to an in-mesh L4 Service, HTTP keep-alive requests to an
``appProtocol: http`` Service (a request on a cleanly closed connection retried once, as HTTP
clients do), four long-lived L4 connections.

- **Take-overs** (``--takeovers``, 10): a new agent with the same flags and run dir starts in a
  new cgroup; once it answers ready, the old one gets SIGTERM and its cgroup is killed when it
  has exited (what the runtime does). Counted per take-over: failed new connections and HTTP
  requests, the overlap (new agent started → old agent exited, with ``--drain-seconds``), the
  new agent's CPU over it (and its Envoy's).
- **The baseline, a crash of the whole pod** (``--crashes``, 3): the serving agent's cgroup is
  killed (agent, keeper and Envoy at once: an OOM kill, a node-level kill), a new agent
  starts at once in a new cgroup. Measured: the time until all 110 pods' listeners are live
  again (status: ``listener: live``), and the failures the same load sees meanwhile (fail
  closed: the pods' tables stay, nothing is proxied until the new Envoy listens).

The take-over's failures are judged against zero (the goal); the crash's, in the same run,
show what the take-over spares.
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
import time
from typing import Any

import psutil

from agent.netns.pin import release_mounts_under
from agent.testing.netutil import http_echo_server
from agent.testing.takeover_load import (
    EXT_PORT,
    RAW_PORT,
    Load,
    answers,
    echo_server,
    envoys_of,
    in_cgroup,
    kill_cgroup,
    new_cgroup,
    remove_cgroup,
    services,
    works,
)
from bench.common import dumps, machine_info, progress, run_dir_on_tmpfs
from integration.conftest import EnvoyNode, until

DRAIN_S = 3.0
KINDS = ("passthrough", "service", "http")


class Agents:
    """The agent processes of the node, one after another, each in its own cgroup."""

    def __init__(self, n: EnvoyNode, workdir: str) -> None:
        self.n, self.workdir = n, workdir
        self.run_dir = n.agent.run_dir
        self.serial = 0
        self.cgroup = new_cgroup("bench-0")
        n.agent.wrapper = in_cgroup(self.cgroup)
        self.cgroups = [self.cgroup]
        self.proc: subprocess.Popen[bytes] | None = None
        self.base: list[str] = []

    def start_first(self) -> None:
        self.n.agent.start()
        self.proc = self.n.agent.proc
        assert self.proc is not None
        args = [str(a) for a in self.proc.args]  # type: ignore[union-attr]
        self.base = args[len(self.n.agent.wrapper):]

    def instance(self) -> str:
        return f"agent-{self.serial}"

    def start_next(self) -> tuple[subprocess.Popen[bytes], str]:
        """A new agent with the first one's flags, in a new cgroup (not yet waited on)."""
        self.serial += 1
        cg = new_cgroup(f"bench-{self.serial}")
        self.cgroups.append(cg)
        cmd = in_cgroup(cg) + self.base
        cmd[cmd.index("agent-0")] = self.instance()
        log = open(os.path.join(self.workdir, f"agent-{self.serial}.log"), "ab")  # noqa: SIM115
        proc = subprocess.Popen(cmd, stdout=log, stderr=log)
        return proc, cg

    def ready(self, proc: subprocess.Popen[bytes], timeout: float = 120,
              poll: float = 0.05) -> None:
        """Until the newest agent answers ready on its control socket (polled every
        ``poll`` s: the take-over's figures are read off it)."""
        name = self.instance()
        deadline = time.monotonic() + timeout
        while not answers(self.run_dir, name):
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode}: see "
                                   f"{self.workdir}/agent-{self.serial}.log")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready after {timeout:.0f} s")
            time.sleep(poll)

    def stop_all(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(DRAIN_S + 30)
            except subprocess.TimeoutExpired:
                pass
        for cg in self.cgroups:
            remove_cgroup(cg)


def _cpu_s(pid: int) -> float:
    try:
        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    except psutil.Error:
        return float("nan")


def _failures_since(load: Load, n: int, t0: float) -> list[str]:
    """The first few failures after the ``n``-th: when (s after ``t0``), what, the error."""
    return [f"{t - t0:+.2f}s {kind}: {err}" for t, kind, err in load.failures_since(n)]


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in KINDS}


def _takeover(agents: Agents, load: Load) -> dict[str, Any]:
    old, old_cg = agents.proc, agents.cgroup
    assert old is not None
    envoys_before = set(envoys_of(agents.run_dir))
    ok0, failed0 = load.counts(KINDS)
    n_failed, wall0 = len(load.failures), time.time()
    t0 = time.monotonic()
    proc, cg = agents.start_next()
    agents.ready(proc, poll=0.05)
    t_ready = time.monotonic()
    envoy_new = [p for p in envoys_of(agents.run_dir) if p not in envoys_before]
    time.sleep(1.0)  # the overlap carries load: A retired, B serving
    old.send_signal(signal.SIGTERM)
    old.wait(DRAIN_S + 30)
    t_exit = time.monotonic()
    cpu_agent = _cpu_s(proc.pid)  # `sh -c exec`: the agent itself
    cpu_envoy = sum(_cpu_s(p) for p in envoy_new)
    kill_cgroup(old_cg)  # the runtime: the pod's containers ended, what is left dies
    until(lambda: not (set(envoys_of(agents.run_dir)) & envoys_before),
          "the replaced agent's Envoy outlived it", timeout=30)
    ok1, failed1 = load.counts(KINDS)
    agents.proc, agents.cgroup = proc, cg
    return {"ready_s": t_ready - t0, "overlap_s": t_exit - t0, "exit_after_term_s":
            t_exit - t_ready - 1.0, "agent_cpu_s": cpu_agent, "envoy_cpu_s": cpu_envoy,
            "ok": _delta(ok1, ok0), "failed": _delta(failed1, failed0),
            "failures": _failures_since(load, n_failed, wall0)}


def _all_live(agents: Agents, pods: int) -> bool:
    try:
        st = agents.n.agent.status()
    except OSError:
        return False
    live = [p for p in st.get("pods", []) if p.get("listener") == "live"]
    return len(live) >= pods


def _crash(agents: Agents, load: Load, pods: int) -> dict[str, Any]:
    old = agents.proc
    assert old is not None
    envoys_before = set(envoys_of(agents.run_dir))
    ok0, failed0 = load.counts(KINDS)
    t_kill = time.monotonic()
    kill_cgroup(agents.cgroup)  # agent, keeper and Envoy at once
    old.wait(30)
    until(lambda: not (set(envoys_of(agents.run_dir)) & envoys_before),
          "the killed agent's Envoy lived on", timeout=30)
    t0 = time.monotonic()
    proc, cg = agents.start_next()
    agents.proc, agents.cgroup = proc, cg
    agents.ready(proc)
    t_ready = time.monotonic()
    deadline = t0 + 120
    while not _all_live(agents, pods):  # polled finer than `until`: this is the figure
        assert time.monotonic() < deadline, "not every listener came back"
        time.sleep(0.05)
    t_live = time.monotonic()
    time.sleep(1.0)  # the load's connections in flight at t_live settle
    ok1, failed1 = load.counts(KINDS)
    return {"live_s": t_live - t0, "live_after_kill_s": t_live - t_kill,
            "ready_s": t_ready - t0, "ok": _delta(ok1, ok0), "failed": _delta(failed1, failed0)}


def _median_spread(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "spread": [min(xs), max(xs)], "n": len(xs)}


def summarize(takeovers: list[dict[str, Any]], crashes: list[dict[str, Any]], pods: int,
              load: Load) -> dict[str, Any]:
    def total(rows: list[dict[str, Any]], key: str, kinds: tuple[str, ...]) -> int:
        return sum(r[key][k] for r in rows for k in kinds)

    new_kinds = ("passthrough", "service")
    out: dict[str, Any] = {
        "pods": pods, "drain_seconds": DRAIN_S, "takeovers": takeovers, "crashes": crashes,
        "takeover": {
            "new_connections": total(takeovers, "ok", new_kinds)
            + total(takeovers, "failed", new_kinds),
            "new_connection_failures": total(takeovers, "failed", new_kinds),
            "http_requests": total(takeovers, "ok", ("http",)) + total(takeovers, "failed",
                                                                       ("http",)),
            "http_failures": total(takeovers, "failed", ("http",)),
            "ready_s": _median_spread([t["ready_s"] for t in takeovers]),
            "overlap_s": _median_spread([t["overlap_s"] for t in takeovers]),
            "agent_cpu_s": _median_spread([t["agent_cpu_s"] for t in takeovers]),
            "envoy_cpu_s": _median_spread([t["envoy_cpu_s"] for t in takeovers]),
        },
        "http_retries": load.http_retries,
        "long_lived_cut": len(load.long_cut),
    }
    if crashes:
        out["crash"] = {
            "new_connections": total(crashes, "ok", new_kinds) + total(crashes, "failed",
                                                                       new_kinds),
            "new_connection_failures": total(crashes, "failed", new_kinds),
            "http_requests": total(crashes, "ok", ("http",)) + total(crashes, "failed",
                                                                     ("http",)),
            "http_failures": total(crashes, "failed", ("http",)),
            "live_s": _median_spread([c["live_s"] for c in crashes]),
            "ready_s": _median_spread([c["ready_s"] for c in crashes]),
        }
    t = out["takeover"]
    out["target_met"] = t["new_connection_failures"] == 0 and t["http_failures"] == 0
    return out


def run(n_takeovers: int, n_crashes: int, n_pods: int, workdir: str) -> dict[str, Any]:
    bridge = f"aetk{os.getpid() % 100000}"
    n = EnvoyNode(workdir, bridge, extra=["--drain-seconds", str(DRAIN_S),
                                          "--instance", "agent-0", "--log-level", "info"])
    run_dir_on_tmpfs(n.agent)
    agents = Agents(n, workdir)
    load: Load | None = None
    servers: list[Any] = []
    try:
        progress(f"[takeover] starting the agent, then {n_pods} pods …")
        agents.start_first()
        n.wait_ready()
        n.agent.write("svcs.yaml", services())
        web = n.pod(name="web-0", labels={"app": "web"})
        raw = n.pod(name="raw-0", labels={"app": "raw"})
        ext = n.pod(namespace="plain", name="ext-0")  # not in the mesh: passthrough
        client = n.pod(name="client-0",
                       annotations={"aether.io/dependencies": "app/web,app/raw"})
        captured = [web, raw, client] + [n.pod(name=f"fill-{i}")
                                         for i in range(max(0, n_pods - 3))]
        for i, p in enumerate([ext, *captured], 1):
            n.add(p)
            if i % 25 == 0:
                progress(f"  ADD {i}/{len(captured) + 1}")
        http_echo_server(web.netns, "0.0.0.0", 8080, "web-0")
        servers = [echo_server(raw.netns, RAW_PORT), echo_server(ext.netns, EXT_PORT)]
        load = Load(client, ext.ip())
        until(lambda: works(load), "the captured client never reached all three destinations")
        until(lambda: _all_live(agents, len(captured)), "not every pod's listener is live",
              timeout=120)
        load.start()
        time.sleep(1.0)
        takeovers: list[dict[str, Any]] = []
        for i in range(n_takeovers):
            progress(f"[takeover] take-over {i + 1}/{n_takeovers} …")
            takeovers.append(_takeover(agents, load))
            t = takeovers[-1]
            progress(f"  ready {t['ready_s']:.1f} s, overlap {t['overlap_s']:.1f} s, "
                     f"failed {t['failed']}, ok {t['ok']}")
            for f in t["failures"]:
                progress(f"    {f}")
        crashes: list[dict[str, Any]] = []
        for i in range(n_crashes):
            progress(f"[takeover] crash of the whole pod {i + 1}/{n_crashes} …")
            crashes.append(_crash(agents, load, len(captured)))
            c = crashes[-1]
            progress(f"  all {len(captured)} listeners live {c['live_s']:.1f} s after the "
                     f"restart; failed {c['failed']}")
            until(lambda: works(load), "the load did not recover after the crash")
        load.finish()
        return summarize(takeovers, crashes, len(captured), load)
    finally:
        if load is not None:
            load.finish()
        for s in servers:
            s.close()
        n.cleanup()
        agents.stop_all()
        subprocess.run(["ip", "link", "del", bridge], check=False, capture_output=True)
        release_mounts_under(workdir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.takeover", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--takeovers", type=int, default=10)
    ap.add_argument("--crashes", type=int, default=3)
    ap.add_argument("--pods", type=int, default=110)
    ap.add_argument("--quick", action="store_true", help="2 take-overs, 1 crash, 20 pods (CI)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.takeover needs root (netns, cgroups)", file=sys.stderr)
        return 2
    takeovers, crashes, pods = ((2, 1, 20) if args.quick
                                else (args.takeovers, args.crashes, args.pods))
    workdir = tempfile.mkdtemp(prefix="aether-bench-takeover-")
    try:
        out = run(takeovers, crashes, pods, workdir)
    except BaseException:
        print(f"bench.takeover: failed; workdir kept: {workdir}", file=sys.stderr)
        raise
    if os.environ.get("AETHER_KEEP_WORKDIR"):
        print(f"bench.takeover: workdir kept: {workdir}", file=sys.stderr)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    out["machine"] = machine_info()
    if args.json:
        with open(args.json, "w") as f:
            f.write(dumps(out))
    else:
        print(json.dumps({k: v for k, v in out.items() if k not in ("takeovers", "crashes")},
                         indent=1))
    return 0 if out["target_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
