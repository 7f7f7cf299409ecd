"""The mesh model (agent/scope): catalogs, registry, route targets, dependency set, increments."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from agent.scope.deps import DependencySet, parse_dependencies
from agent.scope.model import MeshModel, hint_mode
from agent.scope.routes import route_from_object
from agent.scope.services import service_from_object
from agent.source.base import WatchEvent

NODE = "node-a"


def ns(name: str, managed: bool = True) -> dict[str, Any]:
    labels = {"aether.io/managed": "true"} if managed else {}
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}


def pod(
    name: str,
    namespace: str = "apps",
    *,
    sa: str = "default",
    ips: tuple[str, ...] = (),
    node: str = "node-b",
    ready: bool = True,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    ports: dict[str, int] | None = None,
    terminating: bool = False,
    uid: str = "",
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name, "namespace": namespace, "uid": uid or f"uid-{name}",
        "labels": labels or {}, "annotations": annotations or {},
    }
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            "nodeName": node,
            "serviceAccountName": sa,
            "containers": [{
                "name": "app",
                "ports": [{"name": k, "containerPort": v} for k, v in (ports or {}).items()],
            }],
        },
        "status": {
            "phase": "Running",
            "podIPs": [{"ip": ip} for ip in ips],
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def svc(
    name: str,
    namespace: str = "apps",
    *,
    selector: dict[str, str] | None = None,
    ips: tuple[str, ...] = ("10.96.0.10",),
    ports: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "clusterIP": ips[0] if ips else "None",
        "clusterIPs": list(ips) if ips else ["None"],
        "ports": ports if ports is not None else [{"name": "http", "port": 80, "targetPort": 8080}],
    }
    if selector is not None:
        spec["selector"] = selector
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def route(
    name: str,
    parent: str,
    backends: list[str],
    namespace: str = "apps",
    kind: str = "HTTPRoute",
) -> dict[str, Any]:
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": kind,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "parentRefs": [{"group": "", "kind": "Service", "name": parent, "port": 80}],
            "rules": [{"backendRefs": [{"name": b, "port": 80} for b in backends]}],
        },
    }


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def add(m: MeshModel, *objs: dict[str, Any]) -> set[str]:
    out: set[str] = set()
    for o in objs:
        out |= m.apply(WatchEvent("ADDED", o["kind"], o))
    return out


def delete(m: MeshModel, o: dict[str, Any]) -> set[str]:
    return m.apply(WatchEvent("DELETED", o["kind"], o))


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def model(clock: Clock) -> MeshModel:
    return MeshModel("aether.internal", "td.example", NODE, clock=clock)


# ---- catalogs ---------------------------------------------------------------------------------


def test_service_catalog_dual_stack_ports_and_names() -> None:
    s = service_from_object(svc(
        "echo", ips=("10.96.0.10", "fd00:0:0:0::a"),
        ports=[
            {"name": "http", "port": 80, "targetPort": "web", "appProtocol": "http"},
            {"name": "grpc", "port": 9090, "protocol": "TCP"},
        ],
        selector={"app": "echo"},
    ))
    assert s.key == "apps/echo"
    assert s.ipv4 == ("10.96.0.10",) and s.ipv6 == ("fd00::a",)
    assert s.ports[0].target_port == "web" and s.ports[0].app_protocol == "http"
    assert s.ports[1].target_port == 9090  # defaults to port
    assert s.names("aether.internal") == (
        "echo.apps.svc.cluster.local", "echo.apps.aether.internal")
    headless = service_from_object(svc("h", ips=()))
    assert headless.headless and headless.cluster_ips == ()


def test_route_parsing_only_service_parents_and_all_backends() -> None:
    obj = route("r", "echo", ["echo-v1", "echo-v2"])
    obj["spec"]["parentRefs"].append({"name": "gw"})  # a Gateway parent: not ours
    obj["spec"]["rules"][0]["filters"] = [
        {"type": "RequestMirror", "requestMirror": {"backendRef": {"name": "shadow", "port": 80}}}
    ]
    r = route_from_object("HTTPRoute", obj)
    assert [p.key for p in r.parents] == ["apps/echo"]
    assert r.parents[0].port == 80
    assert r.backend_keys == {"apps/echo-v1", "apps/echo-v2", "apps/shadow"}


def test_dependency_annotation_parsing() -> None:
    pats, problems = parse_dependencies("echo, other/db ,infra/*, a/b/c, /x", "apps")
    assert {str(p) for p in pats} == {"apps/echo", "other/db", "infra/*"}
    assert len(problems) == 2


# ---- registry + resolution --------------------------------------------------------------------


def test_versioned_backends_stay_distinct_with_shared_sa(model: MeshModel) -> None:
    add(
        model, ns("apps"),
        svc("echo-v1", selector={"app": "echo", "version": "v1"}, ips=("10.96.0.11",)),
        svc("echo-v2", selector={"app": "echo", "version": "v2"}, ips=("10.96.0.12",)),
        pod("v1-a", ips=("10.0.1.1",), labels={"app": "echo", "version": "v1"}),
        pod("v2-a", ips=("10.0.2.1",), labels={"app": "echo", "version": "v2"}),
    )
    v1, v2 = model.resolve("apps/echo-v1"), model.resolve("apps/echo-v2")
    assert [e.ip for e in v1[80]] == ["10.0.1.1"]
    assert [e.ip for e in v2[80]] == ["10.0.2.1"]
    assert v1[80][0].sa_identity == v2[80][0].sa_identity == "apps/default"
    assert v1[80][0].san == "spiffe://td.example/ns/apps/sa/default"
    assert v1[80][0].port == 8080
    assert {r.key for r in model.endpoints_for_identity("apps/default")} == {
        "apps/v1-a", "apps/v2-a"}


def test_a_pod_is_one_record_held_by_the_registry_whatever_its_api_object_held(
        model: MeshModel) -> None:
    """The registry reads a pod's API object once and keeps the record, not the object: a
    managed pod without a CNI ADD here is the very record its API half is, and a namespace
    flip re-evaluates from the records alone."""
    add(model, ns("plain", managed=False), svc("s", "plain", selector={"app": "s"}),
        pod("p", "plain", ips=("10.0.9.1",), labels={"app": "s"}, ports={"http": 8080}))
    reg = model.registry
    assert reg.get("plain/p") is None and reg.api_pod("plain/p") is not None
    add(model, ns("plain", managed=True))
    rec = reg.get("plain/p")
    assert rec is not None and rec is reg.api_pod("plain/p")
    assert (rec.ips, rec.labels, rec.named_ports, rec.local) == (
        ("10.0.9.1",), {"app": "s"}, {"http": 8080}, False)
    again = pod("p", "plain", ips=("10.0.9.1",), labels={"app": "s"}, ports={"http": 8080})
    again["metadata"]["resourceVersion"] = "2"  # a change no record field shows
    add(model, again)
    assert reg.get("plain/p") is rec and reg.api_pod("plain/p") is rec  # still one object
    finished = pod("p", "plain", ips=("10.0.9.1",), labels={"app": "s"})
    finished["status"]["phase"] = "Succeeded"
    add(model, finished)
    assert reg.get("plain/p") is None and reg.members("plain/s") == []


def test_named_target_ports_resolve_per_pod(model: MeshModel) -> None:
    add(
        model, ns("apps"),
        svc("web", selector={"app": "web"}, ports=[{"name": "http", "port": 80,
                                                     "targetPort": "http-web"}]),
        pod("a", ips=("10.0.0.1",), labels={"app": "web"}, ports={"http-web": 8080}),
        pod("b", ips=("10.0.0.2",), labels={"app": "web"}, ports={"http-web": 9090}),
        pod("c", ips=("10.0.0.3",), labels={"app": "web"}, ports={"other": 1}),
    )
    eps = model.resolve("apps/web")[80]
    assert sorted((e.ip, e.port) for e in eps) == [("10.0.0.1", 8080), ("10.0.0.2", 9090)]


def test_dual_stack_pod_gives_an_endpoint_per_family(model: MeshModel) -> None:
    add(model, ns("apps"), svc("s", selector={"app": "s"}, ips=("10.96.0.1", "fd00::1")),
        pod("p", ips=("10.0.0.1", "fd00:10::1"), labels={"app": "s"}))
    assert sorted(e.ip for e in model.resolve("apps/s")[80]) == ["10.0.0.1", "fd00:10::1"]
    assert model.lookup_cluster_ip("fd00:0::1", 80) == "apps/s"
    assert model.lookup_cluster_ip("10.96.0.1", 81) is None


def test_managedness_health_and_drain(model: MeshModel) -> None:
    add(
        model, ns("plain", managed=False), ns("apps"),
        svc("s", selector={"app": "s"}),
        svc("s", "plain", selector={"app": "s"}, ips=("10.96.1.1",)),
        pod("unmanaged", "plain", ips=("10.0.9.1",), labels={"app": "s"}),
        pod("optin", "plain", ips=("10.0.9.2",),
            labels={"app": "s", "aether.io/managed": "true"}),
        pod("ready", ips=("10.0.0.1",), labels={"app": "s"}),
        pod("notready", ips=("10.0.0.2",), labels={"app": "s"}, ready=False),
        pod("leaving", ips=("10.0.0.3",), labels={"app": "s"}, terminating=True),
        pod("sys", "kube-system", ips=("10.0.0.4",), labels={"aether.io/managed": "true"}),
    )
    assert [e.ip for e in model.resolve("plain/s")[80]] == ["10.0.9.2"]
    eps = {e.ip: e for e in model.resolve("apps/s")[80]}
    assert eps["10.0.0.1"].ready and not eps["10.0.0.1"].draining
    assert not eps["10.0.0.2"].ready
    assert eps["10.0.0.3"].draining
    assert model.registry.get("kube-system/sys") is None
    # the namespace label flips: every pod there is re-evaluated
    affected = add(model, ns("plain", managed=True))
    assert affected == {"plain/s"}
    assert len(model.resolve("plain/s")[80]) == 2


def test_local_pod_registered_by_cni_before_api_ip(model: MeshModel) -> None:
    add(model, ns("apps"), svc("s", selector={"app": "s"}))
    affected = model.register_local("u1", "apps", "p", "api", ["10.0.0.7"],
                                    labels={"app": "s"})
    assert affected == {"apps/s"}
    [ep] = model.resolve("apps/s")[80]
    assert ep.ip == "10.0.0.7" and ep.local and ep.sa_identity == "apps/api"
    # the API catches up without an IP yet: CNI IP kept, API fields win
    add(model, pod("p", sa="api", node=NODE, uid="u1", labels={"app": "s"}, ips=()))
    [ep] = model.resolve("apps/s")[80]
    assert ep.ip == "10.0.0.7" and ep.ready
    model.unregister_local("apps", "p")
    delete(model, pod("p", node=NODE))
    assert model.resolve("apps/s")[80] == []


def test_selectorless_service_uses_endpointslices(model: MeshModel) -> None:
    add(model, ns("apps"), svc("ext", selector=None, ports=[{"name": "http", "port": 80}]),
        pod("p1", ips=("10.0.0.1",)), pod("p2", ips=("10.0.0.2",)))
    assert model.resolve("apps/ext")[80] == []
    slice_obj = {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "ext-abc", "namespace": "apps",
                     "labels": {"kubernetes.io/service-name": "ext"}},
        "ports": [{"name": "http", "port": 7000}],
        "endpoints": [
            {"addresses": ["10.0.0.1"], "targetRef": {"kind": "Pod", "name": "p1"}},
            {"addresses": ["10.0.0.2"]},
            {"addresses": ["192.168.1.1"]},  # not a managed pod: not a mesh endpoint
        ],
    }
    assert add(model, slice_obj) == {"apps/ext"}
    assert sorted((e.ip, e.port) for e in model.resolve("apps/ext")[80]) == [
        ("10.0.0.1", 7000), ("10.0.0.2", 7000)]
    assert delete(model, slice_obj) == {"apps/ext"}
    assert model.resolve("apps/ext")[80] == []


def test_slice_membership_follows_the_service_turning_selectorless_and_back(
        model: MeshModel) -> None:
    """Slices are indexed by endpoint only for selectorless Services: a slice that came
    first, a Service that drops its selector, a pod that comes after, and a selector put
    back all end with the members the Service's kind says."""
    slice_obj = {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "s-abc", "namespace": "apps",
                     "labels": {"kubernetes.io/service-name": "s"}},
        "ports": [{"name": "http", "port": 7000}],
        "endpoints": [{"addresses": ["10.0.0.1"], "targetRef": {"kind": "Pod", "name": "p1"}},
                      {"addresses": ["10.0.0.2"]}],
    }
    add(model, ns("apps"), slice_obj, pod("p1", ips=("10.0.0.1",)))
    add(model, svc("s", selector={"app": "s"}, ports=[{"name": "http", "port": 80}]))
    assert model.resolve("apps/s")[80] == []  # a selector: the slice is not membership
    assert "apps/s" not in model.registry._slice_pods  # nor held for it
    add(model, svc("s", selector=None, ports=[{"name": "http", "port": 80}]))
    assert [e.ip for e in model.resolve("apps/s")[80]] == ["10.0.0.1"]
    assert add(model, pod("p2", ips=("10.0.0.2",))) == {"apps/s"}  # found by its address
    assert sorted(e.ip for e in model.resolve("apps/s")[80]) == ["10.0.0.1", "10.0.0.2"]
    add(model, svc("s", selector={"app": "s"}, ports=[{"name": "http", "port": 80}]))
    assert model.resolve("apps/s")[80] == []
    assert add(model, pod("p3", ips=("10.0.0.3",))) == set()
    reg = model.registry
    assert reg._slice_by_pod == {} and reg._slice_by_ip == {}  # nothing left indexed
    assert delete(model, slice_obj) == set()
    assert reg._slice_pods == {} and reg._slice_ips == {}


