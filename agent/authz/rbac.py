"""The policies that select a pod → Envoy RBAC filters for its inbound chains (#41).

Pure: plain Policy values in, protos out. The principal comes only from the verified peer
certificate (``authenticated.principal_name``, the URI SAN), never from a header; the port
is the inbound hop's server name (the caller's proxy names the target port there). One
filter per DENY policy, one for the ALLOW policies together (present whenever an ALLOW policy
selects the pod: with no policy matching it denies), one per AUDIT policy as shadow rules
(counted, never enforced), in Istio's order.

Where each attribute is read depends on where the filter runs (``Vantage``): the mTLS
inbound listener (the TLS connection itself), the judging listener (plaintext, the restored
destination) or a pod's detection listener past an internal hop (``DETECTED``), where the
peer's verified ID is a filter-state object the inbound listener set from the certificate.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from envoy.config.rbac.v3 import rbac_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.filters.http.rbac.v3 import rbac_pb2 as http_rbac_pb2
from envoy.extensions.filters.network.rbac.v3 import rbac_pb2 as net_rbac_pb2
from envoy.type.matcher.v3 import filter_state_pb2, path_pb2, regex_pb2, string_pb2

from agent.authz.policy import (
    ALLOW,
    AUDIT,
    DENY,
    Operation,
    Policy,
    Rule,
    Source,
    effective_rules,
)

T = TypeVar("T")
NETWORK_RBAC = "envoy.filters.network.rbac"
HTTP_RBAC = "envoy.filters.http.rbac"
_ACTIONS = {DENY: rbac_pb2.RBAC.DENY, ALLOW: rbac_pb2.RBAC.ALLOW, AUDIT: rbac_pb2.RBAC.LOG}


@dataclass(frozen=True)
class Vantage:
    """Where a filter reads what it decides on. ``sni_port``: the port is the hop's server
    name (the mTLS inbound, whose local port is the inbound port), else the connection's
    (restored) destination port; ``peer_state``: the filter-state key holding the verified
    peer ID (past an internal hop, where no certificate is at hand), else the connection's
    peer certificate; ``direct_ip``: the caller's address is the socket peer's (else the
    restored remote address, as an internal listener sees it)."""

    sni_port: bool = True
    peer_state: str | None = None
    direct_ip: bool = True
    # the filter-state string holding the port (as a principal can match it: the HTTP filter
    # folds its ALLOW policies into principals, see ``http_rbac_filters``)
    port_state: str | None = None


MTLS = Vantage()
PLAINTEXT = Vantage(sni_port=False)
# Filter-state strings the listeners set for the RBAC filters after them: the verified
# peer's SPIFFE ID (from its certificate, or past an internal hop from the PROXY header the
# inbound listener wrote) and the port the caller named.
PEER_STATE = "aether.peer"
PORT_STATE = "aether.port"
# The inbound listener's HTTP chain: the peer's ID from filter state, set per request from
# the certificate. Envoy's ``authenticated`` principal, on a mismatch, decodes the
# certificate's DNS SANs and formats its subject again for every matcher of every request
# (it caches neither when empty, as in an SVID): ~60k instructions a request for four DENY
# policies (``bench.authz_instructions``).
MTLS_HTTP = Vantage(peer_state=PEER_STATE, port_state=PORT_STATE)
# A pod's own detection listener, past the internal hop: the restored destination port,
# the restored caller address.
DETECTED = Vantage(sni_port=False, peer_state=PEER_STATE, direct_ip=False,
                   port_state=PORT_STATE)


def _glob(pattern: str, prefix: str = "", ignore_case: bool = False) -> string_pb2.StringMatcher:
    if pattern == "*":
        return string_pb2.StringMatcher(prefix=prefix, ignore_case=ignore_case)
    if pattern.endswith("*"):
        return string_pb2.StringMatcher(prefix=prefix + pattern[:-1], ignore_case=ignore_case)
    if pattern.startswith("*"):
        return string_pb2.StringMatcher(suffix=pattern[1:], ignore_case=ignore_case)
    return string_pb2.StringMatcher(exact=prefix + pattern, ignore_case=ignore_case)


def _ns_matcher(pattern: str, trust_domain: str | None) -> string_pb2.StringMatcher:
    """A caller's namespace, matched in its SPIFFE ID. With the mesh's ``trust_domain`` (the
    only one whose certificates the inbound accepts) an exact or prefix pattern is a prefix
    match of the ID, far cheaper per request than the regex any other pattern needs."""
    if trust_domain is not None and pattern != "*" and not pattern.startswith("*"):
        head = f"spiffe://{trust_domain}/ns/"
        if pattern.endswith("*"):
            return string_pb2.StringMatcher(prefix=head + pattern[:-1])
        return string_pb2.StringMatcher(prefix=f"{head}{pattern}/sa/")
    return _ns_regex(pattern)


def _ns_regex(pattern: str) -> string_pb2.StringMatcher:
    if pattern == "*":
        ns = "[^/]+"
    elif pattern.endswith("*"):
        ns = re.escape(pattern[:-1]) + "[^/]*"
    elif pattern.startswith("*"):
        ns = "[^/]*" + re.escape(pattern[1:])
    else:
        ns = re.escape(pattern)
    return string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(
        regex=f"spiffe://[^/]+/ns/{ns}/sa/[^/]+"))


def _principal_id(m: string_pb2.StringMatcher, at: Vantage = MTLS) -> rbac_pb2.Principal:
    if at.peer_state is not None:
        return rbac_pb2.Principal(filter_state=filter_state_pb2.FilterStateMatcher(
            key=at.peer_state, string_match=m))
    return rbac_pb2.Principal(authenticated=rbac_pb2.Principal.Authenticated(principal_name=m))


def _any_id(ids: Sequence[rbac_pb2.Principal]) -> rbac_pb2.Principal:
    return ids[0] if len(ids) == 1 else rbac_pb2.Principal(
        or_ids=rbac_pb2.Principal.Set(ids=list(ids)))


def _cidr_id(block: str, at: Vantage = MTLS) -> rbac_pb2.Principal:
    from envoy.config.core.v3 import address_pb2
    ip, _, plen = block.partition("/")
    cidr = address_pb2.CidrRange(address_prefix=ip)
    cidr.prefix_len.value = int(plen)
    if not at.direct_ip:
        return rbac_pb2.Principal(remote_ip=cidr)
    return rbac_pb2.Principal(direct_remote_ip=cidr)


def _all_ids(pairs: Sequence[tuple[Sequence[rbac_pb2.Principal], Sequence[rbac_pb2.Principal]]]
             ) -> rbac_pb2.Principal:
    """Every field given must match: for each (yes, no), one of ``yes`` and none of ``no``."""
    parts = [x for yes, no in pairs for x in (
        [_any_id(yes)] if yes else []) + ([rbac_pb2.Principal(not_id=_any_id(no))] if no else [])]
    if not parts:
        return rbac_pb2.Principal(any=True)
    return parts[0] if len(parts) == 1 else rbac_pb2.Principal(
        and_ids=rbac_pb2.Principal.Set(ids=parts))


def source_principal(s: Source, trust_domain: str | None = None, at: Vantage = MTLS
                     ) -> rbac_pb2.Principal:
    def ids(patterns: Sequence[str]) -> list[rbac_pb2.Principal]:
        return [_principal_id(_glob(p, "spiffe://"), at) for p in patterns]

    def nss(patterns: Sequence[str]) -> list[rbac_pb2.Principal]:
        return [_principal_id(_ns_matcher(n, trust_domain), at) for n in patterns]

    return _all_ids([(ids(s.principals), ids(s.not_principals)),
                     (nss(s.namespaces), nss(s.not_namespaces)),
                     ([_cidr_id(b, at) for b in s.ip_blocks],
                      [_cidr_id(b, at) for b in s.not_ip_blocks])])


def _any_perm(perms: Sequence[rbac_pb2.Permission]) -> rbac_pb2.Permission:
    return perms[0] if len(perms) == 1 else rbac_pb2.Permission(
        or_rules=rbac_pb2.Permission.Set(rules=list(perms)))


def _header(name: str, m: string_pb2.StringMatcher) -> rbac_pb2.Permission:
    return rbac_pb2.Permission(header=route_components_pb2.HeaderMatcher(
        name=name, string_match=m))


def _path(pattern: str) -> rbac_pb2.Permission:
    return rbac_pb2.Permission(url_path=path_pb2.PathMatcher(path=_glob(pattern)))


def _operation_fields(o: Operation, port: Callable[[int], T],
                      header: Callable[[str, string_pb2.StringMatcher], T],
                      path: Callable[[str], T]) -> list[tuple[list[T], list[T]]]:
    """An operation's fields as (one of, none of) pairs of matchers built by the callers'."""
    def methods(ms: Sequence[str]) -> list[T]:
        return [header(":method", string_pb2.StringMatcher(exact=m)) for m in ms]

    def hosts(hs: Sequence[str]) -> list[T]:
        return [header(":authority", _glob(h, ignore_case=True)) for h in hs]

    return [([port(p) for p in o.ports], [port(p) for p in o.not_ports]),
            (methods(o.methods), methods(o.not_methods)),
            ([path(p) for p in o.paths], [path(p) for p in o.not_paths]),
            (hosts(o.hosts), hosts(o.not_hosts))]


def operation_permission(o: Operation, at: Vantage = MTLS) -> rbac_pb2.Permission:
    def port(p: int) -> rbac_pb2.Permission:
        if not at.sni_port:
            return rbac_pb2.Permission(destination_port=p)
        return rbac_pb2.Permission(requested_server_name=string_pb2.StringMatcher(exact=str(p)))

    parts = [x for yes, no in _operation_fields(o, port, _header, _path) for x in (
        [_any_perm(yes)] if yes else [])
        + ([rbac_pb2.Permission(not_rule=_any_perm(no))] if no else [])]
    if not parts:
        return rbac_pb2.Permission(any=True)
    return parts[0] if len(parts) == 1 else rbac_pb2.Permission(
        and_rules=rbac_pb2.Permission.Set(rules=parts))


def rbac_rules(policies: Sequence[Policy], action: str, http: bool, at: Vantage = MTLS,
               trust_domain: str | None = None) -> rbac_pb2.RBAC | None:
    """The Envoy RBAC of the ``action`` policies among ``policies``, as enforced on an HTTP
    chain (``http``) or an L4 one; None when no such policy selects the pod."""
    chosen = [p for p in policies if p.action == action]
    if not chosen or (action == AUDIT and all(p.error for p in chosen)):
        return None
    out = rbac_pb2.RBAC(action=_ACTIONS[action])
    for p in chosen:
        rules = effective_rules(p, http)
        if rules is None:  # an unreadable DENY: everything
            out.policies[p.key].permissions.add(any=True)
            out.policies[p.key].principals.add(any=True)
            continue
        for i, r in enumerate(rules):
            pol = out.policies[f"{p.key}[{i}]"]
            pol.permissions.extend([operation_permission(o, at) for o in r.operations]
                                   or [rbac_pb2.Permission(any=True)])
            pol.principals.extend([source_principal(s, trust_domain, at) for s in r.sources]
                                  or [rbac_pb2.Principal(any=True)])
    return out


STAT_ROOT = "aether_authz"
ANY_ALLOW = "any"  # the tag of the one ALLOW filter (its policies are alternatives)


def _rules_in_order(policies: Sequence[Policy], http: bool, at: Vantage = MTLS,
                    trust_domain: str | None = None) -> list[tuple[str, str, rbac_pb2.RBAC]]:
    """(action, tag, RBAC) of each filter, in Istio's order: one per DENY policy (so each
    denial is counted under its policy), one for every ALLOW policy together (a request
    must match one of them), one per AUDIT policy. The tag is the policy's index in
    ``policies`` (``ANY_ALLOW`` for the ALLOW filter): what the stats are named by."""
    out = []
    for action in (DENY, ALLOW, AUDIT):
        if action == ALLOW:
            groups = [(ANY_ALLOW, list(policies))]
        else:
            groups = [(str(i), [p]) for i, p in enumerate(policies) if p.action == action]
        for tag, chosen in groups:
            rules = rbac_rules(chosen, action, http, at, trust_domain)
            if rules is not None:
                out.append((action, tag, rules))
    return out


def stat_prefix(scope: str, action: str, tag: str) -> str:
    """``aether_authz.<scope>.<action>.<tag>.``: a filter's stats (``agent.authz.stats``)."""
    return ".".join(x for x in (STAT_ROOT, scope, action.lower(), tag) if x) + "."


