"""Route status (agent/gamma/status.py) against FakeApiServer, real client; conditions as the
running agent computes them (MeshRuntime.route_statuses → the route-table builder)."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent.common.config import NodeConfig
from agent.gamma.conditions import ParentStatus
from agent.gamma.status import StatusLoop, StatusWriter, desired_parents
from agent.runtime.mesh import MeshRuntime
from agent.scope.routes import ParentRef
from agent.source.base import WatchEvent
from agent.testing import FakeApiServer
from agent.testing import apiserver as fake

pytestmark = pytest.mark.timeout(60)

CTRL = "aether.io/mesh"
GW = "gateway.networking.k8s.io/v1"
EXTRA = (
    fake.Resource("gateway.networking.x-k8s.io", "v1alpha1", "xmeshes", "XMesh",
                  namespaced=False, status=True),
)


class Leadership:
    """A lease stand-in the test flips."""

    def __init__(self, leader: bool = True) -> None:
        self.leader = leader

    def is_leader(self) -> bool:
        return self.leader


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeApiServer]:
    monkeypatch.setattr(fake, "RESOURCES", fake.RESOURCES + EXTRA)
    with FakeApiServer() as srv:
        yield srv



# ---- objects -------------------------------------------------------------------------------

def namespace(name: str, managed: bool = True, **annotations: str) -> dict[str, Any]:
    labels = {"aether.io/managed": "true"} if managed else {}
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": labels, "annotations": annotations}}


def service(name: str, ns: str = "apps", ports: tuple[tuple[str, int], ...] = (("http", 80),),
            labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
            **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": ns, "labels": labels or {},
                         "annotations": annotations or {}},
            "spec": {"clusterIP": "10.96.0.10", "selector": {"app": name},
                     "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports], **spec}}


def route(name: str, parents: list[dict[str, Any]], backends: list[dict[str, Any]],
          ns: str = "apps", kind: str = "HTTPRoute", annotations: dict[str, str] | None = None,
          **rule: Any) -> dict[str, Any]:
    return {"apiVersion": GW, "kind": kind,
            "metadata": {"name": name, "namespace": ns, "annotations": annotations or {}},
            "spec": {"parentRefs": parents, "rules": [{"backendRefs": backends, **rule}]}}


def svc_parent(name: str, **kw: Any) -> dict[str, Any]:
    return {"group": "", "kind": "Service", "name": name, **kw}


def backend(name: str, port: int = 80, **kw: Any) -> dict[str, Any]:
    return {"name": name, "port": port, **kw}


class World:
    """Objects in the API server and in the agent's object store (as the watch would), the
    statuses computed as the running agent computes them (MeshRuntime.route_statuses)."""

    def __init__(self, server: FakeApiServer) -> None:
        self.server = server
        self.runtime = MeshRuntime(NodeConfig(node_name="node-a", run_dir="/nonexistent"),
                                   controller_name=CTRL)
        self.runtime.follow_objects()
        self.store = self.runtime.objects

    def put(self, *objs: dict[str, Any]) -> None:
        for obj in objs:
            stored = self.server.put_object(obj)
            self.store.apply(WatchEvent("ADDED", stored["kind"], stored))

    def refresh(self, kind: str, name: str, ns: str = "apps") -> dict[str, Any]:
        obj = self.server.get_object(kind, name, ns, GW)
        assert obj is not None
        self.store.apply(WatchEvent("MODIFIED", kind, obj))
        return obj

    def statuses(self) -> list[ParentStatus]:
        return self.runtime.route_statuses()


@pytest.fixture
def world(server: FakeApiServer) -> World:
    w = World(server)
    w.put(namespace("apps"), service("echo"), service("echo-v1"), service("echo-v2"))
    return w


def parents_of(server: FakeApiServer, name: str, ns: str = "apps",
               kind: str = "HTTPRoute") -> list[dict[str, Any]]:
    obj = server.get_object(kind, name, ns, GW)
    assert obj is not None
    parents: list[dict[str, Any]] = (obj.get("status") or {}).get("parents") or []
    return parents


def ours(server: FakeApiServer, name: str, **kw: Any) -> list[dict[str, Any]]:
    return [p for p in parents_of(server, name, **kw) if p["controllerName"] == CTRL]


def cond(entry: dict[str, Any], type_: str) -> dict[str, Any]:
    found: dict[str, Any] = next(c for c in entry["conditions"] if c["type"] == type_)
    return found


def writes(server: FakeApiServer) -> list[tuple[str, str]]:
    return [(m, p) for m, p in server.requests if m in ("POST", "PUT", "PATCH", "DELETE")]


# ---- tests ---------------------------------------------------------------------------------

def test_valid_route_accepted_and_resolved_with_observed_generation(server, api, world):
    world.put(route("split", [svc_parent("echo", port=80)], [backend("echo-v1"), backend("echo-v2")]))
    writer = StatusWriter(api, CTRL, Leadership())
    assert writer.sync(world.statuses()) == 1
    [entry] = parents_of(server, "split")
    assert entry["controllerName"] == CTRL
    assert entry["parentRef"] == {"group": "", "kind": "Service", "name": "echo", "port": 80}
    gen = server.get_object("HTTPRoute", "split", "apps", GW)["metadata"]["generation"]
    for type_, reason in (("Accepted", "Accepted"), ("ResolvedRefs", "ResolvedRefs")):
        c = cond(entry, type_)
        assert (c["status"], c["reason"], c["observedGeneration"]) == ("True", reason, gen)
        assert c["lastTransitionTime"]
    # the write went to the /status subresource, as a PUT carrying the resourceVersion
    assert writes(server) == [("PUT", "/apis/gateway.networking.k8s.io/v1/namespaces/apps/"
                                      "httproutes/split/status")]


def test_broken_backend_and_wrong_kind(server, api, world):
    world.put(
        route("missing", [svc_parent("echo")], [backend("nope")]),
        route("kind", [svc_parent("echo")], [backend("x", group="example.com", kind="Bucket")]),
        route("badport", [svc_parent("echo")], [backend("echo-v1", port=9999)]),
    )
    StatusWriter(api, CTRL, Leadership()).sync(world.statuses())
    for name, reason in (("missing", "BackendNotFound"), ("kind", "InvalidKind"),
                         ("badport", "BackendNotFound")):
        [entry] = ours(server, name)
        c = cond(entry, "ResolvedRefs")
        assert (c["status"], c["reason"]) == ("False", reason), name
        assert cond(entry, "Accepted")["status"] == "True"  # the parent itself is fine


def test_cross_namespace_backend_resolves_without_a_reference_grant(server, api, world):
    """GEP-1294: mesh routes' backendRefs resolve in any namespace, no ReferenceGrant."""
    world.put(namespace("data", managed=False), service("db", "data"),
              route("cross", [svc_parent("echo")], [backend("db", namespace="data")]))
    StatusWriter(api, CTRL, Leadership()).sync(world.statuses())
    [entry] = ours(server, "cross")
    c = cond(entry, "ResolvedRefs")
    assert (c["status"], c["reason"]) == ("True", "ResolvedRefs")
    # a cross-namespace backendRef to a Service that does not exist is still not resolved
    world.put(route("cross-missing", [svc_parent("echo")], [backend("nope", namespace="data")]))
    StatusWriter(api, CTRL, Leadership()).sync(world.statuses())
    [entry] = ours(server, "cross-missing")
    c = cond(entry, "ResolvedRefs")
    assert (c["status"], c["reason"]) == ("False", "BackendNotFound")


