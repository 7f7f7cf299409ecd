"""Plain metadata records that every source (Kubernetes API, manifest directory) produces.

Sources hand out raw Kubernetes JSON objects (dicts); these helpers turn them into the few
fields the capture decision needs, so the decision stays a pure function of plain data.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from agent.common.ids import pod_key
from agent.common.workload import workload_of
from agent.source.objects import EndpointSliceObject, NodeObject, PodObject, ServiceObject
from agent.source.packed import pack


@dataclass(frozen=True)
class PodMeta:
    namespace: str
    name: str
    uid: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    service_account: str = "default"
    node_name: str = ""
    host_network: bool = False
    net_admin: bool = False  # a container can set SO_MARK: it could forge the passthrough mark
    ips: tuple[str, ...] = ()  # status.podIPs: how a pod older than the agent is found
    phase: str = ""  # status.phase
    workload: str = ""  # the controlling owner (agent.common.workload): what the metrics name it by

    @property
    def key(self) -> str:
        # interned: the registry's maps and sets all hold this one string per pod
        return pod_key(self.namespace, self.name)


@dataclass(frozen=True)
class NamespaceMeta:
    name: str
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


def _str_map(value: Any) -> dict[str, str]:
    """A string map; the very dict when it already is one (slim pods share theirs between
    the pods of a ReplicaSet: copying would undo that)."""
    if not isinstance(value, dict):
        return {}
    if all(type(k) is str and type(v) is str for k, v in value.items()):
        return value
    return {str(k): "" if v is None else str(v) for k, v in value.items()}


def pod_from_object(obj: Mapping[str, Any]) -> PodMeta:
    """Kubernetes Pod JSON → PodMeta (missing fields take Kubernetes' defaults)."""
    spec = _map(obj.get("spec"))
    status = _map(obj.get("status"))
    ips = [str(_map(x).get("ip") or "") for x in _list(status.get("podIPs"))]
    if not ips and status.get("podIP"):
        ips = [str(status["podIP"])]
    base = pod_identity_from_object(obj)
    return replace(base, net_admin=_holds_net_admin(spec), ips=tuple(ip for ip in ips if ip),
                   phase=str(status.get("phase") or ""), workload=workload_of(base.name, obj))


def pod_identity_from_object(obj: Mapping[str, Any]) -> PodMeta:
    """The part of ``pod_from_object`` the mesh registry reads for every pod of the cluster
    (names, uid, labels, annotations, ServiceAccount, node, hostNetwork: what ``managed`` and
    a record need). Its net_admin, ips, phase and workload stay at their defaults: those
    are read for local pods only, and computing them was half of a MeshPod's cost."""
    meta = _map(obj.get("metadata"))
    spec = _map(obj.get("spec"))
    return PodMeta(
        namespace=str(meta.get("namespace") or "default"),
        name=str(meta.get("name") or ""),
        uid=str(meta.get("uid") or ""),
        labels=_str_map(meta.get("labels")),
        annotations=_str_map(meta.get("annotations")),
        service_account=str(
            spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
        ),
        node_name=str(spec.get("nodeName") or ""),
        host_network=bool(spec.get("hostNetwork") or False),
    )


def _map(value: Any) -> dict[str, Any]:
    """A field that should be a mapping; anything else (a hand-written manifest can hold a
    list or a number anywhere) reads as empty rather than failing the lookup."""
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _holds_net_admin(spec: dict[str, Any]) -> bool:
    for c in _list(spec.get("containers")) + _list(spec.get("initContainers")):
        if not isinstance(c, dict):
            continue
        sc = _map(c.get("securityContext"))
        if sc.get("privileged"):
            return True
        caps = _list(_map(sc.get("capabilities")).get("add"))
        if any(str(x).upper() in ("NET_ADMIN", "CAP_NET_ADMIN", "ALL") for x in caps):
            return True
    return False


def namespace_from_object(obj: Mapping[str, Any]) -> NamespaceMeta:
    meta = _map(obj.get("metadata"))
    return NamespaceMeta(
        name=str(meta.get("name") or ""),
        labels=_str_map(meta.get("labels")),
        annotations=_str_map(meta.get("annotations")),
    )


def _slim_containers(value: Any) -> list[dict[str, Any]]:
    out = []
    for c in _list(value):
        if not isinstance(c, dict):
            continue
        kept: dict[str, Any] = {"name": intern_short(c["name"])} if "name" in c else {}
        ports = [{k: intern_short(p[k]) for k in ("name", "containerPort", "protocol") if k in p}
                 for p in _list(c.get("ports")) if isinstance(p, dict)]
        if ports:
            kept["ports"] = ports
        sc = _map(c.get("securityContext"))
        held = {k: sc[k] for k in ("privileged",) if k in sc}
        add = _list(_map(sc.get("capabilities")).get("add"))
        if add:
            held["capabilities"] = {"add": [intern_short(x) for x in add]}
        if held:
            kept["securityContext"] = held
        out.append(kept)
    return out


#: Sub-structures of slim pods, shared by value (``shared``); cleared when it grows past
#: SHARED_MAX entries, which only costs the sharing of what comes next.
_SHARED: dict[bytes, Any] = {}
SHARED_MAX = 200_000


def shared(value: Any) -> Any:
    """One object for equal labels, annotations, owners, containers or conditions: the pods
    of one ReplicaSet hold the same ones, so 100k pods hold a few thousand of each. Slim pods
    are therefore immutable: nothing may change one in place. Keyed by type and JSON
    (orjson: ~7x faster than repr, three of these a pod), repr where JSON cannot say it."""
    if not value:
        return value
    try:
        key = type(value).__name__.encode() + orjson.dumps(value)
    except TypeError:
        key = f"{type(value).__name__}{value!r}".encode()
    got = _SHARED.get(key)
    if got is None:
        if len(_SHARED) >= SHARED_MAX:
            _SHARED.clear()
        got = _SHARED[key] = value
    return got


def intern_short(value: Any, _intern: Any = sys.intern) -> Any:
    """Label keys and values, namespaces, node and ServiceAccount names repeat across every
    pod of a cluster: one string object each instead of one per pod. (Called ~17 times a
    remote pod: ``sys.intern`` bound as a default, exact ``str`` only, as JSON decodes.)"""
    return _intern(value) if type(value) is str and len(value) <= 128 else value


def _slim_map(value: Any) -> dict[str, Any]:
    return {intern_short(k): intern_short(v) for k, v in _map(value).items()}


#: labels/annotations by their items: the pods of a ReplicaSet find their shared map without
#: re-interning and repr-ing it (a third of slimming a MeshPod); keyed by the shared map's
#: own (interned) items, so the cache holds no string twice.
_SHARED_MAPS: dict[tuple[tuple[Any, Any], ...], dict[str, Any]] = {}


def shared_map(value: Any) -> dict[str, Any]:
    """``shared(_slim_map(value))``, looked up by the raw items first."""
    if not isinstance(value, dict) or not value:
        return {}
    try:
        got = _SHARED_MAPS.get(tuple(value.items()))
    except TypeError:  # an unhashable value: not a string map, no shortcut
        return shared(_slim_map(value))  # type: ignore[no-any-return]
    if got is None:
        got = shared(_slim_map(value))
        if len(_SHARED_MAPS) >= SHARED_MAX:
            _SHARED_MAPS.clear()
        _SHARED_MAPS[tuple(got.items())] = got
    return got


def slim_pod(obj: PodObject) -> dict[str, Any]:
    """The fields of a Pod the agent reads, and nothing else: applied on receipt from the
    API (as a client-go informer transform is), so a node's memory follows what the mesh
    needs — not env, probes, volumes, managedFields or container statuses — and status-only
    churn (restart counts, probe times) no longer changes the stored object (the
    resourceVersion goes too: unchanged content is an unchanged object). Readers:
    ``pod_from_object``, ``agent.scope.registry`` (IPs, Ready, named ports, deletion),
    ``agent.node.repair``, ``agent.runtime.enroll``."""
    meta = _map(obj.get("metadata"))
    spec = _map(obj.get("spec"))
    status = _map(obj.get("status"))
    m: dict[str, Any] = {k: intern_short(meta[k]) for k in ("name", "namespace", "uid")
                         if k in meta}
    for k in ("labels", "annotations"):
        if meta.get(k):
            m[k] = shared_map(meta[k])
    if meta.get("deletionTimestamp"):
        m["deletionTimestamp"] = meta["deletionTimestamp"]
    owners = [{k: intern_short(o[k]) for k in ("kind", "name", "controller") if k in o}
              for o in _list(meta.get("ownerReferences")) if isinstance(o, dict)]
    if owners:
        m["ownerReferences"] = shared(owners)
    s: dict[str, Any] = {k: intern_short(spec[k]) for k in
                         ("nodeName", "serviceAccountName", "serviceAccount", "hostNetwork")
                         if k in spec}
    for k in ("containers", "initContainers"):
        if spec.get(k):
            s[k] = shared(_slim_containers(spec[k]))
    st: dict[str, Any] = {k: intern_short(status[k]) for k in ("phase", "podIP") if k in status}
    ips = [{"ip": intern_short(_map(x).get("ip"))} for x in _list(status.get("podIPs"))]
    if ips and not (len(ips) == 1 and ips[0]["ip"] == st.get("podIP")):
        st["podIPs"] = ips  # a single-stack pod's [{"ip": podIP}] is podIP: readers fall back
    ready = [{"type": "Ready", "status": intern_short(c.get("status"))}
             for c in _list(status.get("conditions"))
             if isinstance(c, dict) and c.get("type") == "Ready"]
    if ready:
        st["conditions"] = shared(ready)
    return {"apiVersion": obj.get("apiVersion", "v1"), "kind": "Pod", "metadata": m,
            "spec": s, "status": st}


def slim_endpoint_slice(obj: EndpointSliceObject) -> dict[str, Any]:
    """An EndpointSlice as the mesh reads it (``MeshModel._apply_slice``, ``is_projected``):
    name, namespace and labels; address type; ports; per endpoint its addresses, conditions,
    node, zone, hints and Pod reference, and the resourceVersion (all the store keeps of it
    once the model follows: ``ObjectStore.thin``). managedFields, annotations and owner
    references go on receipt (the projector keeps its own copies of the slices it writes),
    and repeated strings and conditions are shared, so a 10k-Service cluster's slices cost
    what their endpoints are, not what their JSON was."""
    meta = _map(obj.get("metadata"))
    m: dict[str, Any] = {k: intern_short(meta[k]) for k in ("name", "namespace") if k in meta}
    if meta.get("resourceVersion"):
        m["resourceVersion"] = str(meta["resourceVersion"])
    if meta.get("labels"):
        m["labels"] = shared_map(meta["labels"])
    if meta.get("deletionTimestamp"):
        m["deletionTimestamp"] = meta["deletionTimestamp"]
    out: dict[str, Any] = {"apiVersion": obj.get("apiVersion", "discovery.k8s.io/v1"),
                           "kind": "EndpointSlice", "metadata": m}
    if "addressType" in obj:
        out["addressType"] = intern_short(obj["addressType"])
    ports = [shared({k: intern_short(p[k]) for k in ("name", "port", "protocol", "appProtocol")
                     if k in p}) for p in _list(obj.get("ports")) if isinstance(p, dict)]
    out["ports"] = shared(ports) if ports else []
    endpoints = []
    for ep in _list(obj.get("endpoints")):
        if not isinstance(ep, dict):
            continue
        e: dict[str, Any] = {"addresses": [intern_short(a) for a in _list(ep.get("addresses"))]}
        for k in ("conditions", "hints"):
            if isinstance(ep.get(k), dict):
                e[k] = shared(ep[k])
        for k in ("nodeName", "zone"):
            if k in ep:
                e[k] = intern_short(ep[k])
        ref = _map(ep.get("targetRef"))
        if ref:
            e["targetRef"] = {k: intern_short(ref[k]) for k in ("kind", "namespace", "name")
                              if k in ref}
        endpoints.append(pack(e, ("targetRef",)))  # one object an endpoint, not three
    out["endpoints"] = endpoints
    return out


#: What the API adds to a Service that no reader here looks at (status: load balancer
#: ingress; managedFields: often the biggest part of the object).
_SERVICE_META_DROPPED = frozenset({"managedFields", "creationTimestamp", "generation",
                                   "selfLink"})


def _interned(value: Any) -> Any:
    """Short strings interned all the way down (lists and maps copied, nothing else)."""
    if isinstance(value, dict):
        return {intern_short(k): _interned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_interned(v) for v in value]
    return intern_short(value)


def slim_service(obj: ServiceObject) -> dict[str, Any]:
    """A Service as the agent keeps it: its spec whole (the model, the slice projection and
    route ownership read most of it), its metadata without managedFields and timestamps, no
    status; short strings interned and the port list shared by value (most Services of a
    cluster say the same ``{"name": "http", "port": 80, ...}``): 10k Services held ~18 MB
    as decoded."""
    meta = _map(obj.get("metadata"))
    m: dict[str, Any] = {intern_short(k): (_slim_map(v) if k in ("labels", "annotations")
                                          else _interned(v))
                         for k, v in meta.items() if k not in _SERVICE_META_DROPPED}
    spec: dict[str, Any] = {}
    for k, v in _map(obj.get("spec")).items():
        if k == "ports" and isinstance(v, list):
            spec["ports"] = shared([shared(_interned(p)) for p in v])
        elif k == "ipFamilies" and isinstance(v, list):
            spec[k] = shared(_interned(v))
        else:
            spec[intern_short(k)] = _interned(v)
    if spec.get("selector") and spec["selector"] == m.get("labels"):
        spec["selector"] = m["labels"]  # most Services select what they are labelled: one map
    return {"apiVersion": obj.get("apiVersion", "v1"), "kind": "Service", "metadata": m,
            "spec": spec}


def slim_node(obj: NodeObject) -> dict[str, Any]:
    """A Node as the mesh reads it: its name and its zone label (trafficDistribution).
    Everything else (status, images, heartbeats) is dropped on receipt, so a node's churn
    is no change at all here."""
    meta = _map(obj.get("metadata"))
    zone = _map(meta.get("labels")).get("topology.kubernetes.io/zone")
    m: dict[str, Any] = {"name": intern_short(meta.get("name") or "")}
    if zone:
        m["labels"] = {"topology.kubernetes.io/zone": intern_short(zone)}
    return {"apiVersion": "v1", "kind": "Node", "metadata": m}