def _audit_as_shadow(rules: rbac_pb2.RBAC) -> rbac_pb2.RBAC:
    """AUDIT as shadow ALLOW rules: nothing enforced, a match counted as
    ``shadow_allowed`` (Envoy's LOG action counts every request as allowed, matched or not)."""
    shadow = rbac_pb2.RBAC()
    shadow.CopyFrom(rules)
    shadow.action = rbac_pb2.RBAC.ALLOW
    return shadow


def network_rbac_filters(policies: Sequence[Policy], at: Vantage = MTLS, scope: str = "",
                         trust_domain: str | None = None) -> list[net_rbac_pb2.RBAC]:
    """The network RBAC filters of an L4 inbound chain, in order (DENY, ALLOW, AUDIT);
    ``scope`` (the pod's listener uid) names their stats, which are node-wide."""
    out = []
    for action, tag, rules in _rules_in_order(policies, False, at, trust_domain):
        prefix = stat_prefix(scope, action, tag)
        out.append(net_rbac_pb2.RBAC(shadow_rules=_audit_as_shadow(rules), stat_prefix=prefix)
                   if action == AUDIT else net_rbac_pb2.RBAC(rules=rules, stat_prefix=prefix))
    return out


NO_ALLOW = "~no_allow"  # the HTTP filter's policy denying what no ALLOW policy admits
# ... and a peer certificate with more than one URI SAN (SPIFFE allows exactly one): its IDs
# reach filter state comma-joined, where no pattern would match it and a DENY naming one of
# them would not apply
MULTI_ID = "~multi_uri_san"
HTTP_TAG = "http"  # the HTTP filter's stats: aether_authz.http.{allowed,denied,policy.<id>.*}