def test_parent_problems_no_matching_parent_and_unsupported(server, api, world):
    world.put(
        route("ghost", [svc_parent("ghost")], [backend("echo-v1")]),
        route("port", [svc_parent("echo", port=8080)], [backend("echo-v1")]),
        route("section", [svc_parent("echo", sectionName="grpc")], [backend("echo-v1")]),
        route("cors", [svc_parent("echo")], [backend("echo-v1")],
              filters=[{"type": "CORS", "cors": {"allowOrigins": ["*"]}}]),
        route("ext", [svc_parent("echo")], [backend("echo-v1")],
              filters=[{"type": "ExtensionRef", "extensionRef": {"group": "x.io", "kind": "F",
                                                                 "name": "f"}}]),
    )
    StatusWriter(api, CTRL, Leadership()).sync(world.statuses())
    for name, reason in (("ghost", "NoMatchingParent"), ("port", "NoMatchingParent"),
                         ("section", "NoMatchingParent"), ("cors", "UnsupportedValue")):
        [entry] = ours(server, name)
        c = cond(entry, "Accepted")
        assert (c["status"], c["reason"]) == ("False", reason), name
        assert c["message"]
    # an ExtensionRef we cannot resolve is not skipped: the route is accepted, its requests
    # answer 500, and ResolvedRefs says why (Gateway API: the filter MUST NOT be skipped)
    [entry] = ours(server, "ext")
    assert cond(entry, "Accepted")["status"] == "True"
    c = cond(entry, "ResolvedRefs")
    assert (c["status"], c["reason"]) == ("False", "InvalidKind")


def test_section_name_matches_port_name(server, api, world):
    world.put(route("sec", [svc_parent("echo", sectionName="http")], [backend("echo-v1")]))
    StatusWriter(api, CTRL, Leadership()).sync(world.statuses())
    [entry] = ours(server, "sec")
    assert entry["parentRef"]["sectionName"] == "http"
    assert cond(entry, "Accepted")["status"] == "True"


