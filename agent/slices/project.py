"""Opt-in EndpointSlice projection (proposal 020, Part 2): registry → slices, pure.

The mesh registry stays the single source of truth; a slice is only its local view, written
so non-mesh consumers (kube-proxy, un-meshed pods) can reach a Service's pods. Each agent
owns one slice per Service, address family and port mapping for *its own node*, labelled so
it lists only its own. Conditions carry mesh health: a pod the mesh drains stops serving
non-mesh traffic too. Services with a selector are refused: the EndpointSlice controller
already publishes those, and two definitions of "the endpoints" is the split-brain the
proposal warns about.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from agent.scope.model import SERVICE_NAME_LABEL, ServiceView

EXPOSE_ANNOTATION = "aether.io/expose-endpoints"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
MANAGED_BY = "aether.io/agent"
NODE_LABEL = "aether.io/node"
API_VERSION = "discovery.k8s.io/v1"
MAX_ENDPOINTS = 1000  # the API's per-slice limit
_NAME_MAX = 63
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?\Z")

SliceKey = tuple[str, str]  # (namespace, name)
JSON = dict[str, Any]


def _h(text: str, n: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def exposed(svc: JSON) -> bool:
    """Opted in: the annotation is exactly "true" (off by default, zero-trust stays)."""
    ann = (svc.get("metadata") or {}).get("annotations") or {}
    return ann.get(EXPOSE_ANNOTATION) == "true"


def skip_reason(svc: JSON) -> str | None:
    """Why an opted-in Service gets no slices (None: it is projected)."""
    spec = svc.get("spec") or {}
    if spec.get("selector"):
        return ("has a selector: the EndpointSlice controller publishes its endpoints; "
                "projection is only for selectorless Services (no split-brain)")
    if spec.get("type") == "ExternalName":
        return "ExternalName Services have no endpoints"
    return None


def is_projected(obj: JSON) -> bool:
    """A slice some aether agent wrote: output only, never fed back into the registry."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels.get(MANAGED_BY_LABEL) == MANAGED_BY


def node_label_value(node_name: str) -> str:
    """The node name if it is a valid label value, else a stable hash of it."""
    return node_name if _LABEL_VALUE.match(node_name) else f"node-{_h(node_name, 16)}"


def owned_selector(node_name: str) -> str:
    """The label selector that finds exactly this node's slices."""
    return f"{MANAGED_BY_LABEL}={MANAGED_BY},{NODE_LABEL}={node_label_value(node_name)}"


def slice_name(service: str, node_name: str, family: str, mapping: str | None = None) -> str:
    """``<svc>-aether-<node8>[-<map5>]-v4|v6``, ≤ 63 chars, unique per (svc, node, family, map)."""
    suffix = f"-aether-{_h(node_name, 8)}" + (f"-{mapping}" if mapping else "")
    suffix += "-v6" if family == "IPv6" else "-v4"
    budget = _NAME_MAX - len(suffix)
    if len(service) > budget:  # keep truncated names distinct: hash the full Service name
        service = f"{service[:budget - 6].rstrip('-.')}-{_h(service, 5)}"
    return service + suffix


@dataclass(frozen=True)
class LocalPod:
    """One local registered pod of a Service, as the slice needs it."""

    pod: str  # <ns>/<name>
    ips: tuple[str, ...]
    ready: bool
    draining: bool
    ports: tuple[tuple[int, int], ...]  # (Service port, resolved target port), sorted


def local_pods(view: ServiceView | None) -> list[LocalPod]:
    """A model view's local endpoints regrouped per pod (each pod's targetPorts resolved)."""
    if view is None:
        return []
    ips: dict[str, list[str]] = {}
    ports: dict[str, dict[int, int]] = {}
    health: dict[str, tuple[bool, bool]] = {}
    for svc_port, eps in view.endpoints.items():
        for ep in eps:
            if not ep.local or not ep.pod:
                continue
            if ep.ip not in ips.setdefault(ep.pod, []):
                ips[ep.pod].append(ep.ip)
            ports.setdefault(ep.pod, {})[svc_port] = ep.port
            health[ep.pod] = (ep.ready, ep.draining)
    return [LocalPod(pod, tuple(ips[pod]), health[pod][0], health[pod][1],
                     tuple(sorted(ports[pod].items())))
            for pod in sorted(ips)]


