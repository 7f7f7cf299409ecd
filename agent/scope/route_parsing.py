"""Parsing one GAMMA route's pieces: matches, filters (header and path modifiers, redirect,
rewrite), durations and backendRefs resolved against the Services.

Split out of ``agent.scope.route_tables``: what turns a raw HTTPRoute/GRPCRoute field into
table data, raising ``_Invalid`` (a rule the spec says to reject) or recording a
``_RefProblem`` (a ResolvedRefs condition), apart from how rules become table entries. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.scope import durations
from agent.scope.route_table_types import (
    HTTP_METHODS,
    R_BACKEND_NOT_FOUND,
    R_INVALID_KIND,
    R_UNSUPPORTED,
    REDIRECT_CODES,
    Backend,
    GrpcMethodMatch,
    HeaderModifier,
    Match,
    PathMatch,
    PathModifier,
    Redirect,
    Rewrite,
    ServiceLookup,
    ValueMatch,
)
from agent.scope.routes import Route
from agent.scope.services import ServicePort


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
