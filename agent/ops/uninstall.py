"""`aether-agent uninstall`: release every pod this node captured and stop the node Envoy.

Removing aether must never leave a pod with redirect rules and no proxy behind them (all its
outbound TCP would be refused until it restarts). The order is the one that loses nothing:
1. the CNI entry goes first (optional here; `cni-install` does it in Kubernetes), so no new
   pod is captured;
2. each pod's table is dropped before its listener (new connections flow directly at once;
   connections open through the proxy end when its listener drains);
3. pins and records go, then Envoy stops.
With an agent serving, the agent does 2–3 itself (it holds the per-pod locks); without one,
this command does them from the run dir's records.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from agent.capture.rules import render_releasing
from agent.cni.state import CapturedPod, StateStore
from agent.netns.dataplane import DATAPLANE_ERRORS, CaptureDataplane, NftDataplane
from agent.netns.enter import NetnsGone
from agent.runtime.recovery import recover_interrupted_adds

log = logging.getLogger("aether.uninstall")


@dataclass
class Report:
    released: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    envoy_stopped: bool = False

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_json(self) -> dict[str, object]:
        return {"released": self.released, "failed": self.failed, "notes": self.notes,
                "envoy_stopped": self.envoy_stopped, "ok": self.ok}


def release_record(pod: CapturedPod, dataplane: CaptureDataplane | None = None) -> str:
    """Drop a recorded pod's table and its pin; '' on success, else what went wrong."""
    dp = dataplane or NftDataplane()
    problems = []
    targets = [pod.netns]
    if pod.pinned and pod.kubelet_netns and dp.netns_state(pod.netns) != "netns":
        targets.append(pod.kubelet_netns)  # the pin's mount is gone; the netns may not be
    for target in targets:
        try:
            if dp.identity(target) in dp.host_identities():
                continue  # never touch the node's own netns
        except OSError:
            continue  # gone: its rules went with it
        try:
            dp.drop(target)
        except NetnsGone:
            pass
        except DATAPLANE_ERRORS as e:
            problems.append(f"dropping the table in {target}: {e}")
    if pod.pinned and os.path.lexists(pod.netns):
        try:
            dp.unpin(pod.netns)
        except OSError as e:
            problems.append(f"removing pin {pod.netns}: {e}")
    return "; ".join(problems)


def release_offline(run_dir: str, progress: Callable[[str], None],
                    dataplane: CaptureDataplane | None = None) -> Report:
    """No agent serves: release from the records under `run_dir` and stop its Envoy."""
    dp = dataplane or NftDataplane()
    report = Report()
    store = StateStore(os.path.join(run_dir, "pods"))
    store.load()
    recover_interrupted_adds(store, os.path.join(run_dir, "netns"), report.notes.append, dp)
    pods = store.all()
    # An Envoy the dead agent left may still carry connections: stop redirecting new ones
    # but keep NAT for the open ones until Envoy's exit has closed them.
    for pod in pods:
        try:
            dp.apply(pod.netns, render_releasing())
        except DATAPLANE_ERRORS:
            pass  # released below all the same
    report.envoy_stopped = stop_envoy(run_dir, progress)
    if pods:
        time.sleep(1.0)  # the FIN/RST of Envoy's exit reach the pods through the NAT
    for i, pod in enumerate(sorted(pods, key=lambda p: p.key), 1):
        problem = release_record(pod, dp)
        if problem:
            report.failed.append(f"{pod.key}: {problem}")
            progress(f"[{i}/{len(pods)}] {pod.key}: FAILED: {problem}")
            continue
        store.remove(pod.container_id)
        report.released.append(pod.key)
        progress(f"[{i}/{len(pods)}] {pod.key}: released")
    for seen in store.all_seen():
        store.remove_seen(seen.container_id)
    return report


def stop_envoy(run_dir: str, progress: Callable[[str], None], timeout: float = 10.0) -> bool:
    """Stop every Envoy (and keeper) agents with this run dir left running, in either slot
    (a take-over runs the new agent's Envoy in the other one). True when none is left."""
    from agent.runtime.takeover import SLOTS
    stopped = all([stop_slot(os.path.join(run_dir, slot), progress, timeout) for slot in SLOTS])
    return stop_pod_dns(run_dir, progress, timeout) and stopped


def stop_pod_dns(run_dir: str, progress: Callable[[str], None], timeout: float = 10.0) -> bool:
    """The pod DNS processes of this run dir (one left lingering by a stopped agent)."""
    return _stop_matching(lambda cmd: "agent.dns.server" in cmd and run_dir in cmd,
                          "the pod DNS", progress, timeout,
                          [os.path.join(run_dir, "dns.pid")])


def stop_slot(envoy_dir: str, progress: Callable[[str], None], timeout: float) -> bool:
    """Only a process whose command line names this slot's bootstrap is touched."""
    bootstrap = os.path.join(envoy_dir, "bootstrap.json")
    return _stop_matching(lambda cmd: bootstrap in cmd, "envoy", progress, timeout,
                          [os.path.join(envoy_dir, n) for n in ("envoy.pid", "admin.sock")])


def _stop_matching(match: Callable[[list[str]], bool], what: str,
                   progress: Callable[[str], None], timeout: float, files: list[str]) -> bool:
    """SIGTERM the processes whose command line ``match``es, SIGKILL what is left after
    ``timeout``, remove ``files``; True when none runs any more."""
    mine: list[psutil.Process] = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if match(proc.info["cmdline"] or []):
                mine.append(proc)
        except psutil.Error:
            continue
    for proc in mine:
        progress(f"stopping {what} pid {proc.pid}")
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _gone, alive = psutil.wait_procs(mine, timeout=timeout)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    for path in files:
        try:
            os.unlink(path)
        except OSError:
            pass
    return all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in mine
               if _exists(p))


def _exists(proc: psutil.Process) -> bool:
    try:
        proc.status()
        return True
    except psutil.Error:
        return False


def wait_gone(path: str, pid: int | None, timeout: float) -> bool:
    """Wait for the agent to exit: its pid gone (or, without one, its socket unanswering)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid is not None:
            if not psutil.pid_exists(pid):
                return True
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    return True
            except psutil.Error:
                return True
        elif not os.path.exists(path):
            return True
        time.sleep(0.1)
    return False
