"""Thin kinds: the store keeps stubs of the objects only the mesh model reads (remote pods,
EndpointSlices), and the model still converges through watch events and relists."""

from __future__ import annotations

import copy
from typing import Any, cast

from agent.common.config import NodeConfig
from agent.meshpods import record
from agent.runtime.mesh import THIN_KINDS, MeshRuntime
from agent.scope.model import REMOTE_POD_KIND
from agent.source.base import WatchEvent
from agent.source.events import ObjectStore, Stub
from agent.source.model import slim_pod
from agent.source.objects import PodObject
from agent.source.watch import meshpod_object
from tests.test_meshpods import remote
from tests.test_slices_project import members, namespace, pod, service


def _rv(obj: dict[str, Any], rv: str) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out["metadata"]["resourceVersion"] = rv
    return out


def _slice(name: str, *pods: str) -> dict[str, Any]:
    return members("web", *pods, name=name)


def _runtime() -> MeshRuntime:
    mesh = MeshRuntime(NodeConfig(node_name="node-a"))
    mesh.follow_objects()
    for obj in (namespace(), service(expose=None, selector=None)):
        mesh.objects.apply(WatchEvent("ADDED", obj["kind"], _rv(obj, "1")))
    return mesh


def _members(mesh: MeshRuntime) -> list[str]:
    return sorted(r.key for r in mesh.model.registry.members("apps/web"))


def test_the_runtime_thins_exactly_the_kinds_its_model_digests() -> None:
    assert set(THIN_KINDS) == {"EndpointSlice", REMOTE_POD_KIND}
    mesh = _runtime()
    mesh.objects.apply(WatchEvent("ADDED", "EndpointSlice", _rv(_slice("a", "p1"), "7")))
    held = mesh.objects.get("EndpointSlice", "apps", "web-a")
    assert isinstance(held, Stub)
    assert dict(held) == {"metadata": {"name": "web-a", "namespace": "apps",
                                       "resourceVersion": "7"}}
    assert isinstance(mesh.objects.get("Service", "apps", "web"), dict)  # read back: whole


def test_a_thin_kind_still_tells_changes_from_repeats_by_resource_version() -> None:
    store = ObjectStore()
    seen: list[str] = []
    store.on_event(lambda ev: seen.append(ev.type))
    store.thin(["EndpointSlice"])
    store.apply(WatchEvent("ADDED", "EndpointSlice", _rv(_slice("a", "p1"), "7")))
    assert store.apply(WatchEvent("MODIFIED", "EndpointSlice",
                                  _rv(_slice("a", "p1"), "7"))) is None  # a replayed event
    out = store.apply(WatchEvent("MODIFIED", "EndpointSlice", _rv(_slice("a", "p2"), "8")))
    assert out is not None and out.obj["endpoints"][0]["targetRef"]["name"] == "p2"
    assert seen == ["ADDED", "MODIFIED"]


def test_without_a_resource_version_an_object_is_kept_whole() -> None:
    """A manifest file's objects have none: only their content says whether a re-read
    changed them, so they are never thinned."""
    store = ObjectStore()
    store.thin(["EndpointSlice"])
    store.apply(WatchEvent("ADDED", "EndpointSlice", _slice("a", "p1")))
    assert store.replace_kind("EndpointSlice", [_slice("a", "p1")]) == []
    assert store.get("EndpointSlice", "apps", "web-a") == _slice("a", "p1")


def test_objects_held_when_thinning_starts_become_stubs_and_replays_leave_them_out() -> None:
    store = ObjectStore()
    store.apply(WatchEvent("ADDED", "EndpointSlice", _rv(_slice("a", "p1"), "7")))
    store.apply(WatchEvent("ADDED", "Namespace", _rv(namespace(), "3")))
    store.thin(["EndpointSlice"])
    assert isinstance(store.get("EndpointSlice", "apps", "web-a"), Stub)
    replayed: list[str] = []
    store.on_event(lambda ev: replayed.append(ev.kind))
    assert replayed == ["Namespace"]  # a stub is no object a late subscriber could use


