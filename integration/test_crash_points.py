"""Crash-consistent at every ADD step (issue #13 item 3): the real agent is killed at each
fault point of ADD (AETHER_FAULT=<point> makes it exit there), restarted, and kubelet's answer
to the failed ADD — DEL the chain, ADD again — must succeed, capture, and leave nothing
behind after the final DEL. Root, real netns, nftables and Envoy."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from agent.netns import nft
from agent.testing.kubelet import CniError, Pod
from agent.testing.netutil import dial, host_server
from integration.conftest import GW4, EnvoyNode, Node
from integration.taps import carried

# The ADD steps, in order: intent → pin → rules → record → listener.
UNDONE = ("crash-after-pin", "crash-after-rules")  # no record yet: the restart undoes them
COMPLETED = ("crash-before-listener", "crash-after-listener")  # recorded: the restart completes

CASES = [
    # a /proc/<pid>/ns/net path: the agent pins it under <run-dir>/netns/<id>
    *[(point, "proc") for point in (*UNDONE, *COMPLETED)],
    # the same, and the pin's mount is lost with the crash (the agent's mount namespace went
    # away with it): a plain file is left where the pin was
    ("crash-after-pin", "proc-lost-mount"),
    ("crash-after-rules", "proc-lost-mount"),
    # a /var/run/netns path: no pin
    ("crash-after-rules", "named"),
    ("crash-after-listener", "named"),
]


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def _proc_path(pod: Pod, sleepers: list[subprocess.Popen[bytes]]) -> str:
    """A process in the pod's netns, as a sandbox's pause process: its /proc netns path."""
    sleeper = subprocess.Popen(["ip", "netns", "exec", pod.netns_name, "sleep", "600"])
    sleepers.append(sleeper)
    path = f"/proc/{sleeper.pid}/ns/net"
    named = os.stat(f"/var/run/netns/{pod.netns_name}").st_ino
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # until `ip netns exec` has entered the netns
        try:
            if os.stat(path).st_ino == named:
                return path
        except OSError:
            pass
        time.sleep(0.02)
    raise AssertionError("the sleeper never entered the pod netns")


def _crash_add(enode: EnvoyNode, point: str, kind: str,
               sleepers: list[subprocess.Popen[bytes]]) -> Pod:
    """Start the agent with the fault armed, ADD a pod: the agent dies at `point`."""
    enode.agent.stop()
    enode.agent.start(env={"AETHER_FAULT": point})
    enode.wait_ready()
    pod = enode.pod()
    enode.kubelet.create_sandbox(pod)
    if kind.startswith("proc"):
        pod.netns_override = _proc_path(pod, sleepers)
    with pytest.raises(CniError):
        enode.kubelet.add(pod, create=False)
    assert enode.agent.proc is not None
    assert enode.agent.proc.wait(10) == 70, "the agent did not die at the fault point"
    return pod


def _named(pod: Pod) -> str:
    return f"/var/run/netns/{pod.netns_name}"


def _leftovers(node: Node, pod: Pod) -> list[str]:
    """Everything of this pod's capture still on the node: table, pin, record, intent, and
    temp files of interrupted state writes."""
    run = node.agent.run_dir
    out = []
    if nft.list_table_text(_named(pod)) is not None:
        out.append("table")
    if os.path.lexists(os.path.join(run, "netns", pod.container_id)):
        out.append("pin")
    pods_dir = os.path.join(run, "pods")
    for name in (os.listdir(pods_dir) if os.path.isdir(pods_dir) else []):
        if name.startswith(pod.container_id) or name.startswith(".pod."):
            out.append(name)
    return out


@pytest.mark.parametrize("point,kind", CASES)
def test_kill_at_each_add_step_then_kubelet_retries_succeed(
        enode: EnvoyNode, sleepers: list[subprocess.Popen[bytes]], point: str, kind: str) -> None:
    tcp, tport = host_server()
    try:
        pod = _crash_add(enode, point, kind, sleepers)
        run = enode.agent.run_dir
        pin = os.path.join(run, "netns", pod.container_id)
        record = os.path.join(run, "pods", f"{pod.container_id}.json")
        # the crash left exactly the steps before the point
        assert os.path.ismount(pin) == kind.startswith("proc")
        assert (nft.list_table_text(_named(pod)) is not None) == (point != "crash-after-pin")
        assert os.path.exists(record) == (point in COMPLETED)
        if point in ("crash-after-rules", "crash-before-listener"):
            # rules without a listener: the sandbox's traffic is refused, never sent around
            assert dial(_named(pod), GW4, tport, timeout=1) != "direct"
        if point == "crash-after-listener":
            assert f"capture-{pod.container_id}" in enode.listeners()
        if kind == "proc-lost-mount":
            subprocess.run(["umount", pin], check=True)
            assert os.path.isfile(pin) and not os.path.ismount(pin)  # a plain file is left
        # a SIGKILL in the middle of a state write leaves its temp file
        with open(os.path.join(run, "pods", ".pod.interrupted"), "w") as f:
            f.write('{"version": 1, "po')

        enode.agent.start()
        enode.wait_ready()
        st = enode.agent.status()
        names = os.listdir(os.path.join(run, "pods"))
        assert not [n for n in names if n.startswith(".pod.") or n.endswith(".adding")], names
        if point in UNDONE:  # undone: no table, pin or record
            assert _leftovers(enode, pod) == []
            assert st["pods"] == []
            assert any(pod.container_id in m and "interrupted" in m for m in st["reconcile"])
        else:  # completed: rules and listener as a finished ADD leaves them
            want = [(pod.container_id, "ok", "live")]
            deadline = time.monotonic() + 10
            while [(p["container_id"], p["rules"], p["listener"]) for p in st["pods"]] != want:
                assert time.monotonic() < deadline, st["pods"]
                time.sleep(0.2)
                st = enode.agent.status()

        # kubelet's answer to a failed ADD: DEL the whole chain (must succeed), ADD again
        enode.kubelet.delete(pod, remove_netns=False)
        assert _leftovers(enode, pod) == []
        assert enode.agent.status()["pods"] == []
        enode.kubelet.add(pod, create=False)
        assert f"capture-{pod.container_id}" in enode.listeners()
        if kind.startswith("proc"):
            assert os.path.ismount(pin)
        assert dial(_named(pod), GW4, tport) == "direct"
        assert carried(enode, pod) == 1  # it went through Envoy
        assert [p["rules"] for p in enode.agent.status()["pods"]] == ["ok"]

        enode.kubelet.delete_aether_only(pod)
        assert _leftovers(enode, pod) == []
        enode.listener_withdrawn(pod.container_id)
        assert enode.agent.status()["pods"] == []
    finally:
        tcp.close()


@pytest.mark.parametrize("point", [*UNDONE, "crash-before-listener"])
def test_del_while_the_agent_is_down_then_restart_leaves_nothing(
        enode: EnvoyNode, sleepers: list[subprocess.Popen[bytes]], point: str) -> None:
    """kubelet's DEL succeeds without an agent and the sandbox goes; the restarted agent must
    not keep its pin (which would hold the dead sandbox's netns for ever) nor a record."""
    pod = _crash_add(enode, point, "proc", sleepers)
    pin = os.path.join(enode.agent.run_dir, "netns", pod.container_id)
    assert os.path.ismount(pin)
    enode.kubelet.delete(pod)  # the shim answers DEL without an agent; the netns is deleted
    for s in sleepers:  # the sandbox's processes are gone too
        s.kill()
        s.wait()
    sleepers.clear()
    enode.pods.remove(pod)
    enode.agent.start()
    enode.wait_ready()
    assert not os.path.lexists(pin)
    assert enode.agent.status()["pods"] == []
    assert os.listdir(os.path.join(enode.agent.run_dir, "pods")) == []
    assert [n for n in enode.listeners() if n.startswith("capture-")] == []


def test_del_finding_a_pin_that_is_no_namespace_succeeds(node: Node) -> None:
    """The state the issue found: a pin file whose mount is gone (not a netns). DEL of that
    container used to answer try-again (11) on every retry; it removes the file."""
    pod = node.pod()
    node.kubelet.create_sandbox(pod)
    stale = os.path.join(node.agent.run_dir, "netns", pod.container_id)
    os.makedirs(os.path.dirname(stale), exist_ok=True)
    open(stale, "w").close()
    node.kubelet.delete_aether_only(pod)
    assert not os.path.lexists(stale)
    node.kubelet.delete_aether_only(pod)  # and again: still fine