def _families(svc: JSON) -> list[str]:
    """The Service's IP families (spec.ipFamilies, else its ClusterIPs, else both)."""
    spec = svc.get("spec") or {}
    fams = [f for f in spec.get("ipFamilies") or [] if f in ("IPv4", "IPv6")]
    if not fams:
        ips = [str(i) for i in spec.get("clusterIPs") or [spec.get("clusterIP")] if i and i != "None"]
        fams = sorted({"IPv6" if ":" in i else "IPv4" for i in ips}) or ["IPv4", "IPv6"]
    return fams


def _slice_ports(svc: JSON, mapping: dict[int, int]) -> list[JSON]:
    """The Service's ports as one pod group sees them: number = that group's targetPort."""
    out: list[JSON] = []
    for p in (svc.get("spec") or {}).get("ports") or []:
        if not isinstance(p, dict) or p.get("port") not in mapping:
            continue
        port: JSON = {"name": str(p.get("name") or ""), "protocol": str(p.get("protocol") or "TCP"),
                      "port": mapping[p["port"]]}
        if p.get("appProtocol"):
            port["appProtocol"] = str(p["appProtocol"])
        out.append(port)
    return out


def _endpoint(pod: LocalPod, ips: list[str], node_name: str) -> JSON:
    ns, _, name = pod.pod.partition("/")
    serving = pod.ready and not pod.draining  # drain: no new non-mesh traffic either
    return {
        "addresses": ips,
        "conditions": {"ready": serving, "serving": serving, "terminating": pod.draining},
        "nodeName": node_name,
        "targetRef": {"kind": "Pod", "namespace": ns, "name": name},
    }


def service_slices(node_name: str, svc: JSON, pods: Sequence[LocalPod]) -> dict[SliceKey, JSON]:
    """One opted-in Service's slices for this node (empty when there is nothing to publish)."""
    if not exposed(svc) or skip_reason(svc) is not None:
        return {}
    meta = svc.get("metadata") or {}
    ns, name = str(meta.get("namespace") or "default"), str(meta.get("name") or "")
    named = any(isinstance(p, dict) and isinstance(p.get("targetPort"), str)
                and not p["targetPort"].isdigit() for p in (svc.get("spec") or {}).get("ports") or [])
    has_ports = bool((svc.get("spec") or {}).get("ports"))
    labels = {SERVICE_NAME_LABEL: name, MANAGED_BY_LABEL: MANAGED_BY,
              NODE_LABEL: node_label_value(node_name)}
    owners = []
    if meta.get("uid"):  # no blockOwnerDeletion: it would need update on services/finalizers
        owners = [{"apiVersion": "v1", "kind": "Service", "name": name, "uid": str(meta["uid"]),
                   "controller": True}]
    # pods that disagree on a named targetPort's number go to separate slices, as Kubernetes does
    groups: dict[tuple[str, tuple[tuple[int, int], ...]], list[JSON]] = {}
    for pod in pods:
        if has_ports and not pod.ports:
            continue  # none of the Service's ports resolves in this pod: not an endpoint
        for fam in _families(svc):
            ips = [ip for ip in pod.ips if (":" in ip) == (fam == "IPv6")]
            if ips:
                groups.setdefault((fam, pod.ports), []).append(_endpoint(pod, ips, node_name))
    named = named or len({m for _, m in groups}) > 1  # never two groups under one name
    out: dict[SliceKey, JSON] = {}
    for (fam, mapping), endpoints in sorted(groups.items()):
        tag = _h(repr(mapping), 5) if named else None
        sname = slice_name(name, node_name, fam, tag)
        obj: JSON = {
            "apiVersion": API_VERSION,
            "kind": "EndpointSlice",
            "metadata": {"name": sname, "namespace": ns, "labels": dict(labels)},
            "addressType": fam,
            "endpoints": endpoints[:MAX_ENDPOINTS],
            "ports": _slice_ports(svc, dict(mapping)),
        }
        if owners:
            obj["metadata"]["ownerReferences"] = owners
        out[(ns, sname)] = obj
    return out


def desired_slices(node_name: str, services: Iterable[tuple[JSON, Sequence[LocalPod]]]
                   ) -> dict[SliceKey, JSON]:
    """Every slice this node should own: (Service object, its local pods) → slices by key."""
    out: dict[SliceKey, JSON] = {}
    for svc, pods in services:
        out.update(service_slices(node_name, svc, pods))
    return out
