"""Capture integrity in the handler (issue #12, items 6 and 7), no root needed.

The "kernel" is faked at the nft boundary, and network namespaces are modelled by plain
files: `netns_identity` is a stat, so a hard link is another path to the same namespace
(exactly like a bind-mount pin or /proc/<pid>/ns/net), and a separate file is another netns.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.cni import protocol as p
from agent.cni.handler import CniHandler
from agent.cni.state import StateStore
from agent.common.config import NodeConfig
from agent.netns import dataplane as dataplane_mod
from agent.netns import nft
from agent.netns.enter import is_host_netns, netns_identity
from agent.source.base import PodEvent, SourceError
from agent.source.cached import CachedSource
from agent.source.events import ObjectStore
from agent.source.kube import KubeSource
from agent.source.manifests import ManifestSource
from agent.source.model import NamespaceMeta, PodMeta
from agent.testing import FakeApiServer

NAMESPACES = """\
apiVersion: v1
kind: Namespace
metadata: {name: app, labels: {aether.io/managed: 'true'}}
---
apiVersion: v1
kind: Namespace
metadata: {name: plain}
"""


def pod_yaml(ns: str, name: str) -> str:
    return (f"apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {ns}, "
            f"uid: uid-{name}}}\nspec: {{nodeName: n1}}\n")


class FakeKernel:
    """The aether table per netns identity, behind the nft functions the handler calls."""

    def __init__(self) -> None:
        self.tables: dict[tuple[int, int], str] = {}
        self.applies = 0

    def apply_ruleset(self, netns: str, script: str, first: str | None = None) -> str:
        self.applies += 1
        self.tables[netns_identity(netns)] = script
        return f"fp-{hash(script) & 0xffff}"

    def delete_table(self, netns: str) -> bool:
        return self.tables.pop(netns_identity(netns), None) is not None

    def live_fingerprint(self, netns: str) -> str | None:
        script = self.tables.get(netns_identity(netns))
        return None if script is None else f"fp-{hash(script) & 0xffff}"

    def has_table(self, netns: str) -> bool:
        return netns_identity(netns) in self.tables


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> FakeKernel:
    k = FakeKernel()
    monkeypatch.setattr(nft, "apply_ruleset", k.apply_ruleset)
    monkeypatch.setattr(nft, "apply_ruleset_and", lambda netns, script, first, then: (
        nft.apply_ruleset(netns, script, first), (True, True)))
    monkeypatch.setattr(nft, "delete_table", k.delete_table)
    monkeypatch.setattr(nft, "live_fingerprint", k.live_fingerprint)
    monkeypatch.setattr(dataplane_mod, "check_netns_path", lambda path: path)
    return k


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Namespace files: the node's own (+ another path to it), two pod netns (+ a second
    path to the first, like a pin)."""
    d = tmp_path / "netns"
    d.mkdir()
    for name in ("host", "pod1", "pod2"):
        (d / name).write_text(name)
    os.link(d / "host", d / "host-alias")
    os.link(d / "pod1", d / "pod1-pin")
    host = netns_identity(str(d / "host"))
    monkeypatch.setattr(dataplane_mod, "host_netns_identities", lambda: {host})
    return {n: str(d / n) for n in ("host", "host-alias", "pod1", "pod1-pin", "pod2")}


@pytest.fixture
def manifests(tmp_path: Path) -> Path:
    m = tmp_path / "m"
    m.mkdir()
    (m / "ns.yaml").write_text(NAMESPACES)
    for ns, name in (("app", "web"), ("app", "api"), ("plain", "db")):
        (m / f"pod-{name}.yaml").write_text(pod_yaml(ns, name))
    return m


@pytest.fixture
def handler(tmp_path: Path, manifests: Path, kernel: FakeKernel) -> CniHandler:
    return CniHandler(NodeConfig(run_dir=str(tmp_path / "run")), ManifestSource(str(manifests)),
                      StateStore(str(tmp_path / "pods")))


def req(command: str = "ADD", cid: str = "c1", netns: str = "", pod: str = "web",
        ns: str = "app", args: dict[str, str] | None = None) -> dict[str, Any]:
    return {"command": command, "container_id": cid, "netns": netns, "ifname": "eth0",
            "netconf": {}, "ips": ["10.0.0.5"],
            "args": {"K8S_POD_NAMESPACE": ns, "K8S_POD_NAME": pod} if args is None else args}