# ---- incremental updates ----------------------------------------------------------------------


def test_one_pod_change_touches_only_its_services(model: MeshModel) -> None:
    add(model, ns("apps"),
        svc("a", selector={"app": "a"}, ips=("10.96.0.1",)),
        svc("b", selector={"app": "b"}, ips=("10.96.0.2",)),
        pod("pa", ips=("10.0.0.1",), labels={"app": "a"}),
        pod("pb", ips=("10.0.0.2",), labels={"app": "b"}))
    assert add(model, pod("pa", ips=("10.0.0.1",), labels={"app": "a"}, ready=False)) == {"apps/a"}
    # relabel moves the pod: both old and new Service are affected
    assert add(model, pod("pa", ips=("10.0.0.1",), labels={"app": "b"})) == {"apps/a", "apps/b"}
    # an identical re-apply changes nothing
    assert add(model, pod("pa", ips=("10.0.0.1",), labels={"app": "b"})) == set()
    assert add(model, svc("a", selector={"app": "a"}, ips=("10.96.0.9",))) == {"apps/a"}
    assert model.lookup_cluster_ip("10.96.0.9", 80) is None  # no endpoints: not in mesh


# ---- route targets + dependency set -----------------------------------------------------------


def _gamma(model: MeshModel) -> None:
    add(
        model, ns("apps"),
        svc("echo", selector={"app": "echo"}, ips=("10.96.0.10",)),
        svc("echo-v1", selector={"app": "echo", "version": "v1"}, ips=("10.96.0.11",)),
        svc("echo-v2", selector={"app": "echo", "version": "v2"}, ips=("10.96.0.12",)),
        svc("db", selector={"app": "db"}, ips=("10.96.0.20",)),
        pod("v1", ips=("10.0.1.1",), labels={"app": "echo", "version": "v1"}),
        pod("v2", ips=("10.0.2.1",), labels={"app": "echo", "version": "v2"}),
        pod("db", ips=("10.0.3.1",), labels={"app": "db"}),
    )


