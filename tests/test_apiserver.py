"""The fake API server, driven by the real kubernetes client (what production code uses)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from agent.testing import FakeApiServer

pytestmark = pytest.mark.timeout(30)


def pod(name: str, ns: str = "default", node: str = "node-a", **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "app", "image": "busybox"}]},
    }


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer(bookmark_interval=0.2) as srv:
        yield srv



def test_create_get_and_404(server: FakeApiServer, api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": "shop", "labels": {"mesh": "on"}}})
    created = core.create_namespaced_pod("shop", pod("web-1", "shop", app="web"))
    assert created.metadata.uid
    assert created.metadata.generation == 1
    assert created.metadata.creation_timestamp is not None

    got = core.read_namespaced_pod("web-1", "shop")
    assert got.spec.node_name == "node-a"
    assert got.metadata.resource_version == created.metadata.resource_version
    assert core.read_namespace("shop").metadata.labels == {"mesh": "on"}

    with pytest.raises(ApiException) as err:
        core.read_namespaced_pod("missing", "shop")
    assert err.value.status == 404
    assert '"reason":"NotFound"' in (err.value.body or "").replace(" ", "")

    with pytest.raises(ApiException) as err:
        core.create_namespaced_pod("shop", pod("web-1", "shop"))
    assert err.value.status == 409
    assert "AlreadyExists" in (err.value.body or "")
    assert ("GET", "/api/v1/namespaces/shop/pods/missing") in server.requests


def test_list_with_selectors(server: FakeApiServer, api: client.ApiClient) -> None:
    server.put_object(pod("a", "ns1", node="n1", app="web"))
    server.put_object(pod("b", "ns1", node="n2", app="web"))
    server.put_object(pod("c", "ns2", node="n1", app="db"))
    core = client.CoreV1Api(api)

    every = core.list_pod_for_all_namespaces()
    assert sorted(p.metadata.name for p in every.items) == ["a", "b", "c"]
    assert int(every.metadata.resource_version) >= 3
    assert [p.metadata.name for p in core.list_namespaced_pod("ns1").items] == ["a", "b"]
    on_n1 = core.list_pod_for_all_namespaces(field_selector="spec.nodeName=n1")
    assert sorted(p.metadata.name for p in on_n1.items) == ["a", "c"]
    web = core.list_namespaced_pod("ns1", label_selector="app=web,app!=db")
    assert [p.metadata.name for p in web.items] == ["a", "b"]
    named = core.list_namespaced_pod("ns1", field_selector="metadata.name=b")
    assert [p.metadata.name for p in named.items] == ["b"]
    assert core.list_namespaced_pod("ns2", label_selector="app=web").items == []


def test_update_and_patch_bump_resource_version(api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    created = core.create_namespaced_pod("default", pod("p"))
    patched = core.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"x": "1"}}})
    assert patched.metadata.labels == {"x": "1"}
    assert int(patched.metadata.resource_version) > int(created.metadata.resource_version)
    assert patched.metadata.generation == 1  # metadata-only change
    json_patched = core.patch_namespaced_pod(
        "p", "default", [{"op": "replace", "path": "/spec/nodeName", "value": "n9"}]
    )
    assert json_patched.spec.node_name == "n9"
    assert json_patched.metadata.generation == 2


def test_status_subresource_patch(server: FakeApiServer, api: client.ApiClient) -> None:
    gw = "gateway.networking.k8s.io"
    route = {
        "apiVersion": f"{gw}/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "r1", "namespace": "default"},
        "spec": {"parentRefs": [{"name": "mesh"}]},
    }
    custom = client.CustomObjectsApi(api)
    custom.create_namespaced_custom_object(gw, "v1", "default", "httproutes", route)
    status = {"parents": [{"parentRef": {"name": "mesh"}, "controllerName": "aether.io/mesh"}]}
    custom.patch_namespaced_custom_object_status(
        gw, "v1", "default", "httproutes", "r1", {"status": status, "spec": {"ignored": True}}
    )
    stored = server.get_object("HTTPRoute", "r1", "default", f"{gw}/v1")
    assert stored is not None
    assert stored["status"] == status
    assert stored["spec"] == route["spec"]  # /status must not touch spec
    # and the main resource ignores status changes
    custom.patch_namespaced_custom_object(
        gw, "v1", "default", "httproutes", "r1", {"status": {"parents": []}}
    )
    again = server.get_object("HTTPRoute", "r1", "default", f"{gw}/v1")
    assert again is not None and again["status"] == status


def test_watch_streams_changes_in_order(server: FakeApiServer, api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    start_rv = core.list_namespaced_pod("default").metadata.resource_version
    seen: list[tuple[str, str, int]] = []
    ready = threading.Event()

    def consume() -> None:
        w = watch.Watch()
        for ev in w.stream(
            core.list_namespaced_pod, "default", resource_version=start_rv, timeout_seconds=10
        ):
            seen.append((ev["type"], ev["object"].metadata.name,
                         int(ev["object"].metadata.resource_version)))
            ready.set()
            if ev["type"] == "DELETED":
                w.stop()

    t = threading.Thread(target=consume)
    t.start()
    server.put_object(pod("w"))
    assert ready.wait(5)
    core.patch_namespaced_pod("w", "default", {"metadata": {"labels": {"v": "2"}}})
    core.delete_namespaced_pod("w", "default")
    t.join(10)
    assert not t.is_alive()
    assert [(s[0], s[1]) for s in seen] == [("ADDED", "w"), ("MODIFIED", "w"), ("DELETED", "w")]
    rvs = [s[2] for s in seen]
    assert rvs == sorted(rvs) and len(set(rvs)) == 3


def test_watch_replays_history_and_filters(server: FakeApiServer, api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    rv = server.resource_version
    server.put_object(pod("x", node="n1"))
    server.put_object(pod("y", node="n2"))
    events = list(
        watch.Watch().stream(
            core.list_pod_for_all_namespaces,
            resource_version=rv,
            field_selector="spec.nodeName=n2",
            timeout_seconds=1,
        )
    )
    assert [(e["type"], e["object"].metadata.name) for e in events] == [("ADDED", "y")]


def test_watch_without_resource_version_lists_current_state(api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_pod("default", pod("now"))
    events = list(watch.Watch().stream(core.list_namespaced_pod, "default", timeout_seconds=1))
    assert [(e["type"], e["object"].metadata.name) for e in events] == [("ADDED", "now")]


def test_watch_from_compacted_version_is_410(server: FakeApiServer, api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    server.put_object(pod("old"))
    stale = server.resource_version
    server.put_object(pod("new"))
    server.compact()
    with pytest.raises(ApiException) as err:
        list(
            watch.Watch().stream(
                core.list_namespaced_pod, "default", resource_version=stale, timeout_seconds=2
            )
        )
    assert err.value.status == 410
    # without timeout_seconds the client retries once and then raises
    with pytest.raises(ApiException) as err:
        list(watch.Watch().stream(core.list_namespaced_pod, "default", resource_version=stale))
    assert err.value.status == 410
    # the current version is still watchable
    fresh = list(
        watch.Watch().stream(
            core.list_namespaced_pod,
            "default",
            resource_version=server.resource_version,
            timeout_seconds=1,
        )
    )
    assert fresh == []


def test_drop_watches_ends_stream(server: FakeApiServer, api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    done = threading.Event()
    got: list[str] = []

    def consume() -> None:
        for ev in watch.Watch().stream(
            core.list_namespaced_pod, "default", resource_version="0", timeout_seconds=20
        ):
            got.append(ev["type"])
        done.set()

    t = threading.Thread(target=consume)
    t.start()
    for _ in range(50):
        if server.watch_count:
            break
        threading.Event().wait(0.05)
    assert server.drop_watches() == 1
    assert done.wait(5), "stream did not end after drop_watches()"
    t.join(5)
    assert server.watch_count == 0


def test_bookmarks(server: FakeApiServer, api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    server.put_object(pod("b"))
    types = [
        e["type"]
        for e in watch.Watch().stream(
            core.list_namespaced_pod,
            "default",
            resource_version=server.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=1,
        )
    ]
    assert "BOOKMARK" in types


def test_events_post_and_read_back(server: FakeApiServer, api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    body = {
        "metadata": {"name": "p.1", "namespace": "default"},
        "involvedObject": {"kind": "Pod", "namespace": "default", "name": "p", "uid": "u1"},
        "reason": "CaptureFailed",
        "message": "boom",
        "type": "Warning",
    }
    core.create_namespaced_event("default", body, _preload_content=False)
    [ev] = server.events_for("default", "p")
    assert ev["reason"] == "CaptureFailed"
    assert ev["involvedObject"]["uid"] == "u1"
    assert [e.reason for e in core.list_namespaced_event("default").items] == ["CaptureFailed"]


def test_fault_injection(server: FakeApiServer, api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    server.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
    server.fail_next(1, status=503)
    with pytest.raises(ApiException) as err:
        core.read_node("n1")
    assert err.value.status == 503
    assert core.read_node("n1").metadata.name == "n1"
    patched = core.patch_node("n1", {"spec": {"taints": [{"key": "k", "effect": "NoSchedule"}]}})
    assert patched.spec.taints[0].key == "k"


def test_other_resources(server: FakeApiServer, api: client.ApiClient) -> None:
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "agent-n1", "namespace": "aether-system"},
        "spec": {"holderIdentity": "n1"},
    }
    coord = client.CoordinationV1Api(api)
    coord.create_namespaced_lease("aether-system", lease)
    got = coord.read_namespaced_lease("agent-n1", "aether-system")
    assert got.spec.holder_identity == "n1"
    got.spec.holder_identity = "n2"
    coord.replace_namespaced_lease("agent-n1", "aether-system", got)
    with pytest.raises(ApiException) as err:  # stale resourceVersion → conflict
        coord.replace_namespaced_lease("agent-n1", "aether-system", got)
    assert err.value.status == 409
    server.put_object(
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": "web-abc", "namespace": "default",
                         "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.0.0.1"]}],
        }
    )
    slices = client.DiscoveryV1Api(api).list_namespaced_endpoint_slice(
        "default", label_selector="kubernetes.io/service-name=web"
    )
    assert [s.metadata.name for s in slices.items] == ["web-abc"]
    assert server.delete_object("EndpointSlice", "web-abc", "default", "discovery.k8s.io/v1")
    assert not server.delete_object("EndpointSlice", "web-abc", "default", "discovery.k8s.io/v1")


def test_abrupt_drop_breaks_the_connection(server: FakeApiServer, api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    outcome: list[BaseException | None] = []

    def consume() -> None:
        try:
            for _ in watch.Watch().stream(
                core.list_namespaced_pod, "default", resource_version="0", timeout_seconds=20
            ):
                pass
            outcome.append(None)
        except Exception as exc:
            outcome.append(exc)

    t = threading.Thread(target=consume)
    t.start()
    for _ in range(50):
        if server.watch_count:
            break
        threading.Event().wait(0.05)
    assert server.drop_watches(abrupt=True) == 1
    t.join(5)
    assert not t.is_alive()
    assert outcome and outcome[0] is not None  # a protocol error, not a clean end