# ---- item 6: only pods' netns, only their own ---------------------------------------------


def test_is_host_netns_compares_identity_not_paths(world: dict[str, str]) -> None:
    host = {netns_identity(world["host"])}
    assert is_host_netns(world["host-alias"], host)
    assert not is_host_netns(world["pod1"], host)
    assert not is_host_netns(world["pod1"] + "-missing", host)
    # the real thing: the agent's own netns is the host's by definition
    assert is_host_netns("/proc/self/ns/net")
    assert is_host_netns(f"/proc/{os.getpid()}/ns/net")


@pytest.mark.parametrize("path", ["host", "host-alias"])
def test_add_refuses_the_nodes_own_netns(handler: CniHandler, kernel: FakeKernel,
                                         world: dict[str, str], path: str) -> None:
    out = handler.handle(req(netns=world[path]))
    assert out["ok"] is False and out["code"] == p.ERR_INVALID_ENV
    assert "node's own network namespace" in out["msg"]
    assert kernel.tables == {} and kernel.applies == 0
    assert handler.store.all() == []
    assert handler.counters.add_failed == 1


def test_add_refuses_a_netns_captured_under_another_container(
        handler: CniHandler, kernel: FakeKernel, world: dict[str, str]) -> None:
    assert handler.handle(req(cid="c1", netns=world["pod1"]))["ok"]
    before = dict(kernel.tables)
    # another container id, another path (a pin) to the same namespace
    out = handler.handle(req(cid="c2", netns=world["pod1-pin"], pod="api"))
    assert out["ok"] is False and out["code"] == p.ERR_INVALID_ENV
    assert "already captured for app/web (container c1)" in out["msg"]
    assert kernel.tables == before and kernel.applies == 1
    assert [r.container_id for r in handler.store.all()] == ["c1"]
    # the same container id retried stays idempotent, and a different netns is fine
    assert handler.handle(req(cid="c1", netns=world["pod1"]))["ok"]
    assert handler.handle(req(cid="c2", netns=world["pod2"], pod="api"))["ok"]
    assert sorted(r.container_id for r in handler.store.all()) == ["c1", "c2"]


def test_add_refuses_a_netns_another_add_is_capturing(
        handler: CniHandler, kernel: FakeKernel, world: dict[str, str]) -> None:
    """Two container ids racing into one namespace: the second sees the first's claim."""
    ident = netns_identity(world["pod1"])
    with handler._netns_claim(ident, "c1", "app/web", world["pod1"]):
        out = handler.handle(req(cid="c2", netns=world["pod1-pin"], pod="api"))
        assert out["ok"] is False and "being captured for container c1" in out["msg"]
        # and a DEL for an unknown id must not clean under the in-flight ADD
        kernel.tables[ident] = "in flight"
        assert handler.handle(req(command="DEL", cid="c9", netns=world["pod1"]))["ok"]
        assert kernel.has_table(world["pod1"])
    assert handler._netns_claims == {}


def test_del_of_unknown_container_leaves_a_captured_pod_alone(
        handler: CniHandler, kernel: FakeKernel, world: dict[str, str]) -> None:
    assert handler.handle(req(cid="c1", netns=world["pod1"]))["ok"]
    fp = kernel.live_fingerprint(world["pod1"])
    for path in ("pod1", "pod1-pin"):
        assert handler.handle(req(command="DEL", cid="intruder", netns=world[path]))["ok"]
    assert kernel.live_fingerprint(world["pod1"]) == fp
    assert [r.container_id for r in handler.store.all()] == ["c1"]
    assert handler.handle(req(command="CHECK", cid="c1", netns=world["pod1"]))["ok"]


def test_del_of_unknown_container_never_touches_the_nodes_netns(
        handler: CniHandler, kernel: FakeKernel, world: dict[str, str]) -> None:
    kernel.tables[netns_identity(world["host"])] = "someone's host table"
    assert handler.handle(req(command="DEL", cid="c7", netns=world["host-alias"]))["ok"]
    assert kernel.has_table(world["host"])