def test_route_target_needs_no_pods_and_closure_pulls_backends(model: MeshModel) -> None:
    _gamma(model)
    add(model, svc("front", selector=None, ips=("10.96.0.30",)))
    add(model, route("split", "front", ["echo-v1", "echo-v2"]))
    client = pod("client", node=NODE, ips=("10.0.9.9",),
                 annotations={"aether.io/dependencies": "front"})
    affected = add(model, client)
    assert affected == {"apps/front", "apps/echo-v1", "apps/echo-v2"}
    views = {v.key: v for v in model.in_scope_services()}
    assert set(views) == {"apps/front", "apps/echo-v1", "apps/echo-v2"}
    front = views["apps/front"]
    assert front.is_route_target and front.cluster_ips == ("10.96.0.30",)
    assert front.backends == {"apps/echo-v1", "apps/echo-v2"}
    assert views["apps/echo-v1"].endpoints[80][0].san == "spiffe://td.example/ns/apps/sa/default"
    why = model.explain()
    assert why["apps/front"] == ["declared by apps/client"]
    assert why["apps/echo-v1"] == ["backend of route target apps/front"]
    # transitive: a backend that is itself a route target pulls its own backends
    add(model, route("v1-to-db", "echo-v1", ["db"]))
    assert "apps/db" in model.in_scope_keys()
    assert "backend of route target apps/echo-v1" in model.explain()["apps/db"]
    # the route goes away: only the declared target is left (no pods: no longer served)
    delete(model, route("split", "front", []))
    assert model.in_scope_keys() == set()


