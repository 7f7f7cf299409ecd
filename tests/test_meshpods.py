"""MeshPod records (agent/meshpods): what a node publishes of its pods and how the others read
them — pure parts and the mesh model, then the publisher and the watcher against the test
API server through the real kubernetes client."""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from agent.meshpods import record
from agent.meshpods.publisher import MeshPodPublisher, MeshPodWriter
from agent.scope.model import REMOTE_POD_KIND
from agent.slices.project import NODE_LABEL
from agent.source.events import ObjectStore
from agent.source.model import pod_from_object, slim_pod
from agent.source.watch import (
    MESH_KINDS,
    MESH_KINDS_RECORDS,
    KubeWatcher,
    meshpod_object,
    node_pods_selector,
)
from agent.testing import FakeApiServer
from tests.test_slices_project import NODE, Mesh, pod, service

pytestmark = pytest.mark.timeout(60)


def labelled(p: dict[str, Any], **labels: str) -> dict[str, Any]:
    p["metadata"]["labels"] = dict(labels)
    return p


def remote(name: str, ip: str, node: str = "node-b") -> dict[str, Any]:
    """Another node's pod as the watcher stores its MeshPod record."""
    return meshpod_object(record.record_of(slim_pod(labelled(pod(name, (ip,), node=node),
                                                             app="web")), node))


def test_the_kind_the_model_reads_is_the_record_kind() -> None:
    assert REMOTE_POD_KIND == record.KIND
    assert record.KIND not in MESH_KINDS and record.KIND in MESH_KINDS_RECORDS
    assert node_pods_selector("n1") == {"Pod": "spec.nodeName=n1"}


