"""A GAMMA route's rules evaluated into table entries (``Rule``), one per (rule, match).

Split out of ``agent.scope.route_tables``: per rule, its filters, backendRefs, mirrors,
timeouts, retry and session persistence checked and combined (a rule the spec rejects goes
to its route's ``_RouteEval.rule_errors`` instead of the table); the tables are built from
these in ``route_tables``. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from agent.scope.route_parsing import (
    _grpc_match,
    _header_modifier,
    _http_match,
    _int,
    _Invalid,
    _redirect,
    _RefProblem,
    _Resolver,
    _rewrite,
    parse_duration,
)
from agent.scope.route_table_types import (
    GRPC_ROUTE,
    HTTP_ROUTE,
    R_INCOMPATIBLE,
    R_INVALID_KIND,
    R_UNSUPPORTED,
    Backend,
    GrpcMethodMatch,
    Match,
    Mirror,
    PathMatch,
    Retry,
    Rule,
)
from agent.scope.routes import Route
from agent.scope.services import SessionPersistence, parse_session_persistence


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
