"""SliceWriter/SliceProjector against the test API server, through the real kubernetes client."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from agent.slices.project import EXPOSE_ANNOTATION, MANAGED_BY_LABEL, NODE_LABEL
from agent.slices.writer import SliceProjector, SliceWriter
from agent.testing import FakeApiServer
from tests.test_slices_project import Mesh, members, pod, service

pytestmark = pytest.mark.timeout(60)

SLICES = "/apis/discovery.k8s.io/v1/namespaces/apps/endpointslices"




def live_slices(server: FakeApiServer, node: str | None = None) -> dict[str, dict[str, Any]]:
    """Our slices as stored by the server (name → object)."""
    out = {}
    with server._lock:
        stored = list(server._store.items())
    for (_gv, plural, _, name), obj in stored:
        labels = obj["metadata"].get("labels") or {}
        if plural == "endpointslices" and labels.get(MANAGED_BY_LABEL) == "aether.io/agent" and (
                node is None or labels.get(NODE_LABEL) == node):
            out[name] = copy.deepcopy(obj)
    return out


def writes(server: FakeApiServer) -> list[tuple[str, str]]:
    return [(m, p) for m, p in server.requests if m in ("POST", "PUT", "PATCH", "DELETE")]


def pods_of(obj: dict[str, Any]) -> list[str]:
    return [e["targetRef"]["name"] for e in obj["endpoints"]]


def api_service(server: FakeApiServer, **kw: Any) -> dict[str, Any]:
    """Store the Service in the API (it gets a real uid) and return it as a watch would."""
    svc = service(**kw)
    svc["metadata"].pop("uid")
    return server.put_object(svc)


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_annotation_flips_create_and_delete(server: FakeApiServer, api: client.ApiClient) -> None:
    m = Mesh().put(pod("p1", ("10.0.0.1",)), members("web", "p1"))
    w = SliceWriter(api, "node-a")
    svc = api_service(server, expose=None)
    m.put(svc)
    assert w.reconcile(m.desired()) == 0 and live_slices(server) == {}
    svc["metadata"]["annotations"] = {EXPOSE_ANNOTATION: "true"}
    m.put(svc)
    assert w.reconcile(m.desired()) == 1
    [obj] = live_slices(server).values()
    assert pods_of(obj) == ["p1"]
    assert obj["metadata"]["ownerReferences"][0]["uid"] == svc["metadata"]["uid"]
    svc["metadata"]["annotations"] = {EXPOSE_ANNOTATION: "false"}
    m.put(svc)
    assert w.reconcile(m.desired()) == 1 and live_slices(server) == {}


def test_pod_churn_updates_in_place(server: FakeApiServer, api: client.ApiClient) -> None:
    m = Mesh().put(pod("p1", ("10.0.0.1",)), members("web", "p1"), api_service(server))
    w = SliceWriter(api, "node-a")
    w.reconcile(m.desired())
    [name] = live_slices(server)
    m.put(pod("p2", ("10.0.0.2",)), members("web", "p1", "p2"))
    server.clear_requests()
    assert w.reconcile(m.desired()) == 1
    assert writes(server) == [("PUT", f"{SLICES}/{name}")]
    assert pods_of(live_slices(server)[name]) == ["p1", "p2"]
    m.delete(pod("p1", ("10.0.0.1",)))
    w.reconcile(m.desired())
    assert pods_of(live_slices(server)[name]) == ["p2"]
    m.delete(pod("p2", ("10.0.0.2",)))
    w.reconcile(m.desired())
    assert live_slices(server) == {}


def test_drain_stops_non_mesh_traffic(server: FakeApiServer, api: client.ApiClient) -> None:
    m = Mesh().put(pod("p1", ("10.0.0.1",)), members("web", "p1"), api_service(server))
    w = SliceWriter(api, "node-a")
    w.reconcile(m.desired())
    m.put(pod("p1", ("10.0.0.1",), terminating=True))
    assert w.reconcile(m.desired()) == 1
    [obj] = live_slices(server).values()
    assert obj["endpoints"][0]["conditions"] == {"ready": False, "serving": False, "terminating": True}


def test_restart_adopts_instead_of_duplicating(server: FakeApiServer, api: client.ApiClient) -> None:
    m = Mesh().put(pod("p1", ("10.0.0.1",), ports={}), members("web", "p1"),
                   api_service(server, ips=("10.96.0.10", "fd00:96::10")))
    m.put(pod("p1", ("10.0.0.1", "fd00::1")))
    SliceWriter(api, "node-a").reconcile(m.desired())
    before = live_slices(server)
    assert len(before) == 2  # dual-stack: one slice per family
    server.clear_requests()
    restarted = SliceWriter(api, "node-a")
    assert restarted.reconcile(m.desired()) == 0
    assert writes(server) == [] and restarted.adopted_count == 2
    assert [m_ for m_, _ in server.requests] == ["GET"]  # one LIST, nothing else
    # the next change is an update of the adopted slice, not a second create
    m.put(pod("p1", ("10.0.0.1", "fd00::1"), ready=False))
    assert restarted.reconcile(m.desired()) == 2
    assert {meth for meth, _ in writes(server)} == {"PUT"}
    assert set(live_slices(server)) == set(before)


def test_two_nodes_each_own_only_their_slice(server: FakeApiServer, api: client.ApiClient) -> None:
    svc = api_service(server)
    objs = (pod("a1", ("10.0.0.1",), node="node-a"), pod("b1", ("10.0.1.1",), node="node-b"),
            members("web", "a1", "b1"), svc)
    mesh_a, mesh_b = Mesh("node-a").put(*objs), Mesh("node-b").put(*objs)
    wa, wb = SliceWriter(api, "node-a"), SliceWriter(api, "node-b")
    wa.reconcile(mesh_a.desired())
    wb.reconcile(mesh_b.desired())
    [a] = live_slices(server, "node-a").values()
    [b] = live_slices(server, "node-b").values()
    assert pods_of(a) == ["a1"] and pods_of(b) == ["b1"]
    assert a["metadata"]["name"] != b["metadata"]["name"]
    # a restarted node-a agent adopts only its own slice; node-a leaving leaves node-b's
    wa2 = SliceWriter(api, "node-a")
    assert wa2.adopt() == 1
    wa2.reconcile({})
    assert live_slices(server, "node-a") == {} and len(live_slices(server, "node-b")) == 1


def test_service_deleted_removes_slices(server: FakeApiServer, api: client.ApiClient) -> None:
    svc = api_service(server)
    m = Mesh().put(pod("p1", ("10.0.0.1",)), members("web", "p1"), svc)
    w = SliceWriter(api, "node-a")
    w.reconcile(m.desired())
    m.delete(svc)
    assert w.reconcile(m.desired()) == 1 and live_slices(server) == {}


def test_unchanged_desired_sends_nothing(server: FakeApiServer, api: client.ApiClient) -> None:
    m = Mesh().put(pod("p1", ("10.0.0.1",)), members("web", "p1"), api_service(server))
    w = SliceWriter(api, "node-a")
    w.reconcile(m.desired())
    server.clear_requests()
    for _ in range(5):
        assert w.reconcile(m.desired()) == 0
    assert server.requests == []


def test_changes_behind_our_back_are_repaired(server: FakeApiServer, api: client.ApiClient) -> None:
    m = Mesh().put(pod("p1", ("10.0.0.1",)), members("web", "p1"), api_service(server))
    w = SliceWriter(api, "node-a")
    w.reconcile(m.desired())
    [(name, obj)] = live_slices(server).items()
    # someone edits our slice: our next PUT conflicts (409), is re-read, and the retry wins
    obj["endpoints"] = []
    server.put_object(obj)
    m.put(pod("p2", ("10.0.0.2",)), members("web", "p1", "p2"))
    with pytest.raises(Exception, match="409"):
        w.reconcile(m.desired())
    assert w.reconcile(m.desired()) == 1
    assert pods_of(live_slices(server)[name]) == ["p1", "p2"]
    # someone deletes it: a resync relists and recreates it
    server.delete_object("EndpointSlice", name, "apps", "discovery.k8s.io/v1")
    w.resync()
    assert w.reconcile(m.desired()) == 1 and pods_of(live_slices(server)[name]) == ["p1", "p2"]


def test_projector_batches_bursts(server: FakeApiServer, api: client.ApiClient) -> None:
    m = Mesh().put(api_service(server))
    proj = SliceProjector.for_mesh(m.objects, m.model, SliceWriter(api, "node-a"), interval=0.3)
    proj.start()
    try:
        wait_for(lambda: proj.passes >= 1)
        server.clear_requests()
        names = []
        for i in range(20):  # a burst: 20 pods arrive within the debounce window
            names.append(f"p{i}")
            m.put(pod(f"p{i}", (f"10.0.0.{i + 1}",)), members("web", *names))
            proj.mark_dirty()
        wait_for(lambda: len(live_slices(server)) == 1
                 and len(next(iter(live_slices(server).values()))["endpoints"]) == 20)
        time.sleep(0.5)
        assert len(writes(server)) == 1  # one create carrying the final state
        assert proj.status()["owned"] == [f"apps/{next(iter(live_slices(server)))}"]
    finally:
        proj.stop(node_leaving=False)
    assert len(live_slices(server)) == 1  # a restart keeps the slices serving


def test_projector_survives_api_errors_and_cleans_up_on_leave(
        server: FakeApiServer, api: client.ApiClient) -> None:
    m = Mesh().put(pod("p1", ("10.0.0.1",)), members("web", "p1"), api_service(server))
    server.fail_next(3, 503)
    proj = SliceProjector.for_mesh(m.objects, m.model, SliceWriter(api, "node-a", timeout=2.0),
                                   interval=0.05)
    proj.start()
    try:
        wait_for(lambda: proj.passes >= 1)
        assert proj.last_error is None and proj.failures == 0 and len(live_slices(server)) == 1
    finally:
        proj.stop(node_leaving=True)
    assert live_slices(server) == {}


def test_refused_services_are_reported(server: FakeApiServer, api: client.ApiClient) -> None:
    m = Mesh().put(pod("p1", ("10.0.0.1",)), api_service(server, selector={"app": "web"}))
    proj = SliceProjector.for_mesh(m.objects, m.model, SliceWriter(api, "node-a"), interval=0.05)
    assert proj.run_once()
    assert "selector" in proj.status()["refused"]["apps/web"]
    assert live_slices(server) == {}


def test_projector_waits_for_the_source_sync(server: FakeApiServer, api: client.ApiClient) -> None:
    m = Mesh().put(pod("p1", ("10.0.0.1",)), members("web", "p1"), api_service(server))
    SliceWriter(api, "node-a").reconcile(m.desired())
    restarted = Mesh()  # a new agent whose watch has not listed yet: it knows no Service
    synced = False

    def wait_synced(timeout: float) -> bool:
        time.sleep(min(timeout, 0.05))
        return synced

    proj = SliceProjector.for_mesh(restarted.objects, restarted.model, SliceWriter(api, "node-a"),
                                   interval=0.05)
    proj.start(synced=wait_synced)
    try:
        time.sleep(0.4)
        assert proj.passes == 0 and len(live_slices(server)) == 1  # nothing deleted meanwhile
        restarted.put(pod("p1", ("10.0.0.1",)), members("web", "p1"),
                      server.get_object("Service", "web", "apps") or {})
        server.clear_requests()
        synced = True
        wait_for(lambda: proj.passes >= 1)
        assert writes(server) == [] and len(live_slices(server)) == 1  # adopted as is
    finally:
        proj.stop()
