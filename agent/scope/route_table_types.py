"""The data of the GAMMA route tables: matches, filters, backends, entries, tables, statuses.

Split out of ``agent.scope.route_tables`` so the value types the builder produces (and
``agent.envoy.http_routes`` renders) stand apart from the parsing and the building; the
Gateway API condition types and reasons the statuses carry are here too. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from agent.scope.routes import ParentRef
from agent.scope.services import ServicePort, SessionPersistence

HTTP_ROUTE = "HTTPRoute"
GRPC_ROUTE = "GRPCRoute"
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE",
                          "PATCH"})
REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})

# Condition types and reasons (gateway.networking.k8s.io/v1 RouteConditionType/Reason).
ACCEPTED = "Accepted"
RESOLVED_REFS = "ResolvedRefs"
PARTIALLY_INVALID = "PartiallyInvalid"
R_ACCEPTED = "Accepted"
R_RESOLVED = "ResolvedRefs"
R_NO_MATCHING_PARENT = "NoMatchingParent"
R_UNSUPPORTED = "UnsupportedValue"
R_INCOMPATIBLE = "IncompatibleFilters"
R_CONFLICTED = "Conflicted"  # GEP-1294 "Route types": the losing route type on a Service port
R_BACKEND_NOT_FOUND = "BackendNotFound"
R_INVALID_KIND = "InvalidKind"


class _ServiceLike(Protocol):
    """What the builder needs of a Service (``Service`` and ``ServiceView`` both fit)."""

    @property
    def ports(self) -> tuple[ServicePort, ...]: ...


ServiceLookup = Mapping[str, Any] | Callable[[str], Any]


# ---- table data ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PathMatch:
    kind: str  # "Exact" | "PathPrefix" | "RegularExpression"
    value: str


@dataclass(frozen=True)
class ValueMatch:
    """A header or query-param match; header names are stored lowercase (case-insensitive)."""

    name: str
    value: str
    regex: bool = False


@dataclass(frozen=True)
class GrpcMethodMatch:
    """``service``/``method`` empty = any; ``regex`` = both are RE2 patterns."""

    service: str = ""
    method: str = ""
    regex: bool = False


@dataclass(frozen=True)
class Match:
    """One HTTPRouteMatch/GRPCRouteMatch: everything in it is ANDed."""

    path: PathMatch | None = None  # HTTPRoute; None only for gRPC entries
    headers: tuple[ValueMatch, ...] = ()
    query: tuple[ValueMatch, ...] = ()
    method: str | None = None
    grpc: GrpcMethodMatch | None = None


@dataclass(frozen=True)
class HeaderModifier:
    set: tuple[tuple[str, str], ...] = ()
    add: tuple[tuple[str, str], ...] = ()
    remove: tuple[str, ...] = ()


@dataclass(frozen=True)
class PathModifier:
    kind: str  # "ReplaceFullPath" | "ReplacePrefixMatch"
    value: str


@dataclass(frozen=True)
class Redirect:
    scheme: str | None = None
    hostname: str | None = None
    path: PathModifier | None = None
    port: int | None = None
    status: int = 302


@dataclass(frozen=True)
class Rewrite:
    hostname: str | None = None
    path: PathModifier | None = None


@dataclass(frozen=True)
class Backend:
    """A resolved (or not) backendRef. ``valid`` False → its weighted share answers an error."""

    namespace: str
    name: str
    port: int | None
    weight: int = 1
    valid: bool = True
    reason: str = R_RESOLVED
    message: str = ""
    request_headers: HeaderModifier | None = None
    response_headers: HeaderModifier | None = None
    host_rewrite: str | None = None
    app_protocol: str | None = None
    # the backend Service's session persistence (its XBackendTrafficPolicy/BackendLBPolicy)
    session: SessionPersistence | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Mirror:
    backend: Backend
    numerator: int = 100
    denominator: int = 100


@dataclass(frozen=True)
class Retry:
    codes: tuple[int, ...] = ()
    attempts: int | None = None
    backoff_s: float | None = None


@dataclass(frozen=True)
class Rule:
    """One routing entry: a single match of one rule, with that rule's actions.

    ``direct_status`` set: the entry answers that status itself (no usable backend, or an
    unresolvable ExtensionRef filter). ``backends`` keeps weight-0 and invalid refs so the
    renderer can give an invalid share its error; weight 0 is never routed to.
    """

    kind: str
    route_key: str
    rule_index: int
    match_index: int
    match: Match
    name: str | None = None
    backends: tuple[Backend, ...] = ()
    request_headers: HeaderModifier | None = None
    response_headers: HeaderModifier | None = None
    redirect: Redirect | None = None
    rewrite: Rewrite | None = None
    mirrors: tuple[Mirror, ...] = ()
    request_timeout_s: float | None = None
    backend_timeout_s: float | None = None
    retry: Retry | None = None
    direct_status: int | None = None
    # the rule's own sessionPersistence (its cookie scoped to the match's path)
    session: SessionPersistence | None = None

    @property
    def effective_session(self) -> SessionPersistence | None:
        """GEP-1619: the rule's own session persistence wins over its backend's policy;
        without one, the first routable backend whose Service has a policy gives it."""
        if self.session is not None:
            return self.session
        return next((b.session for b in self.backends
                     if b.valid and b.weight > 0 and b.session is not None), None)

    @property
    def invalid_backend_status(self) -> int:
        """500 for HTTPRoute; gRPC wants UNAVAILABLE, which Envoy maps from 503."""
        return 503 if self.kind == GRPC_ROUTE else 500


@dataclass(frozen=True)
class RouteTable:
    """Ordered entries for one (target, port, scope); no entry matches → ``no_match_status``."""

    target: str
    port: int
    scope: str | None  # None: producer table; else the caller namespace of consumer routes
    kind: str
    rules: tuple[Rule, ...]
    routes: tuple[str, ...]
    no_match_status: int = 404

    @property
    def name(self) -> str:
        """Stable name (route config / stat prefix); '|' never appears in Kubernetes names."""
        return f"gamma|{self.target.replace('/', '|')}|{self.port}|{self.scope or '*'}"


@dataclass(frozen=True)
class Condition:
    type: str
    status: str  # "True" | "False"
    reason: str
    message: str = ""


@dataclass(frozen=True)
class ParentStatus:
    """What the status writer puts in ``status.parents[]`` for one (route, Service parent)."""

    route_kind: str
    route_namespace: str
    route_name: str
    parent: ParentRef
    generation: int | None
    conditions: tuple[Condition, ...]

    @property
    def route_key(self) -> str:
        return f"{self.route_kind}:{self.route_namespace}/{self.route_name}"

    def condition(self, ctype: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == ctype), None)


@dataclass(frozen=True)
class Conflict:
    """GRPCRoute and HTTPRoute on one Service port: the gRPC routes win, ``loser`` is ignored."""

    target: str
    port: int
    scope: str | None
    winners: tuple[str, ...]
    loser: str


@dataclass
class GammaResult:
    tables: dict[tuple[str, int, str | None], RouteTable] = field(default_factory=dict)
    statuses: list[ParentStatus] = field(default_factory=list)
    conflicts: list[Conflict] = field(default_factory=list)

    def table_for(self, target: str, port: int, caller_namespace: str) -> RouteTable | None:
        """The table a pod in ``caller_namespace`` uses; None → the plain identity route."""
        return (self.tables.get((target, port, caller_namespace))
                or self.tables.get((target, port, None)))

    def consumer_namespaces(self, target: str, port: int) -> set[str]:
        """Namespaces whose pods see a different table for this port than everyone else."""
        return {s for (t, p, s) in self.tables if t == target and p == port and s is not None}