def test_del_of_unknown_container_still_cleans_an_unowned_netns(
        handler: CniHandler, kernel: FakeKernel, world: dict[str, str]) -> None:
    """A crashed ADD (table programmed, no record) is cleaned by its DEL."""
    kernel.tables[netns_identity(world["pod2"])] = "left by a crashed ADD"
    assert handler.handle(req(command="DEL", cid="c3", netns=world["pod2"]))["ok"]
    assert not kernel.has_table(world["pod2"])


def test_del_of_a_recorded_container_acts_on_its_own_netns(
        handler: CniHandler, kernel: FakeKernel, world: dict[str, str]) -> None:
    assert handler.handle(req(cid="c1", netns=world["pod1"]))["ok"]
    kernel.tables[netns_identity(world["pod2"])] = "someone else's"
    # kubelet names another netns: the record decides which table goes
    assert handler.handle(req(command="DEL", cid="c1", netns=world["pod2"]))["ok"]
    assert not kernel.has_table(world["pod1"]) and kernel.has_table(world["pod2"])
    assert handler.store.all() == []


def test_check_of_a_managed_pod_never_captured_fails(handler: CniHandler,
                                                      world: dict[str, str]) -> None:
    out = handler.handle(req(command="CHECK", cid="c5", netns=world["pod2"]))
    assert out["ok"] is False and out["code"] == p.ERR_CHECK_DRIFT
    assert "app/web is to be captured" in out["msg"] and "no capture" in out["msg"]
    assert handler.counters.check_failed == 1


def test_check_of_uncaptured_pods_that_are_not_managed_succeeds(
        handler: CniHandler, world: dict[str, str]) -> None:
    assert handler.handle(req(command="CHECK", cid="c5", netns=world["pod2"], ns="plain",
                              pod="db"))["ok"]
    assert handler.handle(req(command="CHECK", cid="c6", netns=world["pod2"], args={}))["ok"]
    assert handler.handle(req(command="CHECK", cid="c7", netns=world["pod2"],
                              ns="kube-system", pod="coredns"))["ok"]


def test_check_of_a_capture_in_another_netns_fails(
        handler: CniHandler, world: dict[str, str]) -> None:
    assert handler.handle(req(cid="c1", netns=world["pod1"]))["ok"]
    assert handler.handle(req(command="CHECK", cid="c1", netns=world["pod1-pin"]))["ok"]
    out = handler.handle(req(command="CHECK", cid="c1", netns=world["pod2"]))
    assert out["ok"] is False and out["code"] == p.ERR_CHECK_DRIFT
    assert "not its netns" in out["msg"]


# ---- item 7: unknown is not "no" -----------------------------------------------------------


def test_unknown_pod_is_try_again_not_uncaptured(handler: CniHandler, kernel: FakeKernel,
                                                 world: dict[str, str]) -> None:
    out = handler.handle(req(netns=world["pod1"], pod="not-written-yet"))
    assert out["ok"] is False and out["code"] == p.ERR_TRY_AGAIN == 11
    assert "pod app/not-written-yet is not known to manifest directory" in out["msg"]
    assert kernel.applies == 0 and handler.counters.add_skipped == 0


def test_unknown_namespace_is_try_again(handler: CniHandler, manifests: Path,
                                        world: dict[str, str]) -> None:
    (manifests / "pod-orphan.yaml").write_text(pod_yaml("nowhere", "orphan"))
    out = handler.handle(req(netns=world["pod1"], ns="nowhere", pod="orphan"))
    assert out["ok"] is False and out["code"] == 11
    assert "namespace nowhere of pod nowhere/orphan is not known" in out["msg"]


def test_unparsable_namespaces_file_never_means_unmanaged(
        tmp_path: Path, kernel: FakeKernel, world: dict[str, str]) -> None:
    """No good version of the namespaces ever: try-again, with the problem in the details."""
    m = tmp_path / "m2"
    m.mkdir()
    (m / "ns.yaml").write_text("kind: Namespace\nmetadata: {name: app, labels: [\n")
    (m / "pod.yaml").write_text(pod_yaml("app", "web"))
    h = CniHandler(NodeConfig(run_dir=str(tmp_path / "run")), ManifestSource(str(m)),
                   StateStore(str(tmp_path / "pods")))
    out = h.handle(req(netns=world["pod1"]))
    assert out["ok"] is False and out["code"] == 11
    assert "ns.yaml" in out["details"] and "YAML error" in out["details"]
    assert kernel.applies == 0


