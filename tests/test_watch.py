"""The event sources: ObjectStore/diff, the Kubernetes watcher against the fake API server
(cut streams, 410 Gone, API server restart) and the manifest directory watcher."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.source.base import WatchEvent
from agent.source.events import ObjectStore, diff_snapshots
from agent.source.watch import MESH_KINDS, KubeWatcher, ManifestWatcher
from agent.testing import FakeApiServer
from agent.testing.apiserver import ApiError

pytestmark = pytest.mark.timeout(60)


def pod(name: str, ns: str = "default", **labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {"nodeName": "node-a", "containers": [{"name": "c"}]}}


def svc(name: str, ns: str = "default") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
            "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80}]}}


def eventually(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached")


def names(store: ObjectStore, kind: str) -> dict[str, dict[str, str]]:
    """name → labels: what convergence is checked on."""
    return {o["metadata"]["name"]: o["metadata"].get("labels") or {} for o in store.of_kind(kind)}


def truth(server: FakeApiServer, kind: str, objs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {n: o["metadata"].get("labels") or {} for n, o in objs.items()}


# ---- store + diff -----------------------------------------------------------------------------


def test_diff_snapshots_and_replace_kind_converge() -> None:
    a, b = pod("a"), pod("b")
    b2 = pod("b", v="2")
    old = {("Pod", "default", "a"): a, ("Pod", "default", "b"): b}
    new = {("Pod", "default", "b"): b2, ("Pod", "default", "c"): pod("c")}
    evs = diff_snapshots(old, new)
    assert [(e.type, e.obj["metadata"]["name"]) for e in evs] == [
        ("MODIFIED", "b"), ("ADDED", "c"), ("DELETED", "a")]

    store = ObjectStore()
    seen: list[tuple[str, str]] = []
    for o in (a, b):
        store.apply(WatchEvent("ADDED", "Pod", o))
    store.on_event(lambda e: seen.append((e.type, e.obj["metadata"]["name"])), replay=True)
    assert seen == [("ADDED", "a"), ("ADDED", "b")]
    seen.clear()
    store.replace_kind("Pod", [b2, pod("c")])
    assert sorted(seen) == [("ADDED", "c"), ("DELETED", "a"), ("MODIFIED", "b")]
    seen.clear()
    assert store.apply(WatchEvent("ADDED", "Pod", b2)) is None  # no phantom change
    assert store.apply(WatchEvent("DELETED", "Pod", pod("zz"))) is None
    assert seen == []


# ---- Kubernetes watcher -----------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    srv = FakeApiServer(bookmark_interval=0.2).start()
    yield srv
    srv.stop()


# the kinds the fake API server serves (it has no experimental Gateway API policy CRDs)
SERVED = [k for k in MESH_KINDS if k != "XBackendTrafficPolicy"]


@pytest.fixture
def watcher(server: FakeApiServer, tmp_path: Path) -> Iterator[tuple[KubeWatcher, ObjectStore]]:
    store = ObjectStore()
    w = KubeWatcher(
        server.kubeconfig(tmp_path / "kubeconfig"), MESH_KINDS, "node-a", store,
        threading.Event(), backoff_base=0.05, backoff_cap=0.3, request_timeout=2.0,
    )
    yield w, store
    w.stop()


def test_list_then_watch_all_kinds(
    server: FakeApiServer, watcher: tuple[KubeWatcher, ObjectStore]
) -> None:
    w, store = watcher
    server.put_object({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "apps"}})
    server.put_object(pod("p1", "apps"))
    server.put_object({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": {"name": "r", "namespace": "apps"}, "spec": {}})
    w.start()
    assert w.wait_synced(10)
    assert store.get("Namespace", "", "apps") is not None
    assert store.get("Pod", "apps", "p1")["kind"] == "Pod"  # type: ignore[index]
    assert store.get("HTTPRoute", "apps", "r") is not None
    server.put_object(svc("s1", "apps"))
    server.delete_object("Pod", "p1", "apps")
    eventually(lambda: store.get("Service", "apps", "s1") is not None
               and store.get("Pod", "apps", "p1") is None)
    # bookmarks advance the resourceVersion of quiet kinds
    rv = int(server.resource_version)
    eventually(lambda: int(w.status["GRPCRoute"].resource_version or 0) >= rv)


def test_watch_cut_mid_stream_resumes_without_loss(
    server: FakeApiServer, watcher: tuple[KubeWatcher, ObjectStore]
) -> None:
    w, store = watcher
    objs = {f"p{i}": pod(f"p{i}", i=str(i)) for i in range(3)}
    for o in objs.values():
        server.put_object(o)
    w.start()
    assert w.wait_synced(10)
    for abrupt in (True, False):
        eventually(lambda: server.watch_count >= len(SERVED))
        server.drop_watches(abrupt=abrupt)
        objs["p1"] = pod("p1", i="changed", abrupt=str(abrupt).lower())
        server.put_object(objs["p1"])
        server.delete_object("Pod", "p2")
        objs.pop("p2", None)
        objs["p9"] = pod("p9")
        server.put_object(objs["p9"])
        eventually(lambda: names(store, "Pod") == truth(server, "Pod", objs))
        server.put_object(pod("p2"))
        objs["p2"] = pod("p2")
        eventually(lambda: names(store, "Pod") == truth(server, "Pod", objs))
    assert w.status["Pod"].relists_410 == 0  # resumed from the last resourceVersion


def test_410_gone_relists_and_converges(
    server: FakeApiServer, watcher: tuple[KubeWatcher, ObjectStore]
) -> None:
    w, store = watcher
    objs = {f"p{i}": pod(f"p{i}") for i in range(3)}
    for o in objs.values():
        server.put_object(o)
    w.start()
    assert w.wait_synced(10)
    eventually(lambda: server.watch_count >= len(SERVED))
    # changes the watcher never sees as events: watches cut, history compacted
    server.drop_watches(abrupt=True)
    server.delete_object("Pod", "p0")
    objs.pop("p0")
    objs["p1"] = pod("p1", moved="yes")
    server.put_object(objs["p1"])
    server.compact()
    objs["p5"] = pod("p5")
    server.put_object(objs["p5"])
    server.compact()
    eventually(lambda: names(store, "Pod") == truth(server, "Pod", objs))
    assert w.status["Pod"].relists_410 >= 1


def test_api_server_restart_converges(
    server: FakeApiServer, watcher: tuple[KubeWatcher, ObjectStore]
) -> None:
    w, store = watcher
    objs = {f"p{i}": pod(f"p{i}") for i in range(3)}
    for o in objs.values():
        server.put_object(o)
    w.start()
    assert w.wait_synced(10)
    eventually(lambda: server.watch_count >= len(SERVED))
    server.stop()
    time.sleep(0.5)  # the watcher sees connection refused and backs off
    server.delete_object("Pod", "p1")  # changed while down, history lost (as after etcd restore)
    objs.pop("p1")
    objs["p7"] = pod("p7")
    server.put_object(objs["p7"])
    server.compact()
    server.start()  # same port: the kubeconfig stays valid
    eventually(lambda: names(store, "Pod") == truth(server, "Pod", objs))
    assert w.status["Pod"].errors >= 1
    # and it keeps watching after the restart
    eventually(lambda: server.watch_count >= len(SERVED))
    server.put_object(pod("p8"))
    eventually(lambda: store.get("Pod", "default", "p8") is not None)


def test_errors_back_off_and_recover(
    server: FakeApiServer, watcher: tuple[KubeWatcher, ObjectStore]
) -> None:
    w, store = watcher
    server.fail_next(8, 500)
    server.put_object(pod("p0"))
    w.start()
    assert w.wait_synced(15)
    assert store.get("Pod", "default", "p0") is not None
    assert sum(s.errors for s in w.status.values()) >= 1


# ---- manifest watcher -------------------------------------------------------------------------


def test_manifest_watcher_emits_diffs_on_change(tmp_path: Path) -> None:
    store = ObjectStore()
    seen: list[tuple[str, str, str]] = []
    store.on_event(lambda e: seen.append((e.type, e.kind, e.obj["metadata"]["name"])))
    (tmp_path / "a.yaml").write_text(yaml.safe_dump_all([pod("p1"), svc("s1")]))
    (tmp_path / "cm.yaml").write_text(yaml.safe_dump(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ignored"}}))
    stop = threading.Event()
    w = ManifestWatcher(str(tmp_path), store, stop, interval=0.05).start()
    try:
        assert w.wait_synced(5)
        assert sorted(seen) == [("ADDED", "Pod", "p1"), ("ADDED", "Service", "s1")]
        seen.clear()
        time.sleep(0.02)
        (tmp_path / "a.yaml").write_text(yaml.safe_dump_all([pod("p1", v="2"), pod("p2")]))
        eventually(lambda: len(seen) == 3)
        assert sorted(seen) == [
            ("ADDED", "Pod", "p2"), ("DELETED", "Service", "s1"), ("MODIFIED", "Pod", "p1")]
    finally:
        w.stop()


# ---- paged LISTs and slim Pods ----------------------------------------------------------------


def test_lists_come_in_pages_and_pods_are_slimmed(server: FakeApiServer, tmp_path: Path) -> None:
    """A LIST of 1,200 Pods arrives as three pages of 500 (limit/continue, as client-go's
    pager asks), all of one snapshot; each Pod is stored slim (no env, no managedFields)."""
    for i in range(1200):
        p = pod(f"p{i:04d}")
        p["spec"]["containers"][0]["env"] = [{"name": "X", "value": "y" * 100}]
        p["metadata"]["managedFields"] = [{"manager": "kubectl"}]
        server.put_object(p)
    store = ObjectStore()
    w = KubeWatcher(server.kubeconfig(tmp_path / "kubeconfig"), ["Pod"], "node-a", store,
                    threading.Event(), request_timeout=5.0, list_page=500)
    before = server.lists
    try:
        w.start()
        assert w.wait_synced(20)
        assert server.lists - before == 3
        assert len(store.of_kind("Pod")) == 1200
        got = store.get("Pod", "default", "p0007")
        assert got is not None and got["kind"] == "Pod"
        assert "env" not in got["spec"]["containers"][0] and "managedFields" not in got["metadata"]
        assert got["spec"]["nodeName"] == "node-a"
    finally:
        w.stop()


def test_a_page_served_after_writes_is_of_the_first_page_snapshot(server: FakeApiServer) -> None:
    for i in range(5):
        server.put_object(pod(f"p{i}", v="1"))
    first = server.list_objects("Pod", limit=2)
    rv, token = first["metadata"]["resourceVersion"], first["metadata"]["continue"]
    assert first["metadata"]["remainingItemCount"] == 3
    server.put_object(pod("p4", v="2"))  # after the snapshot
    server.put_object(pod("p9"))
    rest = server.list_objects("Pod", limit=10, token=token)
    assert rest["metadata"]["resourceVersion"] == rv and "continue" not in rest["metadata"]
    assert [(o["metadata"]["name"], o["metadata"]["labels"]) for o in rest["items"]] == [
        ("p2", {"v": "1"}), ("p3", {"v": "1"}), ("p4", {"v": "1"})]
    again = server.list_objects("Pod", limit=2)
    server.put_object(pod("p10"))
    server.compact()  # the snapshot's revision is compacted away
    with pytest.raises(ApiError) as err:
        server.list_objects("Pod", limit=2, token=again["metadata"]["continue"])
    assert err.value.code == 410


def _thirty_pods_and_a_410(server: FakeApiServer, tmp_path: Path, store: ObjectStore
                           ) -> KubeWatcher:
    """30 Pods listed in pages of 10, the next continue request answered 410 Expired."""
    for i in range(30):
        server.put_object(pod(f"p{i:02d}"))
    server.expire_continues(1)
    return KubeWatcher(server.kubeconfig(tmp_path / "kubeconfig"), ["Pod"], "node-a", store,
                       threading.Event(), request_timeout=5.0, list_page=10,
                       backoff_base=0.05, backoff_cap=0.2)


def test_an_expired_continue_token_restarts_the_list(server: FakeApiServer,
                                                     tmp_path: Path) -> None:
    """410 Expired on a later page: the watcher lists again from the start and converges."""
    store = ObjectStore()
    w = _thirty_pods_and_a_410(server, tmp_path, store)
    try:
        w.start()
        assert w.wait_synced(20)
        assert len(store.of_kind("Pod")) == 30
        assert w.status["Pod"].relists_410 == 1
    finally:
        w.stop()


def test_a_first_list_is_applied_as_read_and_a_relist_replaces_what_it_left(
        server: FakeApiServer, tmp_path: Path) -> None:
    """The first LIST of a kind goes into the store page by page; when a later page fails
    (410), the relist replaces the kind whole, so a pod deleted meanwhile goes too."""
    store = ObjectStore()
    seen: list[tuple[str, str]] = []
    first_page = threading.Event()

    def on_event(ev: WatchEvent) -> None:
        seen.append((ev.type, ev.obj["metadata"]["name"]))
        if len(seen) == 10 and not first_page.is_set():  # the first page is in the store
            first_page.set()
            server.delete_object("Pod", "p00", "default")

    store.on_event(on_event)
    w = _thirty_pods_and_a_410(server, tmp_path, store)
    try:
        w.start()
        assert w.wait_synced(20)
        assert first_page.is_set()
        assert seen[:10] == [("ADDED", f"p{i:02d}") for i in range(10)]  # before the 410
        names = sorted(o["metadata"]["name"] for o in store.of_kind("Pod"))
        assert names == [f"p{i:02d}" for i in range(1, 30)]
        assert ("DELETED", "p00") in seen and w.status["Pod"].relists_410 == 1
    finally:
        w.stop()


def test_a_kind_the_api_does_not_serve_counts_as_synced_and_empty(
        watcher: tuple[KubeWatcher, ObjectStore]) -> None:
    """XBackendTrafficPolicy's CRD is not installed on this API server (404 on its LIST):
    the watcher does not hold everything back for it or retry it hot; it is an empty kind,
    looked for again later."""
    w, store = watcher
    w.start()
    assert w.wait_synced(10)
    st = w.status["XBackendTrafficPolicy"]
    assert st.not_served and st.synced and st.errors == 0
    assert store.of_kind("XBackendTrafficPolicy") == []
    assert not w.status["Pod"].not_served