def test_a_relist_missing_thinned_objects_removes_them_from_the_model() -> None:
    """The relist's synthetic DELETED carries only the stub: name and namespace are all the
    model needs to drop a slice's members and a remote pod."""
    mesh = _runtime()
    p1 = _rv(pod("p1", ("10.1.0.1",), node="node-b"), "5")
    mesh.objects.apply(WatchEvent("ADDED", "Pod", p1))
    mesh.objects.apply(WatchEvent("ADDED", "EndpointSlice", _rv(_slice("a", "p1"), "7")))
    assert _members(mesh) == ["apps/p1"]
    events = mesh.objects.replace_kind("EndpointSlice", [])
    assert [(e.type, isinstance(e.obj, Stub)) for e in events] == [("DELETED", True)]
    assert _members(mesh) == []

    web = service(expose=None, selector={"app": "web"})
    mesh.objects.apply(WatchEvent("MODIFIED", "Service", _rv(web, "2")))
    mesh.objects.apply(WatchEvent("ADDED", REMOTE_POD_KIND, _rv(remote("r1", "10.1.0.9"), "9")))
    assert _members(mesh) == ["apps/r1"]
    mesh.objects.replace_kind(REMOTE_POD_KIND, [])
    assert _members(mesh) == []


def test_a_remote_pod_and_a_slice_arrive_with_the_resource_version_their_stub_keeps() -> None:
    rec = record.record_of(slim_pod(cast(PodObject, pod("r1", ("10.1.0.9",), node="node-b"))),
                           "node-b")
    rec["metadata"]["resourceVersion"] = "42"
    obj = meshpod_object(rec)
    store = ObjectStore()
    store.thin([REMOTE_POD_KIND])
    store.apply(WatchEvent("ADDED", REMOTE_POD_KIND, obj))
    assert dict(store.get(REMOTE_POD_KIND, "apps", "r1") or {}) == {
        "metadata": {"name": "r1", "namespace": "apps", "resourceVersion": "42"}}


def test_a_stub_gives_back_the_resource_version_exactly_as_the_api_spelled_it() -> None:
    """The store may hold a plain decimal as a number; what readers see is the same string
    (an opaque token to Kubernetes: "007" and "7" are two versions)."""
    store = ObjectStore()
    store.thin(["EndpointSlice"])
    for name, rv in (("a", "7"), ("b", "007"), ("c", "0"), ("d", "x1")):
        store.apply(WatchEvent("ADDED", "EndpointSlice", _rv(_slice(name, "p1"), rv)))
        assert (store.get("EndpointSlice", "apps", f"web-{name}") or {})["metadata"][
            "resourceVersion"] == rv
    assert store.apply(WatchEvent("MODIFIED", "EndpointSlice",
                                  _rv(_slice("b", "p2"), "7"))) is not None  # "007" ≠ "7"
    assert store.apply(WatchEvent("MODIFIED", "EndpointSlice",
                                  _rv(_slice("b", "p2"), "7"))) is None


def test_thinning_twice_and_odd_digits_change_nothing() -> None:
    store = ObjectStore()
    store.thin(["EndpointSlice"])
    store.apply(WatchEvent("ADDED", "EndpointSlice", _rv(_slice("a", "p1"), "²")))
    store.apply(WatchEvent("ADDED", "EndpointSlice", _rv(_slice("b", "p1"), "12")))
    store.thin(["EndpointSlice"])  # the held values are held already
    assert [(o["metadata"]["name"], o["metadata"]["resourceVersion"])
            for o in store.of_kind("EndpointSlice")] == [("web-a", "²"), ("web-b", "12")]


def test_a_thin_kind_is_keyed_by_the_pods_own_interned_key() -> None:
    """No key tuple per object: the inner key is the very ``<ns>/<name>`` string the mesh
    model keys the pod by, and readers still see (kind, namespace, name)."""
    from agent.common.ids import pod_key

    store = ObjectStore()
    store.thin(["MeshPod"])
    obj = {"kind": "MeshPod", "metadata": {"name": "web-1", "namespace": "shop",
                                           "resourceVersion": "7"}}
    store.apply(WatchEvent("ADDED", "MeshPod", obj))
    (inner,) = store._kinds["MeshPod"]
    assert inner is pod_key("shop", "web-1")
    got = store.get("MeshPod", "shop", "web-1")
    assert isinstance(got, Stub) and got["metadata"] == {"name": "web-1", "namespace": "shop",
                                                         "resourceVersion": "7"}
    assert list(store.snapshot()) == [("MeshPod", "shop", "web-1")]
    assert store.replace_kind("MeshPod", []) and store.get("MeshPod", "shop", "web-1") is None
    assert store.counts() == {}
