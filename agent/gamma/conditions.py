"""Route status records as the status writer takes them, and the step that narrows the
route-table builder's records to the parents aether owns.

The conditions themselves are decided in one place, the route-table builder
(``agent.scope.route_tables.build_tables``), from the same tables the proxy is given, so status
says what the data plane does. ``adopt_records`` only converts its records and drops
parents another mesh controller owns (docs/ownership.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from agent.gamma.ownership import owns
from agent.scope.routes import ParentRef

GATEWAY_GROUP = "gateway.networking.k8s.io"


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