def test_plain_service_gets_identity_route(model: MeshModel) -> None:
    _gamma(model)
    add(model, pod("client", node=NODE, annotations={"aether.io/dependencies": "db, other/*"}))
    [view] = model.in_scope_services()
    assert view.key == "apps/db" and not view.is_route_target
    assert [e.ip for e in view.endpoints[80]] == ["10.0.3.1"]


def test_declared_wildcard_and_cross_namespace(model: MeshModel) -> None:
    _gamma(model)
    add(model, ns("infra"), svc("cache", "infra", selector={"app": "c"}, ips=("10.96.5.1",)),
        pod("c1", "infra", ips=("10.0.5.1",), labels={"app": "c"}))
    add(model, pod("client", node=NODE, annotations={"aether.io/dependencies": "infra/*"}))
    assert model.in_scope_keys() == {"infra/cache"}
    # a new Service in the namespace joins through the wildcard
    add(model, svc("queue", "infra", selector={"app": "c"}, ips=("10.96.5.2",)))
    assert model.in_scope_keys() == {"infra/cache", "infra/queue"}
    # remote pods' declarations do not count; removing the local pod empties the set
    add(model, pod("remote", node="node-z", annotations={"aether.io/dependencies": "db"}))
    assert "apps/db" not in model.in_scope_keys()
    delete(model, pod("client", node=NODE))
    assert model.in_scope_keys() == set()


