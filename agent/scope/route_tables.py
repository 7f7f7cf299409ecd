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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from agent.scope import durations
from agent.scope.routes import ParentRef, Route
from agent.scope.services import ServicePort, SessionPersistence, parse_session_persistence

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


# ---- parsing -------------------------------------------------------------------------------


class _Invalid(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def parse_duration(value: Any) -> float:
    """GEP-2257 duration → seconds ("0s" = disabled, kept as 0.0)."""
    got = durations.seconds(value)
    if got is None:
        raise _Invalid(R_UNSUPPORTED, f"invalid duration {value!r}")
    return got


def _lookup(services: ServiceLookup, key: str) -> Any:
    return services.get(key) if isinstance(services, Mapping) else services(key)


def _service_port(svc: Any, number: int) -> ServicePort | None:
    return next((p for p in getattr(svc, "ports", ()) if p.port == number), None)


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _header_modifier(raw: Any) -> HeaderModifier:
    """First entry per (case-insensitive) name wins, as the spec asks of equivalent names."""
    if not isinstance(raw, dict):
        raise _Invalid(R_UNSUPPORTED, "header modifier without configuration")
    seen: set[str] = set()

    def pairs(items: Any) -> tuple[tuple[str, str], ...]:
        out = []
        for h in items or []:
            if not isinstance(h, dict) or not h.get("name"):
                raise _Invalid(R_UNSUPPORTED, "header modifier entry without a name")
            name = str(h["name"]).lower()
            if name in seen:
                continue
            seen.add(name)
            out.append((name, str(h.get("value", ""))))
        return tuple(out)

    set_ = pairs(raw.get("set"))
    add = pairs(raw.get("add"))
    remove = tuple(dict.fromkeys(str(n).lower() for n in raw.get("remove") or [] if n))
    return HeaderModifier(set=set_, add=add, remove=remove)


def _path_modifier(raw: Any) -> PathModifier:
    if not isinstance(raw, dict):
        raise _Invalid(R_UNSUPPORTED, "path modifier without configuration")
    kind = raw.get("type")
    if kind == "ReplaceFullPath" and isinstance(raw.get("replaceFullPath"), str):
        return PathModifier(kind, raw["replaceFullPath"])
    if kind == "ReplacePrefixMatch" and isinstance(raw.get("replacePrefixMatch"), str):
        return PathModifier(kind, raw["replacePrefixMatch"])
    raise _Invalid(R_UNSUPPORTED, f"unsupported path modifier type {kind!r}")


def _redirect(raw: Any) -> Redirect:
    if not isinstance(raw, dict):
        raise _Invalid(R_UNSUPPORTED, "requestRedirect without configuration")
    scheme = raw.get("scheme")
    if scheme is not None and scheme not in ("http", "https"):
        raise _Invalid(R_UNSUPPORTED, f"unsupported redirect scheme {scheme!r}")
    status = _int(raw.get("statusCode", 302))
    if status not in REDIRECT_CODES:
        raise _Invalid(R_UNSUPPORTED, f"unsupported redirect statusCode {raw.get('statusCode')!r}")
    port = _int(raw.get("port"))
    if raw.get("port") is not None and (port is None or not 1 <= port <= 65535):
        raise _Invalid(R_UNSUPPORTED, f"invalid redirect port {raw.get('port')!r}")
    path = _path_modifier(raw["path"]) if raw.get("path") is not None else None
    return Redirect(scheme=scheme, hostname=raw.get("hostname") or None, path=path, port=port,
                    status=status)


def _rewrite(raw: Any) -> Rewrite:
    if not isinstance(raw, dict):
        raise _Invalid(R_UNSUPPORTED, "urlRewrite without configuration")
    path = _path_modifier(raw["path"]) if raw.get("path") is not None else None
    return Rewrite(hostname=raw.get("hostname") or None, path=path)


def _value_matches(items: Any, what: str, lower: bool) -> tuple[ValueMatch, ...]:
    out: list[ValueMatch] = []
    seen: set[str] = set()
    for m in items or []:
        if not isinstance(m, dict) or not m.get("name") or "value" not in m:
            raise _Invalid(R_UNSUPPORTED, f"{what} match without name/value")
        kind = m.get("type", "Exact")
        if kind not in ("Exact", "RegularExpression"):
            raise _Invalid(R_UNSUPPORTED, f"unsupported {what} match type {kind!r}")
        name = str(m["name"]).lower() if lower else str(m["name"])
        if name in seen:  # only the first entry with an equivalent name counts
            continue
        seen.add(name)
        out.append(ValueMatch(name, str(m["value"]), kind == "RegularExpression"))
    return tuple(out)


def _http_match(raw: Any) -> Match:
    if not isinstance(raw, dict):
        raise _Invalid(R_UNSUPPORTED, "match is not an object")
    p = raw.get("path") or {}
    kind = p.get("type", "PathPrefix")
    value = p.get("value", "/")
    if kind not in ("Exact", "PathPrefix", "RegularExpression") or not isinstance(value, str):
        raise _Invalid(R_UNSUPPORTED, f"unsupported path match type {kind!r}")
    if kind != "RegularExpression" and not value.startswith("/"):
        raise _Invalid(R_UNSUPPORTED, f"path {value!r} must start with '/'")
    if kind == "PathPrefix" and value != "/":
        value = value.rstrip("/") or "/"  # a trailing '/' is ignored for PathPrefix
    method = raw.get("method")
    if method is not None and method not in HTTP_METHODS:
        raise _Invalid(R_UNSUPPORTED, f"unsupported method {method!r}")
    return Match(path=PathMatch(kind, value),
                 headers=_value_matches(raw.get("headers"), "header", lower=True),
                 query=_value_matches(raw.get("queryParams"), "query param", lower=False),
                 method=method)


def _grpc_match(raw: Any) -> Match:
    if not isinstance(raw, dict):
        raise _Invalid(R_UNSUPPORTED, "match is not an object")
    m = raw.get("method")
    grpc = GrpcMethodMatch()
    if m is not None:
        if not isinstance(m, dict):
            raise _Invalid(R_UNSUPPORTED, "method match is not an object")
        kind = m.get("type", "Exact")
        if kind not in ("Exact", "RegularExpression"):
            raise _Invalid(R_UNSUPPORTED, f"unsupported gRPC method match type {kind!r}")
        service, method = str(m.get("service") or ""), str(m.get("method") or "")
        if kind == "Exact" and ("/" in service or "/" in method):
            raise _Invalid(R_UNSUPPORTED, "gRPC service/method must not contain '/'")
        grpc = GrpcMethodMatch(service, method, kind == "RegularExpression")
    return Match(grpc=grpc, headers=_value_matches(raw.get("headers"), "header", lower=True))


@dataclass
class _RefProblem:
    reason: str
    message: str


class _Resolver:
    """backendRef → Backend, recording ResolvedRefs problems per route."""

    def __init__(self, services: ServiceLookup) -> None:
        self.services = services

    def resolve(self, route: Route, ref: Any, problems: list[_RefProblem]) -> Backend:
        ref = ref if isinstance(ref, dict) else {}
        ns = str(ref.get("namespace") or route.namespace)
        name = str(ref.get("name") or "")
        port = _int(ref.get("port"))
        weight = _int(ref.get("weight"))
        weight = 1 if weight is None else max(weight, 0)
        base = Backend(ns, name, port, weight)

        def bad(reason: str, message: str) -> Backend:
            problems.append(_RefProblem(reason, message))
            return Backend(ns, name, port, weight, valid=False, reason=reason, message=message)

        group, kind = ref.get("group") or "", ref.get("kind") or "Service"
        if group != "" or kind != "Service":
            return bad(R_INVALID_KIND, f"backendRef {group or 'core'}/{kind} {ns}/{name}: "
                                       "only core Services are supported")
        if not name:
            return bad(R_BACKEND_NOT_FOUND, "backendRef without a name")
        # GEP-1294: a mesh route may send to a Service in any namespace, with no
        # ReferenceGrant (it augments an existing Service, it exposes nothing new)
        svc = _lookup(self.services, f"{ns}/{name}")
        if svc is None:
            return bad(R_BACKEND_NOT_FOUND, f"Service {ns}/{name} not found")
        if getattr(svc, "type", "ClusterIP") == "ExternalName":
            return bad(R_INVALID_KIND, f"Service {ns}/{name} is ExternalName (not a mesh backend)")
        if port is None:
            return bad(R_BACKEND_NOT_FOUND, f"backendRef {ns}/{name}: port is required")
        sp = _service_port(svc, port)
        if sp is None:
            return bad(R_BACKEND_NOT_FOUND, f"Service {ns}/{name} has no port {port}")
        traffic = getattr(svc, "traffic", None)
        return Backend(base.namespace, base.name, port, weight, app_protocol=sp.app_protocol,
                       session=getattr(traffic, "session", None))


# ---- building ------------------------------------------------------------------------------


@dataclass
class _RouteEval:
    """Per-route outcome: its entries, rule validity and reference problems."""

    route: Route
    entries: list[Rule]
    rule_errors: list[_Invalid]
    rule_count: int
    ref_problems: list[_RefProblem]


_HTTP_FILTERS = {"RequestHeaderModifier", "ResponseHeaderModifier", "RequestRedirect", "URLRewrite",
                 "RequestMirror", "ExtensionRef"}
_GRPC_FILTERS = {"RequestHeaderModifier", "ResponseHeaderModifier", "RequestMirror", "ExtensionRef"}


def _mirror(route: Route, raw: Any, resolver: _Resolver, problems: list[_RefProblem]
            ) -> Mirror | None:
    if not isinstance(raw, dict):
        raise _Invalid(R_UNSUPPORTED, "requestMirror without configuration")
    num, den = 100, 100
    if raw.get("percent") is not None and raw.get("fraction") is not None:
        raise _Invalid(R_UNSUPPORTED, "requestMirror: only one of percent/fraction may be set")
    if raw.get("percent") is not None:
        pct = _int(raw["percent"])
        if pct is None or not 0 <= pct <= 100:
            raise _Invalid(R_UNSUPPORTED, f"requestMirror: invalid percent {raw['percent']!r}")
        num = pct
    elif isinstance(raw.get("fraction"), dict):
        n = _int(raw["fraction"].get("numerator"))
        d = _int(raw["fraction"].get("denominator", 100))
        if n is None or d is None or d <= 0 or not 0 <= n <= d:
            raise _Invalid(R_UNSUPPORTED, "requestMirror: invalid fraction")
        num, den = n, d
    b = resolver.resolve(route, raw.get("backendRef"), problems)
    # An unresolvable mirror target is dropped (not configured), reported via ResolvedRefs.
    return Mirror(b, num, den) if b.valid else None


def _eval_route(route: Route, resolver: _Resolver) -> _RouteEval:
    spec = route.obj.get("spec") or {}
    raw_rules = spec.get("rules")
    if not raw_rules:  # HTTPRoute defaults to one rule matching "/" (that has no backends)
        raw_rules = [{}]
    grpc = route.kind == GRPC_ROUTE
    allowed = _GRPC_FILTERS if grpc else _HTTP_FILTERS
    ev = _RouteEval(route, [], [], len(raw_rules), [])
    for ri, raw in enumerate(raw_rules):
        try:
            ev.entries.extend(_eval_rule(route, ri, raw, allowed, resolver, ev.ref_problems))
        except _Invalid as e:
            ev.rule_errors.append(e)
    return ev


def _eval_rule(route: Route, ri: int, raw: Any, allowed: set[str], resolver: _Resolver,
               problems: list[_RefProblem]) -> list[Rule]:
    if not isinstance(raw, dict):
        raise _Invalid(R_UNSUPPORTED, f"rule {ri} is not an object")
    grpc = route.kind == GRPC_ROUTE
    matches = [(_grpc_match if grpc else _http_match)(m) for m in raw.get("matches") or []]
    if not matches:
        matches = [Match(grpc=GrpcMethodMatch()) if grpc else Match(path=PathMatch("PathPrefix", "/"))]
    req_h = resp_h = None
    redirect = rewrite = None
    mirrors: list[Mirror] = []
    direct: int | None = None
    seen: set[str] = set()
    for f in raw.get("filters") or []:
        ftype = f.get("type") if isinstance(f, dict) else None
        if ftype not in allowed:
            raise _Invalid(R_UNSUPPORTED, f"rule {ri}: unsupported filter type {ftype!r}")
        if ftype in seen and ftype not in ("RequestMirror", "ExtensionRef"):
            raise _Invalid(R_UNSUPPORTED, f"rule {ri}: filter {ftype} repeated")
        seen.add(ftype)
        if ftype == "RequestHeaderModifier":
            req_h = _header_modifier(f.get("requestHeaderModifier"))
        elif ftype == "ResponseHeaderModifier":
            resp_h = _header_modifier(f.get("responseHeaderModifier"))
        elif ftype == "RequestRedirect":
            redirect = _redirect(f.get("requestRedirect"))
        elif ftype == "URLRewrite":
            rewrite = _rewrite(f.get("urlRewrite"))
        elif ftype == "RequestMirror":
            m = _mirror(route, f.get("requestMirror"), resolver, problems)
            if m is not None:
                mirrors.append(m)
        else:  # ExtensionRef: we resolve no extension kinds; the filter MUST NOT be skipped
            ext = f.get("extensionRef") or {}
            problems.append(_RefProblem(R_INVALID_KIND, f"rule {ri}: extensionRef "
                                        f"{ext.get('group')}/{ext.get('kind')} is not supported"))
            direct = 500
    if redirect is not None and rewrite is not None:
        raise _Invalid(R_INCOMPATIBLE, f"rule {ri}: RequestRedirect and URLRewrite together")
    backend_refs = raw.get("backendRefs") or []
    if redirect is not None and backend_refs:
        raise _Invalid(R_INCOMPATIBLE, f"rule {ri}: RequestRedirect with backendRefs")
    for mod in (redirect.path if redirect else None, rewrite.path if rewrite else None):
        if mod is not None and mod.kind == "ReplacePrefixMatch" and (
                len(matches) != 1 or matches[0].path is None or matches[0].path.kind != "PathPrefix"):
            raise _Invalid(R_UNSUPPORTED, f"rule {ri}: ReplacePrefixMatch needs exactly one "
                                          "PathPrefix match")
    backends = [_backend_with_filters(route, ri, b, resolver, problems) for b in backend_refs]
    timeouts = raw.get("timeouts") or {}
    req_t = parse_duration(timeouts["request"]) if timeouts.get("request") is not None else None
    be_t = (parse_duration(timeouts["backendRequest"])
            if timeouts.get("backendRequest") is not None else None)
    if req_t and be_t and be_t > req_t:
        raise _Invalid(R_UNSUPPORTED, f"rule {ri}: backendRequest timeout longer than request")
    retry = _retry(raw.get("retry"), ri) if not grpc else None
    try:
        session = parse_session_persistence(raw.get("sessionPersistence"))
    except ValueError as e:
        raise _Invalid(R_UNSUPPORTED, f"rule {ri}: {e}") from None
    status = 503 if grpc else 500
    if direct is None and redirect is None and not any(b.valid and b.weight > 0 for b in backends):
        direct = status  # no backends, all invalid, or all weight 0: nothing may receive traffic
    name = raw.get("name")
    return [Rule(kind=route.kind, route_key=route.key, rule_index=ri, match_index=mi, match=m,
                 name=str(name) if name else None, backends=tuple(backends),
                 request_headers=req_h, response_headers=resp_h, redirect=redirect,
                 rewrite=rewrite, mirrors=tuple(mirrors), request_timeout_s=req_t,
                 backend_timeout_s=be_t, retry=retry, direct_status=direct,
                 session=_scoped(session, m))
            for mi, m in enumerate(matches)]


def _scoped(session: SessionPersistence | None, match: Match) -> SessionPersistence | None:
    """A rule's session cookie is scoped to its match's path (an Exact or PathPrefix
    match; "/" otherwise), so two rules' sessions of one name do not overwrite each other."""
    if session is None or session.kind != "Cookie" or match.path is None \
            or match.path.kind not in ("Exact", "PathPrefix"):
        return session
    return replace(session, path=match.path.value or "/")


def _retry(raw: Any, ri: int) -> Retry | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise _Invalid(R_UNSUPPORTED, f"rule {ri}: retry is not an object")
    codes = []
    for c in raw.get("codes") or []:
        code = _int(c)
        if code is None or not 400 <= code <= 599:
            raise _Invalid(R_UNSUPPORTED, f"rule {ri}: invalid retry code {c!r}")
        codes.append(code)
    attempts = _int(raw.get("attempts"))
    if raw.get("attempts") is not None and (attempts is None or attempts < 0):
        raise _Invalid(R_UNSUPPORTED, f"rule {ri}: invalid retry attempts")
    backoff = parse_duration(raw["backoff"]) if raw.get("backoff") is not None else None
    return Retry(tuple(codes), attempts, backoff)


def _backend_with_filters(route: Route, ri: int, ref: Any, resolver: _Resolver,
                          problems: list[_RefProblem]) -> Backend:
    """Backend-level filters Envoy can apply per weighted cluster: header modifiers and a
    hostname rewrite. ExtensionRef makes the share fail (500); anything else rejects the rule."""
    b = resolver.resolve(route, ref, problems)
    req_h = resp_h = None
    host = None
    for f in (ref or {}).get("filters") or [] if isinstance(ref, dict) else []:
        ftype = f.get("type") if isinstance(f, dict) else None
        if ftype == "RequestHeaderModifier":
            req_h = _header_modifier(f.get("requestHeaderModifier"))
        elif ftype == "ResponseHeaderModifier":
            resp_h = _header_modifier(f.get("responseHeaderModifier"))
        elif ftype == "URLRewrite" and route.kind == HTTP_ROUTE:
            rw = _rewrite(f.get("urlRewrite"))
            if rw.path is not None:
                raise _Invalid(R_UNSUPPORTED, f"rule {ri}: backendRef-level URLRewrite path "
                                              "is not supported")
            host = rw.hostname
        elif ftype == "ExtensionRef":
            msg = f"rule {ri}: backendRef {b.key} extensionRef is not supported"
            problems.append(_RefProblem(R_INVALID_KIND, msg))
            b = Backend(b.namespace, b.name, b.port, b.weight, valid=False, reason=R_INVALID_KIND,
                        message=msg)
        else:
            raise _Invalid(R_UNSUPPORTED, f"rule {ri}: backendRef-level filter {ftype!r} "
                                          "is not supported")
    return replace(b, request_headers=req_h, response_headers=resp_h, host_rewrite=host)


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
