"""Node readiness taint and capture repair, against the project's test API server."""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.common.config import NodeConfig
from agent.install.installer import Installer, InstallOptions
from agent.kube import api_client
from agent.node.readiness import (
    TAINT_KEY,
    NodeReadiness,
    ReadinessLoop,
    plugin_installed,
    shutting_down_for_good,
    socket_serving,
)
from agent.node.repair import NodePod, RepairLoop, find_uncaptured
from agent.source.kube import KubeSource
from agent.source.model import NamespaceMeta, PodMeta
from agent.testing import apiserver
from agent.testing.apiserver import FakeApiServer, Resource

FIX = Path(__file__).parent / "fixtures" / "cni"
NODE = "node-a"
OTHER_TAINT = {"key": "dedicated", "value": "x", "effect": "NoSchedule"}


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeApiServer, str]]:
    ds = Resource("apps", "v1", "daemonsets", "DaemonSet", status=True)
    if ds not in apiserver.RESOURCES:
        monkeypatch.setattr(apiserver, "RESOURCES", (*apiserver.RESOURCES, ds))
    with FakeApiServer() as server:
        server.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
                           "spec": {"taints": [OTHER_TAINT,
                                               {"key": TAINT_KEY, "effect": "NoSchedule"}]}})
        yield server, server.kubeconfig(tmp_path / "kubeconfig")


def taints(server: FakeApiServer) -> list[dict[str, Any]]:
    node = server.get_object("Node", NODE)
    assert node is not None
    return list(node["spec"].get("taints") or [])


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_taint_removed_when_ready_and_restored_on_shutdown(
        api: tuple[FakeApiServer, str], tmp_path: Path) -> None:
    server, kubeconfig = api
    conf, bin_ = tmp_path / "net.d", tmp_path / "bin"
    conf.mkdir()
    sock_path = str(tmp_path / "cni.sock")
    envoy_ready = {"v": False}
    loop = ReadinessLoop(NodeReadiness(kubeconfig, NODE), {
        "plugin": lambda: plugin_installed(str(conf), str(bin_)),
        "socket": lambda: socket_serving(sock_path),
        "envoy": lambda: envoy_ready["v"],
    }, interval=0.05)
    assert not loop.tick()
    assert loop.status()["waiting_for"] == ["plugin", "socket", "envoy"]
    shutil.copy(FIX / "10-flannel.conflist", conf / "10-flannel.conflist")
    Installer(InstallOptions(cni_conf_dir=str(conf), cni_bin_dir=str(bin_),
                             python_runtime="host")).install(timeout=1)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(8)
    try:
        assert not loop.tick() and loop.status()["waiting_for"] == ["envoy"]
        assert any(t["key"] == TAINT_KEY for t in taints(server))
        loop.start()
        envoy_ready["v"] = True
        wait_for(lambda: loop.ready)
        assert taints(server) == [OTHER_TAINT]
        loop.stop(for_good=True)
        assert taints(server) == [OTHER_TAINT, {"key": TAINT_KEY, "effect": "NoSchedule"}]
        assert not NodeReadiness(kubeconfig, NODE).mark_not_ready(), "idempotent"
    finally:
        srv.close()


def test_restart_keeps_taint_off(api: tuple[FakeApiServer, str]) -> None:
    server, kubeconfig = api
    loop = ReadinessLoop(NodeReadiness(kubeconfig, NODE), {"ok": lambda: True})
    assert loop.tick()
    loop.stop(for_good=False)
    assert taints(server) == [OTHER_TAINT]
    assert not NodeReadiness(kubeconfig, NODE).mark_ready()


