"""The agent-side handler rejects malformed requests with clear errors (no root needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.cni.handler import CniHandler
from agent.cni.state import StateStore
from agent.common.config import NodeConfig
from agent.source.manifests import ManifestSource


@pytest.fixture
def handler(tmp_path: Path) -> CniHandler:
    m = tmp_path / "m"
    m.mkdir()
    (m / "ns.yaml").write_text(
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: app, labels: {aether.io/managed: 'true'}}\n"
        "---\napiVersion: v1\nkind: Namespace\nmetadata: {name: other}\n")
    # pods the source knows: one unknown to it would be CNI try-again, not "not managed"
    (m / "pods.yaml").write_text(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: web, namespace: app}\n"
        "---\napiVersion: v1\nkind: Pod\nmetadata: {name: x, namespace: other}\n")
    return CniHandler(NodeConfig(run_dir=str(tmp_path / "run")), ManifestSource(str(m)),
                      StateStore(str(tmp_path / "state.json")))


def req(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"command": "ADD", "container_id": "abc", "netns": "/var/run/netns/x",
                            "ifname": "eth0", "netconf": {}, "ips": [],
                            "args": {"K8S_POD_NAMESPACE": "app", "K8S_POD_NAME": "web"}}
    base.update(kw)
    return base


@pytest.mark.parametrize("bad,needle", [
    ([1, 2], "not a JSON object"),
    ({"command": "EXPLODE"}, "unknown command"),
    ({"command": "ADD", "container_id": "../../etc"}, "CNI_CONTAINERID"),
    ({"command": "ADD", "container_id": 7}, "CNI_CONTAINERID"),
])
def test_malformed_requests(handler: CniHandler, bad: Any, needle: str) -> None:
    out = handler.handle(bad)
    assert out["ok"] is False and needle in out["msg"]


def test_wrong_types_rejected(handler: CniHandler) -> None:
    out = handler.handle(req(args="K8S_POD_NAME=x"))
    assert out["ok"] is False and "wrong types" in out["msg"]


@pytest.mark.parametrize("netns", ["relative/ns", "/var/run/netns/../../etc/passwd"])
def test_netns_path_traversal_rejected(handler: CniHandler, netns: str) -> None:
    out = handler.handle(req(netns=netns))
    assert out["ok"] is False and "clean absolute path" in out["msg"]


def test_netns_must_be_a_network_namespace(handler: CniHandler, tmp_path: Path) -> None:
    f = tmp_path / "not-a-netns"
    f.write_text("x")
    out = handler.handle(req(netns=str(f)))
    assert out["ok"] is False and "not a namespace" in out["details"] + out["msg"]
    out = handler.handle(req(netns=str(tmp_path / "missing")))
    assert out["ok"] is False and "does not exist" in out["msg"]
    assert handler.counters.add_failed == 2


def test_unmanaged_and_non_pod_requests_succeed_without_capture(handler: CniHandler) -> None:
    assert handler.handle(req(args={"K8S_POD_NAMESPACE": "other", "K8S_POD_NAME": "x"}))["ok"]
    assert handler.handle(req(args={}))["ok"]
    assert handler.counters.add_skipped == 2 and handler.store.all() == []


def test_del_and_check_of_unknown_container_succeed(handler: CniHandler) -> None:
    assert handler.handle(req(command="DEL", netns=""))["ok"]
    # CHECK without a record: fine for a pod that is not to be captured (and for a non-pod);
    # a managed pod without a capture fails (tests/test_cni_integrity.py)
    assert handler.handle(req(command="CHECK", args={"K8S_POD_NAMESPACE": "other",
                                                     "K8S_POD_NAME": "x"}))["ok"]
    assert handler.handle(req(command="CHECK", args={}))["ok"]
    out = handler.handle(req(command="CHECK"))
    assert out["ok"] is False and "no capture" in out["msg"]
