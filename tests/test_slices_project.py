"""EndpointSlice projection (agent/slices/project.py): registry view → this node's slices, pure."""

from __future__ import annotations

from typing import Any

from agent.scope.model import MeshModel
from agent.slices.project import (
    EXPOSE_ANNOTATION,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    NODE_LABEL,
    is_projected,
    local_pods,
    node_label_value,
    owned_selector,
    service_slices,
    slice_name,
)
from agent.slices.writer import mesh_desired
from agent.source.base import WatchEvent
from agent.source.events import ObjectStore

NODE = "node-a"


def namespace(name: str = "apps") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": {"aether.io/managed": "true"}}}


def pod(name: str, ips: tuple[str, ...], *, node: str = NODE, ready: bool = True,
        terminating: bool = False, ports: dict[str, int] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "apps", "uid": f"uid-{name}"}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": meta,
        "spec": {"nodeName": node, "serviceAccountName": "api", "containers": [{
            "name": "app",
            "ports": [{"name": k, "containerPort": v} for k, v in (ports or {}).items()]}]},
        "status": {"phase": "Running", "podIPs": [{"ip": ip} for ip in ips],
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def service(name: str = "web", *, expose: str | None = "true", selector: dict[str, str] | None = None,
            ips: tuple[str, ...] = ("10.96.0.10",), families: list[str] | None = None,
            ports: list[dict[str, Any]] | None = None, uid: str = "svc-uid") -> dict[str, Any]:
    spec: dict[str, Any] = {
        "clusterIP": ips[0], "clusterIPs": list(ips),
        "ports": ports if ports is not None else [{"name": "http", "port": 80, "targetPort": 8080}],
    }
    if families is not None:
        spec["ipFamilies"] = families
    if selector is not None:
        spec["selector"] = selector
    ann = {EXPOSE_ANNOTATION: expose} if expose is not None else {}
    return {"apiVersion": "v1", "kind": "Service", "spec": spec,
            "metadata": {"name": name, "namespace": "apps", "uid": uid, "annotations": ann}}


def members(svc_name: str, *pods: str, name: str = "registrar") -> dict[str, Any]:
    """A slice from elsewhere (not ours) naming a selectorless Service's members."""
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": f"{svc_name}-{name}", "namespace": "apps",
                         "labels": {"kubernetes.io/service-name": svc_name}},
            "endpoints": [{"addresses": [], "targetRef": {"kind": "Pod", "name": p}} for p in pods]}


class Mesh:
    """An ObjectStore feeding a MeshModel, as MeshRuntime wires them."""

    def __init__(self, node: str = NODE) -> None:
        self.node = node
        self.objects = ObjectStore()
        self.model = MeshModel(node_name=node)
        self.objects.on_event(self.model.apply)
        self.objects.apply(WatchEvent("ADDED", "Namespace", namespace()))

    def put(self, *objs: dict[str, Any]) -> Mesh:
        for o in objs:
            self.objects.apply(WatchEvent("MODIFIED", o["kind"], o))
        return self

    def delete(self, obj: dict[str, Any]) -> None:
        self.objects.apply(WatchEvent("DELETED", obj["kind"], obj))

    def desired(self, skipped: dict[str, str] | None = None) -> dict[tuple[str, str], Any]:
        return mesh_desired(self.objects, self.model, self.node, skipped)


def test_opt_in_is_exact_and_off_by_default() -> None:
    m = Mesh().put(pod("p1", ("10.0.0.1",)), members("web", "p1"))
    for value in (None, "True", "yes", "1", "false"):
        m.put(service(expose=value))
        assert m.desired() == {}, value
    m.put(service(expose="true"))
    [(key, obj)] = m.desired().items()
    assert key == ("apps", slice_name("web", NODE, "IPv4"))
    meta = obj["metadata"]
    assert meta["labels"] == {"kubernetes.io/service-name": "web", MANAGED_BY_LABEL: MANAGED_BY,
                              NODE_LABEL: NODE}
    assert meta["ownerReferences"] == [{"apiVersion": "v1", "kind": "Service", "name": "web",
                                        "uid": "svc-uid", "controller": True}]
    assert obj["addressType"] == "IPv4"
    assert obj["ports"] == [{"name": "http", "protocol": "TCP", "port": 8080}]
    assert obj["endpoints"] == [{
        "addresses": ["10.0.0.1"],
        "conditions": {"ready": True, "serving": True, "terminating": False},
        "nodeName": NODE, "targetRef": {"kind": "Pod", "namespace": "apps", "name": "p1"}}]


def test_selector_services_are_refused() -> None:
    m = Mesh().put(pod("p1", ("10.0.0.1",)), service(selector={"app": "web"}))
    skipped: dict[str, str] = {}
    assert m.desired(skipped) == {}
    assert "selector" in skipped["apps/web"]


def test_only_local_endpoints() -> None:
    m = Mesh().put(pod("p1", ("10.0.0.1",)), pod("far", ("10.0.1.1",), node="node-b"),
                   members("web", "p1", "far"), service())
    assert sorted(e.ip for e in m.model.resolve("apps/web")[80]) == ["10.0.0.1", "10.0.1.1"]
    [obj] = m.desired().values()
    assert [e["targetRef"]["name"] for e in obj["endpoints"]] == ["p1"]
    # the other node's agent projects the other pod, under its own name and label
    other = Mesh("node-b").put(pod("p1", ("10.0.0.1",)), pod("far", ("10.0.1.1",), node="node-b"),
                               members("web", "p1", "far"), service())
    [(key, obj_b)] = other.desired().items()
    assert key[1] != slice_name("web", NODE, "IPv4")
    assert [e["targetRef"]["name"] for e in obj_b["endpoints"]] == ["far"]
    assert obj_b["metadata"]["labels"][NODE_LABEL] == "node-b"


