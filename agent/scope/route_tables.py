"""GAMMA route tables: HTTPRoute/GRPCRoute objects attached to Services → ordered routing entries.

Pure (no protos, no I/O), so every Gateway API rule is unit-testable; ``agent.envoy.http_routes``
renders a ``RouteTable`` into Envoy protos. A table exists per (target Service, Service port,
scope), where scope is ``None`` for the producer table (routes in the Service's namespace,
applied to every caller) or a caller namespace that has consumer routes of its own (GEP-1294:
"requests from a namespace with consumer routes will utilize the set of routes in the consumer
namespace" — the producer routes are not merged in). Each (rule, match) is one ``Rule`` entry:
precedence is per match, and that is the order Envoy evaluates routes in.

Alongside the tables come the inputs of the status writer: per (route, parentRef) ``Accepted``
/ ``ResolvedRefs`` (and ``PartiallyInvalid``) conditions, plus the HTTP-vs-gRPC ``Conflict`` list.

The pieces live next to this module: the table data and condition reasons in
``route_table_types``, the parsing of matches, filters and backendRefs in ``route_parsing``,
the rules' evaluation into entries in ``route_rules``, the per-parent status in
``route_status``; here is how the tables are built from them (attachment, the HTTP-vs-gRPC
conflict, precedence). Every public name stays importable from here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from agent.scope.route_parsing import _lookup, _Resolver, parse_duration
from agent.scope.route_rules import _eval_route, _RouteEval
from agent.scope.route_status import _status
from agent.scope.route_table_types import (
    ACCEPTED,
    GRPC_ROUTE,
    HTTP_METHODS,
    HTTP_ROUTE,
    PARTIALLY_INVALID,
    R_ACCEPTED,
    R_BACKEND_NOT_FOUND,
    R_CONFLICTED,
    R_INCOMPATIBLE,
    R_INVALID_KIND,
    R_NO_MATCHING_PARENT,
    R_RESOLVED,
    R_UNSUPPORTED,
    REDIRECT_CODES,
    RESOLVED_REFS,
    Backend,
    Condition,
    Conflict,
    GammaResult,
    GrpcMethodMatch,
    HeaderModifier,
    Match,
    Mirror,
    ParentStatus,
    PathMatch,
    PathModifier,
    Redirect,
    Retry,
    Rewrite,
    RouteTable,
    Rule,
    ServiceLookup,
    ValueMatch,
)
from agent.scope.routes import ParentRef, Route

# the names this module held before the split, importable from here as before
__all__ = [
    "ACCEPTED",
    "Backend",
    "Condition",
    "Conflict",
    "GRPC_ROUTE",
    "GammaResult",
    "GrpcMethodMatch",
    "HTTP_METHODS",
    "HTTP_ROUTE",
    "HeaderModifier",
    "Match",
    "Mirror",
    "PARTIALLY_INVALID",
    "ParentStatus",
    "PathMatch",
    "PathModifier",
    "REDIRECT_CODES",
    "RESOLVED_REFS",
    "R_ACCEPTED",
    "R_BACKEND_NOT_FOUND",
    "R_CONFLICTED",
    "R_INCOMPATIBLE",
    "R_INVALID_KIND",
    "R_NO_MATCHING_PARENT",
    "R_RESOLVED",
    "R_UNSUPPORTED",
    "Redirect",
    "Retry",
    "Rewrite",
    "RouteTable",
    "Rule",
    "ServiceLookup",
    "ValueMatch",
    "build_tables",
    "parse_duration",
]


def _created_key(route: Route) -> tuple[int, str]:
    return (0, route.created) if route.created else (1, "")  # no timestamp sorts last


def _precedence(entry: Rule, route: Route) -> tuple[Any, ...]:
    """Gateway API match precedence, then oldest route, then namespace/name, then rule order.

    HTTPRoute: Exact path, then RegularExpression (implementation-specific: we put it between,
    longest pattern first), then PathPrefix by length; method; header count; query count.
    GRPCRoute: service length, method length, header count.
    """
    m = entry.match
    if entry.kind == GRPC_ROUTE:
        g = m.grpc or GrpcMethodMatch()
        spec: tuple[Any, ...] = (-len(g.service), -len(g.method), -len(m.headers))
    else:
        p = m.path or PathMatch("PathPrefix", "/")
        rank = {"Exact": 0, "RegularExpression": 1, "PathPrefix": 2}[p.kind]
        spec = (rank, -len(p.value), 0 if m.method else 1, -len(m.headers), -len(m.query))
    return spec + (_created_key(route), f"{route.namespace}/{route.name}", entry.rule_index,
                   entry.match_index)


def _parent_ports(parent: ParentRef, svc: Any) -> list[int]:
    ports = [p for p in getattr(svc, "ports", ()) if (p.protocol or "TCP").upper() == "TCP"]
    if parent.port is not None:
        ports = [p for p in ports if p.port == parent.port]
    if parent.section_name is not None:
        ports = [p for p in ports if p.name == parent.section_name]
    return [p.port for p in ports]


def build_tables(routes: Iterable[Route], services: ServiceLookup) -> GammaResult:
    """Every route attached to a Service parent → tables, statuses and conflicts.

    ``services`` maps ``<ns>/<name>`` to a Service (or ServiceView), as a Mapping or a lookup
    function. backendRefs resolve in any namespace without a ReferenceGrant (GEP-1294).
    """
    resolver = _Resolver(services)
    result = GammaResult()
    # (target, port, scope) → accepted routes' evaluations
    groups: dict[tuple[str, int, str | None], list[_RouteEval]] = {}
    evals: list[tuple[_RouteEval, dict[ParentRef, list[int]]]] = []
    for route in sorted(routes, key=lambda r: r.key):
        if route.kind not in (HTTP_ROUTE, GRPC_ROUTE) or not route.parents:
            continue
        ev = _eval_route(route, resolver)
        bound: dict[ParentRef, list[int]] = {}
        all_invalid = len(ev.rule_errors) == ev.rule_count
        for parent in route.parents:
            svc = _lookup(services, parent.key)
            ok = (svc is not None and getattr(svc, "type", "ClusterIP") != "ExternalName"
                  and not getattr(svc, "headless", False))
            bound[parent] = _parent_ports(parent, svc) if ok else []
            if bound[parent] and not all_invalid:
                scope = None if parent.namespace == route.namespace else route.namespace
                for port in bound[parent]:
                    groups.setdefault((parent.key, port, scope), []).append(ev)
        evals.append((ev, bound))

    lost: dict[tuple[str, ParentRef], set[int]] = {}
    for (target, port, scope), members in sorted(groups.items(), key=lambda kv: str(kv[0])):
        uniq = list({id(e): e for e in members}.values())
        kinds = {e.route.kind for e in uniq}
        kind = GRPC_ROUTE if GRPC_ROUTE in kinds else HTTP_ROUTE
        if len(kinds) > 1:
            winners = tuple(sorted(e.route.key for e in uniq if e.route.kind == GRPC_ROUTE))
            for e in uniq:
                if e.route.kind != GRPC_ROUTE:
                    result.conflicts.append(Conflict(target, port, scope, winners, e.route.key))
                    for p in e.route.parents:
                        if p.key == target:
                            lost.setdefault((e.route.key, p), set()).add(port)
            uniq = [e for e in uniq if e.route.kind == GRPC_ROUTE]
        keyed = [(_precedence(r, e.route), r) for e in uniq for r in e.entries]
        keyed.sort(key=lambda kr: kr[0])
        result.tables[(target, port, scope)] = RouteTable(
            target=target, port=port, scope=scope, kind=kind,
            rules=tuple(r for _, r in keyed),
            routes=tuple(sorted(e.route.key for e in uniq)))

    for ev, bound in evals:
        for parent, ports in bound.items():
            result.statuses.append(_status(ev, parent, ports, services, lost.get((ev.route.key, parent))))
    return result
