"""Shared pieces for the benchmarks: an agent, pod sandboxes, timed plugin execs, statistics.

The agent and the kubelet are the ones the integration tests use (`integration.conftest`,
`agent.testing.kubelet`); this module only adds what a benchmark needs on top: a sandbox
brought up to just before our plugin, and subprocess wall times measured the way kubelet
sees them (from fork to exit, input already serialized).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

from agent.testing.kubelet import CniError, Kubelet, Pod, exec_plugin
from integration.conftest import AgentProc

__all__ = [
    "AgentProc",
    "Kubelet",
    "Pod",
    "Stats",
    "machine_info",
    "plugin_env",
    "prepare_pod",
    "progress",
    "make_agent",
    "run_dir_on_tmpfs",
    "timed_run",
    "write_pods",
]


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


PROGRESS_EVERY = 50


def pool_map(fn: Callable[[Pod], Any], pods: list[Pod], workers: int, what: str) -> list[Any]:
    """fn over pods with `workers` threads; progress every PROGRESS_EVERY; stops on error."""
    pool = ThreadPoolExecutor(max_workers=workers)
    results: list[Any] = []
    try:
        futures: list[Future[Any]] = [pool.submit(fn, p) for p in pods]
        for done, fut in enumerate(as_completed(futures), 1):
            results.append(fut.result())
            if done % PROGRESS_EVERY == 0 or done == len(pods):
                progress(f"  {what}: {done}/{len(pods)}")
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return results


def delete_pods(kubelet: Kubelet, pods: list[Pod]) -> None:
    """DEL every pod, 8 at a time; the netns goes even when DEL fails (best-effort teardown)."""
    def one(pod: Pod) -> None:
        try:
            kubelet.delete(pod)
        except Exception:  # noqa: BLE001 - best effort teardown
            subprocess.run(["ip", "netns", "del", pod.netns_name], check=False,
                           capture_output=True)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, pods))


def run_dir_on_tmpfs(agent: AgentProc) -> AgentProc:
    """Mount a tmpfs at the agent's run dir, where production has it: the DaemonSet's
    ``/var/run/aether`` and the systemd unit's ``/run/aether`` live on the node's ``/run``, a
    tmpfs. An ADD writes its intent and its record there; on this machine's ext4 ``/tmp``, 16
    concurrent ADDs creating files in one directory cost the agent ~2 ms of CPU each on the
    directory's lock (measured: 6.8–7.9 against 4.6–4.8 ms of agent CPU per ADD), a cost no
    node pays. The mount goes with ``release_mounts_under`` of the benchmark's workdir."""
    os.makedirs(agent.run_dir, mode=0o700, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700,size=256m", "aether-run",
                    agent.run_dir], check=True)
    return agent


def make_agent(workdir: str, namespace: str, envoy: bool = False) -> AgentProc:
    """An agent (info logging; Envoy only if asked) whose manifests mark `namespace` managed,
    its run dir on a tmpfs as on a node; not started."""
    agent = run_dir_on_tmpfs(AgentProc(workdir, envoy=envoy, extra=["--log-level", "info"]))
    agent.write("bench-namespace.yaml", [
        {"apiVersion": "v1", "kind": "Namespace",
         "metadata": {"name": namespace, "labels": {"aether.io/managed": "true"}}},
    ])
    return agent


def write_pods(agent: AgentProc, pods: list[Pod]) -> None:
    """Every pod in one manifest written before start: no directory re-read while timing."""
    agent.write("bench-pods.yaml", [
        {"apiVersion": "v1", "kind": "Pod",
         "metadata": {"name": p.name, "namespace": p.namespace, "uid": p.uid,
                      "labels": {}, "annotations": {}},
         "spec": {"nodeName": "test-node", "serviceAccountName": "default"}}
        for p in pods
    ])


def prepare_pod(kubelet: Kubelet, pod: Pod) -> dict[str, Any]:
    """Sandbox + every plugin of the conflist but the last; returns the last plugin's netconf.

    pod.result holds the prevResult (what the primary plugin returned), exactly what kubelet
    would hand aether-cni.
    """
    kubelet.create_sandbox(pod)
    conflist: dict[str, Any] = kubelet.conflist
    plugins: list[dict[str, Any]] = conflist["plugins"]
    prev: dict[str, Any] | None = None
    for plugin in plugins[:-1]:
        conf = dict(plugin, name=conflist["name"], cniVersion=kubelet.cni_version)
        if prev is not None:
            conf["prevResult"] = prev
        prev = exec_plugin(kubelet.plugin_dir, plugin["type"], "ADD", conf, pod.container_id,
                           pod.netns, "eth0", pod.cni_args)
    pod.result = prev or {}
    return dict(plugins[-1], name=conflist["name"], cniVersion=kubelet.cni_version,
                prevResult=pod.result)