def test_health_and_drain_conditions() -> None:
    m = Mesh().put(pod("ok", ("10.0.0.1",)), pod("sick", ("10.0.0.2",), ready=False),
                   pod("going", ("10.0.0.3",), terminating=True),
                   members("web", "ok", "sick", "going"), service())
    [obj] = m.desired().values()
    conds = {e["targetRef"]["name"]: e["conditions"] for e in obj["endpoints"]}
    assert conds == {
        "ok": {"ready": True, "serving": True, "terminating": False},
        "sick": {"ready": False, "serving": False, "terminating": False},
        # the mesh drains it: non-mesh traffic stops too
        "going": {"ready": False, "serving": False, "terminating": True},
    }


def test_dual_stack_and_single_stack() -> None:
    m = Mesh().put(pod("p1", ("10.0.0.1", "fd00::1")), members("web", "p1"),
                   service(ips=("10.96.0.10", "fd00:96::10")))
    out = m.desired()
    assert sorted(o["addressType"] for o in out.values()) == ["IPv4", "IPv6"]
    assert {o["endpoints"][0]["addresses"][0] for o in out.values()} == {"10.0.0.1", "fd00::1"}
    assert ("apps", slice_name("web", NODE, "IPv6")) in out
    # a single-stack Service gets only its family's slice, even from dual-stack pods
    m.put(service(ips=("10.96.0.10",)))
    assert [o["addressType"] for o in m.desired().values()] == ["IPv4"]
    m.put(service(ips=("fd00:96::10",), families=["IPv6"]))
    assert [o["addressType"] for o in m.desired().values()] == ["IPv6"]


def test_named_target_ports_split_by_mapping() -> None:
    ports = [{"name": "http", "port": 80, "targetPort": "web"},
             {"name": "metrics", "port": 9090, "targetPort": 9090, "appProtocol": "http"}]
    m = Mesh().put(pod("a", ("10.0.0.1",), ports={"web": 8080}),
                   pod("b", ("10.0.0.2",), ports={"web": 8080}),
                   pod("c", ("10.0.0.3",), ports={"web": 9000}),
                   pod("none", ("10.0.0.4",)),  # no "web" port: only the numeric port
                   members("web", "a", "b", "c", "none"), service(ports=ports))
    by_pods = {tuple(e["targetRef"]["name"] for e in o["endpoints"]): o for o in m.desired().values()}
    assert set(by_pods) == {("a", "b"), ("c",), ("none",)}
    assert by_pods[("a", "b")]["ports"] == [
        {"name": "http", "protocol": "TCP", "port": 8080},
        {"name": "metrics", "protocol": "TCP", "port": 9090, "appProtocol": "http"}]
    assert [p["port"] for p in by_pods[("c",)]["ports"]] == [9000, 9090]
    assert [p["name"] for p in by_pods[("none",)]["ports"]] == ["metrics"]
    names = {o["metadata"]["name"] for o in by_pods.values()}
    assert len(names) == 3 and all(len(n) <= 63 for n in names)
    # a pod joining an existing mapping does not rename anything
    m.put(pod("d", ("10.0.0.5",), ports={"web": 9000}), members("web", "a", "b", "c", "d", "none"))
    assert {o["metadata"]["name"] for o in m.desired().values()} == names


def test_names_are_bounded_and_distinct() -> None:
    long_a, long_b = "x" * 60 + "a", "x" * 60 + "b"
    names = {slice_name(s, n, f) for s in (long_a, long_b, "web") for n in ("node-a", "node-b")
             for f in ("IPv4", "IPv6")}
    assert len(names) == 12 and all(len(n) <= 63 for n in names)
    assert slice_name("web", "node-a", "IPv4").startswith("web-aether-")
    assert slice_name("web", "node-a", "IPv6").endswith("-v6")


def test_node_label_and_ownership_filter() -> None:
    assert node_label_value("node-a") == "node-a"
    long = "n" * 70 + ".example.com"
    assert len(node_label_value(long)) <= 63 and node_label_value(long) != node_label_value(long + "x")
    assert owned_selector("node-a") == f"{MANAGED_BY_LABEL}={MANAGED_BY},{NODE_LABEL}=node-a"
    m = Mesh().put(pod("p1", ("10.0.0.1",)), members("web", "p1"), service())
    [obj] = m.desired().values()
    assert is_projected(obj) and not is_projected(members("web", "p1"))


def test_no_local_pods_no_slice() -> None:
    m = Mesh().put(pod("far", ("10.0.1.1",), node="node-b"), members("web", "far"), service())
    assert m.desired() == {}
    assert local_pods(None) == []
    assert service_slices(NODE, service(), []) == {}


def test_service_without_uid_has_no_owner() -> None:
    m = Mesh().put(pod("p1", ("10.0.0.1",)), members("web", "p1"), service(uid=""))
    [obj] = m.desired().values()
    assert "ownerReferences" not in obj["metadata"]
