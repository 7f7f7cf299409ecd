"""A cluster's worth of Kubernetes objects for the scale benchmark, shaped like real ones.

Pods are what a Deployment's pods look like when the API serves them: labels and owner
references, one container with env, probes, resources and a projected token volume,
managedFields, full status (about 4 KB of JSON each). Every Service selects its own pods and
has one EndpointSlice listing them, as the EndpointSlice controller writes it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from typing import Any

from agent.meshpods.record import record_of
from agent.source.model import slim_pod

NAMESPACES = 50
LOCAL_NODE = "node-000"


def node_of(i: int, nodes: int, local: int) -> str:
    """The first ``local`` pods run on LOCAL_NODE, the rest spread over the other nodes."""
    return LOCAL_NODE if i < local else f"node-{1 + i % (nodes - 1):03d}"


def namespace_of(svc: int) -> str:
    return f"ns-{svc % NAMESPACES:02d}"


def pod_ip(i: int) -> str:
    return str(ipaddress.IPv4Address("10.64.0.0") + 2 + i)


def cluster_ip(svc: int) -> str:
    return str(ipaddress.IPv4Address("10.96.0.0") + 10 + svc)


def namespaces() -> Iterator[dict[str, Any]]:
    for n in range(NAMESPACES):
        yield {"apiVersion": "v1", "kind": "Namespace",
               "metadata": {"name": f"ns-{n:02d}", "labels": {"aether.io/managed": "true",
                                                               "team": f"team-{n % 7}"}}}


def service(svc: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": f"svc-{svc:05d}", "namespace": namespace_of(svc),
                     "labels": {"app": f"svc-{svc:05d}"}},
        "spec": {"type": "ClusterIP", "clusterIP": cluster_ip(svc),
                 "clusterIPs": [cluster_ip(svc)], "ipFamilies": ["IPv4"],
                 "selector": {"app": f"svc-{svc:05d}"},
                 "ports": [{"name": "http", "port": 80, "targetPort": 8080,
                            "protocol": "TCP"}]},
    }


def pod(i: int, services: int, nodes: int, local: int) -> dict[str, Any]:
    svc = i % services
    app = f"svc-{svc:05d}"
    rs = f"{app}-7d9f8c6b5"
    name = f"{rs}-{i:06d}"
    ip = pod_ip(i)
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name, "namespace": namespace_of(svc), "generateName": f"{rs}-",
            "labels": {"app": app, "pod-template-hash": "7d9f8c6b5", "version": "v1"},
            "annotations": {"kubectl.kubernetes.io/restartedAt": "2026-11-30T09:00:00Z"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": rs,
                                 "uid": f"rs-{svc}", "controller": True,
                                 "blockOwnerDeletion": True}],
            "managedFields": [{"manager": "kube-controller-manager", "operation": "Update",
                               "apiVersion": "v1", "time": "2026-11-30T10:00:00Z",
                               "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {
                                   "f:labels": {".": {}, "f:app": {},
                                                "f:pod-template-hash": {}}}}},
                              {"manager": "kubelet", "operation": "Update", "apiVersion": "v1",
                               "time": "2026-11-30T10:00:05Z", "fieldsType": "FieldsV1",
                               "subresource": "status", "fieldsV1": {"f:status": {
                                   "f:conditions": {}, "f:podIP": {}, "f:podIPs": {}}}}],
        },
        "spec": {
            "nodeName": node_of(i, nodes, local), "serviceAccountName": app,
            "serviceAccount": app, "restartPolicy": "Always", "dnsPolicy": "ClusterFirst",
            "terminationGracePeriodSeconds": 30, "schedulerName": "default-scheduler",
            "containers": [{
                "name": "app", "image": f"registry.example/{app}:1.2.3",
                "imagePullPolicy": "IfNotPresent",
                "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}],
                "env": [{"name": f"SETTING_{k}", "value": f"value-{k}-" + "x" * 24}
                        for k in range(8)],
                "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080,
                                               "scheme": "HTTP"},
                                   "periodSeconds": 5, "timeoutSeconds": 1,
                                   "successThreshold": 1, "failureThreshold": 3},
                "livenessProbe": {"httpGet": {"path": "/live", "port": 8080, "scheme": "HTTP"},
                                  "periodSeconds": 10, "timeoutSeconds": 1,
                                  "successThreshold": 1, "failureThreshold": 3},
                "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                              "limits": {"memory": "256Mi"}},
                "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]}},
                "volumeMounts": [{"name": "kube-api-access", "readOnly": True,
                                  "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}],
                "terminationMessagePath": "/dev/termination-log",
                "terminationMessagePolicy": "File",
            }],
            "volumes": [{"name": "kube-api-access", "projected": {"defaultMode": 420, "sources": [
                {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                {"configMap": {"name": "kube-root-ca.crt",
                               "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {
                    "apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}]}}],
            "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists",
                             "effect": "NoExecute", "tolerationSeconds": 300},
                            {"key": "node.kubernetes.io/unreachable", "operator": "Exists",
                             "effect": "NoExecute", "tolerationSeconds": 300}],
        },
        "status": {
            "phase": "Running", "hostIP": "192.168.1.7", "podIP": ip, "podIPs": [{"ip": ip}],
            "startTime": "2026-11-30T10:00:00Z", "qosClass": "Burstable",
            "conditions": [{"type": t, "status": "True", "lastProbeTime": None,
                            "lastTransitionTime": "2026-11-30T10:00:05Z"}
                           for t in ("Initialized", "Ready", "ContainersReady",
                                     "PodScheduled")],
            "containerStatuses": [{
                "name": "app", "ready": True, "started": True, "restartCount": 0,
                "image": f"registry.example/{app}:1.2.3",
                "imageID": "registry.example/" + app + "@sha256:" + "b" * 64,
                "containerID": "containerd://" + "a" * 64,
                "state": {"running": {"startedAt": "2026-11-30T10:00:03Z"}},
                "lastState": {}}],
        },
    }


def endpoint_slice(svc: int, pods: list[int], services: int, nodes: int,
                   local: int) -> dict[str, Any]:
    app = f"svc-{svc:05d}"
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": f"{app}-abcde", "namespace": namespace_of(svc),
                     "labels": {"kubernetes.io/service-name": app,
                                "endpointslice.kubernetes.io/managed-by":
                                    "endpointslice-controller.k8s.io"},
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": app,
                                          "uid": f"svc-{svc}", "controller": True}]},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [{"addresses": [pod_ip(i)],
                       "conditions": {"ready": True, "serving": True, "terminating": False},
                       "nodeName": node_of(i, nodes, local),
                       "targetRef": {"kind": "Pod", "namespace": namespace_of(svc),
                                     "name": f"{app}-7d9f8c6b5-{i:06d}"}}
                      for i in pods],
    }


def cluster(pods: int, services: int, nodes: int, local: int) -> Iterator[dict[str, Any]]:
    """Every object, Namespaces first; beside each pod of another node, the MeshPod record
    its node's agent publishes (every pod here is in a managed namespace)."""
    yield from namespaces()
    for s in range(services):
        yield service(s)
    by_svc: dict[int, list[int]] = {}
    for i in range(pods):
        by_svc.setdefault(i % services, []).append(i)
        p = pod(i, services, nodes, local)
        yield p
        node = node_of(i, nodes, local)
        if node != LOCAL_NODE:
            yield record_of(slim_pod(p), node)
    for s in range(services):
        yield endpoint_slice(s, by_svc.get(s, []), services, nodes, local)
