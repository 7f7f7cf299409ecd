"""MeshPod: the slim Pod a node's agent publishes so other nodes need not list every Pod (pure).

A remote Pod is read for its labels, ServiceAccount, IPs, readiness, named ports and owner;
of those only the ServiceAccount has no other source in the API, and listing every Pod of
the cluster on every node (~4.4 KB of JSON a Pod, decoded and slimmed) is what made an agent
at 100k Pods slow to start and big. So each agent watches the Pods of its own node only
(``spec.nodeName`` field selector) and publishes one ``MeshPod`` per managed local Pod
holding exactly the slim Pod (``agent.source.model.slim_pod``), labelled with its node and
owned by the Pod (deleted with it by the garbage collector). Remote agents read the
records in place of Pods: the registry sees the same fields, from ~700 bytes a pod.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

from agent.slices.project import NODE_LABEL, node_label_value
from agent.source.model import intern_short, slim_pod
from agent.source.objects import PodObject

GROUP = "aether.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "MeshPod"
PLURAL = "meshpods"

JSON = dict[str, Any]
RecordKey = tuple[str, str]  # (namespace, name): the Pod's own


def owned_selector(node_name: str) -> str:
    """The label selector that finds exactly this node's records."""
    return f"{NODE_LABEL}={node_label_value(node_name)}"


def record_of(pod: JSON, node_name: str) -> JSON:
    """A local Pod (slim) → its MeshPod record, named and namespaced as the Pod."""
    meta = pod.get("metadata") or {}
    name, ns = str(meta.get("name") or ""), str(meta.get("namespace") or "default")
    owners = []
    if meta.get("uid"):  # no blockOwnerDeletion: it would need update on pods/finalizers
        owners = [{"apiVersion": "v1", "kind": "Pod", "name": name, "uid": str(meta["uid"])}]
    body = {k: pod[k] for k in ("metadata", "spec", "status") if k in pod}
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": name, "namespace": ns,
                         "labels": {NODE_LABEL: node_label_value(node_name)},
                         "ownerReferences": owners},
            "spec": {"pod": body}}


def pod_of(record: JSON) -> JSON | None:
    """A MeshPod as the registry reads a Pod (slimmed again: a record is written by another
    node and is input like any other), or None when it holds no usable Pod. The record's own
    name and namespace win over what its body says: RBAC lets an agent write records, and a
    record may only speak for the Pod it is named after."""
    meta = record.get("metadata") or {}
    body = (record.get("spec") or {}).get("pod")
    if not isinstance(body, dict) or not meta.get("name"):
        return None
    pod = slim_pod(cast(PodObject, {"apiVersion": "v1", **body}))
    # slim_pod's dicts are its own: set in place (interned, as slim_pod's own strings are)
    pod["metadata"]["name"] = intern_short(meta["name"])
    pod["metadata"]["namespace"] = intern_short(meta.get("namespace") or "default")
    # a remote pod's uid is read by nothing (a local pod's is: CNI DEL, enrollment, repair,
    # none of which a remote pod reaches); unique per pod, it was ~10 MB at 100k pods
    pod["metadata"].pop("uid", None)
    return pod


def pod_node(pod: JSON) -> str:
    return str((pod.get("spec") or {}).get("nodeName") or "")


def desired_records(node_name: str, pods: Iterable[JSON],
                    managed: Callable[[str], bool]) -> dict[RecordKey, JSON]:
    """The records this node should hold: one per local Pod the mesh manages (a pod the
    registry holds), none for pods of other nodes or pods the mesh ignores."""
    out: dict[RecordKey, JSON] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        name, ns = str(meta.get("name") or ""), str(meta.get("namespace") or "default")
        if not name or pod_node(pod) != node_name or not managed(f"{ns}/{name}"):
            continue
        out[(ns, name)] = record_of(pod, node_name)
    return out
