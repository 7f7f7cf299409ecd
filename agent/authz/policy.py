"""AuthorizationPolicy (``security.aether.io/v1alpha1``, Istio's shape): parsing and the
decision, as plain functions over plain data (#41).

Istio's semantics: DENY policies first (a match denies); then, if any ALLOW policy selects
the workload, the request must match one of them; otherwise it is allowed. An ALLOW policy
without rules denies everything (it selects, nothing matches). AUDIT never denies.

A rule matches when one of its ``from`` matches (or it has none) and one of its ``to``
matches (or it has none); within a source or an operation every field given must match, and
a field matches when one of its values does (``not*``: none does).

On an L4 port there are no HTTP attributes: an ALLOW rule that names ``methods``, ``paths``
or ``hosts`` matches nothing there; a DENY rule that names them has those fields ignored and
the rest applied (Istio's rule for TCP; it denies more, never less). A policy that cannot be
read (unknown action or field, malformed principal, CIDR or port) is reported and enforced
fail closed: an ALLOW still selects its workloads and matches nothing, a DENY matches
everything, an AUDIT is ignored. ``when`` conditions are not supported yet: a rule with one
is treated as unreadable, the same way.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ALLOW, DENY, AUDIT = "ALLOW", "DENY", "AUDIT"
ACTIONS = (ALLOW, DENY, AUDIT)
KIND = "AuthorizationPolicy"
API_VERSION = "security.aether.io/v1alpha1"
DEFAULT_ROOT_NAMESPACE = "aether-system"

_SOURCE_FIELDS = ("principals", "notPrincipals", "namespaces", "notNamespaces", "ipBlocks",
                  "notIpBlocks")
_OPERATION_FIELDS = ("ports", "notPorts", "methods", "notMethods", "paths", "notPaths",
                     "hosts", "notHosts")
_HTTP_FIELDS = frozenset({"methods", "notMethods", "paths", "notPaths", "hosts", "notHosts"})
_SPEC_FIELDS = frozenset({"selector", "action", "rules"})
_RULE_FIELDS = frozenset({"from", "to", "when"})


class PolicyError(ValueError):
    """A policy that cannot be read; enforced fail closed (see the module docstring)."""


@dataclass(frozen=True)
class Source:
    principals: tuple[str, ...] = ()  # Istio form: "<td>/ns/<ns>/sa/<sa>", * prefix/suffix
    not_principals: tuple[str, ...] = ()
    namespaces: tuple[str, ...] = ()
    not_namespaces: tuple[str, ...] = ()
    ip_blocks: tuple[str, ...] = ()  # CIDRs, normalized
    not_ip_blocks: tuple[str, ...] = ()


@dataclass(frozen=True)
class Operation:
    ports: tuple[int, ...] = ()
    not_ports: tuple[int, ...] = ()
    methods: tuple[str, ...] = ()
    not_methods: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()
    not_paths: tuple[str, ...] = ()
    hosts: tuple[str, ...] = ()
    not_hosts: tuple[str, ...] = ()

    @property
    def needs_http(self) -> bool:
        return bool(self.methods or self.not_methods or self.paths or self.not_paths
                    or self.hosts or self.not_hosts)

    def without_http(self) -> Operation:
        return Operation(ports=self.ports, not_ports=self.not_ports)


@dataclass(frozen=True)
class Rule:
    sources: tuple[Source, ...] = ()  # empty: any source
    operations: tuple[Operation, ...] = ()  # empty: any operation


@dataclass(frozen=True)
class Policy:
    namespace: str
    name: str
    action: str = ALLOW
    # matchLabels; None: every pod of the policy's namespace (the root namespace: the mesh)
    selector: tuple[tuple[str, str], ...] | None = None
    rules: tuple[Rule, ...] = ()
    error: str | None = None  # unreadable: enforced fail closed

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Request:
    """What the destination's proxy knows of a connection or request. ``principal``: the
    verified peer certificate's SPIFFE ID (None: plaintext, or no certificate)."""

    port: int
    principal: str | None = None
    source_ip: str | None = None
    method: str | None = None  # None: an L4 connection (no HTTP attributes)
    path: str | None = None
    host: str | None = None

    @property
    def http(self) -> bool:
        return self.method is not None


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str  # "no policy", "denied by <ns>/<name>", "allowed by …", "no ALLOW matched"
    policy: str | None = None
    audited: tuple[str, ...] = field(default=())