def _header_id(name: str, m: string_pb2.StringMatcher) -> rbac_pb2.Principal:
    return rbac_pb2.Principal(header=route_components_pb2.HeaderMatcher(name=name, string_match=m))


def operation_principal(o: Operation, at: Vantage) -> rbac_pb2.Principal:
    """An operation as a principal (the RBAC principal matchers cover headers and the path
    too; the port is read from ``at.port_state``)."""
    key = at.port_state
    if key is None:
        raise ValueError("an operation as a principal needs the port in filter state")

    def port(p: int) -> rbac_pb2.Principal:
        return rbac_pb2.Principal(filter_state=filter_state_pb2.FilterStateMatcher(
            key=key, string_match=string_pb2.StringMatcher(exact=str(p))))

    def path(pattern: str) -> rbac_pb2.Principal:
        return rbac_pb2.Principal(url_path=path_pb2.PathMatcher(path=_glob(pattern)))

    return _all_ids(_operation_fields(o, port, _header_id, path))


def _rule_principal(r: Rule, trust_domain: str | None, at: Vantage) -> rbac_pb2.Principal:
    """A whole rule (one of its sources and one of its operations) as one principal."""
    parts = []
    if r.sources:
        parts.append(_any_id([source_principal(s, trust_domain, at) for s in r.sources]))
    if r.operations:
        parts.append(_any_id([operation_principal(o, at) for o in r.operations]))
    if not parts:
        return rbac_pb2.Principal(any=True)
    return parts[0] if len(parts) == 1 else rbac_pb2.Principal(
        and_ids=rbac_pb2.Principal.Set(ids=parts))


