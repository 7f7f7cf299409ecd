"""`aether-agent status` as an operator runs it, against a live agent with captured pods."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

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
