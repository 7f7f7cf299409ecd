"""Explicit mesh ownership (agent/gamma/ownership.py, docs/ownership.md): pure rules, and the
end-to-end effect on route status against FakeApiServer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from agent.gamma.ownership import MANAGED_LABEL, MESH_CONTROLLER_ANNOTATION, controllers, owns
from agent.gamma.status import StatusWriter
from agent.testing import FakeApiServer
from agent.testing import apiserver as fake
from tests.test_gamma_status import (
    CTRL,
    EXTRA,
    Leadership,
    World,
    backend,
    cond,
    namespace,
    ours,
    parents_of,
    route,
    service,
    svc_parent,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeApiServer]:
    monkeypatch.setattr(fake, "RESOURCES", fake.RESOURCES + EXTRA)
    with FakeApiServer() as srv:
        yield srv



@pytest.fixture
def world(server: FakeApiServer) -> World:
    w = World(server)
    w.put(namespace("apps"), service("echo"), service("echo-v1"), service("echo-v2"))
    return w

ISTIO = "istio.io/mesh-controller"


def ns(managed: bool = False, **ann: str) -> dict[str, Any]:
    return namespace("apps", managed, **ann)


def svc(labels: dict[str, str] | None = None, **ann: str) -> dict[str, Any]:
    return service("echo", labels=labels, annotations=ann)


def rt(*named: str) -> dict:
    ann = {MESH_CONTROLLER_ANNOTATION: ", ".join(named)} if named else {}
    return route("r", [svc_parent("echo")], [], annotations=ann)


@pytest.mark.parametrize(("route_obj", "svc_obj", "ns_obj", "expect", "why"), [
    (rt(), svc(), ns(managed=True), True, "Namespace label"),
    (rt(), svc({MANAGED_LABEL: "true"}), ns(), True, "Service label"),
    (rt(), svc(), ns(), False, "neither"),
    (rt(), svc({MANAGED_LABEL: "false"}), ns(managed=True), False, "Service label aether.io/managed=false"),
    (rt(), None, ns(managed=True), True, "Namespace label"),  # missing Service: NoMatchingParent
    (rt(), None, None, False, "neither"),
    (rt(ISTIO), svc(), ns(managed=True), False, "route annotation"),
    (rt(ISTIO, CTRL), svc(), ns(managed=True), True, "Namespace label"),
    (rt(CTRL), svc(), ns(), False, "neither"),  # naming us does not enrol the Service
    (rt(), svc(None, **{MESH_CONTROLLER_ANNOTATION: ISTIO}), ns(managed=True), False, "Service annotation"),
    (rt(), svc({MANAGED_LABEL: "true"}, **{MESH_CONTROLLER_ANNOTATION: ISTIO}), ns(), False,
     "Service annotation"),
    (rt(), svc(None, **{MESH_CONTROLLER_ANNOTATION: CTRL}), ns(), True, "Service annotation"),
    (rt(), svc(), ns(managed=True, **{MESH_CONTROLLER_ANNOTATION: ISTIO}), False,
     "Namespace annotation"),
    (rt(), svc(None, **{MESH_CONTROLLER_ANNOTATION: CTRL}),
     ns(False, **{MESH_CONTROLLER_ANNOTATION: ISTIO}), True, "Service annotation"),
    (rt(), svc({MANAGED_LABEL: "true"}), ns(False, **{MESH_CONTROLLER_ANNOTATION: ISTIO}), False,
     "Namespace annotation"),
])
def test_owns_rules(route_obj, svc_obj, ns_obj, expect, why):
    mine, reason = owns(route_obj, svc_obj, ns_obj, CTRL)
    assert mine is expect
    assert why in reason


def test_controllers_list_parsing():
    assert controllers(" a.io/x , ,b.io/y") == ["a.io/x", "b.io/y"]
    assert controllers(None) == []


def test_configurable_controller_name():
    mine, _ = owns(rt("example.com/aether-canary"), svc(), ns(managed=True), "example.com/aether-canary")
    assert mine
    assert not owns(rt("example.com/aether-canary"), svc(), ns(managed=True), CTRL)[0]


def test_routes_not_ours_get_no_status(server, api, world: World):
    world.put(
        namespace("legacy", managed=False), service("old", "legacy"),
        namespace("split", managed=True, **{MESH_CONTROLLER_ANNOTATION: ISTIO}), service("s", "split"),
        route("to-legacy", [svc_parent("old", namespace="legacy")], [backend("echo-v1")]),
        route("to-istio-ns", [svc_parent("s", namespace="split")], [backend("echo-v1")]),
        route("named-istio", [svc_parent("echo")], [backend("echo-v1")],
              annotations={MESH_CONTROLLER_ANNOTATION: ISTIO}),
        route("ghost-unenrolled", [svc_parent("ghost", namespace="legacy")], [backend("echo-v1")]),
        route("mixed", [svc_parent("echo"), svc_parent("old", namespace="legacy")],
              [backend("echo-v1")]),
    )
    server.clear_requests()
    StatusWriter(api, CTRL, Leadership()).sync(world.statuses())
    for name in ("to-legacy", "to-istio-ns", "named-istio", "ghost-unenrolled"):
        assert parents_of(server, name) == [], name
    put_paths = [p for m, p in server.requests if m == "PUT"]
    assert put_paths == ["/apis/gateway.networking.k8s.io/v1/namespaces/apps/httproutes/mixed/status"]
    # a route with one parent in our mesh and one outside: an entry for ours only
    [entry] = parents_of(server, "mixed")
    assert entry["parentRef"]["name"] == "echo" and cond(entry, "Accepted")["status"] == "True"


def test_missing_service_in_enrolled_namespace_is_no_matching_parent(server, api, world: World):
    world.put(route("ghost", [svc_parent("ghost")], [backend("echo-v1")]))
    StatusWriter(api, CTRL, Leadership()).sync(world.statuses())
    [entry] = ours(server, "ghost")
    c = cond(entry, "Accepted")
    assert (c["status"], c["reason"]) == ("False", "NoMatchingParent")


def test_consumer_route_in_other_namespace(server, api, world: World):
    world.put(namespace("client", managed=False),
              route("consumer", [svc_parent("echo", namespace="apps", port=80)],
                    [backend("echo", namespace="apps")], ns="client"))
    StatusWriter(api, CTRL, Leadership()).sync(world.statuses())
    [entry] = ours(server, "consumer", ns="client")
    # ownership follows the parent Service (apps is enrolled), not the route's namespace
    assert entry["parentRef"]["namespace"] == "apps"
    assert cond(entry, "Accepted")["status"] == "True"
    # its backendRef crosses into apps with no ReferenceGrant: resolved all the same (GEP-1294)
    c = cond(entry, "ResolvedRefs")
    assert (c["status"], c["reason"]) == ("True", "ResolvedRefs")
