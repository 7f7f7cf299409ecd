"""Pins Envoy can always open (issue #13 item 4): a restarted agent in a mount namespace of
its own (as a restarted container gets) adopts the Envoy the previous agent left running,
and captures a pod given as /proc/<pid>/ns/net through it. The pin the new agent makes must
reach Envoy's mount namespace: <run-dir>/netns is a shared bind mount of itself, and the new
namespace was made from one in its peer group (`unshare --propagation unchanged`, as a
container's Bidirectional host path is). Root, real netns, nftables and Envoy."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator

import psutil
import pytest

from agent.netns.pin import mount_entry
from agent.testing.kubelet import Pod
from agent.testing.netutil import dial, host_server
from integration.conftest import GW4, EnvoyNode
from integration.taps import carried, tap


@pytest.fixture
def knode(workdir: str, bridge_name: str) -> Iterator[EnvoyNode]:
    """An Envoy node whose agent leaves Envoy running on exit (an upgrade-style stop)."""
    n = EnvoyNode(workdir, bridge_name, extra=["--envoy-on-exit", "keep"])
    n.agent.start()
    n.wait_ready()
    keeper = 0
    with open(os.path.join(n.agent.run_dir, "envoy", "envoy.pid")) as f:
        keeper = int(f.read())
    yield n
    n.cleanup()
    n.agent.stop()
    if psutil.pid_exists(keeper):
        os.kill(keeper, signal.SIGTERM)
        psutil.Process(keeper).wait(10)
    # and whichever Envoy a later agent started for this run dir (kept on its exit too)
    bootstrap = os.path.join(n.agent.run_dir, "envoy", "bootstrap.json")
    for proc in psutil.process_iter(["cmdline"]):
        if bootstrap in (proc.info["cmdline"] or []):
            try:
                proc.terminate()
                proc.wait(10)
            except psutil.Error:
                pass


def _mntns(pid: int | str) -> int:
    return os.stat(f"/proc/{pid}/ns/mnt").st_ino


def _proc_pod(n: EnvoyNode, sleepers: list[subprocess.Popen[bytes]]) -> Pod:
    pod = n.pod()
    n.kubelet.create_sandbox(pod)
    sleeper = subprocess.Popen(["ip", "netns", "exec", pod.netns_name, "sleep", "600"])
    sleepers.append(sleeper)
    named = os.stat(f"/var/run/netns/{pod.netns_name}").st_ino
    path = f"/proc/{sleeper.pid}/ns/net"
    deadline = time.monotonic() + 5
    while True:
        try:
            if os.stat(path).st_ino == named:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, "the sleeper never entered the pod netns"
        time.sleep(0.02)
    pod.netns_override = path
    return pod


def test_restarted_agent_in_its_own_mount_namespace_pins_for_the_adopted_envoy(
        knode: EnvoyNode) -> None:
    n = knode
    tcp, tport = host_server()
    sleepers: list[subprocess.Popen[bytes]] = []
    try:
        pin_dir = os.path.join(n.agent.run_dir, "netns")
        entry = mount_entry(pin_dir)
        assert entry is not None and any(x.startswith("shared:") for x in entry), entry
        assert n.agent.status()["pin_dir"]["propagation"].startswith("shared:")

        first = _proc_pod(n, sleepers)  # captured by agent A
        n.kubelet.add(first, create=False)
        envoy = n.envoy_pid()
        assert _mntns(envoy) == _mntns("self")  # A and its Envoy: this test's mount namespace
        n.agent.stop()  # SIGTERM, --envoy-on-exit keep: Envoy serves on, for B to adopt
        assert psutil.pid_exists(envoy)

        # agent B: a mount namespace of its own, copied with propagation kept
        n.agent.wrapper = ["unshare", "--mount", "--propagation", "unchanged"]
        n.agent.start()
        assert n.agent.proc is not None
        assert _mntns(n.agent.proc.pid) != _mntns(envoy), "B must not share Envoy's mount ns"
        n.wait_ready()
        assert n.envoy_pid() == envoy  # adopted, not restarted
        st = n.agent.status()
        want = [(first.container_id, "ok", "live")]
        deadline = time.monotonic() + 10
        while [(p["container_id"], p["rules"], p["listener"]) for p in st["pods"]] != want:
            assert time.monotonic() < deadline, st["pods"]
            time.sleep(0.2)
            st = n.agent.status()
        assert st["pin_dir"]["envoy_sees_pins"] is True

        second = _proc_pod(n, sleepers)  # pinned by B, opened by A's Envoy
        n.kubelet.add(second, create=False)  # fails unless Envoy could open B's pin
        pin = os.path.join(pin_dir, second.container_id)
        assert os.path.ismount(pin)  # B's pin, seen from Envoy's mount namespace
        assert f"capture-{second.container_id}" in n.listeners()
        around = tap(n, second, GW4, tport)
        assert dial(f"/var/run/netns/{second.netns_name}", GW4, tport) == "direct"
        assert carried(n, second) == 1  # through Envoy's listener in the pod netns
        assert around.counts() == {"proxy": 1, "other": 0}  # and out through Envoy

        n.kubelet.delete_aether_only(second)  # B unpins: the unmount reaches Envoy's ns too
        assert not os.path.lexists(pin)
        n.listener_withdrawn(second.container_id)
    finally:
        tcp.close()
        for s in sleepers:
            s.kill()
            s.wait()


def test_an_adopted_envoy_that_cannot_see_our_pins_is_restarted_in_our_mount_namespace(
        knode: EnvoyNode) -> None:
    """The systemd case: the new agent's mount namespace is a *slave* copy (a unit's sandbox),
    so its pins never reach the Envoy it would adopt. The agent restarts that Envoy in its
    own namespace before serving ADDs; the pod captured before keeps its listener, and a
    /proc-path pod is captured through the new Envoy."""
    n = knode
    tcp, tport = host_server()
    sleepers: list[subprocess.Popen[bytes]] = []
    try:
        first = _proc_pod(n, sleepers)
        n.kubelet.add(first, create=False)
        envoy = n.envoy_pid()
        n.agent.stop()  # Envoy serves on
        assert psutil.pid_exists(envoy)

        n.agent.wrapper = ["unshare", "--mount", "--propagation", "slave"]
        n.agent.start()
        assert n.agent.proc is not None
        deadline = time.monotonic() + 20
        while n.agent.status()["envoy"].get("pid") in (None, envoy):
            assert time.monotonic() < deadline, "the unreachable Envoy was never restarted"
            time.sleep(0.2)
        n.wait_ready()
        new = n.envoy_pid()
        assert _mntns(new) == _mntns(n.agent.proc.pid)  # now in the agent's mount namespace
        st = n.agent.status()
        assert st["pin_dir"]["envoy_sees_pins"] is True
        assert any("restarted the adopted Envoy" in line for line in st["reconcile"])
        deadline = time.monotonic() + 10
        while [(p["container_id"], p["listener"]) for p in st["pods"]] != [
                (first.container_id, "live")]:
            assert time.monotonic() < deadline, st["pods"]
            time.sleep(0.2)
            st = n.agent.status()

        second = _proc_pod(n, sleepers)  # pinned in the agent's namespace, opened by its Envoy
        n.kubelet.add(second, create=False)
        assert dial(f"/var/run/netns/{second.netns_name}", GW4, tport) == "direct"
        assert carried(n, second) == 1
    finally:
        tcp.close()
        for s in sleepers:
            s.kill()
            s.wait()