def test_grpc_route_gets_status_too(server, api, world):
    world.put(route("g", [svc_parent("echo")], [backend("echo-v1")], kind="GRPCRoute"))
    StatusWriter(api, CTRL, Leadership()).sync(world.statuses())
    [entry] = ours(server, "g", kind="GRPCRoute")
    assert cond(entry, "Accepted")["status"] == "True"


def test_other_controllers_entries_preserved_in_place(server, api, world):
    theirs = {"parentRef": {"group": "", "kind": "Service", "name": "echo"},
              "controllerName": "istio.io/mesh-controller",
              "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted",
                              "message": "", "lastTransitionTime": "2024-01-01T00:00:00Z",
                              "observedGeneration": 1}]}
    obj = route("shared", [svc_parent("echo")], [backend("echo-v1")])
    obj["status"] = {"parents": [theirs]}
    world.put(obj)
    StatusWriter(api, CTRL, Leadership()).sync(world.statuses())
    parents = parents_of(server, "shared")
    assert parents[0] == theirs
    assert [p["controllerName"] for p in parents] == ["istio.io/mesh-controller", CTRL]


def test_no_write_when_unchanged_and_transition_time_kept(server, api, world):
    world.put(route("r", [svc_parent("echo")], [backend("echo-v1")]))
    writer = StatusWriter(api, CTRL, Leadership())
    assert writer.sync(world.statuses()) == 1
    first = ours(server, "r")[0]
    server.clear_requests()
    assert writer.sync(world.statuses()) == 0
    assert writes(server) == []
    # a fresh writer (new leader) reads the API and still sees nothing to do
    server.clear_requests()
    time.sleep(1.1)  # a new lastTransitionTime would now differ
    assert StatusWriter(api, CTRL, Leadership()).sync(world.statuses()) == 0
    assert writes(server) == []
    # the backend vanishes: ResolvedRefs flips (new time), Accepted keeps its time
    server.delete_object("Service", "echo-v1", "apps")
    world.store.apply(WatchEvent("DELETED", "Service", service("echo-v1")))
    assert writer.sync(world.statuses()) == 1
    now = ours(server, "r")[0]
    assert cond(now, "Accepted")["lastTransitionTime"] == cond(first, "Accepted")["lastTransitionTime"]
    assert cond(now, "ResolvedRefs")["status"] == "False"
    old_time = cond(first, "ResolvedRefs")["lastTransitionTime"]
    assert cond(now, "ResolvedRefs")["lastTransitionTime"] != old_time


def test_conflict_is_retried_on_fresh_object(server, api, world):
    world.put(route("r", [svc_parent("echo")], [backend("echo-v1")]))
    writer = StatusWriter(api, CTRL, Leadership())
    writer.adopt()
    # someone else writes status after our list: our cached resourceVersion is stale
    obj = server.get_object("HTTPRoute", "r", "apps", GW)
    other = {"parentRef": {"group": "", "kind": "Service", "name": "echo"},
             "controllerName": "other.io/mesh", "conditions": []}
    obj["status"] = {"parents": [other]}
    server.put_object(obj)
    assert writer.sync(world.statuses()) == 2  # 409, re-read, merged write
    assert writer.conflicts == 1
    assert [p["controllerName"] for p in parents_of(server, "r")] == ["other.io/mesh", CTRL]


def test_stale_entry_removed_when_parent_dropped(server, api, world):
    world.put(service("other"), route("r", [svc_parent("echo"), svc_parent("other")],
                                      [backend("echo-v1")]))
    writer = StatusWriter(api, CTRL, Leadership())
    writer.sync(world.statuses())
    assert [p["parentRef"]["name"] for p in ours(server, "r")] == ["echo", "other"]
    obj = world.refresh("HTTPRoute", "r")
    obj["spec"]["parentRefs"] = [svc_parent("other")]
    world.put(obj)
    writer.sync(world.statuses())
    assert [p["parentRef"]["name"] for p in ours(server, "r")] == ["other"]
    # route now names another mesh: our entry goes, and a fresh leader (relist) agrees
    obj = world.refresh("HTTPRoute", "r")
    obj["metadata"]["annotations"] = {"aether.io/mesh-controller": "istio.io/mesh-controller"}
    world.put(obj)
    StatusWriter(api, CTRL, Leadership()).sync(world.statuses())
    assert ours(server, "r") == []


def test_not_leader_writes_nothing(server, api, world):
    world.put(route("r", [svc_parent("echo")], [backend("echo-v1")]))
    lead = Leadership(False)
    writer = StatusWriter(api, CTRL, lead)
    server.clear_requests()
    assert writer.sync(world.statuses()) == 0
    assert server.requests == []
    lead.leader = True
    assert writer.sync(world.statuses()) == 1