def test_learned_dependency_with_ttl(model: MeshModel, clock: Clock) -> None:
    _gamma(model)
    add(model, pod("client", node=NODE))
    assert model.learn("10.96.0.99", 80) == set()  # not a Service: passthrough only
    assert model.learn("10.96.0.20", 80) == {"apps/db"}
    assert model.in_scope_keys() == {"apps/db"}
    assert model.explain()["apps/db"] == ["learned from traffic, expires in 600s"]
    clock.t += 500
    assert model.learn("10.96.0.20", 80) == set()  # refresh, no change
    clock.t += 500
    assert model.expire() == set()  # refreshed at 500: still 100s left
    clock.t += 101
    assert model.expire() == {"apps/db"}
    assert model.in_scope_keys() == set()


def test_learnable_targets_are_in_mesh_services_out_of_scope(model: MeshModel,
                                                             clock: Clock) -> None:
    """What Envoy reports for learning: in-mesh, not yet in scope; learned ones drop out."""
    _gamma(model)
    add(model, pod("client", node=NODE))
    before = model.learnable_targets()
    assert ("10.96.0.20", 80) in before
    assert not [t for t in before if t[0] == "10.96.0.99"]  # not a Service
    model.learn("10.96.0.20", 80)
    assert ("10.96.0.20", 80) not in model.learnable_targets()
    clock.t += 601
    model.expire()
    assert ("10.96.0.20", 80) in model.learnable_targets()


def test_scope_all_serves_every_in_mesh_service(clock: Clock) -> None:
    m = MeshModel("aether.internal", "td", NODE, scope_all=True, clock=clock)
    _gamma(m)
    add(m, svc("nomesh", selector={"app": "none"}, ips=("10.96.0.77",)))
    assert m.in_scope_keys() == {"apps/echo", "apps/echo-v1", "apps/echo-v2", "apps/db"}


def test_dependency_set_unit(clock: Clock) -> None:
    d = DependencySet(ttl=10, clock=clock)
    assert d.set_declared("a/p", "x, b/y", "a")
    assert not d.set_declared("a/p", "b/y,x", "a")
    d.learn("c/z")
    backends = {"a/x": {"a/w"}, "a/w": {"a/x"}}  # a cycle terminates
    got = d.compute(lambda n: [], lambda k: backends.get(k, set()))
    assert got == {"a/x", "b/y", "c/z", "a/w"}
    assert d.next_expiry() == 10
    clock.t += 10
    assert d.expire() == {"c/z"}
    assert d.remove_pod("a/p")
    assert d.compute(lambda n: [], lambda k: set()) == set()


def test_event_model_same_from_manifests_and_api(model: MeshModel, tmp_path: Any) -> None:
    """The manifest loader's objects drive the model exactly like API events."""
    import yaml

    from agent.source.events import ObjectStore
    from agent.source.watch import ManifestWatcher

    docs = [ns("apps"), svc("db", selector={"app": "db"}),
            pod("db", ips=("10.0.3.1",), labels={"app": "db"}),
            pod("client", node=NODE, annotations={"aether.io/dependencies": "db"})]
    (tmp_path / "all.yaml").write_text(yaml.safe_dump_all(docs))
    store = ObjectStore()
    store.on_event(model.apply)
    ManifestWatcher(str(tmp_path), store).poll_once()
    assert model.in_scope_keys() == {"apps/db"}
    other = MeshModel("aether.internal", "td.example", NODE)
    add(other, *docs)
    assert other.in_scope_services() == model.in_scope_services()


def test_namespace_change_is_applied_in_chunks_with_the_lock_free_between(clock: Clock) -> None:
    """With ``breathe`` set (a serving agent), a Namespace edit re-evaluates its pods
    NAMESPACE_CHUNK at a time and releases the model between chunks; the outcome is the
    one-piece outcome."""
    import threading

    from agent.scope.model import NAMESPACE_CHUNK

    n = NAMESPACE_CHUNK * 3 + 7
    objs = [ns("big", managed=False), svc("web", "big", selector={"app": "web"}),
            *[pod(f"p{i}", "big", ips=(f"10.7.{i // 250}.{i % 250 + 1}",),
                  labels={"app": "web"}) for i in range(n)]]
    one, chunked = (MeshModel("aether.internal", "td", NODE, clock=clock) for _ in range(2))
    for m in (one, chunked):
        add(m, *objs)
        assert not m.is_in_mesh("big/web")  # the namespace is not managed yet
    pauses: list[float] = []
    free: list[bool] = []

    def other_thread_gets_the_lock() -> bool:
        got: list[bool] = []

        def probe() -> None:
            ok = chunked._lock.acquire(blocking=False)
            if ok:
                chunked._lock.release()
            got.append(ok)

        th = threading.Thread(target=probe)
        th.start()
        th.join(5)
        return got == [True]

    def breathe(busy: float) -> None:
        pauses.append(busy)
        free.append(other_thread_gets_the_lock())

    chunked.breathe = breathe
    result = {}
    t = threading.Thread(target=lambda: result.update(
        out=chunked.apply(WatchEvent("MODIFIED", "Namespace", ns("big")))))
    t.start()
    t.join(10)
    expected = one.apply(WatchEvent("MODIFIED", "Namespace", ns("big")))
    assert result["out"] == expected == {"big/web"}
    assert len(pauses) == 3 and all(free)  # 4 chunks, a pause (lock free) between each
    assert chunked.is_in_mesh("big/web") and len(chunked.registry.members("big/web")) == n
    assert len(one.registry.members("big/web")) == n


