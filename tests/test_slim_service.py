"""slim_service: what the watcher keeps of a Service, and that every reader sees the same."""

from __future__ import annotations

import copy
from typing import Any, cast

from agent.scope.services import service_from_object
from agent.slices.project import exposed, skip_reason
from agent.source.model import slim_service
from agent.source.objects import ServiceObject


def _service(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {
            "name": name, "namespace": "shop", "uid": f"uid-{name}", "resourceVersion": "42",
            "creationTimestamp": "2026-11-30T10:00:00Z", "generation": 1,
            "labels": {"app": name}, "annotations": {"aether.io/expose": "true"},
            "managedFields": [{"manager": "kubectl", "operation": "Update",
                               "fieldsV1": {"f:spec": {"f:ports": {}}}}]},
        "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"],
                 "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack",
                 "selector": {"app": name}, "sessionAffinity": "ClientIP",
                 "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 600}},
                 "internalTrafficPolicy": "Local", "publishNotReadyAddresses": True,
                 "trafficDistribution": "PreferClose",
                 "ports": [{"name": "http", "port": 80, "targetPort": "web", "protocol": "TCP",
                            "appProtocol": "http"}], **spec},
        "status": {"loadBalancer": {}},
    }


def test_it_keeps_what_readers_use_and_drops_the_rest() -> None:
    whole = _service("web")
    slim = slim_service(cast(ServiceObject, copy.deepcopy(whole)))
    assert "status" not in slim
    assert set(slim["metadata"]) == {"name", "namespace", "uid", "resourceVersion", "labels",
                                     "annotations"}
    assert slim["spec"] == whole["spec"]
    assert service_from_object(cast(ServiceObject, slim)) == \
        service_from_object(cast(ServiceObject, whole))
    assert exposed(slim) == exposed(whole) and skip_reason(slim) == skip_reason(whole)


def test_services_saying_the_same_ports_share_them_and_strings_are_interned() -> None:
    a = slim_service(cast(ServiceObject, _service("web")))
    b = slim_service(cast(ServiceObject, _service("api")))
    assert a["spec"]["ports"] is b["spec"]["ports"]
    assert a["spec"]["type"] is b["spec"]["type"]
    c = slim_service(cast(ServiceObject, _service("db", ports=[{"port": 5432}])))
    assert c["spec"]["ports"] == [{"port": 5432}] and c["spec"]["ports"] is not a["spec"]["ports"]


def test_the_model_holds_the_stores_maps_instead_of_copies() -> None:
    slim = slim_service(cast(ServiceObject, _service("web")))
    svc = service_from_object(cast(ServiceObject, slim))
    assert svc.labels is slim["metadata"]["labels"]
    assert svc.selector is slim["spec"]["selector"]


def test_a_selector_equal_to_the_labels_is_the_labels_map() -> None:
    slim = slim_service(cast(ServiceObject, _service("web")))
    assert slim["spec"]["selector"] is slim["metadata"]["labels"]
    other = slim_service(cast(ServiceObject, _service("api", selector={"tier": "api"})))
    assert other["spec"]["selector"] == {"tier": "api"}
    assert other["metadata"]["labels"] == {"app": "api"}