# ---- parsing ---------------------------------------------------------------------------------

def _strings(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise PolicyError(f"{where}: expected a list of non-empty strings")
    return tuple(value)


def normalize_principal(value: str) -> str:
    """Istio's principal form; a full ``spiffe://`` URI is accepted and stripped."""
    p = value.removeprefix("spiffe://")
    inner = p.strip("*")
    if "*" in inner:
        raise PolicyError(f"principal {value!r}: '*' only as a prefix or a suffix")
    return p


def _cidr(value: str) -> str:
    try:
        return str(ipaddress.ip_network(value, strict=False))
    except ValueError as e:
        raise PolicyError(f"ipBlock {value!r}: {e}") from None


def _port(value: Any) -> int:
    try:
        port = int(str(value))
    except ValueError:
        raise PolicyError(f"port {value!r}: not a number") from None
    if not 1 <= port <= 65535:
        raise PolicyError(f"port {value!r}: out of range")
    return port


def _check_fields(obj: Mapping[str, Any], known: Iterable[str], where: str) -> None:
    unknown = sorted(set(obj) - set(known))
    if unknown:
        raise PolicyError(f"{where}: unknown field(s) {', '.join(unknown)}")


def _source(obj: Any, where: str) -> Source:
    if not isinstance(obj, dict) or set(obj) != {"source"} or not isinstance(obj["source"], dict):
        raise PolicyError(f"{where}: expected {{source: {{…}}}}")
    s = obj["source"]
    _check_fields(s, _SOURCE_FIELDS, f"{where}.source")
    return Source(
        principals=tuple(normalize_principal(p) for p in _strings(s.get("principals"), where)),
        not_principals=tuple(normalize_principal(p)
                             for p in _strings(s.get("notPrincipals"), where)),
        namespaces=_strings(s.get("namespaces"), where),
        not_namespaces=_strings(s.get("notNamespaces"), where),
        ip_blocks=tuple(_cidr(c) for c in _strings(s.get("ipBlocks"), where)),
        not_ip_blocks=tuple(_cidr(c) for c in _strings(s.get("notIpBlocks"), where)))


def _operation(obj: Any, where: str) -> Operation:
    if not isinstance(obj, dict) or set(obj) != {"operation"} \
            or not isinstance(obj["operation"], dict):
        raise PolicyError(f"{where}: expected {{operation: {{…}}}}")
    o = obj["operation"]
    _check_fields(o, _OPERATION_FIELDS, f"{where}.operation")
    return Operation(
        ports=tuple(_port(p) for p in _strings(o.get("ports"), where)),
        not_ports=tuple(_port(p) for p in _strings(o.get("notPorts"), where)),
        methods=_strings(o.get("methods"), where),
        not_methods=_strings(o.get("notMethods"), where),
        paths=_strings(o.get("paths"), where),
        not_paths=_strings(o.get("notPaths"), where),
        hosts=_strings(o.get("hosts"), where),
        not_hosts=_strings(o.get("notHosts"), where))


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise PolicyError(f"{where}: expected a list")
    return value


def parse_policy(obj: Mapping[str, Any]) -> Policy:
    """An AuthorizationPolicy object → Policy; unreadable ones come back with ``error`` set
    (and their action, when it could be read) rather than raising."""
    meta = obj.get("metadata") or {}
    ns, name = str(meta.get("namespace") or "default"), str(meta.get("name") or "")
    spec = obj.get("spec") or {}
    action = ALLOW
    selector: tuple[tuple[str, str], ...] | None = None
    try:
        if not isinstance(spec, dict):
            raise PolicyError("spec: expected an object")
        # the selector first: an unreadable policy still selects only its own workloads
        sel = spec.get("selector")
        if sel is not None:
            if not isinstance(sel, dict) or set(sel) - {"matchLabels"} or not isinstance(
                    sel.get("matchLabels", {}), dict):
                raise PolicyError("spec.selector: only matchLabels is supported")
            selector = tuple(sorted((str(k), str(v))
                                    for k, v in (sel.get("matchLabels") or {}).items()))
        _check_fields(spec, _SPEC_FIELDS, "spec")
        raw_action = spec.get("action", ALLOW)
        if raw_action not in ACTIONS:
            action = DENY if raw_action == "CUSTOM" else ALLOW
            raise PolicyError(f"spec.action {raw_action!r}: expected one of {', '.join(ACTIONS)}")
        action = str(raw_action)
        rules = []
        for i, r in enumerate(_list(spec.get("rules"), "spec.rules")):
            where = f"spec.rules[{i}]"
            if not isinstance(r, dict):
                raise PolicyError(f"{where}: expected an object")
            _check_fields(r, _RULE_FIELDS, where)
            if r.get("when"):
                raise PolicyError(f"{where}.when: conditions are not supported")
            rules.append(Rule(
                sources=tuple(_source(s, f"{where}.from[{j}]")
                              for j, s in enumerate(_list(r.get("from"), f"{where}.from"))),
                operations=tuple(_operation(o, f"{where}.to[{j}]")
                                 for j, o in enumerate(_list(r.get("to"), f"{where}.to")))))
        return Policy(ns, name, action, selector, tuple(rules))
    except PolicyError as e:
        return Policy(ns, name, action, selector, (), error=str(e))


# ---- selection and matching --------------------------------------------------------------

def selects(policy: Policy, namespace: str, labels: Mapping[str, str],
            root_namespace: str = DEFAULT_ROOT_NAMESPACE) -> bool:
    """Whether ``policy`` applies to a pod of ``namespace`` with ``labels``."""
    if policy.namespace != namespace and policy.namespace != root_namespace:
        return False
    return policy.selector is None or all(labels.get(k) == v for k, v in policy.selector)


def glob_match(pattern: str, value: str, fold: bool = False) -> bool:
    """Istio's string match: exact, ``*`` (any), ``prefix*`` or ``*suffix``."""
    if fold:
        pattern, value = pattern.lower(), value.lower()
    if pattern == "*":
        return True
    if pattern.endswith("*"):
        return value.startswith(pattern[:-1])
    if pattern.startswith("*"):
        return value.endswith(pattern[1:])
    return pattern == value


def _any(patterns: Sequence[str], value: str | None, fold: bool = False) -> bool:
    return value is not None and any(glob_match(p, value, fold) for p in patterns)


def _field(yes: Sequence[Any], no: Sequence[Any], hit: Any) -> bool:
    """A field pair: ``yes`` (if given) must hit, ``no`` must not."""
    return (not yes or hit(yes)) and not (no and hit(no))


def _principal_ns(principal: str | None) -> str | None:
    if principal is None:
        return None
    parts = principal.removeprefix("spiffe://").split("/")
    return parts[2] if len(parts) == 5 and parts[1] == "ns" and parts[3] == "sa" else None


def _in_blocks(blocks: Sequence[str], ip: str | None) -> bool:
    if ip is None:
        return False
    addr = ipaddress.ip_address(ip)
    return any(addr in ipaddress.ip_network(b) for b in blocks)


def source_matches(s: Source, req: Request) -> bool:
    principal = None if req.principal is None else req.principal.removeprefix("spiffe://")
    ns = _principal_ns(req.principal)
    return (_field(s.principals, s.not_principals, lambda ps: _any(ps, principal))
            and _field(s.namespaces, s.not_namespaces, lambda ns_: _any(ns_, ns))
            and _field(s.ip_blocks, s.not_ip_blocks, lambda bs: _in_blocks(bs, req.source_ip)))


def operation_matches(o: Operation, req: Request) -> bool:
    return (_field(o.ports, o.not_ports, lambda ps: req.port in ps)
            and _field(o.methods, o.not_methods, lambda ms: req.method in ms)
            and _field(o.paths, o.not_paths, lambda ps: _any(ps, req.path))
            and _field(o.hosts, o.not_hosts, lambda hs: _any(hs, req.host, fold=True)))


def effective_rules(policy: Policy, http: bool) -> tuple[Rule, ...] | None:
    """The rules as enforced where HTTP attributes are (``http``) or are not known; None: the
    policy matches everything (an unreadable DENY)."""
    if policy.error is not None:
        return None if policy.action == DENY else ()
    if http:
        return policy.rules
    out: list[Rule] = []
    for r in policy.rules:
        if not any(o.needs_http for o in r.operations):
            out.append(r)
        elif policy.action == DENY:  # the HTTP-only fields ignored, the rest applied
            out.append(Rule(r.sources, tuple(o.without_http() for o in r.operations)))
        else:  # ALLOW/AUDIT: the operations needing HTTP match nothing on L4
            ops = tuple(o for o in r.operations if not o.needs_http)
            if ops:
                out.append(Rule(r.sources, ops))
    return tuple(out)


def needs_http(policies: Sequence[Policy]) -> bool:
    """Whether any of ``policies`` names an HTTP attribute: the pod's undeclared ports then
    get their HTTP detected ahead of the decision, in a detection listener of its own."""
    return any(o.needs_http for p in policies if p.error is None
               for r in p.rules for o in r.operations)


def policy_matches(policy: Policy, req: Request) -> bool:
    rules = effective_rules(policy, req.http)
    if rules is None:
        return True
    return any((not r.sources or any(source_matches(s, req) for s in r.sources))
               and (not r.operations or any(operation_matches(o, req) for o in r.operations))
               for r in rules)


def decide(policies: Sequence[Policy], req: Request) -> Decision:
    """The decision for ``req`` under ``policies`` (those that select the workload)."""
    audited = tuple(p.key for p in policies if p.action == AUDIT and p.error is None
                    and policy_matches(p, req))
    for p in policies:
        if p.action == DENY and policy_matches(p, req):
            return Decision(False, f"denied by {p.key}", p.key, audited)
    allows = [p for p in policies if p.action == ALLOW]
    if not allows:
        return Decision(True, "no ALLOW policy selects the workload", None, audited)
    for p in allows:
        if policy_matches(p, req):
            return Decision(True, f"allowed by {p.key}", p.key, audited)
    return Decision(False, "no ALLOW policy matched", None, audited)


def l4_notes(policy: Policy) -> list[str]:
    """How ``policy`` is enforced where there are no HTTP attributes (an L4 port, what is
    not HTTP on an undeclared port), when that differs from its text: what ``aether-agent
    status`` reports."""
    if policy.error is not None:
        return [f"unreadable ({policy.error}): " + (
            "matches every connection" if policy.action == DENY else
            "selects its pods and matches nothing" if policy.action == ALLOW else "ignored")]
    out = []
    for i, r in enumerate(policy.rules):
        if not any(o.needs_http for o in r.operations):
            continue
        if policy.action == DENY:
            out.append(f"rule {i}: on L4 ports its methods/paths/hosts are ignored and the "
                       "rest applies (it denies the whole connection)")
        else:
            out.append(f"rule {i}: on L4 ports its operations naming methods/paths/hosts "
                       "match nothing")
    return out


def describe(policies: Sequence[Policy]) -> list[dict[str, Any]]:
    """The policies selecting a pod, for status: key, action, rules, problems."""
    return [{"policy": p.key, "action": p.action, "rules": len(p.rules), "error": p.error,
             "l4": l4_notes(p)} for p in policies]
