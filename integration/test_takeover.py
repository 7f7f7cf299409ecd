"""Hitless upgrade (#40): a second agent on the same run dir takes over a node under load.

Agent A runs in a cgroup v2 of its own with captured client and server pods; load runs (a
new connection every 25 ms to a passthrough destination and to an in-mesh L4 Service, HTTP
keep-alive requests to an `appProtocol: http` Service, four long-lived L4 connections, a pod
ADD or DEL every 100 ms); agent B starts with the same flags and run dir in another cgroup,
takes over, and A is SIGTERMed once B is ready, with everything left in A's cgroup killed
40 s later as a container runtime does. Not one new connection or HTTP request fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator

import psutil
import pytest

from agent.cni import protocol
from agent.envoy.compat import BUILT_FOR
from agent.envoy.supervisor import envoy_version
from agent.testing.kubelet import CniError, Pod
from agent.testing.netutil import http_echo_server
from agent.testing.takeover_load import (
    EXT_PORT,
    RAW_PORT,
    Load,
    answers,
    control,
    echo_server,
    envoys_of,
    in_cgroup,
    kill_cgroup,
    new_cgroup,
    remove_cgroup,
    services,
    works,
)
from integration.conftest import EnvoyNode, until

DRAIN_S = 4.0
# the previous Envoy release, unpacked by scripts/setup: A runs it, B the project's own
PREVIOUS_ENVOY = "/opt/aether/envoy-1.39.3/envoy"


class Churn:
    """A pod ADD or DEL every 100 ms through the real CNI chain, throughout the take-over;
    each succeeds or fails with CNI try-again (11)."""

    def __init__(self, n: EnvoyNode) -> None:
        self.n = n
        self.stop = threading.Event()
        self.added: list[Pod] = []
        self.try_again: list[Pod] = []
        self.deleted: list[Pod] = []
        self.errors: list[str] = []
        self.del_try_again = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _delete(self, pod: Pod) -> bool:
        """DEL as kubelet does it: retried while the answer is try-again."""
        deadline = time.monotonic() + 30
        while True:
            try:
                self.n.kubelet.delete(pod, remove_netns=False)
                subprocess.run(["ip", "netns", "del", pod.netns_name], check=False,
                               capture_output=True)
                return True
            except CniError as e:
                if e.result.get("code") != 11 or time.monotonic() > deadline:
                    self.errors.append(f"DEL {pod.name}: {e}")
                    return False
                self.del_try_again += 1
                time.sleep(0.1)

    def _run(self) -> None:
        while not self.stop.wait(0.1):
            if len(self.added) >= 2:
                pod = self.added.pop(0)
                if self._delete(pod):
                    self.deleted.append(pod)
                continue
            pod = self.n.pod(name=f"churn-{uuid.uuid4().hex[:6]}")
            try:
                self.n.kubelet.add(pod)
                self.added.append(pod)
            except CniError as e:
                (self.try_again if e.result.get("code") == 11 else self.errors).append(
                    pod if e.result.get("code") == 11 else f"ADD {pod.name}: {e}")  # type: ignore[arg-type]
                self._delete(pod)  # kubelet tears a failed sandbox down with DEL

    def start(self) -> None:
        self.thread.start()

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(30)


@pytest.fixture
def cgroups() -> Iterator[tuple[str, str]]:
    a, b = new_cgroup("a"), new_cgroup("b")
    yield a, b
    remove_cgroup(a)
    remove_cgroup(b)


def _envoy_version(pid: int) -> str:
    """The release of the Envoy binary process ``pid`` runs."""
    return ".".join(map(str, envoy_version(psutil.Process(pid).exe())))


@pytest.mark.parametrize("a_envoy", ["same", "previous"])
def test_a_second_agent_takes_over_under_load_with_not_one_failure(
        workdir: str, bridge_name: str, cgroups: tuple[str, str], a_envoy: str) -> None:
    """With a_envoy=previous, A runs the previous Envoy release and B the project's: an upgrade
    of Envoy itself, the two builds' listeners side by side in every pod netns."""
    cg_a, cg_b = cgroups
    a_binary: list[str] = []
    if a_envoy == "previous":
        assert os.access(PREVIOUS_ENVOY, os.X_OK), f"{PREVIOUS_ENVOY} missing: run scripts/setup"
        a_binary = ["--envoy-binary", PREVIOUS_ENVOY]
    n = EnvoyNode(workdir, bridge_name, extra=["--drain-seconds", str(DRAIN_S),
                                               "--instance", "agent-a", *a_binary])
    n.agent.wrapper = in_cgroup(cg_a)
    b_proc: subprocess.Popen[bytes] | None = None
    load: Load | None = None
    churn: Churn | None = None
    n.agent.start()
    try:
        n.wait_ready()
        run_dir = n.agent.run_dir
        n.agent.write("svcs.yaml", services())
        web = n.pod(name="web-0", labels={"app": "web"})
        raw = n.pod(name="raw-0", labels={"app": "raw"})
        ext = n.pod(namespace="plain", name="ext-0")  # not in the mesh: passthrough
        client = n.pod(name="client-0", annotations={"aether.io/dependencies": "app/web,app/raw"})
        for p in (web, raw, ext, client):
            n.add(p)
        http_echo_server(web.netns, "0.0.0.0", 8080, "web-0")
        servers = [echo_server(raw.netns, RAW_PORT), echo_server(ext.netns, EXT_PORT)]
        load = Load(client, ext.ip())
        until(lambda: works(load), "the captured client never reached all three destinations")
        envoy_a = n.envoy_pid()
        assert control(run_dir, "agent-a", "hello")["hello"]["slot"] == "envoy"

        load.start()
        time.sleep(1.5)
        churn = Churn(n)
        churn.start()
        time.sleep(0.5)
        # B: the same command and run dir, in another cgroup, under another name
        cmd_a = list(n.agent.proc.args)  # type: ignore[union-attr, arg-type]
        cmd_b = in_cgroup(cg_b) + cmd_a[len(n.agent.wrapper):]
        cmd_b[cmd_b.index("agent-a")] = "agent-b"
        if a_binary:  # B: the project's own Envoy
            i = cmd_b.index("--envoy-binary")
            del cmd_b[i:i + 2]
        b_log = open(os.path.join(workdir, "agent-b.log"), "ab")  # noqa: SIM115
        t0 = time.time()
        b_proc = subprocess.Popen(cmd_b, stdout=b_log, stderr=b_log)

        def b_ready() -> bool:
            try:
                return bool(control(run_dir, "agent-b", "ready")["ready"])
            except OSError:
                assert b_proc is not None and b_proc.poll() is None, _tail(workdir, "agent-b.log")
                return False

        until(b_ready, "agent B never became ready", timeout=90)
        t_ready = time.time()
        status_b = n.agent.status()  # the status socket is B's now
        assert status_b["takeover"]["instance"] == "agent-b", status_b["takeover"]
        assert status_b["takeover"]["role"] == "serving"
        replaced = status_b["takeover"]["replaced"]
        assert replaced["instance"] == "agent-a" and replaced["state"] == "draining", replaced
        assert replaced["role"] == "retired" and replaced["seconds_left"] is None, replaced
        out = subprocess.run(["aether-agent", "status", "--run-dir", run_dir],
                             capture_output=True, text=True, check=False).stdout
        assert "take-over: serving as agent-b" in out and "replacing agent-a" in out, out
        # B's Envoy holds every pod's listener beside A's, and both proxies RETURN meanwhile
        envoy_b = [p for p in envoys_of(run_dir) if p != envoy_a]
        assert len(envoy_b) == 1, envoys_of(run_dir)
        version_a, version_b = _envoy_version(envoy_a), _envoy_version(envoy_b[0])
        assert version_b == ".".join(map(str, BUILT_FOR)), version_b
        assert (version_a != version_b) == (a_envoy == "previous"), (version_a, version_b)
        assert status_b["envoy"]["version"] == version_b, status_b["envoy"]  # B's own
        time.sleep(2.0)  # load runs against the overlap (A retired, B serving)
        t_term = time.time()
        n.agent.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        killer = threading.Timer(40.0, kill_cgroup, args=(cg_a,))
        killer.start()
        try:
            n.agent.proc.wait(DRAIN_S + 20)  # type: ignore[union-attr]
        finally:
            killer.cancel()
        t_exit = time.time()
        assert n.agent.proc.returncode == 0, n.agent.logs()[-3000:]  # type: ignore[union-attr]
        until(lambda: envoy_a not in envoys_of(run_dir), "A's Envoy outlived A")
        time.sleep(2.0)  # load goes on against B alone
        churn.finish()
        load.finish()
        for s in servers:
            s.close()

        assert not load.failures, (load.failures, load.ok)
        assert not churn.errors, churn.errors
        assert min(load.ok.values()) > 100, (load.ok, t0, t_ready, t_term, t_exit, time.time())
        # the long-lived connections ran through A's Envoy: cut at the end of its drain at
        # the earliest, never before A got SIGTERM
        assert all(t >= t_term for t in load.long_cut), (load.long_cut, t_term)
        assert envoys_of(run_dir) == envoy_b, (envoys_of(run_dir), envoy_b)
        st = n.agent.status()
        assert st["takeover"]["replaced"]["state"] == "gone", st["takeover"]
        pods = {p["pod"]: p for p in st["pods"]}
        for p in (web, raw, client, *churn.added):
            got = pods[f"app/{p.name}"]
            assert got["rules"] == "ok" and got["listener"] == "live", got
        for p in churn.deleted + churn.try_again:
            assert f"app/{p.name}" not in pods, p.name
        # A's RETURN left the tables once its Envoy was gone; B's own is there
        listing = protocol.call(os.path.join(run_dir, "status.sock"),
                                {"command": "pod", "pod": "app/client-0"}, 10)["pod"]["rules"]
        assert "being replaced" not in listing and "proxy upstream" in listing, listing
        # a new pod's ADD and DEL are B's
        late = n.pod(name="late-0")
        n.add(late)
        assert f"app/{late.name}" in {p["pod"] for p in n.agent.status()["pods"]}
        n.kubelet.delete(late)
        n.pods.remove(late)
        assert f"app/{late.name}" not in {p["pod"] for p in n.agent.status()["pods"]}
        b_logs = _tail(workdir, "agent-b.log", 10**7)
        assert "Traceback" not in b_logs
        # B crashes (its Envoy lives on under its keeper): a plain restart adopts B's slot
        b_proc.kill()
        b_proc.wait()
        cmd_c = list(cmd_b)
        cmd_c[cmd_c.index("agent-b")] = "agent-c"
        b_proc = subprocess.Popen(cmd_c, stdout=b_log, stderr=b_log)
        until(lambda: answers(run_dir, "agent-c"), "the restarted agent never became ready",
              timeout=60)
        st = n.agent.status()
        assert st["takeover"]["instance"] == "agent-c" and "replaced" not in st["takeover"]
        assert st["envoy"]["pid"] == envoy_b[0] and st["envoy"].get("adopted"), st["envoy"]
        assert envoys_of(run_dir) == envoy_b
        print(f"take-over (Envoy {version_a} -> {version_b}): B ready {t_ready - t0:.1f}s "
              f"after start; A exited "
              f"{t_exit - t_term:.1f}s after SIGTERM; {load.ok} ok, {load.http_retries} HTTP "
              f"retries on cleanly closed connections; churn {len(churn.added)} added, "
              f"{len(churn.deleted)} deleted, {len(churn.try_again)} ADDs and "
              f"{churn.del_try_again} DELs answered try-again")
    finally:
        if load is not None:
            load.finish()
        if churn is not None:
            churn.finish()
            n.pods += churn.added
        n.cleanup()
        if b_proc is not None and b_proc.poll() is None:
            b_proc.send_signal(signal.SIGTERM)
            try:
                b_proc.wait(30)
            except subprocess.TimeoutExpired:
                b_proc.kill()
        n.agent.stop()
    assert "Traceback" not in n.agent.logs()


def _tail(workdir: str, name: str, size: int = 3000) -> str:
    try:
        with open(os.path.join(workdir, name), errors="replace") as f:
            return f.read()[-size:]
    except OSError:
        return ""
