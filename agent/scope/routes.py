"""The route-target catalog (proposal 023): Services that are the parentRef of a GAMMA route.

A route target is a routing handle keyed ``<ns>/<name>``: clients dial its real ClusterIP:port,
its attached HTTPRoutes/GRPCRoutes decide where traffic goes, and its backendRefs name the
Services whose pods (and SA identities) actually serve. It needs no pods of its own and has
no identity. Only parentRefs with ``group: ""`` and ``kind: Service`` count (Gateway API's
defaults are a Gateway parent); full route objects are kept for the route-table builder.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from agent.source.objects import RouteObject

ROUTE_KINDS = ("HTTPRoute", "GRPCRoute")


@dataclass(frozen=True)
class ParentRef:
    """A Service parent: ``port``/``section_name`` narrow the route to one Service port."""

    namespace: str
    name: str
    port: int | None = None
    section_name: str | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class BackendRef:
    namespace: str
    name: str
    port: int | None = None
    weight: int = 1
    mirror: bool = False  # from a RequestMirror filter: a dependency, not a weighted backend

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Route:
    kind: str
    namespace: str
    name: str
    parents: tuple[ParentRef, ...] = ()
    backends: tuple[BackendRef, ...] = ()
    created: str = ""
    obj: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    generation: str = ""

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.namespace}/{self.name}"

    @property
    def backend_keys(self) -> frozenset[str]:
        return frozenset(b.key for b in self.backends)

    @property
    def parent_keys(self) -> frozenset[str]:
        return frozenset(p.key for p in self.parents)


def _is_service(ref: Mapping[str, Any], default_group: str, default_kind: str) -> bool:
    group = ref.get("group", default_group)
    kind = ref.get("kind", default_kind)
    return (group or "") == "" and kind == "Service"


def _int(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _backend(ref: Mapping[str, Any], ns: str, mirror: bool = False) -> BackendRef | None:
    if not isinstance(ref, dict) or not ref.get("name") or not _is_service(ref, "", "Service"):
        return None
    weight = _int(ref.get("weight"))
    return BackendRef(
        namespace=str(ref.get("namespace") or ns),
        name=str(ref["name"]),
        port=_int(ref.get("port")),
        weight=1 if weight is None else weight,
        mirror=mirror,
    )


def route_from_object(kind: str, obj: RouteObject) -> Route:
    """HTTPRoute/GRPCRoute JSON → Route with its Service parents and every Service backend."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    ns = str(meta.get("namespace") or "default")
    parents: list[ParentRef] = []
    for ref in spec.get("parentRefs") or []:
        if not isinstance(ref, dict) or not ref.get("name"):
            continue
        if not _is_service(ref, "gateway.networking.k8s.io", "Gateway"):
            continue
        p = ParentRef(
            namespace=str(ref.get("namespace") or ns),
            name=str(ref["name"]),
            port=_int(ref.get("port")),
            section_name=str(ref["sectionName"]) if ref.get("sectionName") else None,
        )
        if p not in parents:
            parents.append(p)
    backends: list[BackendRef] = []
    for rule in spec.get("rules") or []:
        if not isinstance(rule, dict):
            continue
        filters = list(rule.get("filters") or [])
        for bref in rule.get("backendRefs") or []:
            b = _backend(bref, ns)
            if b is not None:
                backends.append(b)
            filters += list((bref or {}).get("filters") or [])
        for f in filters:
            mirror = (f or {}).get("requestMirror") if isinstance(f, dict) else None
            if isinstance(mirror, dict):
                b = _backend(mirror.get("backendRef") or {}, ns, mirror=True)
                if b is not None:
                    backends.append(b)
    return Route(
        kind=kind,
        namespace=ns,
        name=str(meta.get("name") or ""),
        parents=tuple(parents),
        backends=tuple(backends),
        created=str(meta.get("creationTimestamp") or ""),
        obj=cast(dict[str, Any], obj),
        generation=str(meta.get("resourceVersion") or meta.get("generation") or ""),
    )


class RouteCatalog:
    """Routes by key and by the Service they attach to. Not thread-safe (model serialises)."""

    def __init__(self) -> None:
        self._routes: dict[str, Route] = {}
        self._by_target: dict[str, set[str]] = {}

    def upsert(self, route: Route) -> set[str]:
        """Insert/replace; returns the target keys whose route set changed."""
        old = self._routes.get(route.key)
        if old is not None and old == route and old.obj == route.obj:
            return set()
        if old is not None:
            self._detach(old)
        self._routes[route.key] = route
        for t in route.parent_keys:
            self._by_target.setdefault(t, set()).add(route.key)
        return set(route.parent_keys) | (set(old.parent_keys) if old else set())

    def remove(self, kind: str, namespace: str, name: str) -> set[str]:
        old = self._routes.pop(f"{kind}:{namespace}/{name}", None)
        if old is None:
            return set()
        self._detach(old)
        return set(old.parent_keys)

    def _detach(self, route: Route) -> None:
        for t in route.parent_keys:
            keys = self._by_target.get(t)
            if keys is not None:
                keys.discard(route.key)
                if not keys:
                    del self._by_target[t]

    def is_target(self, svc_key: str) -> bool:
        return svc_key in self._by_target

    def targets(self) -> list[str]:
        return sorted(self._by_target)

    def routes_for(self, svc_key: str) -> list[Route]:
        """Oldest first, then by namespace/name: Gateway API's conflict-resolution order."""
        routes = [self._routes[k] for k in self._by_target.get(svc_key, ())]
        return sorted(routes, key=lambda r: (r.created, r.namespace, r.name, r.kind))

    def backends_of(self, svc_key: str) -> set[str]:
        out: set[str] = set()
        for r in self.routes_for(svc_key):
            out |= r.backend_keys
        return out

    def all(self) -> list[Route]:
        return [self._routes[k] for k in sorted(self._routes)]
