"""The one HTTP RBAC filter (agent.authz.rbac.http_rbac_filters) decides as Istio's order
(agent.authz.policy.decide) says, for every request of a grid: its rules are evaluated here
as Envoy evaluates them (a DENY engine, first match in name order, the AUDIT shadow)."""

from __future__ import annotations

import ipaddress
import itertools
import re
from typing import Any

from agent.authz.policy import Request, decide, parse_policy
from agent.authz.rbac import NO_ALLOW, PEER_STATE, PORT_STATE, http_rbac_filters

TD = "cluster.local"


def _string(m: Any, value: str | None) -> bool:
    if value is None:
        return False
    v, kind = (value.lower(), m) if m.ignore_case else (value, m)
    which = kind.WhichOneof("match_pattern")
    pat = getattr(m, which)
    if which == "safe_regex":
        return re.fullmatch(pat.regex, value) is not None
    pat = pat.lower() if m.ignore_case and isinstance(pat, str) else pat
    return {"exact": v == pat, "prefix": v.startswith(pat), "suffix": v.endswith(pat),
            "contains": pat in v}[which]


def _header(req: Request, name: str) -> str | None:
    return {":method": req.method, ":authority": req.host, ":path": req.path}[name]


def _principal(p: Any, req: Request) -> bool:
    which = p.WhichOneof("identifier")
    if which == "any":
        return True
    if which == "and_ids":
        return all(_principal(x, req) for x in p.and_ids.ids)
    if which == "or_ids":
        return any(_principal(x, req) for x in p.or_ids.ids)
    if which == "not_id":
        return not _principal(p.not_id, req)
    if which == "filter_state":
        value = {PEER_STATE: f"spiffe://{req.principal}" if req.principal else None,
                 PORT_STATE: str(req.port)}[p.filter_state.key]
        return _string(p.filter_state.string_match, value)
    if which == "header":
        return _string(p.header.string_match, _header(req, p.header.name))
    if which == "url_path":
        return _string(p.url_path.path, (req.path or "").split("?")[0])
    if which == "direct_remote_ip":
        cidr = p.direct_remote_ip
        net = ipaddress.ip_network(f"{cidr.address_prefix}/{cidr.prefix_len.value}")
        return req.source_ip is not None and ipaddress.ip_address(req.source_ip) in net
    raise AssertionError(f"principal {which} not rendered for HTTP")


def _permission(p: Any, req: Request) -> bool:
    which = p.WhichOneof("rule")
    if which == "any":
        return True
    if which == "and_rules":
        return all(_permission(x, req) for x in p.and_rules.rules)
    if which == "or_rules":
        return any(_permission(x, req) for x in p.or_rules.rules)
    if which == "not_rule":
        return not _permission(p.not_rule, req)
    if which == "requested_server_name":
        return _string(p.requested_server_name, str(req.port))
    if which == "header":
        return _string(p.header.string_match, _header(req, p.header.name))
    if which == "url_path":
        return _string(p.url_path.path, (req.path or "").split("?")[0])
    raise AssertionError(f"permission {which} not rendered for HTTP")


def _first_match(rules: Any, req: Request) -> str | None:
    for name in sorted(rules.policies):
        pol = rules.policies[name]
        if any(_permission(x, req) for x in pol.permissions) and \
                any(_principal(x, req) for x in pol.principals):
            return name
    return None


def _p(name: str, spec: dict[str, Any]) -> Any:
    return parse_policy({"metadata": {"name": name, "namespace": "app"}, "spec": spec})


POLICIES = [
    _p("allow-a", {"rules": [
        {"from": [{"source": {"principals": [f"{TD}/ns/app/sa/a"]}}],
         "to": [{"operation": {"ports": ["8080"], "notPaths": ["/private*"]}}]},
        {"from": [{"source": {"namespaces": ["other"], "notPrincipals": [f"{TD}/ns/other/sa/x"]}}],
         "to": [{"operation": {"methods": ["GET"]}}]}]}),
    _p("allow-host", {"rules": [{"to": [{"operation": {"hosts": ["*.example.com"],
                                                      "ports": ["9090"]}}]}]}),
    _p("allow-net", {"rules": [{"from": [{"source": {"ipBlocks": ["10.9.0.0/16"]}}]}]}),
    _p("deny-admin", {"action": "DENY", "rules": [
        {"to": [{"operation": {"paths": ["/admin*"], "notMethods": ["GET"]}}]}]}),
    _p("deny-b", {"action": "DENY", "rules": [
        {"from": [{"source": {"principals": [f"{TD}/ns/app/sa/b"]}}]}]}),
    _p("watch", {"action": "AUDIT", "rules": [{"to": [{"operation": {"methods": ["POST"]}}]}]}),
]

REQUESTS = [Request(port=port, principal=principal, source_ip=ip, method=method, path=path,
                    host=host)
            for port, principal, ip, method, path, host in itertools.product(
                (8080, 9090, 7070),
                (f"{TD}/ns/app/sa/a", f"{TD}/ns/app/sa/b", f"{TD}/ns/other/sa/c",
                 f"{TD}/ns/other/sa/x", None),
                ("10.9.1.1", "10.1.0.5"),
                ("GET", "POST"),
                ("/", "/admin/x", "/private/y?q=1"),
                ("api.example.com", "other.test"))]


def _decide(filters: list[Any], req: Request) -> tuple[bool, str | None, bool]:
    (f,) = filters
    matched = _first_match(f.rules, req) if f.HasField("rules") else None
    audited = f.HasField("shadow_rules") and _first_match(f.shadow_rules, req) is not None
    return matched is None, matched, audited


def _expected_id(d: Any) -> str | None:
    if d.allowed:
        return None
    return NO_ALLOW if d.policy is None else d.policy


def test_the_one_filter_decides_every_request_as_istios_order() -> None:
    for subset in (POLICIES, POLICIES[:3], POLICIES[3:], POLICIES[3:5], [POLICIES[5]],
                   [POLICIES[0], POLICIES[4]], [_p("none", {})]):
        filters = http_rbac_filters(subset, TD)
        for req in REQUESTS:
            want = decide(subset, req)
            allowed, matched, audited = _decide(filters, req)
            assert allowed == want.allowed, (subset, req, want)
            # the denial is counted under the policy Istio's order names
            assert (matched.split("[")[0] if matched else None) == _expected_id(want), (req, want)
            assert audited == bool(want.audited), (req, want)


def test_an_unreadable_allow_admits_nothing_and_an_unreadable_deny_denies_all() -> None:
    broken_allow = _p("x", {"action": "ALLOW", "rules": [{"when": [{"key": "k"}]}]})
    broken_deny = _p("y", {"action": "DENY", "rules": [{"when": [{"key": "k"}]}]})
    for subset in ([broken_allow], [broken_deny, POLICIES[2]]):
        filters = http_rbac_filters(subset, TD)
        for req in REQUESTS[:40]:
            assert _decide(filters, req)[0] is False
            assert decide(subset, req).allowed is False
