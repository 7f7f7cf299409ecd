"""Fault injection, storms and soak (issue 7): real agent, real Envoy, real netns, root."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from agent.netns import nft
from agent.testing.kubelet import CniError
from agent.testing.netutil import dial, host_server
from integration.conftest import GW4, EnvoyNode
from integration.taps import carried, tap


@pytest.fixture
def hnode(workdir: str, bridge_name: str) -> Iterator[EnvoyNode]:
    """An Envoy node with a short hang timeout, for the hung-Envoy test."""
    n = EnvoyNode(workdir, bridge_name, extra=["--envoy-hang-timeout", "3"])
    n.agent.start()
    n.wait_ready()
    yield n
    n.cleanup()
    n.agent.stop()


@pytest.mark.parametrize("point", ["crash-after-rules", "crash-before-listener"])
def test_agent_killed_during_add_never_half_captures(enode: EnvoyNode, point: str) -> None:
    tcp, tport = host_server()
    try:
        enode.agent.stop()
        enode.agent.start(env={"AETHER_FAULT": point})
        pod = enode.pod()
        with pytest.raises(CniError) as err:
            enode.add(pod)
        assert err.value.result["code"] == 100  # the agent died mid-request: fail closed
        enode.agent.proc.wait(10)  # type: ignore[union-attr]
        pod_ip = _pod_ip4(pod.netns_name)
        # meanwhile the pod's traffic is refused or captured, never sent around the mesh
        dial(pod.netns, GW4, tport, timeout=1)
        assert pod_ip not in {p for p, _ in tcp.seen}
        enode.agent.start()
        enode.wait_ready()
        # kubelet's answer to a failed ADD: DEL the whole chain, then ADD again
        enode.kubelet.delete(pod, remove_netns=False)
        enode.kubelet.add(pod, create=False)
        assert f"capture-{pod.container_id}" in enode.listeners()
        assert dial(pod.netns, GW4, tport) == "direct"
        assert carried(enode, pod) == 1  # it went through Envoy
        st = enode.agent.status()
        assert [p["rules"] for p in st["pods"]] == ["ok"]
    finally:
        tcp.close()


def _pod_ip4(netns_name: str) -> str:
    out = subprocess.run(["ip", "-n", netns_name, "-4", "-o", "addr", "show", "dev", "eth0"],
                         capture_output=True, text=True, check=False).stdout.split()
    return out[3].split("/")[0] if len(out) > 3 else ""


def test_agent_restart_refuses_nothing_for_more_than_a_second(enode: EnvoyNode) -> None:
    pod = enode.pod()
    enode.add(pod)
    tcp, tport = host_server()
    failures: list[float] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            if dial(pod.netns, GW4, tport, timeout=1) != "direct":
                failures.append(time.monotonic())
            time.sleep(0.02)

    t = threading.Thread(target=client)
    t.start()
    try:
        time.sleep(0.5)
        enode.agent.stop(signal.SIGKILL)
        time.sleep(0.5)
        enode.agent.start()
        time.sleep(1.0)
    finally:
        stop.set()
        t.join()
        tcp.close()
    streak = (failures[-1] - failures[0]) if failures else 0.0
    assert streak <= 1.0, f"{len(failures)} refused connections over {streak:.2f}s"


def test_envoy_hung_is_detected_and_restarted(hnode: EnvoyNode) -> None:
    pod = hnode.pod()
    hnode.add(pod)
    tcp, tport = host_server()
    around = tap(hnode, pod, GW4, tport)
    try:
        pid = hnode.envoy_pid()
        os.kill(pid, signal.SIGSTOP)
        # hung: connections are not served and never bypass Envoy
        assert dial(pod.netns, GW4, tport, timeout=1) != "direct"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if dial(pod.netns, GW4, tport, timeout=1) == "direct":
                break
            time.sleep(0.2)
        else:
            raise AssertionError("envoy was not restarted after hanging")
        assert hnode.envoy_pid() != pid
        assert hnode.agent.status()["envoy"]["hang_kills"] >= 1
        assert around.counts()["other"] == 0  # nothing went around the hung proxy
    finally:
        tcp.close()


def test_netns_deleted_under_captured_pod(enode: EnvoyNode) -> None:
    pod = enode.pod()
    enode.add(pod)
    pid = enode.envoy_pid()
    ino = os.stat(pod.netns).st_ino
    subprocess.run(["ip", "netns", "del", pod.netns_name], check=True)
    enode.kubelet.delete_aether_only(pod)
    enode.listener_withdrawn(pod.container_id)
    deadline = time.monotonic() + 10
    while any(_fd_ns(pid, fd) == ino for fd in os.listdir(f"/proc/{pid}/fd")):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    enode.kubelet.delete_aether_only(pod)  # and again: still fine


def _fd_ns(pid: int, fd: str) -> int | None:
    try:
        link = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None
    return int(link[5:-1]) if link.startswith("net:[") else None


def test_del_arriving_before_add_finished(enode: EnvoyNode) -> None:
    pod = enode.pod()
    enode.kubelet.create_sandbox(pod)
    pid = enode.envoy_pid()
    os.kill(pid, signal.SIGSTOP)  # ADD now waits for Envoy's ACK
    result: list[object] = []
    adder = threading.Thread(target=lambda: result.append(_try(lambda: enode.kubelet.add(pod, create=False))))
    adder.start()
    time.sleep(1.0)
    deleter = threading.Thread(
        target=lambda: result.append(_try(lambda: enode.kubelet.delete(pod, remove_netns=False))))
    deleter.start()
    time.sleep(0.5)
    os.kill(pid, signal.SIGCONT)
    adder.join(60)
    deleter.join(60)
    enode.pods.remove(pod)
    subprocess.run(["ip", "netns", "del", pod.netns_name], check=False)
    time.sleep(0.5)
    assert enode.agent.status()["pods"] == []
    enode.listener_withdrawn(pod.container_id)


def _try(fn: object) -> object:
    try:
        return fn()  # type: ignore[operator]
    except Exception as e:  # noqa: BLE001
        return e


def test_hundred_concurrent_adds(enode: EnvoyNode) -> None:
    pods = [enode.pod(name=f"storm-{i}") for i in range(100)]
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        list(ex.map(enode.kubelet.create_sandbox, pods))
    times: list[float] = []

    def add(p: object) -> None:
        t0 = time.monotonic()
        enode.kubelet.add(p, create=False)  # type: ignore[arg-type]
        times.append(time.monotonic() - t0)

    with concurrent.futures.ThreadPoolExecutor(100) as ex:
        list(ex.map(add, pods))
    st = enode.agent.status()
    assert len(st["pods"]) == 100 and all(p["rules"] == "ok" for p in st["pods"])
    listeners = {n for n in enode.listeners() if n.startswith("capture-")}
    assert len(listeners) == 100
    times.sort()
    print(f"\n100 concurrent ADDs (bridge + aether-cni): p50 {times[49]*1000:.0f} ms, "
          f"p99 {times[98]*1000:.0f} ms")


def test_thousand_add_del_cycles_leave_nothing(enode: EnvoyNode) -> None:
    agent = psutil.Process(enode.agent.proc.pid)  # type: ignore[union-attr]
    envoy_pid = enode.envoy_pid()
    pods = [enode.pod(name=f"soak-{i}") for i in range(16)]  # 16 concurrent, 1008 cycles
    for p in pods:
        enode.kubelet.create_sandbox(p)
        enode.kubelet.add(p, create=False)
        enode.kubelet.delete_aether_only(p)
    start = (agent.num_threads(), agent.memory_info().rss, agent.num_fds())

    def cycle(p: object, n: int) -> None:
        for _ in range(n):
            enode.kubelet.add_aether_only(p)  # type: ignore[arg-type]
            enode.kubelet.delete_aether_only(p)  # type: ignore[arg-type]

    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda p: cycle(p, 32), pods))
    time.sleep(1.0)
    mid_threads = agent.num_threads()
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda p: cycle(p, 31), pods))
    time.sleep(1.0)
    end = (agent.num_threads(), agent.memory_info().rss, agent.num_fds())
    print(f"\nsoak 1008 ADD/DEL (16 concurrent): threads {start[0]}→{end[0]}, agent RSS "
          f"{start[1] >> 20}→{end[1] >> 20} MiB, fds {start[2]}→{end[2]}")
    assert enode.agent.status()["pods"] == []
    assert [n for n in enode.listeners() if n.startswith("capture-")] == []
    for p in pods:
        assert nft.list_table_text(p.netns) is None
    run_netns = os.path.join(enode.agent.run_dir, "netns")
    assert not os.path.isdir(run_netns) or os.listdir(run_netns) == []
    assert os.listdir(os.path.join(enode.agent.run_dir, "pods")) == []
    inos = {os.stat(p.netns).st_ino for p in pods}
    assert not [fd for fd in os.listdir(f"/proc/{envoy_pid}/fd") if _fd_ns(envoy_pid, fd) in inos]
    # reused threads wait for the next request (the CNI server's handlers, one per
    # concurrent ADD, and the idle netns workers): a pool, bounded by the concurrency and
    # flat from one half of the soak to the next; a leak would grow with the cycles
    assert end[0] <= mid_threads + 4, f"thread count grew with the cycles: {mid_threads}→{end[0]}"
    assert end[0] <= start[0] + 16 + 8 + 4, "thread count grew beyond the pools"
    assert end[2] <= start[2] + 8, "the agent's fd count grew"
    assert end[1] <= start[1] + (40 << 20), "agent RSS grew by more than 40 MiB"


def test_malformed_requests_on_the_socket(enode: EnvoyNode) -> None:
    # app/x is known to the source: an unknown pod is try-again before its netns is looked at
    enode.agent.write("pod-app-x.yaml", [{"apiVersion": "v1", "kind": "Pod",
                                          "metadata": {"name": "x", "namespace": "app"}}])
    sock_path = enode.agent.socket
    assert os.stat(sock_path).st_mode & 0o777 == 0o600

    def raw(payload: bytes) -> str:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(sock_path)
            try:
                s.sendall(payload)
                s.shutdown(socket.SHUT_WR)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the agent stopped reading an oversized request and answered already
            return s.recv(1 << 20).decode()

    rc, _, out = raw(b"{not json").partition("\n")
    assert rc == "1" and json.loads(out)["code"] == 6
    rc, _, out = raw(b"x" * (2 << 20)).partition("\n")
    assert rc == "1" and "larger than 1 MiB" in json.loads(out)["msg"]
    env = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "abc", "CNI_NETNS": "/proc/1/../../etc/passwd",
           "CNI_ARGS": "K8S_POD_NAMESPACE=app;K8S_POD_NAME=x"}
    req = {"v": 2, "env": env, "stdin": {"cniVersion": "1.0.0", "prevResult": {}}}
    rc, _, out = raw(json.dumps(req).encode()).partition("\n")
    assert rc == "1" and "clean absolute path" in json.loads(out)["msg"]
    env["CNI_NETNS"] = "/etc/passwd"
    rc, _, out = raw(json.dumps(req).encode()).partition("\n")
    assert rc == "1" and "not a namespace" in json.loads(out)["details"] + json.loads(out)["msg"]
    req["env"] = {"CNI_COMMAND": 7}  # type: ignore[assignment]
    rc, _, out = raw(json.dumps(req).encode()).partition("\n")
    assert rc == "1"
    assert enode.agent.proc.poll() is None  # type: ignore[union-attr]