def _node(name: str, zone: str | None) -> dict[str, Any]:
    labels = {"topology.kubernetes.io/zone": zone} if zone else {}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}


def _three_zones(model: MeshModel, service: dict[str, Any]) -> Callable[[], dict[str, bool]]:
    """This node and node-b in z1, node-c in z2; ``service`` (web) with a pod on node-b and
    one on node-c, and a client here. Returns the reader of which endpoints are preferred."""
    add(model, ns("apps"), _node(NODE, "z1"), _node("node-b", "z1"), _node("node-c", "z2"),
        service,
        pod("w-b", ips=("10.0.1.2",), node="node-b", labels={"app": "web"}),
        pod("w-c", ips=("10.0.1.3",), node="node-c", labels={"app": "web"}),
        pod("client", node=NODE, annotations={"aether.io/dependencies": "web"}))

    def preferred() -> dict[str, bool]:
        [view] = model.in_scope_services()
        return {e.ip: e.preferred for e in view.endpoints[80]}
    return preferred


def test_traffic_distribution_marks_the_endpoints_it_prefers(model: MeshModel) -> None:
    """PreferSameZone: endpoints on nodes of this node's zone are preferred; a zone label
    change re-evaluates the Service; PreferSameNode prefers this node's pods only."""
    s = svc("web", selector={"app": "web"})
    s["spec"]["trafficDistribution"] = "PreferSameZone"
    preferred = _three_zones(model, s)
    assert preferred() == {"10.0.1.2": True, "10.0.1.3": False}
    assert add(model, _node("node-c", "z1")) == {"apps/web"}
    assert preferred() == {"10.0.1.2": True, "10.0.1.3": True}
    assert add(model, _node("node-c", "z1")) == set()  # unchanged zone: nothing to redo
    s["spec"]["trafficDistribution"] = "PreferSameNode"
    add(model, s)
    assert preferred() == {"10.0.1.2": False, "10.0.1.3": False}


def test_prefer_close_is_same_zone_and_prefer_same_node_this_nodes_pods(model: MeshModel) -> None:
    """PreferClose reads as PreferSameZone; PreferSameNode prefers a pod on this node (and
    nothing once it is gone), not one of another node in this zone."""
    s = svc("web", selector={"app": "web"})
    s["spec"]["trafficDistribution"] = "PreferClose"
    preferred = _three_zones(model, s)
    assert preferred() == {"10.0.1.2": True, "10.0.1.3": False}
    here = pod("w-a", ips=("10.0.1.4",), node=NODE, labels={"app": "web"})
    add(model, here)
    assert preferred() == {"10.0.1.2": True, "10.0.1.3": False, "10.0.1.4": True}
    s["spec"]["trafficDistribution"] = "PreferSameNode"
    assert add(model, s) == {"apps/web"}
    assert preferred() == {"10.0.1.2": False, "10.0.1.3": False, "10.0.1.4": True}
    assert delete(model, here) == {"apps/web"}
    assert preferred() == {"10.0.1.2": False, "10.0.1.3": False}


def _hinted_slice(hints: dict[str, dict[str, list[str]]]) -> dict[str, Any]:
    """Service web's EndpointSlice: one endpoint per address, with the hints given for it
    ({"forZones": [...], "forNodes": [...]})."""
    eps = [{"addresses": [ip], "conditions": {"ready": True},
            **({"hints": {k: [{"name": n} for n in v] for k, v in h.items()}} if h else {})}
           for ip, h in hints.items()]
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "web-x1", "namespace": "apps",
                         "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": 80}], "endpoints": eps}


