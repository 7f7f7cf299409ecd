"""`aether-agent uninstall` on a real node: every captured pod is released (no aether table,
no listener, no pin, no record), the node Envoy is stopped, and a formerly captured pod then
reaches its destination directly — with the agent serving, and with the agent already dead
and its Envoy left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

from agent.netns import nft
from agent.testing.netutil import dial, host_server
from integration.conftest import GW4, EnvoyNode

pytestmark = [pytest.mark.integration]


def _uninstall(enode: EnvoyNode, *extra: str) -> tuple[int, dict[str, object], str]:
    r = subprocess.run([sys.executable, "-m", "agent.cli", "uninstall", "--run-dir",
                        enode.agent.run_dir, "--json", *extra],
                       capture_output=True, text=True, timeout=120)
    return r.returncode, json.loads(r.stdout), r.stderr


def _envoys(enode: EnvoyNode) -> list[int]:
    bootstrap = os.path.join(enode.agent.run_dir, "envoy", "bootstrap.json")
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        if bootstrap in (p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
            out.append(p.pid)
    return out


def _nothing_left(enode: EnvoyNode) -> None:
    run = enode.agent.run_dir
    assert [n for n in os.listdir(os.path.join(run, "pods")) if n.endswith(".json")] == []
    assert not os.listdir(os.path.join(run, "pods", "seen")) if os.path.isdir(
        os.path.join(run, "pods", "seen")) else True
    pins = os.path.join(run, "netns")
    assert not os.path.isdir(pins) or os.listdir(pins) == []
    assert _envoys(enode) == []


def test_uninstall_with_the_agent_serving_releases_every_pod(enode: EnvoyNode) -> None:
    a, b, plain = enode.pod("app"), enode.pod("app"), enode.pod("plain")
    for p in (a, b, plain):
        enode.add(p)
    assert len(enode.agent.status()["pods"]) == 2
    srv, port = host_server(tag=b"direct")
    try:
        code, report, err = _uninstall(enode, "--no-cni")
        assert code == 0, (report, err)
        assert sorted(report["released"]) == sorted(  # type: ignore[arg-type]
            [f"app/{a.name}", f"app/{b.name}"])
        assert report["envoy_stopped"] is True
        assert enode.agent.proc is not None and enode.agent.proc.wait(10) == 0
        _nothing_left(enode)
        for p in (a, b):
            assert nft.list_table_text(p.netns) is None
            assert dial(p.netns, GW4, port) == "direct"  # no proxy anywhere, reaches it
        assert "releasing all 2 captured pods" in enode.agent.logs()
    finally:
        srv.close()


def test_uninstall_with_the_agent_dead_and_envoy_left_running(enode: EnvoyNode) -> None:
    a = enode.pod("app")
    enode.add(a)
    assert enode.agent.proc is not None
    enode.agent.proc.kill()  # SIGKILL: Envoy (under its keeper) keeps serving
    enode.agent.proc.wait(10)
    assert _envoys(enode), "envoy should outlive a killed agent"
    srv, port = host_server(tag=b"direct")
    try:
        code, report, err = _uninstall(enode, "--no-cni")
        assert code == 0, (report, err)
        assert report["released"] == [f"app/{a.name}"]
        assert "releasing from its records" in err
        _nothing_left(enode)
        assert nft.list_table_text(a.netns) is None
        assert dial(a.netns, GW4, port) == "direct"
    finally:
        srv.close()


def test_uninstall_removes_the_cni_entry_first(enode: EnvoyNode, tmp_path: object) -> None:
    conf_dir = os.path.join(str(tmp_path), "net.d")
    os.makedirs(conf_dir)
    conflist = dict(enode.kubelet.conflist, name="k8s-pod-network")
    with open(os.path.join(conf_dir, "10-net.conflist"), "w") as f:
        json.dump(conflist, f)
    assert any(p["type"] == "aether-cni" for p in conflist["plugins"])
    code, report, err = _uninstall(enode, "--cni-conf-dir", conf_dir,
                                   "--cni-bin-dir", str(tmp_path))
    assert code == 0, (report, err)
    with open(os.path.join(conf_dir, "10-net.conflist")) as f:
        left = json.load(f)
    assert [p["type"] for p in left["plugins"]] == [
        p["type"] for p in conflist["plugins"] if p["type"] != "aether-cni"]
