"""One managed pod as the mesh sees it: ``PodRecord``, the ``CniRegistration`` a CNI ADD
gives before the API has caught up, and the reading of a Pod object's IPs, Ready condition and
named container ports.

Split out of ``agent.scope.registry`` (which indexes these records by identity, address and
Service): the record's memory layout (a ``_Shape`` shared by the pods of a ReplicaSet, the
interned SPIFFE IDs) is its own concern. Pure: no I/O.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

from agent.common.ids import PodKey, pod_key
from agent.identity.svid import spiffe_id
from agent.scope.services import canonical_ip
from agent.source.model import PodMeta, pod_identity_from_object, shared
from agent.source.objects import PodObject


@dataclass(frozen=True, slots=True, weakref_slot=True)
class _Shape:
    """What a pod has in common with the other pods of its ReplicaSet (one object for all of
    them): everything a PodRecord holds but its key, uid, IPs and node."""

    namespace: str
    service_account: str
    labels: dict[str, str]
    annotations: dict[str, str]
    named_ports: dict[str, int]
    sources: frozenset[str]
    ready: bool
    terminating: bool
    local: bool
    host_network: bool
    finished: bool
    identity: str  # <ns>/<sa>, interned: every endpoint of the pod holds it


#: the shapes some record holds, by their parts (the maps by identity: ``shared`` ones);
#: weak, so a ReplicaSet's shape goes with its last pod, not with the cache's next clear
_SHAPES: weakref.WeakValueDictionary[tuple[Any, ...], _Shape] = weakref.WeakValueDictionary()
_SANS: dict[tuple[str, str], str] = {}  # (trust domain, identity) → SPIFFE ID, interned
_SANS_MAX = 1 << 16


def _shape(namespace: str, service_account: str, labels: dict[str, str],
           annotations: dict[str, str], named_ports: dict[str, int], sources: frozenset[str],
           ready: bool, terminating: bool, local: bool, host_network: bool,
           finished: bool) -> _Shape:
    key = (namespace, service_account, id(labels), id(annotations), id(named_ports), sources,
           ready, terminating, local, host_network, finished)
    got = _SHAPES.get(key)
    if got is None or got.labels is not labels or got.annotations is not annotations \
            or got.named_ports is not named_ports:
        got = _Shape(sys.intern(namespace), sys.intern(service_account), labels, annotations,
                     named_ports, sources, ready, terminating, local, host_network, finished,
                     sys.intern(f"{namespace}/{service_account}"))
        _SHAPES[key] = got
    return got


_EMPTY: dict[str, Any] = {}


def _restore(key: PodKey, uid: str, ips: str | tuple[str, ...], node_name: str,
             shape: _Shape) -> PodRecord:
    rec = PodRecord.__new__(PodRecord)
    for name, value in (("key", key), ("uid", uid), ("_ips", ips), ("node_name", node_name),
                        ("_shape", shape)):
        object.__setattr__(rec, name, value)
    return rec


class PodRecord:
    """One managed pod as the mesh sees it (an endpoint, possibly local).

    Immutable. Holds its key, uid, IPs and node, and a ``_Shape`` shared with the pods of its
    ReplicaSet for the rest: the registry holds one per pod of the cluster, and as a
    15-field dataclass with its own name string it was ~230 bytes a pod (23 MB at 100k)."""

    __slots__ = ("key", "uid", "_ips", "node_name", "_shape")

    key: PodKey
    uid: str
    _ips: str | tuple[str, ...]  # a single-stack pod's one address as is (a 1-tuple: 48 bytes)
    node_name: str
    _shape: _Shape

    def __init__(self, namespace: str, name: str, uid: str = "",
                 service_account: str = "default", ips: tuple[str, ...] = (),
                 node_name: str = "", ready: bool = False, terminating: bool = False,
                 local: bool = False, labels: dict[str, str] | None = None,
                 annotations: dict[str, str] | None = None,
                 named_ports: dict[str, int] | None = None,
                 sources: frozenset[str] = frozenset(), host_network: bool = False,
                 finished: bool = False) -> None:
        init = object.__setattr__
        init(self, "key", pod_key(namespace, name))
        init(self, "uid", uid)
        init(self, "_ips", ips[0] if len(ips) == 1 else tuple(ips))
        init(self, "node_name", node_name)
        init(self, "_shape", _shape(namespace, service_account, labels or _EMPTY,
                                    annotations or _EMPTY, named_ports or _EMPTY, sources,
                                    ready, terminating, local, host_network, finished))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"PodRecord is immutable (set {name})")

    def __reduce__(self) -> tuple[Any, ...]:  # copy and pickle without __setattr__
        return (_restore, (self.key, self.uid, self._ips, self.node_name, self._shape))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PodRecord):
            return NotImplemented
        return (self.key == other.key and self.uid == other.uid and self._ips == other._ips
                and self.node_name == other.node_name
                and (self._shape is other._shape or self._shape == other._shape))

    def __hash__(self) -> int:
        return hash((self.key, self.uid, self._ips, self.node_name))

    def __repr__(self) -> str:
        s = self._shape
        return (f"PodRecord({self.key} uid={self.uid!r} sa={s.service_account} ips={self.ips} "
                f"node={self.node_name!r} ready={s.ready} local={s.local})")

    @property
    def ips(self) -> tuple[str, ...]:
        v = self._ips
        return (v,) if type(v) is str else v  # type: ignore[return-value]

    # ---- the shared part -------------------------------------------------------------------

    namespace = property(lambda self: self._shape.namespace)
    service_account = property(lambda self: self._shape.service_account)
    labels = property(lambda self: self._shape.labels)
    annotations = property(lambda self: self._shape.annotations)
    named_ports = property(lambda self: self._shape.named_ports)
    sources = property(lambda self: self._shape.sources)
    ready = property(lambda self: self._shape.ready)
    terminating = property(lambda self: self._shape.terminating)
    local = property(lambda self: self._shape.local)
    host_network = property(lambda self: self._shape.host_network)
    finished = property(lambda self: self._shape.finished)  # Succeeded/Failed: no endpoint

    @property
    def name(self) -> str:
        return self.key.partition("/")[2]

    @property
    def identity(self) -> str:
        """``<ns>/<sa>``, interned (every endpoint of the pod holds it)."""
        return self._shape.identity

    def san(self, trust_domain: str) -> str:
        got = _SANS.get((trust_domain, self._shape.identity))
        if got is None:
            s = self._shape
            got = sys.intern(spiffe_id(trust_domain, s.namespace, s.service_account))
            if len(_SANS) >= _SANS_MAX:
                _SANS.clear()
            _SANS[(trust_domain, s.identity)] = got
        return got

    def evolve(self, **changes: Any) -> PodRecord:
        """A copy with ``changes`` (the constructor's keywords)."""
        s = self._shape
        kw: dict[str, Any] = {
            "namespace": s.namespace, "name": self.name, "uid": self.uid,
            "service_account": s.service_account, "ips": self.ips, "node_name": self.node_name,
            "ready": s.ready, "terminating": s.terminating, "local": s.local,
            "labels": s.labels, "annotations": s.annotations, "named_ports": s.named_ports,
            "sources": s.sources, "host_network": s.host_network, "finished": s.finished}
        kw.update(changes)
        return PodRecord(**kw)

    @classmethod
    def of_api(cls, obj: PodObject, node_name: str, remote: bool = False) -> PodRecord:
        """The pod as its API object says, read once: the registry keeps this instead of the
        object (which stays with the source's store, a stub there for other nodes' pods: at
        100k remote pods holding it here too was ~50 MB), and a managed pod without a CNI
        ADD here is this very record. ``remote``: from another node's MeshPod record."""
        meta = pod_identity_from_object(obj)
        phase = str((obj.get("status") or {}).get("phase") or "")
        return cls(
            namespace=meta.namespace, name=meta.name, uid=meta.uid,
            service_account=meta.service_account, ips=_pod_ips(obj), node_name=meta.node_name,
            ready=_ready(obj),
            terminating=bool((obj.get("metadata") or {}).get("deletionTimestamp")),
            local=bool(meta.node_name) and meta.node_name == node_name,
            labels=meta.labels, annotations=meta.annotations,
            named_ports=shared(_named_ports(obj)), sources=REMOTE if remote else _API,
            host_network=meta.host_network, finished=phase in ("Succeeded", "Failed"))

    def meta(self) -> PodMeta:
        """As ``managed`` reads a pod."""
        s = self._shape
        return PodMeta(namespace=s.namespace, name=self.name, uid=self.uid,
                       labels=s.labels, annotations=s.annotations,
                       service_account=s.service_account, node_name=self.node_name,
                       host_network=s.host_network)

    def target_port(self, target: int | str) -> int | None:
        """A Service targetPort in this pod: ints as is, names via the containers' ports."""
        if isinstance(target, int):
            return target
        return self._shape.named_ports.get(target)


@dataclass(frozen=True)
class CniRegistration:
    """What the CNI ADD knows about a local pod, before the API has caught up."""

    uid: str
    namespace: str
    name: str
    service_account: str
    ips: tuple[str, ...]
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    ready: bool = False


_API, _CNI, _API_CNI = frozenset({"api"}), frozenset({"cni"}), frozenset({"api", "cni"})
#: the source of a pod known from another node's MeshPod record (not from its own Pod)
REMOTE = frozenset({"meshpod"})


def _pod_ips(obj: PodObject) -> tuple[str, ...]:
    status = obj.get("status") or {}
    raw = [p.get("ip") for p in status.get("podIPs") or [] if isinstance(p, dict)]
    if not raw and status.get("podIP"):
        raw = [status["podIP"]]
    out: list[str] = []
    for ip in raw:
        c = canonical_ip(str(ip)) if ip else None
        if c and c not in out:
            out.append(c)
    return tuple(out)


def _ready(obj: PodObject) -> bool:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if isinstance(cond, dict) and cond.get("type") == "Ready":
            return str(cond.get("status")) == "True"
    return False


def _named_ports(obj: PodObject) -> dict[str, int]:
    out: dict[str, int] = {}
    spec = obj.get("spec") or {}
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        for p in (c or {}).get("ports") or []:
            name, number = (p or {}).get("name"), (p or {}).get("containerPort")
            if name and isinstance(number, int) and name not in out:
                out[str(name)] = number
    return out