def test_endpoint_slice_hints_decide_what_is_preferred(model: MeshModel) -> None:
    """Hints as kube-proxy reads them: forNodes when every ready endpoint has one and one
    names this node; else forZones when every one has a zone hint and one names this node's
    zone (even an endpoint of another zone, as the controller balances zones); else
    trafficDistribution's own reading (here none: all preferred)."""
    preferred = _three_zones(model, svc("web", selector={"app": "web"}))
    assert preferred() == {"10.0.1.2": True, "10.0.1.3": True}
    zones = {"10.0.1.2": {"forZones": ["z2"]}, "10.0.1.3": {"forZones": ["z1"]}}
    assert add(model, _hinted_slice(zones)) == {"apps/web"}
    assert preferred() == {"10.0.1.2": False, "10.0.1.3": True}  # the hint, not the zone
    both = {"10.0.1.2": {"forZones": ["z1"], "forNodes": [NODE]},
            "10.0.1.3": {"forZones": ["z1"], "forNodes": ["node-c"]}}
    add(model, _hinted_slice(both))
    assert preferred() == {"10.0.1.2": True, "10.0.1.3": False}  # forNodes first
    partial = {"10.0.1.2": {"forZones": ["z2"]}, "10.0.1.3": {}}
    add(model, _hinted_slice(partial))
    assert preferred() == {"10.0.1.2": True, "10.0.1.3": True}  # one without: ignored
    nobody = {"10.0.1.2": {"forZones": ["z2"]}, "10.0.1.3": {"forZones": ["z3"]}}
    add(model, _hinted_slice(nobody))
    assert preferred() == {"10.0.1.2": True, "10.0.1.3": True}  # none for z1: ignored
    add(model, _hinted_slice(zones))
    assert add(model, _node(NODE, "z2")) == {"apps/web"}  # our zone moved: re-read
    assert preferred() == {"10.0.1.2": True, "10.0.1.3": False}
    assert delete(model, _hinted_slice(zones)) == {"apps/web"}
    assert preferred() == {"10.0.1.2": True, "10.0.1.3": True}


def test_hint_mode_counts_only_what_it_is_given() -> None:
    z = (frozenset({"z1"}), frozenset())
    n = (frozenset({"z1"}), frozenset({"n1"}))
    assert hint_mode([], "n1", "z1") == ""
    assert hint_mode([z, z], "n1", "z1") == "zone"
    assert hint_mode([z, z], "n1", "") == ""  # this node's zone unknown
    assert hint_mode([n, z], "n1", "z1") == "zone"  # one without a node hint
    assert hint_mode([n, n], "n1", "z9") == "node"
    assert hint_mode([n, n], "n2", "z1") == "zone"


def _btp(name: str, target: str, percent: int, count: int | None = None,
         created: str = "2026-01-01T00:00:00Z") -> dict[str, Any]:
    rc: dict[str, Any] = {"budget": {"percent": percent, "interval": "10s"}}
    if count is not None:
        rc["minRetryRate"] = {"count": count, "interval": "1s"}
    return {"apiVersion": "gateway.networking.x-k8s.io/v1alpha1", "kind": "XBackendTrafficPolicy",
            "metadata": {"name": name, "namespace": "apps", "creationTimestamp": created},
            "spec": {"targetRefs": [{"group": "", "kind": "Service", "name": target}],
                     "retryConstraint": rc}}


def test_backend_traffic_policy_sets_the_services_retry_budget(model: MeshModel) -> None:
    add(model, ns("apps"), svc("web", selector={"app": "web"}),
        pod("w", ips=("10.0.1.2",), labels={"app": "web"}),
        pod("client", node=NODE, annotations={"aether.io/dependencies": "web"}))

    def budget() -> tuple[float | None, int | None]:
        [view] = model.in_scope_services()
        return view.traffic.retry_budget_percent, view.traffic.min_retry_concurrency

    assert budget() == (None, None)
    assert add(model, _btp("newer", "web", 30, created="2026-02-01T00:00:00Z")) == {"apps/web"}
    assert budget() == (30.0, None)
    add(model, _btp("older", "web", 5, count=2))  # the oldest policy wins a conflict
    assert budget() == (5.0, 2)
    assert delete(model, _btp("older", "web", 5)) == {"apps/web"}
    assert budget() == (30.0, None)
    assert add(model, _btp("other", "db", 1)) == {"apps/db"}  # not ours: web unchanged
    assert budget() == (30.0, None)


