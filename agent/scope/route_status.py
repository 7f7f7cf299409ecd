"""The Gateway API status of one (route, Service parent): its Accepted, PartiallyInvalid and
ResolvedRefs conditions, as ``agent.gamma`` writes them to ``status.parents[]``.

Split out of ``agent.scope.route_tables``: the status comes from the same evaluation the
tables are built from (so status and proxy agree), but reading it is its own concern. Pure.
"""

from __future__ import annotations

from typing import Any

from agent.scope.route_parsing import _int, _lookup
from agent.scope.route_rules import _RouteEval
from agent.scope.route_table_types import (
    ACCEPTED,
    PARTIALLY_INVALID,
    R_ACCEPTED,
    R_CONFLICTED,
    R_NO_MATCHING_PARENT,
    R_RESOLVED,
    RESOLVED_REFS,
    Condition,
    ParentStatus,
    ServiceLookup,
)
from agent.scope.routes import ParentRef


def _status(ev: _RouteEval, parent: ParentRef, ports: list[int], services: ServiceLookup,
            lost: set[int] | None) -> ParentStatus:
    route = ev.route
    conds: list[Condition] = []
    svc = _lookup(services, parent.key)
    if svc is None:
        conds.append(Condition(ACCEPTED, "False", R_NO_MATCHING_PARENT,
                               f"Service {parent.key} not found"))
    elif not ports:
        conds.append(Condition(ACCEPTED, "False", R_NO_MATCHING_PARENT, _no_port_message(parent, svc)))
    elif len(ev.rule_errors) == ev.rule_count:
        err = ev.rule_errors[0]
        conds.append(Condition(ACCEPTED, "False", err.reason, "; ".join(e.message for e in ev.rule_errors)))
    elif lost and lost >= set(ports):
        conds.append(Condition(ACCEPTED, "False", R_CONFLICTED,
                               f"a GRPCRoute is attached to {parent.key} port(s) "
                               f"{','.join(map(str, sorted(lost)))}; GRPCRoute takes precedence"))
    else:
        msg = "Route is accepted"
        if lost:
            msg += f"; ignored on port(s) {','.join(map(str, sorted(lost)))} (GRPCRoute wins)"
        conds.append(Condition(ACCEPTED, "True", R_ACCEPTED, msg))
        if ev.rule_errors:
            conds.append(Condition(PARTIALLY_INVALID, "True", ev.rule_errors[0].reason,
                                   "; ".join(e.message for e in ev.rule_errors)))
    if ev.ref_problems:
        first = ev.ref_problems[0]
        conds.append(Condition(RESOLVED_REFS, "False", first.reason,
                               "; ".join(dict.fromkeys(p.message for p in ev.ref_problems))))
    else:
        conds.append(Condition(RESOLVED_REFS, "True", R_RESOLVED, "All references resolved"))
    gen = _int((route.obj.get("metadata") or {}).get("generation"))
    return ParentStatus(route.kind, route.namespace, route.name, parent, gen, tuple(conds))


def _no_port_message(parent: ParentRef, svc: Any) -> str:
    if getattr(svc, "headless", False) or getattr(svc, "type", "") == "ExternalName":
        return f"Service {parent.key} is headless/ExternalName and cannot be a mesh parent"
    want = []
    if parent.port is not None:
        want.append(f"port {parent.port}")
    if parent.section_name is not None:
        want.append(f"port name {parent.section_name!r}")
    return f"Service {parent.key} has no TCP {' and '.join(want) or 'port'}"