def plugin_env(kubelet: Kubelet, pod: Pod, command: str) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": pod.container_id,
        "CNI_NETNS": pod.netns,
        "CNI_IFNAME": "eth0",
        "CNI_ARGS": pod.cni_args,
        "CNI_PATH": kubelet.plugin_dir,
    }


def timed_run(argv: list[str], stdin: str = "", env: dict[str, str] | None = None,
              timeout: float = 60.0) -> tuple[float, str]:
    """Wall time of one subprocess (fork → exit), stdout; raises CniError on a non-zero exit."""
    t0 = time.perf_counter()
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, env=env,
                          timeout=timeout, check=False)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise CniError(os.path.basename(argv[0]), proc.returncode, proc.stdout, proc.stderr)
    return elapsed, proc.stdout


@dataclass(frozen=True)
class Stats:
    n: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float

    @classmethod
    def of(cls, seconds: list[float]) -> Stats:
        if not seconds:
            raise ValueError("no samples")
        ms = sorted(s * 1000.0 for s in seconds)
        return cls(len(ms), _pct(ms, 50), _pct(ms, 99), statistics.fmean(ms), ms[0], ms[-1])

    def to_json(self) -> dict[str, float]:
        return {"n": self.n, "p50_ms": round(self.p50_ms, 3), "p99_ms": round(self.p99_ms, 3),
                "mean_ms": round(self.mean_ms, 3), "min_ms": round(self.min_ms, 3),
                "max_ms": round(self.max_ms, 3)}


def _pct(sorted_ms: list[float], pct: float) -> float:
    """Linear-interpolated percentile (numpy's default) of an already sorted list."""
    if len(sorted_ms) == 1:
        return sorted_ms[0]
    rank = (len(sorted_ms) - 1) * pct / 100.0
    lo = int(rank)
    hi = min(lo + 1, len(sorted_ms) - 1)
    return sorted_ms[lo] + (sorted_ms[hi] - sorted_ms[lo]) * (rank - lo)


def _cmd_version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=10)
    except OSError:
        return "unknown"
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr) \
        else "unknown"


def machine_info() -> dict[str, str]:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "nproc": str(os.cpu_count() or 0),
        "cpu": cpu,
        "kernel": platform.release(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "nft": _cmd_version(["nft", "--version"]),
    }


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True)


def teardown_node(kubelet: Kubelet, pods: list[Pod], agent: AgentProc, bridge: str,
                  workdir: str) -> None:
    """Best-effort teardown of a benchmark node: pods (DEL, else their netns), the agent,
    the bridge and the netns pins under ``workdir``."""
    from agent.netns.pin import release_mounts_under
    for p in reversed(pods):
        try:
            kubelet.delete(p)
        except Exception:  # noqa: BLE001 - best-effort teardown
            subprocess.run(["ip", "netns", "del", p.netns_name], check=False, capture_output=True)
    agent.stop()
    subprocess.run(["ip", "link", "del", bridge], check=False, capture_output=True)
    release_mounts_under(workdir)


def bench_cli(prog: str, doc: str | None, tool: str, tool_hint: str, prefix: str,
              run: Callable[[int, float, str], dict[str, Any]], argv: list[str] | None) -> int:
    """The shared CLI of the round-based data-path benchmarks: --rounds/--duration/--quick/
    --json; root and ``tool`` required; ``run(rounds, duration, workdir)`` in a temp dir."""
    import argparse
    import shutil
    import tempfile
    ap = argparse.ArgumentParser(prog=prog, description=doc)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--quick", action="store_true", help="1 round of 2 s (CI smoke)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    if os.geteuid() != 0 or shutil.which(tool) is None:
        print(f"{prog} needs root and {tool_hint}", file=sys.stderr)
        return 2
    rounds, duration = (1, 2.0) if args.quick else (args.rounds, args.duration)
    workdir = tempfile.mkdtemp(prefix=prefix)
    try:
        out = run(rounds, duration, workdir)
    except BaseException:
        # the agent's and Envoy's logs are the only account of what went wrong
        print(f"{prog}: failed; workdir kept: {workdir}", file=sys.stderr)
        raise
    shutil.rmtree(workdir, ignore_errors=True)
    out["machine"] = machine_info()
    if args.json:
        with open(args.json, "w") as f:
            f.write(dumps(out))
    else:
        print(json.dumps(out, indent=1)[:4000])
    return 0