def test_backend_traffic_policy_session_persistence(model: MeshModel) -> None:
    from agent.scope.services import SessionPersistence, session_persistence
    add(model, ns("apps"), svc("web", selector={"app": "web"}),
        pod("w", ips=("10.0.1.2",), labels={"app": "web"}),
        pod("client", node=NODE, annotations={"aether.io/dependencies": "web"}))

    def session() -> SessionPersistence | None:
        [view] = model.in_scope_services()
        return view.traffic.session

    sp = _btp("sticky", "web", 20, created="2026-03-01T00:00:00Z")
    del sp["spec"]["retryConstraint"]
    sp["spec"]["sessionPersistence"] = {"sessionName": "shop", "type": "Cookie",
                                        "absoluteTimeout": "1h",
                                        "cookieConfig": {"lifetimeType": "Permanent"}}
    assert add(model, sp) == {"apps/web"}
    assert session() == SessionPersistence("Cookie", "shop", 3600.0)
    # an older policy with only a retry budget does not hide the newer one's session
    add(model, _btp("budget", "web", 5))
    [view] = model.in_scope_services()
    assert view.traffic.retry_budget_percent == 5.0 and session() is not None

    def parsed(**spec: object) -> SessionPersistence | None:
        return session_persistence({"spec": {"sessionPersistence": spec}})
    assert parsed() == SessionPersistence("Cookie", "aether-session", None)  # a session cookie
    assert parsed(type="Header", sessionName="x-shard") == SessionPersistence("Header", "x-shard")
    assert parsed(type="Magic") is None  # a type we do not implement: no persistence
    assert parsed(cookieConfig={"lifetimeType": "Permanent"}) is None  # needs absoluteTimeout
    assert session_persistence({"spec": {}}) is None


def test_backend_lb_policy_session_persistence(model: MeshModel) -> None:
    """BackendLBPolicy (Gateway API v1alpha2) sets session persistence as
    XBackendTrafficPolicy does; of both, the older wins; a route's backendRef to the
    Service is given it (service_with_policies)."""
    from agent.scope.services import SessionPersistence
    add(model, ns("apps"), svc("web", selector={"app": "web"}),
        pod("w", ips=("10.0.1.2",), labels={"app": "web"}),
        pod("client", node=NODE, annotations={"aether.io/dependencies": "web"}))
    lb = {"apiVersion": "gateway.networking.k8s.io/v1alpha2", "kind": "BackendLBPolicy",
          "metadata": {"name": "sticky", "namespace": "apps",
                       "creationTimestamp": "2026-01-01T00:00:00Z"},
          "spec": {"targetRefs": [{"group": "", "kind": "Service", "name": "web"}],
                   "sessionPersistence": {"sessionName": "lb", "type": "Header"}}}
    assert add(model, lb) == {"apps/web"}
    [view] = model.in_scope_services()
    assert view.traffic.session == SessionPersistence("Header", "lb")
    with_policies = model.service_with_policies("apps/web")
    assert with_policies is not None and with_policies.traffic.session == view.traffic.session
    newer = _btp("sticky", "web", 20, created="2026-03-01T00:00:00Z")  # same name, other kind
    newer["spec"]["sessionPersistence"] = {"sessionName": "btp"}
    add(model, newer)
    [view] = model.in_scope_services()
    assert view.traffic.session == SessionPersistence("Header", "lb")  # the older wins
    assert view.traffic.retry_budget_percent == 20.0  # the other field is the newer's
    assert delete(model, lb) == {"apps/web"}
    [view] = model.in_scope_services()
    assert view.traffic.session == SessionPersistence("Cookie", "btp")


def test_an_external_name_service_is_passthrough(model: MeshModel) -> None:
    """ExternalName is DNS only: it gets no chain and no cluster, even with a selector and
    a stray clusterIP in the manifest, so the connection goes wherever the client resolved
    the name, through the passthrough (docs/service-semantics.md)."""
    from agent.envoy.resources import LISTENER_TYPE, NodeXdsState, PodListener, build_resources
    ext = svc("ext", selector={"app": "x"}, ips=("10.96.9.9",))
    ext["spec"].update(type="ExternalName", externalName="db.example.com")
    add(model, ns("apps"), ext, svc("plain", selector={"app": "x"}, ips=("10.96.9.10",)),
        pod("x1", ips=("10.0.9.1",), labels={"app": "x"}),
        pod("client", node=NODE, annotations={"aether.io/dependencies": "ext, plain"}))
    s = service_from_object(ext)
    assert s.type == "ExternalName" and s.cluster_ips == () and not s.headless
    views = {v.key: v for v in model.in_scope_services()}
    res = build_resources(NodeXdsState(pods=(PodListener("c", "/n", namespace="apps"),),
                                       services=tuple(views.values())))
    mesh = res[LISTENER_TYPE]["mesh"].message()
    names = [c.name for c in mesh.filter_chains]
    assert any("|plain|" in n for n in names)  # the control: a ClusterIP Service has its chain
    assert not any("|ext|" in n for n in names), names
    assert not any("|ext|" in c for c in res["type.googleapis.com/envoy.config.cluster.v3.Cluster"])
