"""AuthorizationPolicy parsing and Istio's decision order (agent.authz.policy)."""

from __future__ import annotations

from typing import Any

from agent.authz.policy import (
    ALLOW,
    DENY,
    Request,
    decide,
    glob_match,
    parse_policy,
    selects,
)

A = "spiffe://cluster.local/ns/app/sa/a"
B = "spiffe://cluster.local/ns/app/sa/b"
OTHER = "spiffe://cluster.local/ns/other/sa/c"


def _p(name: str, spec: dict[str, Any], ns: str = "app") -> Any:
    return parse_policy({"apiVersion": "security.aether.io/v1alpha1",
                         "kind": "AuthorizationPolicy",
                         "metadata": {"name": name, "namespace": ns}, "spec": spec})


ALLOW_A = _p("allow-a", {"selector": {"matchLabels": {"app": "web"}}, "rules": [
    {"from": [{"source": {"principals": ["cluster.local/ns/app/sa/a"]}}]}]})
DENY_ADMIN = _p("deny-admin", {"action": "DENY", "rules": [
    {"to": [{"operation": {"paths": ["/admin*"]}}]}]})
ALLOW_OTHER_NS = _p("allow-other", {"rules": [{"from": [{"source": {"namespaces": ["other"]}}]}]})


def test_no_policy_allows_everyone_even_plaintext() -> None:
    assert decide([], Request(8080)).allowed
    assert decide([], Request(8080, principal=B)).allowed


def test_allow_from_a_admits_a_only() -> None:
    assert decide([ALLOW_A], Request(8080, principal=A)).allowed
    for who in (B, OTHER, None):
        d = decide([ALLOW_A], Request(8080, principal=who, source_ip="10.0.0.9"))
        assert not d.allowed and d.reason == "no ALLOW policy matched"


def test_deny_first_then_allow_and_http_only_fields() -> None:
    pols = [ALLOW_A, DENY_ADMIN]
    assert not decide(pols, Request(80, A, method="GET", path="/admin/x")).allowed
    assert decide(pols, Request(80, A, method="GET", path="/home")).allowed
    # on L4 the DENY's HTTP-only fields are ignored (Istio): it denies the whole port
    assert not decide(pols, Request(80, A)).allowed


def test_an_allow_needing_http_matches_nothing_on_l4() -> None:
    get_only = _p("get", {"rules": [{"to": [{"operation": {"methods": ["GET"]}}]}]})
    assert decide([get_only], Request(80, A, method="GET", path="/")).allowed
    assert not decide([get_only], Request(80, A, method="POST", path="/")).allowed
    assert not decide([get_only], Request(80, A)).allowed


def test_a_second_allow_adds_callers() -> None:
    pols = [ALLOW_A, ALLOW_OTHER_NS]
    assert decide(pols, Request(80, OTHER)).allowed
    assert not decide(pols, Request(80, B)).allowed


def test_allow_without_rules_denies_everything_and_an_empty_rule_allows_all() -> None:
    assert not decide([_p("none", {})], Request(80, A)).allowed
    assert decide([_p("all", {"rules": [{}]})], Request(80, A)).allowed
    assert decide([_p("deny-none", {"action": "DENY"})], Request(80, A)).allowed


def test_audit_never_denies_and_is_reported() -> None:
    audit = _p("watch", {"action": "AUDIT", "rules": [{"from": [{"source": {
        "principals": ["*/sa/b"]}}]}]})
    d = decide([audit], Request(80, B))
    assert d.allowed and d.audited == ("app/watch",)
    assert decide([audit], Request(80, A)).audited == ()


def test_not_fields_ip_blocks_and_ports() -> None:
    p = _p("mix", {"rules": [{"from": [{"source": {"notNamespaces": ["other"],
                                                   "ipBlocks": ["10.1.0.0/16"]}}],
                              "to": [{"operation": {"ports": ["8080"], "notPorts": ["9090"]}}]}]})
    assert decide([p], Request(8080, A, source_ip="10.1.2.3")).allowed
    assert not decide([p], Request(8080, A, source_ip="10.2.0.1")).allowed
    assert not decide([p], Request(8080, OTHER, source_ip="10.1.2.3")).allowed
    assert not decide([p], Request(9090, A, source_ip="10.1.2.3")).allowed


def test_full_spiffe_uris_and_globs() -> None:
    p = _p("uri", {"rules": [{"from": [{"source": {"principals": [A]}}]}]})
    assert decide([p], Request(80, A)).allowed
    assert glob_match("*", "x") and glob_match("ab*", "abc") and glob_match("*bc", "abc")
    assert not glob_match("ab", "abc")
    assert glob_match("*.Example.com", "api.example.COM", fold=True)


def test_unreadable_policies_fail_closed_and_the_others_hold() -> None:
    bad_allow = _p("bad", {"rules": [{"from": [{"source": {"ipBlocks": ["10.0.0.0/99"]}}]}]})
    assert bad_allow.error and "ipBlock" in bad_allow.error and bad_allow.action == ALLOW
    # it still selects, and matches nothing: only the readable ALLOW admits
    assert not decide([bad_allow], Request(80, A)).allowed
    assert decide([bad_allow, ALLOW_A], Request(80, A)).allowed
    bad_deny = _p("bad-deny", {"action": "DENY", "rules": [{"when": [{"key": "x"}]}]})
    assert bad_deny.error and bad_deny.action == DENY
    assert not decide([bad_deny, ALLOW_A], Request(80, A)).allowed  # a DENY unread: all
    for spec, needle in (({"action": "MAYBE"}, "spec.action"), ({"bogus": 1}, "unknown field"),
                         ({"rules": [{"from": [{"source": {"principals": ["a*b*"]}}]}]},
                          "prefix or a suffix"),
                         ({"rules": [{"to": [{"operation": {"ports": ["http"]}}]}]},
                          "not a number")):
        p = _p("x", spec)
        assert p.error and needle in p.error, (spec, p.error)


def test_selection_by_namespace_labels_and_root() -> None:
    assert selects(ALLOW_A, "app", {"app": "web", "v": "1"})
    assert not selects(ALLOW_A, "app", {"app": "db"})
    assert not selects(ALLOW_A, "other", {"app": "web"})
    mesh_wide = _p("mesh", {"action": "DENY"}, ns="aether-system")
    assert selects(mesh_wide, "anything", {}) and not selects(ALLOW_OTHER_NS, "other", {})


def test_an_unreadable_policy_still_selects_only_its_own_workloads() -> None:
    from agent.authz.policy import parse_policy, selects
    p = parse_policy({"metadata": {"name": "x", "namespace": "app"}, "spec": {
        "selector": {"matchLabels": {"app": "web"}}, "action": "ALOW"}})
    assert p.error and p.selector == (("app", "web"),)
    assert selects(p, "app", {"app": "web"}) and not selects(p, "app", {"app": "db"})
    # a selector it cannot read: every pod of the namespace (fail closed)
    q = parse_policy({"metadata": {"name": "y", "namespace": "app"}, "spec": {
        "selector": {"matchExpressions": []}}})
    assert q.error and q.selector is None and selects(q, "app", {"app": "db"})
