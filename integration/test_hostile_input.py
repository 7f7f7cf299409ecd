"""The real agent under hostile input (issue #13): a connection flood on its CNI socket, a
FIFO as CNI_NETNS, a container id with a trailing newline, mistyped status requests."""

from __future__ import annotations

import json
import os
import socket
import time

import psutil
import pytest

from agent.cni import protocol
from agent.testing.kubelet import CniError, exec_plugin
from integration.conftest import Node


def _raw(path: str, payload: bytes, timeout: float = 10) -> str:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        return s.recv(1 << 20).decode()


def test_eleven_hundred_idle_connections_then_an_add_succeeds(node: Node) -> None:
    assert node.agent.proc is not None
    agent = psutil.Process(node.agent.proc.pid)
    flood = []
    try:
        for _ in range(1100):
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(5)
            try:
                s.connect(node.agent.socket)
            except OSError:
                s.close()
                continue
            flood.append(s)
        time.sleep(0.5)
        fds = agent.num_fds()
        assert fds < 400, fds  # the cap holds: no fd anywhere near FD_SETSIZE
        pod = node.pod()
        deadline = time.monotonic() + 30
        node.kubelet.create_sandbox(pod)
        while True:  # as kubelet: a failed ADD is undone by DEL and tried again
            try:
                node.kubelet.add(pod, create=False)
                break
            except CniError as e:
                assert e.result.get("code") == 11, e.result  # "busy", never a crash
                assert time.monotonic() < deadline, "ADD never got through the flood"
                try:
                    node.kubelet.delete(pod, remove_netns=False)
                except CniError as d:  # our DEL may be "busy" too; the bridge's ran
                    assert d.result.get("code") == 11, d.result
                time.sleep(0.5)
        assert agent.is_running() and node.agent.proc.poll() is None
        st = node.agent.status()
        assert [p["rules"] for p in st["pods"]] == ["ok"]
        assert st["refused_busy"]["cni"] > 0  # over the cap: refused and counted, not silent
    finally:
        for s in flood:
            s.close()


def test_a_fifo_as_cni_netns_is_answered_within_the_deadline(node: Node) -> None:
    pod = node.pod()
    fifo = os.path.join(node.agent.workdir, "netns-fifo")
    os.mkfifo(fifo)
    conf = dict(node.kubelet.conflist["plugins"][-1], name="aether-test", cniVersion="1.0.0",
                prevResult={"cniVersion": "1.0.0", "interfaces": [], "ips": []})
    started = time.monotonic()
    with pytest.raises(CniError) as err:
        exec_plugin(node.kubelet.plugin_dir, "aether-cni", "ADD", conf, pod.container_id, fifo,
                    "eth0", pod.cni_args, timeout=30)
    assert time.monotonic() - started < 5
    assert "not a namespace" in err.value.msg + json.dumps(err.value.result)
    started = time.monotonic()  # the per-container lock was released: DEL answers at once
    exec_plugin(node.kubelet.plugin_dir, "aether-cni", "DEL", conf, pod.container_id, fifo,
                "eth0", pod.cni_args, timeout=30)
    assert time.monotonic() - started < 5


def test_container_id_with_a_trailing_newline_is_refused(node: Node) -> None:
    env = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "abc\n", "CNI_NETNS": "/var/run/netns/x",
           "CNI_IFNAME": "eth0", "CNI_ARGS": "K8S_POD_NAMESPACE=app;K8S_POD_NAME=x"}
    req = {"v": 2, "env": env, "stdin": {"cniVersion": "1.0.0", "prevResult": {}}}
    rc, _, out = _raw(node.agent.socket, json.dumps(req).encode()).partition("\n")
    assert rc == "1" and json.loads(out)["code"] == 4
    records = os.path.join(node.agent.run_dir, "pods")
    assert not os.path.isdir(records) or not os.listdir(records)  # nothing recorded


def test_mistyped_status_requests_get_a_clear_answer(node: Node) -> None:
    pod = node.pod()
    node.add(pod)
    path = os.path.join(node.agent.run_dir, "status.sock")
    key = f"{pod.namespace}/{pod.name}"
    for bad, says in [({"command": "pod", "pod": key, "dest": 80}, '"dest"'),
                      ({"command": "pod", "pod": 7}, '"pod"'),
                      ({"command": "reboot"}, '"command"'),
                      ([1, 2], "JSON object")]:
        answer = json.loads(_raw(path, json.dumps(bad).encode()))
        assert answer["ok"] is False and says in answer["msg"], (bad, answer)
    ok = protocol.call(path, {"command": "pod", "pod": key, "dest": "1.2.3.4:80"}, 10)
    assert ok["ok"] is True and ok["pod"]["dest"]["address"] == "1.2.3.4:80"
