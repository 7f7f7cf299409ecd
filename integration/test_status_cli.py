"""`aether-agent status` as an operator runs it, against a live agent with captured pods."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from agent.cni import protocol
from agent.ops.status_view import render, render_pod
from agent.testing.kubelet import CniError
from integration.conftest import GW4, EnvoyNode


def status(run_dir: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent.cli", "status", "--run-dir", run_dir,
                           *args], capture_output=True, text=True, timeout=30, check=False)


def test_status_human_json_drilldown_and_degraded(enode: EnvoyNode) -> None:
    pod = enode.pod(annotations={"capture.aether.io/exclude-outbound-ports": "5432,nope"})
    enode.add(pod)
    rd = enode.agent.run_dir
    human = status(rd)
    assert human.returncode == 0, human.stderr
    assert "healthy" in human.stdout and f"app/{pod.name}" in human.stdout
    assert "redirect-all" in human.stdout and "CaptureAnnotationInvalid" in human.stdout
    doc = json.loads(status(rd, "--json").stdout)
    assert doc["degraded"] is False and doc["envoy"]["ready"] is True
    assert [p["pod"] for p in doc["pods"]] == [f"app/{pod.name}"]
    assert doc["pods"][0]["rules"] == "ok" and doc["pods"][0]["exclude_ports"] == ["5432"]
    assert doc["pods"][0]["listener"] == "live"
    assert doc["cni_install"]["conf_dir"] == "/etc/cni/net.d"

    one = status(rd, f"app/{pod.name}", "--dest", f"{GW4}:5432")
    assert one.returncode == 0, one.stderr
    assert "exclude-outbound-ports" in one.stdout and "table inet aether" in one.stdout
    one = json.loads(status(rd, f"app/{pod.name}", "--dest", f"{GW4}:443", "--json").stdout)
    assert "passes it through" in one["dest"]["verdict"] and one["listener_live"] is True
    assert status(rd, "app/nope").returncode == 3

    pid = enode.envoy_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 15
        while True:
            r = status(rd)
            if r.returncode == 1:
                break
            assert time.monotonic() < deadline, r.stdout
            time.sleep(0.5)
        assert "DEGRADED" in r.stdout
    finally:
        os.kill(pid, signal.SIGCONT)


def test_status_unreachable_agent(tmp_path: object) -> None:
    r = status(str(tmp_path))
    assert r.returncode == 2 and "not reachable" in r.stderr
    r = status(str(tmp_path), "--json")
    assert r.returncode == 2 and json.loads(r.stdout)["reachable"] is False


def _status_until(rd: str, ok: Callable[[subprocess.CompletedProcess[str]], bool],
                  timeout: float = 10, args: tuple[str, ...] = ("--json",)
                  ) -> subprocess.CompletedProcess[str]:
    """Status is cached for about a second (one admin probe per refresh): poll."""
    deadline = time.monotonic() + timeout
    while True:
        r = status(rd, *args)
        if ok(r):
            return r
        assert time.monotonic() < deadline, r.stdout + r.stderr
        time.sleep(0.3)


def test_status_sees_envoy_drain_listeners(enode: EnvoyNode) -> None:
    """A root `POST /drain_listeners` on Envoy's admin socket closes every listener's sockets
    while Envoy keeps listing them as active. Status must not believe the agent's intent (or
    Envoy's listing): the pods' listeners are `stopped`, the node is degraded, and a pod
    added afterwards — Envoy ACKs it but ignores it — is `missing`."""
    pods = [enode.pod(), enode.pod()]
    for p in pods:
        enode.add(p)
    rd = enode.agent.run_dir
    r = status(rd, "--json")
    assert r.returncode == 0, r.stdout
    assert {p["listener"] for p in json.loads(r.stdout)["pods"]} == {"live"}

    assert enode.admin("/drain_listeners", method="POST").strip() == "OK"
    assert set(enode.listeners()) >= {f"capture-{p.container_id}" for p in pods}  # still listed
    r = _status_until(rd, lambda r: r.returncode == 1)
    doc = json.loads(r.stdout)
    assert doc["degraded"] is True
    for p in doc["pods"]:
        assert p["listener"] == "stopped" and "drain_listeners" in p["listener_detail"], p
    human = status(rd)
    assert human.returncode == 1 and "DEGRADED" in human.stdout
    assert f"LISTENER STOPPED: app/{pods[0].name}" in human.stdout
    one = status(rd, f"app/{pods[0].name}", "--json")
    assert one.returncode == 1 and json.loads(one.stdout)["listener_live"] is False

    late = enode.pod()
    enode.add(late)  # ACKed by Envoy, which holds no listener for it
    assert f"capture-{late.container_id}" not in enode.listeners()
    doc = json.loads(_status_until(rd, lambda r: len(json.loads(r.stdout)["pods"]) == 3).stdout)
    (mine,) = [p for p in doc["pods"] if p["pod"] == f"app/{late.name}"]
    assert mine["listener"] == "missing" and "ignores new listeners" in mine["listener_detail"]


def test_status_shows_listener_envoy_rejected(enode: EnvoyNode) -> None:
    """A listener Envoy rejects is `rejected` with Envoy's reason, and the node is degraded.

    The NACK is real and comes from the real path: a process in the pod's netns holds
    127.0.0.1:15001 before the ADD (as a pod app listening on 15001 would), so Envoy's bind of
    the pod listener fails with EADDRINUSE and Envoy NACKs the LDS update. The ADD fails
    closed, but the agent keeps the pod's record (its rules stay in place) until kubelet's
    DEL — and meanwhile still *intends* the listener, which is what status used to report as
    live. (Not an IPv6-disabled netns: the agent learns to bind 127.0.0.1 only there.)

    Envoy's failed bind leaves its main thread in the pod's netns (the known Envoy bug); the
    agent then restarts Envoy, and every new Envoy is handed the same listener and rejects it
    again while the port stays taken. So status is polled: while Envoy restarts it truthfully
    says `unknown: envoy admin not answering`; whenever Envoy answers, the pod is `rejected`.
    Those windows are shorter than the CLI takes to start, so this test asks the agent's
    status socket (what the CLI asks) and renders like the CLI; the CLI's own exit codes for
    a non-live listener are in the drain test. This test has its own agent and Envoy (the
    `enode` fixture), so the restarts stay here."""
    healthy = enode.pod()
    enode.add(healthy)
    pod = enode.pod()
    enode.kubelet.create_sandbox(pod)
    holder = subprocess.Popen(
        ["ip", "netns", "exec", pod.netns_name, sys.executable, "-c",
         "import socket,time;s=socket.socket();s.bind(('127.0.0.1',15001));s.listen();"
         "print('held',flush=True);time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    rd = enode.agent.run_dir
    # Envoy's own error_state, or (once the agent withdrew the rejected listener) its NACK
    line_head = f"LISTENER REJECTED: app/{pod.name}: "

    def rejected_and_answering(doc: dict[str, Any]) -> bool:
        assert doc["degraded"] is True
        states = {p["pod"]: p for p in doc["pods"]}
        bad = states[f"app/{pod.name}"]
        if bad["listener"] == "unknown":  # Envoy restarting
            assert bad["listener_detail"].startswith("envoy admin not answering"), bad
            return False
        assert bad["listener"] == "rejected", bad
        assert "cannot bind '127.0.0.1:15001': Address already in use" in bad["listener_detail"]
        return bool(states[f"app/{healthy.name}"]["listener"] == "live")

    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(CniError) as err:
            enode.kubelet.add(pod, create=False)
        assert "did not confirm the capture listener" in err.value.msg
        # Envoy answers in short windows between restarts, shorter than the CLI's own start:
        # poll the agent's status socket (what the CLI asks) and render as the CLI does.
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "Envoy never answered while the port was held"
            doc = enode.agent.status()
            if rejected_and_answering(doc):
                one = protocol.call(os.path.join(rd, "status.sock"),
                                    {"command": "pod", "pod": f"app/{pod.name}"}, 10)["pod"]
                if one["listener_state"] == "rejected":
                    break
            time.sleep(0.05)
        human = render(doc)
        assert "DEGRADED" in human and line_head in human, human
        assert "cannot bind '127.0.0.1:15001': Address already in use" in human, human
        assert one["degraded"] is True and one["listener_live"] is False
        assert "cannot bind" in render_pod(one)
    finally:
        holder.kill()
        holder.wait()
    # kubelet's DEL after the failed ADD: the record goes, every remaining listener is live
    enode.kubelet.delete(pod)
    enode.pods.remove(pod)

    def healed(r: subprocess.CompletedProcess[str]) -> bool:
        doc = json.loads(r.stdout)
        return ([p["listener"] for p in doc["pods"]] == ["live"]
                and doc["pods"][0]["pod"] == f"app/{healthy.name}")

    _status_until(rd, healed, timeout=60)
