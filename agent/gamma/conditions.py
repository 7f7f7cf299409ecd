"""Per-(route, Service parent) ``Accepted`` / ``ResolvedRefs`` conditions for the simple cases.

Status must work before (and independently of) the route-table builder, so this module
judges what needs no traffic knowledge: does the parent exist and belong to us, do its
port/sectionName exist, are the filter and match values ones we implement, do the
backendRefs exist, have a supported kind and, across namespaces, a ReferenceGrant. The
builder may replace these conditions (e.g. an HTTPRoute losing to a GRPCRoute) by emitting
its own ``ParentStatus`` records: this small record is the whole contract.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from agent.gamma.ownership import owns
from agent.scope.routes import ROUTE_KINDS, ParentRef, route_from_object

GATEWAY_GROUP = "gateway.networking.k8s.io"

ACCEPTED = "Accepted"
RESOLVED_REFS = "ResolvedRefs"
# Reasons from the Gateway API route condition vocabulary.
REASON_ACCEPTED = "Accepted"
REASON_RESOLVED = "ResolvedRefs"
NO_MATCHING_PARENT = "NoMatchingParent"
UNSUPPORTED_VALUE = "UnsupportedValue"
BACKEND_NOT_FOUND = "BackendNotFound"
INVALID_KIND = "InvalidKind"
REF_NOT_PERMITTED = "RefNotPermitted"

#: Filter types we program, per route kind (the route-table builder's contract with us).
SUPPORTED_FILTERS: dict[str, frozenset[str]] = {
    "HTTPRoute": frozenset({"RequestHeaderModifier", "ResponseHeaderModifier", "RequestRedirect",
                            "URLRewrite", "RequestMirror"}),
    "GRPCRoute": frozenset({"RequestHeaderModifier", "ResponseHeaderModifier"}),
}
_MATCH_TYPES = frozenset({"Exact", "PathPrefix", "RegularExpression"})
_VALUE_MATCH_TYPES = frozenset({"Exact", "RegularExpression"})
_REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})

JSON = dict[str, Any]


@dataclass(frozen=True)
class Condition:
    """One metav1.Condition without the bookkeeping fields the writer adds."""

    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str = ""


@dataclass
class ParentStatus:
    """What one controller says about one route for one Service parent."""

    route_kind: str
    ns: str
    name: str
    parent: ParentRef
    generation: int
    conditions: list[Condition] = field(default_factory=list)

    @property
    def route_key(self) -> tuple[str, str, str]:
        return (self.route_kind, self.ns, self.name)


class Objects(Protocol):
    """Read side of ``agent.source.events.ObjectStore`` (namespace "" for cluster scope)."""

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None: ...

    def of_kind(self, kind: str) -> list[dict[str, Any]]: ...


def _int(v: Any) -> int | None:
    try:
        return int(v) if v is not None else None
    except (TypeError, ValueError):
        return None


# ---- Accepted ------------------------------------------------------------------------------

def parent_condition(parent: ParentRef, service_obj: Mapping[str, Any] | None) -> Condition:
    """``Accepted`` as far as the parent is concerned: it exists and the port/section match."""
    if service_obj is None:
        return Condition(ACCEPTED, "False", NO_MATCHING_PARENT, f"Service {parent.key} not found")
    spec = service_obj.get("spec") or {}
    if spec.get("type") == "ExternalName":
        return Condition(ACCEPTED, "False", UNSUPPORTED_VALUE,
                         f"Service {parent.key} is ExternalName: mesh routes need a ClusterIP")
    if spec.get("clusterIP") == "None":
        return Condition(ACCEPTED, "False", UNSUPPORTED_VALUE,
                         f"Service {parent.key} is headless: mesh routes need a ClusterIP")
    ports = [p for p in spec.get("ports") or [] if isinstance(p, dict)]
    if parent.port is not None and not any(_int(p.get("port")) == parent.port for p in ports):
        return Condition(ACCEPTED, "False", NO_MATCHING_PARENT,
                         f"Service {parent.key} has no port {parent.port}")
    if parent.section_name is not None:
        named = [p for p in ports if p.get("name") == parent.section_name]
        if not named:
            return Condition(ACCEPTED, "False", NO_MATCHING_PARENT,
                             f"Service {parent.key} has no port named {parent.section_name!r}")
        if parent.port is not None and _int(named[0].get("port")) != parent.port:
            return Condition(ACCEPTED, "False", NO_MATCHING_PARENT,
                             f"Service {parent.key} port {parent.section_name!r} is not {parent.port}")
    where = f" port {parent.port}" if parent.port is not None else ""
    if parent.section_name is not None:
        where = f" port {parent.section_name!r}"
    return Condition(ACCEPTED, "True", REASON_ACCEPTED, f"attached to Service {parent.key}{where}")


def _rules(route_obj: Mapping[str, Any]) -> list[JSON]:
    return [r for r in (route_obj.get("spec") or {}).get("rules") or [] if isinstance(r, dict)]


def _filters(rule: JSON) -> Iterator[JSON]:
    for f in rule.get("filters") or []:
        if isinstance(f, dict):
            yield f
    for ref in rule.get("backendRefs") or []:
        for f in (ref or {}).get("filters") or [] if isinstance(ref, dict) else []:
            if isinstance(f, dict):
                yield f


def unsupported_value(kind: str, route_obj: Mapping[str, Any]) -> str | None:
    """The first enum value we do not implement (the spec: Accepted=False UnsupportedValue)."""
    supported = SUPPORTED_FILTERS.get(kind, frozenset())
    for rule in _rules(route_obj):
        for f in _filters(rule):
            if f.get("type") not in supported:
                return f"{kind} filter type {f.get('type')!r} is not supported"
            redirect = f.get("requestRedirect")
            if isinstance(redirect, dict) and redirect.get("statusCode") is not None \
                    and _int(redirect.get("statusCode")) not in _REDIRECT_CODES:
                return f"redirect statusCode {redirect.get('statusCode')!r} is not supported"
        for m in rule.get("matches") or []:
            if not isinstance(m, dict):
                continue
            path = m.get("path") if kind == "HTTPRoute" else m.get("method")
            if isinstance(path, dict) and path.get("type", "Exact" if kind == "GRPCRoute"
                                                   else "PathPrefix") not in _MATCH_TYPES:
                return f"{kind} match type {path.get('type')!r} is not supported"
            for part in ("headers", "queryParams"):
                for h in m.get(part) or []:
                    if isinstance(h, dict) and h.get("type", "Exact") not in _VALUE_MATCH_TYPES:
                        return f"{part} match type {h.get('type')!r} is not supported"
    return None


# ---- ResolvedRefs --------------------------------------------------------------------------

def backend_refs(route_obj: Mapping[str, Any]) -> Iterator[JSON]:
    """Every backendRef of the route: weighted ones and RequestMirror targets."""
    for rule in _rules(route_obj):
        for ref in rule.get("backendRefs") or []:
            if isinstance(ref, dict):
                yield ref
        for f in _filters(rule):
            mirror = f.get("requestMirror")
            if isinstance(mirror, dict) and isinstance(mirror.get("backendRef"), dict):
                yield mirror["backendRef"]


def grant_permits(grants: Iterable[Mapping[str, Any]], route_kind: str, route_ns: str,
                  target_ns: str, target_name: str) -> bool:
    """A ReferenceGrant in ``target_ns`` lets ``route_kind`` routes of ``route_ns`` reach it."""
    for g in grants:
        if str((g.get("metadata") or {}).get("namespace") or "default") != target_ns:
            continue
        spec = g.get("spec") or {}
        froms = [f for f in spec.get("from") or [] if isinstance(f, dict)]
        tos = [t for t in spec.get("to") or [] if isinstance(t, dict)]
        if not any(f.get("group") == GATEWAY_GROUP and f.get("kind") == route_kind
                   and f.get("namespace") == route_ns for f in froms):
            continue
        if any((t.get("group") or "") == "" and t.get("kind") == "Service"
               and t.get("name") in (None, "", target_name) for t in tos):
            return True
    return False


def backend_condition(kind: str, route_obj: Mapping[str, Any], objects: Objects) -> Condition:
    """``ResolvedRefs``: the worst problem wins (InvalidKind, RefNotPermitted, BackendNotFound)."""
    meta = route_obj.get("metadata") or {}
    ns = str(meta.get("namespace") or "default")
    grants = objects.of_kind("ReferenceGrant")
    found: dict[str, list[str]] = {}
    for ref in backend_refs(route_obj):
        group, rkind = ref.get("group") or "", ref.get("kind") or "Service"
        name = str(ref.get("name") or "")
        bns = str(ref.get("namespace") or ns)
        if group != "" or rkind != "Service":
            found.setdefault(INVALID_KIND, []).append(f"{group or 'core'}/{rkind} {name}")
        elif bns != ns and not grant_permits(grants, kind, ns, bns, name):
            found.setdefault(REF_NOT_PERMITTED, []).append(
                f"Service {bns}/{name} (no ReferenceGrant in {bns} allows {kind}s from {ns})")
        else:
            svc = objects.get("Service", bns, name)
            port = _int(ref.get("port"))
            if svc is None:
                found.setdefault(BACKEND_NOT_FOUND, []).append(f"Service {bns}/{name}")
            elif port is not None and not any(
                    isinstance(p, dict) and _int(p.get("port")) == port
                    for p in (svc.get("spec") or {}).get("ports") or []):
                found.setdefault(BACKEND_NOT_FOUND, []).append(f"Service {bns}/{name} port {port}")
    for reason in (INVALID_KIND, REF_NOT_PERMITTED, BACKEND_NOT_FOUND):
        if reason in found:
            msg = "; ".join(f"{r}: {', '.join(v)}" for r, v in found.items())
            return Condition(RESOLVED_REFS, "False", reason, msg)
    return Condition(RESOLVED_REFS, "True", REASON_RESOLVED, "all backendRefs resolved")


# ---- routes → ParentStatus -----------------------------------------------------------------

def route_statuses(kind: str, route_obj: Mapping[str, Any], objects: Objects,
                   controller_name: str) -> list[ParentStatus]:
    """Our status for each Service parent of one route that we own (others: nothing)."""
    route = route_from_object(kind, dict(route_obj))
    generation = _int((route_obj.get("metadata") or {}).get("generation")) or 0
    out: list[ParentStatus] = []
    resolved: Condition | None = None
    bad_value = unsupported_value(kind, route_obj)
    for parent in route.parents:
        svc = objects.get("Service", parent.namespace, parent.name)
        ns_obj = objects.get("Namespace", "", parent.namespace)
        mine, _why = owns(route_obj, svc, ns_obj, controller_name)
        if not mine:
            continue
        if resolved is None:
            resolved = backend_condition(kind, route_obj, objects)
        accepted = parent_condition(parent, svc)
        if accepted.status == "True" and bad_value is not None:
            accepted = Condition(ACCEPTED, "False", UNSUPPORTED_VALUE, bad_value)
        out.append(ParentStatus(kind, route.namespace, route.name, parent, generation,
                                [accepted, resolved]))
    return out


def statuses_from_store(objects: Objects, controller_name: str) -> list[ParentStatus]:
    """Every route in the store → our ParentStatus records (the StatusLoop compute callable)."""
    out: list[ParentStatus] = []
    for kind in ROUTE_KINDS:
        for obj in objects.of_kind(kind):
            out.extend(route_statuses(kind, obj, objects, controller_name))
    return out


def adopt_records(records: Iterable[Any], objects: Objects, controller_name: str) -> list[ParentStatus]:
    """Another producer's per-parent records (duck-typed: ``route_kind``, ``ns``/``route_namespace``,
    ``name``/``route_name``, ``parent``, ``generation``, ``conditions`` of type/status/reason/
    message) → our ParentStatus, keeping only parents we own. The route-table builder can
    then decide conditions without knowing the ownership rules."""
    out: list[ParentStatus] = []
    for r in records:
        kind = str(r.route_kind)
        ns = str(getattr(r, "ns", None) or getattr(r, "route_namespace", ""))
        name = str(getattr(r, "name", None) or getattr(r, "route_name", ""))
        parent: ParentRef = r.parent
        route_obj = objects.get(kind, ns, name)
        svc = objects.get("Service", parent.namespace, parent.name)
        if not owns(route_obj, svc, objects.get("Namespace", "", parent.namespace), controller_name)[0]:
            continue
        conds = [Condition(str(c.type), str(c.status), str(c.reason), str(c.message or ""))
                 for c in r.conditions]
        out.append(ParentStatus(kind, ns, name, parent, int(r.generation or 0), conds))
    return out