def test_taint_update_survives_a_conflict(api: tuple[FakeApiServer, str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    server, kubeconfig = api
    r = NodeReadiness(kubeconfig, NODE)
    real = r._node
    calls = {"n": 0}

    def stale_once() -> dict[str, Any]:
        node = real()
        calls["n"] += 1
        if calls["n"] == 1:  # another writer changes the Node after our read
            fresh = server.get_object("Node", NODE)
            assert fresh is not None
            fresh["metadata"]["labels"] = {"changed": "yes"}
            server.put_object(fresh)
        return node

    monkeypatch.setattr(r, "_node", stale_once)
    assert r.mark_ready()
    assert calls["n"] == 2
    assert taints(server) == [OTHER_TAINT]
    node = server.get_object("Node", NODE)
    assert node is not None and node["metadata"]["labels"] == {"changed": "yes"}


def test_for_good_follows_the_daemonset(api: tuple[FakeApiServer, str]) -> None:
    server, kubeconfig = api
    assert shutting_down_for_good(kubeconfig, "aether-system", "aether-agent")
    server.put_object({"apiVersion": "apps/v1", "kind": "DaemonSet",
                       "metadata": {"name": "aether-agent", "namespace": "aether-system"}})
    assert not shutting_down_for_good(kubeconfig, "aether-system", "aether-agent")


# ---- repair ------------------------------------------------------------------------------

CFG = NodeConfig(node_name=NODE, run_dir="/nonexistent")


def meta(name: str, ns: str = "app", uid: str = "", node: str = NODE,
         labels: dict[str, str] | None = None, host_network: bool = False) -> PodMeta:
    return PodMeta(ns, name, uid or f"uid-{name}", labels or {}, {}, "default", node,
                   host_network)


def test_find_uncaptured_pure() -> None:
    namespaces = {"app": NamespaceMeta("app", {"aether.io/managed": "true"}),
                  "plain": NamespaceMeta("plain")}
    pods = [
        NodePod(meta("captured"), "Running"),
        NodePod(meta("missed"), "Running"),
        NodePod(meta("pending"), "Pending"),
        NodePod(meta("leaving"), "Running", deleting=True),
        NodePod(meta("elsewhere", node="node-b"), "Running"),
        NodePod(meta("hostnet", host_network=True), "Running"),
        NodePod(meta("optout", labels={"aether.io/managed": "false"}), "Running"),
        NodePod(meta("unmanaged", ns="plain"), "Running"),
        NodePod(meta("optin", ns="plain", labels={"aether.io/managed": "true"}), "Running"),
        NodePod(meta("system", ns="kube-system", labels={"aether.io/managed": "true"}),
                "Running"),
    ]
    found = find_uncaptured(pods, namespaces, {"uid-captured"}, CFG)
    assert [u.pod.name for u in found] == ["missed", "optin"]


def pod_obj(name: str, ns: str = "app", phase: str = "Running", node: str = NODE) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}"},
            "spec": {"nodeName": node}, "status": {"phase": phase}}


@pytest.fixture
def cluster(api: tuple[FakeApiServer, str]) -> tuple[FakeApiServer, str]:
    server, _ = api
    server.put_object({"apiVersion": "v1", "kind": "Namespace",
                       "metadata": {"name": "app", "labels": {"aether.io/managed": "true"}}})
    server.put_object({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "plain"}})
    for obj in (pod_obj("captured"), pod_obj("missed"), pod_obj("plainpod", ns="plain"),
                pod_obj("remote", node="node-b"), pod_obj("starting", phase="Pending")):
        server.put_object(obj)
    return api


def make_loop(kubeconfig: str, mode: str) -> RepairLoop:
    source = KubeSource(kubeconfig, node_name=NODE)
    return RepairLoop(api_client(kubeconfig), CFG, lambda: {"uid-captured"},
                      source.record_event, mode=mode, resync=30)


def test_uncaptured_pod_reported_at_startup_and_on_events(
        cluster: tuple[FakeApiServer, str]) -> None:
    server, kubeconfig = cluster
    loop = make_loop(kubeconfig, "report")
    loop.start()
    try:
        wait_for(lambda: bool(server.events_for("app", "missed")))
        ev = server.events_for("app", "missed")[0]
        assert ev["reason"] == "CaptureMissing" and ev["type"] == "Warning"
        assert [s["pod"] for s in loop.status()] == ["app/missed"]
        assert loop.status()[0]["action"] == "reported"
        # a Pending pod turning Running without a capture is caught on its pod event
        server.put_object(pod_obj("starting"))
        wait_for(lambda: bool(server.events_for("app", "starting")))
        assert [s["pod"] for s in loop.status()] == ["app/missed", "app/starting"]
        server.delete_object("Pod", "missed", "app")
        wait_for(lambda: [s["pod"] for s in loop.status()] == ["app/starting"])
    finally:
        loop.stop()
    assert not server.events_for("app", "captured")
    assert not server.events_for("plain", "plainpod")
    assert len(server.events_for("app", "starting")) == 1, "reported once"


def test_repair_delete_evicts_uncaptured(cluster: tuple[FakeApiServer, str]) -> None:
    server, kubeconfig = cluster
    loop = make_loop(kubeconfig, "delete")
    found = loop.scan()
    assert [u.pod.name for u in found] == ["missed"]
    assert server.get_object("Pod", "missed", "app") is None
    assert server.get_object("Pod", "captured", "app") is not None
    assert server.get_object("Pod", "plainpod", "plain") is not None
    assert "evicted" in server.events_for("app", "missed")[0]["message"]


def test_repair_mode_validated(api: tuple[FakeApiServer, str]) -> None:
    with pytest.raises(ValueError):
        RepairLoop(api_client(api[1]), CFG, set, lambda e: None, mode="nuke")


def test_plugin_installed_false_without_files(tmp_path: Path) -> None:
    assert not plugin_installed(str(tmp_path), str(tmp_path))
    os.makedirs(tmp_path / "x", exist_ok=True)
    assert not socket_serving(str(tmp_path / "nope.sock"))