def http_rbac_filters(policies: Sequence[Policy], trust_domain: str | None = None,
                      at: Vantage = MTLS_HTTP) -> list[http_rbac_pb2.RBAC]:
    """The HTTP RBAC filter of an HTTP inbound chain (a denial is a 403): none, or one.

    Each RBAC filter costs every request ~13k instructions of its own (Envoy builds and
    merges its dynamic metadata), so Istio's order is one engine here: a DENY engine whose
    policies are the DENY policies' rules and, when an ALLOW policy selects the pod,
    ``~no_allow``, matching a request that none of the ALLOW rules admits (those rules
    folded into principals: the principal matchers cover headers, the path and, through
    ``at.port_state``, the port). Envoy reports the first match in name order, and
    ``~`` sorts after every ``<ns>/<name>``, so a DENY policy is named before the missing
    ALLOW. AUDIT policies are its shadow rules. Counted per policy by Envoy's per-rule
    stats (``aether_authz.http.policy.<id>.denied``, ``aether_authz.audit.all.policy.<id>.
    shadow_allowed``) and in all (``aether_authz.http.allowed``); an allowed request
    matches no policy, so it costs no per-policy counter."""
    if not policies:
        return []
    engine = rbac_rules(policies, DENY, True, at, trust_domain) or rbac_pb2.RBAC(
        action=rbac_pb2.RBAC.DENY)
    allows = [p for p in policies if p.action == ALLOW]
    if allows:
        admits = [_rule_principal(r, trust_domain, at) for p in allows
                  for r in (effective_rules(p, True) or ())]
        pol = engine.policies[NO_ALLOW]
        pol.permissions.add(any=True)
        if admits:
            pol.principals.add().not_id.CopyFrom(_any_id(admits))
        else:  # ALLOW policies without a readable rule: nothing is admitted
            pol.principals.add(any=True)
    if at.peer_state is not None and engine.policies:  # AUDIT alone never denies
        pol = engine.policies[MULTI_ID]
        pol.permissions.add(any=True)
        pol.principals.add(filter_state=filter_state_pb2.FilterStateMatcher(
            key=at.peer_state, string_match=string_pb2.StringMatcher(contains=",")))
    f = http_rbac_pb2.RBAC(track_per_rule_stats=True)
    if engine.policies:
        f.rules.CopyFrom(engine)
        f.rules_stat_prefix = stat_prefix("", HTTP_TAG, "")
    audit = rbac_rules(policies, AUDIT, True, at, trust_domain)
    if audit is not None:
        f.shadow_rules.CopyFrom(_audit_as_shadow(audit))
        f.shadow_rules_stat_prefix = stat_prefix("", AUDIT, MERGED)
    if not f.HasField("rules") and not f.HasField("shadow_rules"):
        return []
    return [f]


MERGED = "all"  # the tag of the AUDIT shadow rules of the HTTP filter