def test_api_failure_raises_after_trying_all_then_recovers(server, api, world):
    world.put(route("a", [svc_parent("echo")], [backend("echo-v1")]),
              route("b", [svc_parent("echo")], [backend("echo-v1")]))
    writer = StatusWriter(api, CTRL, Leadership())
    writer.adopt()
    server.fail_next(1, 500)
    with pytest.raises(Exception, match="HTTP 500"):
        writer.sync(world.statuses())
    assert len(ours(server, "b")) == 1  # the other route was still written
    writer.sync(world.statuses())
    assert len(ours(server, "a")) == 1


def test_desired_parents_is_pure_and_ignores_gateway_parents():
    r = route("r", [{"name": "gw"}, svc_parent("echo")], [backend("echo-v1")])
    r["metadata"]["generation"] = 3
    r["status"] = {"parents": [{"parentRef": {"name": "gw"}, "controllerName": CTRL,
                                "conditions": []}]}
    from agent.gamma.conditions import Condition
    ps = ParentStatus("HTTPRoute", "apps", "r", ParentRef("apps", "echo"), 3,
                      [Condition("Accepted", "True", "Accepted", "ok")])
    out = desired_parents(r, [ps], CTRL, now="2025-01-01T00:00:00Z")
    # our entry for a Gateway parent (written by some other tool under our name) is dropped
    assert out == [{"parentRef": {"group": "", "kind": "Service", "name": "echo"},
                    "controllerName": CTRL,
                    "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted",
                                    "message": "ok", "observedGeneration": 3,
                                    "lastTransitionTime": "2025-01-01T00:00:00Z"}]}]
    assert r["status"]["parents"][0]["parentRef"] == {"name": "gw"}  # input untouched


def test_status_loop_debounces_and_follows_leadership(server, api, world):
    world.put(route("r", [svc_parent("echo")], [backend("echo-v1")]))
    lead = Leadership(False)
    writer = StatusWriter(api, CTRL, lead)
    loop = StatusLoop(world.statuses, writer, interval=0.05, leader_poll=0.05)
    loop.start()
    try:
        time.sleep(0.3)
        assert ours(server, "r") == []
        lead.leader = True  # becoming leader triggers a pass without any model change
        deadline = time.monotonic() + 5
        while not ours(server, "r") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(ours(server, "r")) == 1
        world.put(route("r2", [svc_parent("echo")], [backend("nope")]))
        for _ in range(5):
            loop.mark_dirty()
        deadline = time.monotonic() + 5
        while not ours(server, "r2") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cond(ours(server, "r2")[0], "ResolvedRefs")["reason"] == "BackendNotFound"
        assert loop.status()["leader"] is True and loop.failures == 0
    finally:
        loop.stop()


def test_copy_safety_of_store_objects(server, api, world):
    """The writer must not mutate the objects it was handed (the store shares them)."""
    world.put(route("r", [svc_parent("echo")], [backend("echo-v1")]))
    before = copy.deepcopy(world.store.snapshot())
    StatusWriter(api, CTRL, Leadership()).sync(world.statuses())
    assert world.store.snapshot() == before


def test_records_from_another_producer_are_filtered_by_ownership(server, api, world):
    from types import SimpleNamespace

    from agent.gamma.conditions import adopt_records
    world.put(namespace("legacy", managed=False), service("old", "legacy"),
              route("r", [svc_parent("echo"), svc_parent("old", namespace="legacy")], [backend("echo-v1")]))
    c = SimpleNamespace(type="Accepted", status="False", reason="NotAllowedByParent", message="lost")
    recs = [SimpleNamespace(route_kind="HTTPRoute", route_namespace="apps", route_name="r",
                            parent=ParentRef(ns_, n), generation=None, conditions=(c,))
            for ns_, n in (("apps", "echo"), ("legacy", "old"))]
    got = adopt_records(recs, world.store, CTRL)
    assert [p.parent.name for p in got] == ["echo"] and got[0].conditions[0].reason == "NotAllowedByParent"
    StatusWriter(api, CTRL, Leadership()).sync(got)
    assert cond(ours(server, "r")[0], "Accepted")["message"] == "lost"


def test_a_headless_or_external_name_parent_is_not_a_mesh_parent(server, api, world):
    # one decision for the data plane and for status: the table builder's (docs table row)
    world.put(service("hl", clusterIP="None"), service("ext", type="ExternalName",
                                                     externalName="example.com"),
              route("on-hl", [svc_parent("hl")], [backend("echo-v1")]),
              route("on-ext", [svc_parent("ext")], [backend("echo-v1")]))
    StatusWriter(api, CTRL, Leadership()).sync(world.statuses())
    for name in ("on-hl", "on-ext"):
        [entry] = ours(server, name)
        c = cond(entry, "Accepted")
        assert (c["status"], c["reason"]) == ("False", "NoMatchingParent"), name
        assert "cannot be a mesh parent" in c["message"]