def test_not_a_pod_and_system_namespaces_are_decided_without_the_source(
        tmp_path: Path, kernel: FakeKernel, world: dict[str, str]) -> None:
    class Down:
        def get_pod(self, namespace: str, name: str, uid: str = "") -> PodMeta | None:
            raise SourceError("down")

        def get_namespace(self, name: str) -> NamespaceMeta | None:
            raise SourceError("down")

        def record_event(self, event: PodEvent) -> None:
            return None

        def describe(self) -> str:
            return "a source that is down"

    h = CniHandler(NodeConfig(run_dir=str(tmp_path / "run")), Down(),
                   StateStore(str(tmp_path / "pods")))
    assert h.handle(req(netns=world["pod1"], args={}))["ok"]
    assert h.handle(req(netns=world["pod1"], ns="kube-system", pod="coredns"))["ok"]
    assert h.counters.add_skipped == 2
    out = h.handle(req(netns=world["pod1"]))
    assert out["code"] == 11 and "cannot read pod app/web from a source that is down" in out["msg"]
    assert kernel.applies == 0


# ---- the Kubernetes source: 404 from a lagging cache is try-again ----------------------------


@pytest.fixture
def kube_handler(server: FakeApiServer, tmp_path: Path,
                 kernel: FakeKernel) -> Iterator[tuple[CniHandler, ObjectStore]]:
    src = KubeSource(server.kubeconfig(tmp_path / "kubeconfig"), node_name="n1",
                     retry_budget=2.0, request_timeout=1.0)
    cache = ObjectStore()
    h = CniHandler(NodeConfig(run_dir=str(tmp_path / "run")), CachedSource(src, cache),
                   StateStore(str(tmp_path / "pods")))
    yield h, cache
    src.close()


def _pod_obj(ns: str, name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}"},
            "spec": {"nodeName": "n1", "containers": []}}


@pytest.mark.timeout(60)
def test_kube_pod_404_is_try_again(server: FakeApiServer, world: dict[str, str],
                                   kube_handler: tuple[CniHandler, ObjectStore],
                                   kernel: FakeKernel) -> None:
    h, _cache = kube_handler
    server.put_object({"apiVersion": "v1", "kind": "Namespace",
                       "metadata": {"name": "app", "labels": {"aether.io/managed": "true"}}})
    # not in the watch cache, and the API answers 404
    out = h.handle(req(netns=world["pod1"]))
    assert out["ok"] is False and out["code"] == 11
    assert "pod app/web is not known to kubernetes API" in out["msg"]
    # the pod appears (kubelet retries): captured, from the API on a cache miss
    server.put_object(_pod_obj("app", "web"))
    assert h.handle(req(netns=world["pod1"]))["ok"]
    assert kernel.has_table(world["pod1"])


@pytest.mark.timeout(60)
def test_kube_namespace_404_and_api_down_are_try_again(
        server: FakeApiServer, world: dict[str, str],
        kube_handler: tuple[CniHandler, ObjectStore], kernel: FakeKernel) -> None:
    h, cache = kube_handler
    server.put_object(_pod_obj("app", "web"))
    out = h.handle(req(netns=world["pod1"]))
    assert out["code"] == 11 and "namespace app of pod app/web is not known" in out["msg"]
    server.fail_next(1000, 503)
    out = h.handle(req(netns=world["pod1"], pod="other"))
    assert out["code"] == 11 and "cannot read pod app/other" in out["msg"]
    assert kernel.applies == 0


def test_concurrent_adds_of_two_ids_into_one_netns_capture_at_most_one(
        handler: CniHandler, kernel: FakeKernel, world: dict[str, str]) -> None:
    gate = threading.Barrier(2)
    results: dict[str, dict[str, Any]] = {}

    def add(cid: str, path: str, pod: str) -> None:
        gate.wait()
        results[cid] = handler.handle(req(cid=cid, netns=path, pod=pod))

    threads = [threading.Thread(target=add, args=("c1", world["pod1"], "web")),
               threading.Thread(target=add, args=("c2", world["pod1-pin"], "api"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(r["ok"] for r in results.values()) == [False, True]
    assert len(handler.store.all()) == 1
