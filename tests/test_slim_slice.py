"""EndpointSlices are slimmed on receipt from the API: the mesh sees the same Service."""

from __future__ import annotations

import copy
import json
from typing import Any

from agent.scope.model import MeshModel
from agent.source.base import WatchEvent
from agent.source.model import slim_endpoint_slice
from agent.source.packed import Packed, unpacked


def realistic_slice(svc: str = "web", ns: str = "shop") -> dict[str, Any]:
    """An EndpointSlice as the EndpointSlice controller writes it (and the API serves it)."""
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {
            "name": f"{svc}-abcde", "namespace": ns, "uid": "slice-uid",
            "resourceVersion": "4711", "generateName": f"{svc}-", "generation": 3,
            "creationTimestamp": "2026-11-30T10:00:00Z",
            "labels": {"kubernetes.io/service-name": svc,
                       "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"},
            "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2026-11-30"},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": svc,
                                 "uid": "svc-uid", "controller": True}],
            "managedFields": [{"manager": "kube-controller-manager", "operation": "Update",
                               "fieldsV1": {"f:endpoints": {}}}],
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP", "appProtocol": "http"}],
        "endpoints": [{"addresses": [f"10.0.0.{i}"],
                       "conditions": {"ready": i != 3, "serving": True, "terminating": i == 3},
                       "nodeName": f"node-{i}", "zone": "z1",
                       "hints": {"forZones": [{"name": "z1"}]},
                       "targetRef": {"kind": "Pod", "namespace": ns, "name": f"{svc}-{i}",
                                     "uid": f"pod-uid-{i}", "resourceVersion": "99"}}
                      for i in range(1, 4)],
    }


def pod(i: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"web-{i}", "namespace": "shop", "uid": f"u{i}",
                         "labels": {"app": "web"}},
            "spec": {"nodeName": f"node-{i}", "serviceAccountName": "web"},
            "status": {"phase": "Running", "podIP": f"10.0.0.{i}",
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def test_what_the_mesh_reads_survives_and_the_rest_goes() -> None:
    raw = realistic_slice()
    slim = slim_endpoint_slice(copy.deepcopy(raw))
    meta = slim["metadata"]
    assert (meta["name"], meta["namespace"]) == ("web-abcde", "shop")
    assert meta["labels"] == raw["metadata"]["labels"]
    assert not {"managedFields", "annotations", "ownerReferences", "uid"} & set(meta)
    assert meta["resourceVersion"] == "4711"  # what the store keeps of it (ObjectStore.thin)
    assert slim["addressType"] == "IPv4"
    assert slim["ports"] == raw["ports"]
    ep = slim["endpoints"][2]
    assert ep["addresses"] == ["10.0.0.3"]
    assert ep["conditions"] == {"ready": False, "serving": True, "terminating": True}
    assert (ep["nodeName"], ep["zone"]) == ("node-3", "z1")
    assert ep["hints"] == {"forZones": [{"name": "z1"}]}
    assert ep["targetRef"] == {"kind": "Pod", "namespace": "shop", "name": "web-3"}
    plain = {**slim, "endpoints": [unpacked(e) for e in slim["endpoints"]]}
    assert len(json.dumps(plain)) < len(json.dumps(raw)) * 0.7


def test_an_endpoint_is_one_packed_object_equal_to_its_dict() -> None:
    """Each endpoint is packed (one object, not an endpoint dict and a targetRef dict): a
    10k-Service cluster holds one per remote pod. It reads and compares as the dict did."""
    slim = slim_endpoint_slice(realistic_slice())
    ep = slim["endpoints"][2]
    assert isinstance(ep, Packed)
    assert ep == {"addresses": ["10.0.0.3"], "conditions": ep["conditions"],
                  "nodeName": "node-3", "zone": "z1", "hints": ep["hints"],
                  "targetRef": {"kind": "Pod", "namespace": "shop", "name": "web-3"}}
    assert ep.get("targetRef") is not ep.get("targetRef")  # a fresh dict: nothing to mutate
    assert slim == slim_endpoint_slice(realistic_slice())  # a relist finds it unchanged


def test_equal_conditions_are_one_object() -> None:
    slim = slim_endpoint_slice(realistic_slice())
    a, b = slim["endpoints"][0]["conditions"], slim["endpoints"][1]["conditions"]
    assert a == b and a is b


def _members(slice_obj: dict[str, Any]) -> list[tuple[str, str]]:
    model = MeshModel("aether.internal", "cluster.local", "node-1", scope_all=True)
    model.apply(WatchEvent("ADDED", "Namespace", {
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "shop", "labels": {"aether.io/managed": "true"}}}))
    model.apply(WatchEvent("ADDED", "Service", {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": "shop"},
        "spec": {"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80,
                                                       "targetPort": 8080}]}}))
    for i in range(1, 4):
        model.apply(WatchEvent("ADDED", "Pod", pod(i)))
    model.apply(WatchEvent("ADDED", "EndpointSlice", slice_obj))
    return sorted((r.key, r.node_name) for r in model.registry.members("shop/web"))


def test_a_selectorless_service_has_the_same_members_from_the_slim_slice() -> None:
    raw = _members(realistic_slice())
    assert raw == [("shop/web-1", "node-1"), ("shop/web-2", "node-2"), ("shop/web-3", "node-3")]
    assert _members(slim_endpoint_slice(realistic_slice())) == raw


def test_odd_shapes_do_not_raise() -> None:
    for odd in ({}, {"metadata": None, "endpoints": None, "ports": None},
                {"endpoints": ["x", {"addresses": None, "targetRef": None}],
                 "ports": ["y", {"port": "80"}]}):
        out = slim_endpoint_slice(odd)
        assert out["kind"] == "EndpointSlice"
