"""Pods are slimmed on receipt from the API: what the agent reads survives, nothing else."""

from __future__ import annotations

import copy
import json
from typing import Any

from agent.scope.registry import _named_ports, _pod_ips, _ready
from agent.source.model import pod_from_object, slim_pod


def realistic_pod(i: int = 0, node: str = "node-007") -> dict[str, Any]:
    """A Deployment's pod as the API serves it: env, probes, volumes, managedFields, full
    status (what a cluster-wide LIST hands every agent)."""
    name = f"web-7d9f8c6b5-{i:05d}"
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name, "namespace": "shop", "uid": f"uid-{i}", "resourceVersion": str(1000 + i),
            "generateName": "web-7d9f8c6b5-", "creationTimestamp": "2026-11-30T10:00:00Z",
            "labels": {"app": "web", "pod-template-hash": "7d9f8c6b5", "version": "v1"},
            "annotations": {"capture.aether.io/exclude-outbound-ports": "5432",
                            "kubectl.kubernetes.io/restartedAt": "2026-11-30T09:00:00Z"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                 "name": "web-7d9f8c6b5", "uid": "rs-uid", "controller": True,
                                 "blockOwnerDeletion": True}],
            "managedFields": [{"manager": "kube-controller-manager", "operation": "Update",
                               "apiVersion": "v1", "time": "2026-11-30T10:00:00Z",
                               "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {
                                   "f:labels": {".": {}, "f:app": {}}}}}],
        },
        "spec": {
            "nodeName": node, "serviceAccountName": "web", "serviceAccount": "web",
            "containers": [{
                "name": "app", "image": "registry.example/web:1.2.3",
                "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}],
                "env": [{"name": f"VAR_{k}", "value": "x" * 40} for k in range(12)],
                "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080},
                                   "periodSeconds": 5},
                "livenessProbe": {"httpGet": {"path": "/live", "port": 8080}},
                "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
                "securityContext": {"runAsNonRoot": True,
                                    "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}},
                "volumeMounts": [{"name": "kube-api-access", "mountPath": "/var/run/secrets"}],
            }],
            "volumes": [{"name": "kube-api-access", "projected": {"sources": [
                {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}}]}}],
            "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists"}],
        },
        "status": {
            "phase": "Running", "podIP": f"10.8.{i // 250}.{i % 250 + 1}",
            "podIPs": [{"ip": f"10.8.{i // 250}.{i % 250 + 1}"}], "hostIP": "192.168.1.7",
            "conditions": [{"type": t, "status": "True",
                            "lastTransitionTime": "2026-11-30T10:00:05Z"}
                           for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")],
            "containerStatuses": [{"name": "app", "ready": True, "restartCount": 0,
                                   "image": "registry.example/web:1.2.3",
                                   "containerID": "containerd://" + "a" * 64,
                                   "state": {"running": {"startedAt": "2026-11-30T10:00:03Z"}}}],
            "startTime": "2026-11-30T10:00:00Z", "qosClass": "Burstable",
        },
    }


def test_what_the_agent_reads_survives() -> None:
    full = realistic_pod(3)
    slim = slim_pod(copy.deepcopy(full))
    assert pod_from_object(slim) == pod_from_object(full)
    assert _pod_ips(slim) == _pod_ips(full) == ("10.8.0.4",)
    assert _ready(slim) and _named_ports(slim) == _named_ports(full) == {"http": 8080}
    assert slim["metadata"]["ownerReferences"] == [
        {"kind": "ReplicaSet", "name": "web-7d9f8c6b5", "controller": True}]
    assert len(json.dumps(slim)) * 4 < len(json.dumps(full))  # a quarter of the size or less


def test_security_flags_survive() -> None:
    full = realistic_pod()
    full["spec"]["initContainers"] = [{"name": "init", "securityContext": {
        "capabilities": {"add": ["NET_ADMIN"]}}}]
    assert pod_from_object(slim_pod(full)).net_admin
    priv = realistic_pod()
    priv["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    assert pod_from_object(slim_pod(priv)).net_admin
    host = realistic_pod()
    host["spec"]["hostNetwork"] = True
    assert pod_from_object(slim_pod(host)).host_network


def test_status_only_churn_leaves_the_slim_pod_equal_and_deletion_shows() -> None:
    a, b = realistic_pod(), realistic_pod()
    b["metadata"]["resourceVersion"] = "99999"
    b["status"]["containerStatuses"][0]["restartCount"] = 4
    b["status"]["conditions"][0]["lastTransitionTime"] = "2026-12-01T00:00:00Z"
    assert slim_pod(a) == slim_pod(b)
    b["status"]["conditions"][1]["status"] = "False"  # Ready flips: that is a change
    assert slim_pod(a) != slim_pod(b)
    c = realistic_pod()
    c["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    assert slim_pod(c)["metadata"]["deletionTimestamp"]


def test_odd_shapes_do_not_raise() -> None:
    for odd in ({}, {"metadata": 5}, {"spec": {"containers": [None, 3, {"ports": "x"}]}},
                {"status": {"podIPs": [None], "conditions": "x"}}):
        slim = slim_pod(odd)
        assert slim["kind"] == "Pod"
        pod_from_object(slim)


def test_a_single_stack_pods_ip_is_kept_once_and_both_dual_stack_ips_stay() -> None:
    single = slim_pod(realistic_pod(3))
    assert "podIPs" not in single["status"]  # [{"ip": podIP}] says nothing podIP does not
    assert _pod_ips(single) == ("10.8.0.4",) and pod_from_object(single).ips == ("10.8.0.4",)
    dual = realistic_pod(3)
    dual["status"]["podIPs"] = [{"ip": "10.8.0.4"}, {"ip": "fd00::4"}]
    slim = slim_pod(dual)
    assert slim["status"]["podIPs"] == [{"ip": "10.8.0.4"}, {"ip": "fd00::4"}]
    assert _pod_ips(slim) == ("10.8.0.4", "fd00::4")
    assert pod_from_object(slim).ips == ("10.8.0.4", "fd00::4")


def test_label_maps_are_shared_between_pods_and_looked_up_by_their_items() -> None:
    from agent.source.model import shared_map
    a, b = slim_pod(realistic_pod(1)), slim_pod(realistic_pod(2))
    assert a["metadata"]["labels"] is b["metadata"]["labels"]  # one dict for the ReplicaSet
    other = realistic_pod(3)
    other["metadata"]["labels"] = {**other["metadata"]["labels"], "version": "v2"}
    c = slim_pod(other)
    assert c["metadata"]["labels"]["version"] == "v2"
    assert a["metadata"]["labels"]["version"] == "v1"  # the shared map was not changed
    assert shared_map({"a": ["not", "hashable"]}) == {"a": ["not", "hashable"]}
    assert shared_map(None) == {} and shared_map({}) == {}


def test_the_registrys_lean_reader_agrees_with_the_full_one_on_what_it_reads() -> None:
    from agent.source.model import pod_identity_from_object
    for obj in (slim_pod(realistic_pod(4)), realistic_pod(5), {"metadata": {"name": "bare"}}):
        full, lean = pod_from_object(obj), pod_identity_from_object(obj)
        for field in ("namespace", "name", "uid", "labels", "annotations", "service_account",
                      "node_name", "host_network", "key"):
            assert getattr(lean, field) == getattr(full, field), field
    hostnet = realistic_pod(6)
    hostnet["spec"]["hostNetwork"] = True  # what `managed` refuses: the lean reader keeps it
    assert pod_identity_from_object(hostnet).host_network is True