def test_a_record_carries_what_the_registry_reads_of_a_pod() -> None:
    full = labelled(pod("p1", ("10.0.0.1",), ports={"http": 8080}), app="web")
    full["metadata"]["ownerReferences"] = [{"kind": "ReplicaSet", "name": "web-5d9",
                                            "controller": True}]
    full["spec"]["containers"][0]["env"] = [{"name": "SECRET", "value": "x" * 500}]
    rec = record.record_of(slim_pod(full), NODE)
    assert rec["apiVersion"] == "aether.io/v1alpha1" and rec["kind"] == "MeshPod"
    assert rec["metadata"]["labels"] == {NODE_LABEL: NODE}
    assert rec["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "p1", "uid": "uid-p1"}]
    assert "env" not in str(rec)  # slim: only what the mesh reads crosses the API
    back = record.pod_of(rec)
    assert back is not None
    # all but the uid, which a remote pod's reader never reads (so it is not kept)
    assert "uid" not in back["metadata"]
    assert pod_from_object(back) == dataclasses.replace(pod_from_object(full), uid="")


def test_a_record_speaks_only_for_the_pod_it_is_named_after() -> None:
    rec = record.record_of(slim_pod(pod("p1", ("10.0.0.1",))), NODE)
    rec["metadata"]["name"] = "p2"
    rec["spec"]["pod"]["metadata"]["namespace"] = "kube-system"
    back = record.pod_of(rec)
    assert back is not None
    assert (back["metadata"]["namespace"], back["metadata"]["name"]) == ("apps", "p2")
    assert record.pod_of({"metadata": {"name": "x"}, "spec": {"pod": "junk"}}) is None
    stored = meshpod_object({"metadata": {"name": "x", "namespace": "apps"}, "spec": {}})
    assert stored["kind"] == "MeshPod" and "spec" not in stored  # ignored by the model


def test_desired_records_are_the_local_managed_pods() -> None:
    pods = [slim_pod(pod("mine", ("10.0.0.1",))), slim_pod(pod("ignored", ("10.0.0.2",))),
            slim_pod(pod("theirs", ("10.0.0.3",), node="node-b"))]
    got = record.desired_records(NODE, pods, lambda key: key != "apps/ignored")
    assert list(got) == [("apps", "mine")]
    assert got[("apps", "mine")] == record.record_of(pods[0], NODE)
    assert record.owned_selector(NODE) == f"{NODE_LABEL}={NODE}"


def test_a_remote_record_is_an_endpoint_and_leaves_with_its_record() -> None:
    m = Mesh().put(service(expose=None, selector={"app": "web"}), remote("r1", "10.1.0.1"))
    [rec] = m.model.registry.members("apps/web")
    assert (rec.key, rec.ips, rec.local, rec.service_account) == (
        "apps/r1", ("10.1.0.1",), False, "api")
    m.delete(remote("r1", "10.1.0.1"))
    assert m.model.registry.members("apps/web") == []


def test_a_record_claiming_this_node_is_ignored() -> None:
    m = Mesh().put(service(expose=None, selector={"app": "web"}), remote("r1", "10.1.0.1", NODE))
    assert m.model.registry.members("apps/web") == []


def test_this_nodes_own_view_of_a_pod_wins_over_a_lingering_record() -> None:
    """A StatefulSet pod rescheduled here while its old node's record lingers: the local Pod
    is the endpoint, and the record's later deletion does not remove it."""
    local = labelled(pod("web-0", ("10.0.0.9",)), app="web")
    m = Mesh().put(service(expose=None, selector={"app": "web"}), remote("web-0", "10.1.0.1"))
    m.put(local)
    [rec] = m.model.registry.members("apps/web")
    assert (rec.ips, rec.local) == (("10.0.0.9",), True)
    stale = remote("web-0", "10.1.0.2")
    m.put(stale)  # the old record changes: still ignored
    m.delete(stale)
    [rec] = m.model.registry.members("apps/web")
    assert rec.ips == ("10.0.0.9",)


def test_a_cni_add_takes_a_pod_over_from_its_record() -> None:
    m = Mesh().put(service(expose=None, selector={"app": "web"}), remote("web-0", "10.1.0.1"))
    m.model.register_local("uid-new", "apps", "web-0", "api", ("10.0.0.9",), ready=True)
    m.put(remote("web-0", "10.1.0.3"))  # the record's next change hands the pod over
    rec = m.model.registry.get("apps/web-0")
    assert rec is not None and rec.local and "10.1.0.3" not in rec.ips


# ---- against the test API server ------------------------------------------------------------


def eventually(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def stored_records(server: FakeApiServer) -> dict[str, dict[str, Any]]:
    with server._lock:
        items = list(server._store.items())
    return {f"{ns}/{name}": copy.deepcopy(o) for (_gv, plural, ns, name), o in items
            if plural == "meshpods"}


def test_the_publisher_creates_updates_and_deletes_this_nodes_records(
        server: FakeApiServer, api: client.ApiClient) -> None:
    m = Mesh().put(labelled(pod("p1", ("10.0.0.1",)), app="web"),
                   pod("p2", ("10.0.0.2",), node="node-b"))
    server.put_object(record.record_of(slim_pod(pod("gone", ("10.0.0.5",))), NODE))
    other = server.put_object(record.record_of(slim_pod(pod("p2", ("10.0.0.2",), node="node-b")),
                                               "node-b"))
    pub = MeshPodPublisher.for_mesh(m.objects, m.model, MeshPodWriter(api, NODE))
    pub.run_once()
    live = stored_records(server)
    assert set(live) == {"apps/p1", "apps/p2"}  # "gone" (no such pod) removed, node-b's kept
    assert live["apps/p2"] == other
    assert live["apps/p1"]["spec"]["pod"]["status"]["podIPs"] == [{"ip": "10.0.0.1"}]
    assert pub.writer.reconcile(pub.compute()) == 0  # unchanged: no request
    m.put(labelled(pod("p1", ("10.0.0.1",), ready=False), app="web"))
    pub.run_once()
    conditions = stored_records(server)["apps/p1"]["spec"]["pod"]["status"]["conditions"]
    assert conditions == [{"type": "Ready", "status": "False"}]
    restarted = MeshPodPublisher.for_mesh(m.objects, m.model, MeshPodWriter(api, NODE))
    assert restarted.writer.reconcile(restarted.compute()) == 0  # adopted, not duplicated
    restarted.stop(node_leaving=True)
    assert set(stored_records(server)) == {"apps/p2"}


def test_a_publish_failure_is_retried_and_loses_nothing(
        server: FakeApiServer, api: client.ApiClient) -> None:
    m = Mesh().put(pod("p1", ("10.0.0.1",)))
    pub = MeshPodPublisher.for_mesh(m.objects, m.model, MeshPodWriter(api, NODE))
    server.fail_next(1, 503)
    assert not pub.run_once() and pub.failures == 1 and "503" in str(pub.last_error)
    assert pub.run_once()
    assert set(stored_records(server)) == {"apps/p1"}


@pytest.fixture
def node_watcher(server: FakeApiServer, tmp_path: Path
                 ) -> Iterator[tuple[KubeWatcher, ObjectStore]]:
    store = ObjectStore()
    w = KubeWatcher(server.kubeconfig(tmp_path / "kubeconfig"), ["Pod", record.KIND], NODE,
                    store, threading.Event(), backoff_base=0.05, backoff_cap=0.3,
                    request_timeout=2.0, field_selectors=node_pods_selector(NODE))
    yield w, store
    w.stop()


def test_the_watcher_holds_this_nodes_pods_and_the_others_records(
        server: FakeApiServer, node_watcher: tuple[KubeWatcher, ObjectStore]) -> None:
    w, store = node_watcher
    server.put_object(pod("mine", ("10.0.0.1",)))
    server.put_object(pod("theirs", ("10.0.0.2",), node="node-b"))
    server.put_object(record.record_of(slim_pod(pod("theirs", ("10.0.0.2",), node="node-b")),
                                       "node-b"))
    w.start()
    assert w.wait_synced(10)
    assert [p["metadata"]["name"] for p in store.of_kind("Pod")] == ["mine"]
    [got] = store.of_kind(record.KIND)
    assert (got["metadata"]["name"], got["spec"]["nodeName"]) == ("theirs", "node-b")
    assert got["status"]["podIPs"] == [{"ip": "10.0.0.2"}]
    # a pod bound to this node after the list arrives (selector starts matching: ADDED)
    pending = pod("late", ("10.0.0.3",))
    pending["spec"]["nodeName"] = ""
    server.put_object(pending)
    time.sleep(0.2)
    assert store.get("Pod", "apps", "late") is None
    pending["spec"]["nodeName"] = NODE
    server.put_object(pending)
    eventually(lambda: store.get("Pod", "apps", "late") is not None)
    server.delete_object(record.KIND, "theirs", "apps", api_version=record.API_VERSION)
    eventually(lambda: store.of_kind(record.KIND) == [])


# ---- what made every remote pod cheaper to take in --------------------------------------------


def test_the_ipv4_fast_path_spells_addresses_as_ipaddress_does() -> None:
    import ipaddress
    import random

    from agent.scope.services import canonical_ip

    rng = random.Random(7)
    cases = ["10.0.0.1", "010.0.0.1", "1.2.3", "256.1.1.1", "0.0.0.0", " 1.2.3.4", "::1",
             "a.b.c.d", "1.2.3.\u0663", "00.1.1.1", "255.255.255.255", "1.2.3.4\n", "",
             "2001:DB8::1", "::ffff:10.0.0.1"]
    cases += [".".join(str(rng.randint(0, 300)) for _ in range(4)) for _ in range(3000)]
    for text in cases:
        try:
            canon = str(ipaddress.ip_address(text.strip()))
            want: str | None = text if canon == text else canon
        except ValueError:
            want = None
        assert canonical_ip(text) == want, text


def test_managed_gives_the_verdict_of_decide_without_parsing_annotations() -> None:
    from agent.capture.policy import decide, managed
    from agent.common.config import NodeConfig
    from agent.source.model import NamespaceMeta, PodMeta

    node = NodeConfig(node_name=NODE)
    on = NamespaceMeta("apps", {"aether.io/managed": "true"})
    off = NamespaceMeta("apps")
    bad = {"capture.aether.io/exclude-outbound-ports": "80,http"}
    for pod_ns, labels, ns, host in (
            ("apps", {}, on, False), ("apps", {}, off, False), ("apps", {}, None, False),
            ("apps", {"aether.io/managed": "false"}, on, False),
            ("apps", {"aether.io/managed": "true"}, off, False), ("apps", {}, on, True),
            ("kube-system", {"aether.io/managed": "true"}, on, False)):
        pod = PodMeta(pod_ns, "p", labels=labels, annotations=bad, host_network=host)
        d = decide(pod, ns, node, False)
        assert managed(pod, ns, node) == (d.captured, d.reason)


def test_without_the_crd_publishing_fails_with_404_and_keeps_retrying(
        server: FakeApiServer, api: client.ApiClient) -> None:
    with server._lock:  # an API server where the MeshPod CRD is not installed
        server._by_path.pop((record.API_VERSION, record.PLURAL))
    m = Mesh().put(pod("p1", ("10.0.0.1",)))
    pub = MeshPodPublisher.for_mesh(m.objects, m.model, MeshPodWriter(api, NODE))
    assert not pub.run_once()
    assert pub.failures == 1 and "404" in str(pub.last_error)
    assert pub.status()["last_error"] == pub.last_error


def test_status_says_where_remote_pods_come_from_and_what_failed() -> None:
    from agent.ops.status_view import meshpod_lines, render

    mp = {"owned": ["apps/p1", "apps/p2"], "writes": 3, "failures": 1, "remote_pods": "meshpods",
          "last_error": "HTTP 404 Not Found"}
    lines = meshpod_lines(mp, {"Pod": 2, "MeshPod": 99})
    assert lines == ["remote pods: --remote-pods meshpods · 99 MeshPod records read · this node "
                     "publishes 2 (writes 3, failures 1)",
                     "  MESHPOD PUBLISHING FAILS: HTTP 404 Not Found"]
    assert meshpod_lines({**mp, "remote_pods": "pods", "last_error": None}, {"Pod": 7}) == [
        "remote pods: --remote-pods pods · 7 Pods listed cluster-wide · this node publishes 2 "
        "(writes 3, failures 1)"]
    assert meshpod_lines(None, {}) == []
    assert "MESHPOD PUBLISHING FAILS" in render({"pods": [], "meshpods": mp})


def test_a_record_another_node_took_over_is_not_deleted(
        server: FakeApiServer, api: client.ApiClient) -> None:
    """The pod moved: node-b deleted this node's record of it and wrote its own under the same
    name before this node's next pass. That pass must not delete node-b's record."""
    m = Mesh().put(pod("web-0", ("10.0.0.1",)))
    pub = MeshPodPublisher.for_mesh(m.objects, m.model, MeshPodWriter(api, NODE))
    assert pub.run_once()
    assert server.delete_object(record.KIND, "web-0", "apps", api_version=record.API_VERSION)
    theirs = server.put_object(record.record_of(slim_pod(pod("web-0", ("10.1.0.1",),
                                                             node="node-b")), "node-b"))
    m.delete(pod("web-0", ("10.0.0.1",)))
    assert pub.run_once()  # the 409 (another uid now) is not a failure: the record is theirs
    assert stored_records(server)["apps/web-0"] == theirs
    assert pub.writer.owned == []


def test_the_test_server_checks_delete_preconditions(server: FakeApiServer,
                                                     api: client.ApiClient) -> None:
    from kubernetes.client.exceptions import ApiException

    live = server.put_object(record.record_of(slim_pod(pod("p1", ("10.0.0.1",))), NODE))
    custom = client.CustomObjectsApi(api)
    args = (record.GROUP, record.VERSION, "apps", record.PLURAL, "p1")
    with pytest.raises(ApiException) as err:
        custom.delete_namespaced_custom_object(*args, body={"preconditions": {"uid": "other"}})
    assert err.value.status == 409 and "Precondition failed" in str(err.value.body)
    assert "apps/p1" in stored_records(server)
    custom.delete_namespaced_custom_object(
        *args, body={"preconditions": {"uid": live["metadata"]["uid"]}})
    assert stored_records(server) == {}


def test_a_delete_leaves_its_connection_clean_for_the_next_call(server: FakeApiServer,
                                                               api: client.ApiClient) -> None:
    """One pooled connection, no retries: a delete whose answer went back to the pool unread
    made the next call on that connection read the deleted object as its status line."""
    import urllib3

    from agent.meshpods.publisher import _MeshPodApi

    api.configuration.retries = urllib3.Retry(total=0)
    api.rest_client.pool_manager = urllib3.PoolManager(maxsize=1, block=True,
                                                       retries=urllib3.Retry(total=0))
    raw = _MeshPodApi(api, timeout=5.0)
    for name in ("a", "b", "c"):
        live = server.put_object(record.record_of(slim_pod(pod(name, ("10.0.0.9",))), NODE))
        raw.delete("apps", name, live["metadata"]["uid"])
        assert f"apps/{name}" not in stored_records(server)
    assert raw.list_owned(record.owned_selector(NODE)) == []


def test_done_closes_a_connection_whose_body_cannot_be_read() -> None:
    from agent.kube import done

    class Resp:
        closed = released = False

        @property
        def data(self) -> bytes:
            raise ConnectionResetError("cut mid-body")

        def close(self) -> None:
            self.closed = True

        def release_conn(self) -> None:
            self.released = True

    r = Resp()
    done(r)  # the call's answer was already a success: no exception for the caller
    assert r.closed and r.released
