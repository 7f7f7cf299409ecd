"""GAMMA route tables: attachment, precedence, producer/consumer scope, conflicts, status inputs."""

from __future__ import annotations

from typing import Any

import pytest

from agent.scope.route_tables import (
    GRPC_ROUTE,
    HTTP_ROUTE,
    GammaResult,
    GrpcMethodMatch,
    PathMatch,
    ValueMatch,
    build_tables,
    parse_duration,
)
from agent.scope.routes import route_from_object
from agent.scope.services import Service, ServicePort

SVCS = {
    "ns/echo": Service("ns", "echo", ("10.96.0.10",),
                       (ServicePort(80, "http"), ServicePort(9090, "grpc"))),
    "ns/v1": Service("ns", "v1", ("10.96.0.11",), (ServicePort(80, "http"),)),
    "ns/v2": Service("ns", "v2", ("10.96.0.12",), (ServicePort(80, "http"),)),
    "other/ext": Service("other", "ext", ("10.96.0.13",), (ServicePort(8080),)),
    "ns/headless": Service("ns", "headless", (), (ServicePort(80),), headless=True),
    "ns/dns": Service("ns", "dns", (), (ServicePort(80),), type="ExternalName"),
}


def route(name: str, rules: list[dict[str, Any]], *, ns: str = "ns", kind: str = HTTP_ROUTE,
          parent: dict[str, Any] | None = None, created: str = "2024-01-01T00:00:00Z",
          parents: list[dict[str, Any]] | None = None) -> Any:
    p = parent if parent is not None else {"group": "", "kind": "Service", "name": "echo",
                                           "namespace": "ns"}
    return route_from_object(kind, {
        "metadata": {"name": name, "namespace": ns, "creationTimestamp": created, "generation": 3},
        "spec": {"parentRefs": parents if parents is not None else [p], "rules": rules}})


def to(*names: str, port: int = 80, **extra: Any) -> dict[str, Any]:
    """A rule with backendRefs to ns/<name>:port."""
    return {"backendRefs": [{"name": n, "port": port} for n in names], **extra}


def table(res: GammaResult, port: int = 80, caller: str = "ns") -> Any:
    t = res.table_for("ns/echo", port, caller)
    assert t is not None
    return t


def order(res: GammaResult, port: int = 80, caller: str = "ns") -> list[tuple[str, int, int]]:
    return [(r.route_key.split("/")[-1], r.rule_index, r.match_index)
            for r in table(res, port, caller).rules]


def status(res: GammaResult, name: str, ctype: str) -> tuple[str, str]:
    (ps,) = [s for s in res.statuses if s.route_name == name]
    c = ps.condition(ctype)
    assert c is not None
    return c.status, c.reason


# ---- matches -------------------------------------------------------------------------------


def test_every_http_match_kind_parsed() -> None:
    r = route("r", [to("v1", matches=[
        {"path": {"type": "Exact", "value": "/a"}},
        {"path": {"type": "PathPrefix", "value": "/v2/"}, "method": "POST"},
        {"path": {"type": "RegularExpression", "value": "/x/[0-9]+"},
         "headers": [{"name": "X-Env", "value": "prod"},
                     {"name": "x-env", "value": "ignored"},  # equivalent name: first wins
                     {"type": "RegularExpression", "name": "X-V", "value": "v[12]"}],
         "queryParams": [{"name": "q", "value": "1"},
                         {"type": "RegularExpression", "name": "r", "value": "a.*"}]},
    ])])
    ms = {r.match_index: r.match for r in table(build_tables([r], SVCS)).rules}
    assert ms[0].path == PathMatch("Exact", "/a")
    assert ms[1].path == PathMatch("PathPrefix", "/v2") and ms[1].method == "POST"
    assert ms[2].path == PathMatch("RegularExpression", "/x/[0-9]+")
    assert ms[2].headers == (ValueMatch("x-env", "prod"), ValueMatch("x-v", "v[12]", True))
    assert ms[2].query == (ValueMatch("q", "1"), ValueMatch("r", "a.*", True))


def test_default_match_is_prefix_root_and_matches_are_ored() -> None:
    res = build_tables([route("r", [to("v1"), to("v2", matches=[
        {"path": {"type": "Exact", "value": "/a"}}, {"path": {"type": "Exact", "value": "/b"}}])])],
        SVCS)
    rules = table(res).rules
    assert [r.match.path for r in rules] == [PathMatch("Exact", "/a"), PathMatch("Exact", "/b"),
                                             PathMatch("PathPrefix", "/")]
    assert {r.backends[0].name for r in rules[:2]} == {"v2"}


def test_grpc_match_kinds() -> None:
    r = route("g", [to("v1", matches=[
        {"method": {"service": "foo.Svc", "method": "Get"}},
        {"method": {"type": "RegularExpression", "service": "foo\\..*"}},
        {"headers": [{"name": "X-A", "value": "1"}]}])], kind=GRPC_ROUTE)
    rules = table(build_tables([r], SVCS)).rules
    assert [x.match.grpc for x in rules] == [
        GrpcMethodMatch("foo.Svc", "Get"), GrpcMethodMatch("foo\\..*", "", True), GrpcMethodMatch()]
    assert all(x.kind == GRPC_ROUTE and x.invalid_backend_status == 503 for x in rules)


# ---- precedence: each tie-break would fail if the order were wrong ----------------------------


def P(kind: str, value: str, **kw: Any) -> dict[str, Any]:
    return {"path": {"type": kind, "value": value}, **kw}


def test_exact_beats_longer_prefix() -> None:
    res = build_tables([route("r", [to("v1", matches=[P("PathPrefix", "/aaaaaaaa")]),
                                    to("v2", matches=[P("Exact", "/a")])])], SVCS)
    assert order(res)[0] == ("r", 1, 0)


def test_longest_prefix_first() -> None:
    res = build_tables([route("r", [to("v1", matches=[P("PathPrefix", "/a")]),
                                    to("v2", matches=[P("PathPrefix", "/a/b")])])], SVCS)
    assert order(res) == [("r", 1, 0), ("r", 0, 0)]


def test_method_beats_headers() -> None:
    res = build_tables([route("r", [
        to("v1", matches=[P("PathPrefix", "/", headers=[{"name": "a", "value": "1"},
                                                      {"name": "b", "value": "2"}])]),
        to("v2", matches=[P("PathPrefix", "/", method="GET")])])], SVCS)
    assert order(res)[0] == ("r", 1, 0)


def test_more_headers_first() -> None:
    res = build_tables([route("r", [
        to("v1", matches=[P("PathPrefix", "/", headers=[{"name": "a", "value": "1"}])]),
        to("v2", matches=[P("PathPrefix", "/", headers=[{"name": "a", "value": "1"},
                                                      {"name": "b", "value": "2"}])])])], SVCS)
    assert order(res) == [("r", 1, 0), ("r", 0, 0)]


def test_headers_beat_query_params() -> None:
    res = build_tables([route("r", [
        to("v1", matches=[P("PathPrefix", "/", queryParams=[{"name": "a", "value": "1"},
                                                           {"name": "b", "value": "1"}])]),
        to("v2", matches=[P("PathPrefix", "/", headers=[{"name": "a", "value": "1"}])])])], SVCS)
    assert order(res)[0] == ("r", 1, 0)


def test_more_query_params_first() -> None:
    res = build_tables([route("r", [
        to("v1", matches=[P("PathPrefix", "/", queryParams=[{"name": "a", "value": "1"}])]),
        to("v2", matches=[P("PathPrefix", "/", queryParams=[{"name": "a", "value": "1"},
                                                          {"name": "b", "value": "1"}])])])], SVCS)
    assert order(res) == [("r", 1, 0), ("r", 0, 0)]


def test_oldest_route_wins_tie_even_if_alphabetically_later() -> None:
    res = build_tables([route("a", [to("v1")], created="2024-02-01T00:00:00Z"),
                        route("z", [to("v2")], created="2024-01-01T00:00:00Z")], SVCS)
    assert [x[0] for x in order(res)] == ["z", "a"]


def test_alphabetical_namespace_name_on_same_timestamp() -> None:
    res = build_tables([route("b", [to("v1")]), route("a", [to("v2")])], SVCS)
    assert [x[0] for x in order(res)] == ["a", "b"]


def test_rule_order_within_route() -> None:
    res = build_tables([route("r", [to("v2", matches=[P("PathPrefix", "/x")]),
                                    to("v1", matches=[P("PathPrefix", "/y")])])], SVCS)
    assert order(res) == [("r", 0, 0), ("r", 1, 0)]


def test_precedence_is_per_match_not_per_rule() -> None:
    """Rule 0's /a/b/c match outranks rule 1's /a/b; rule 0's / match ranks below it."""
    res = build_tables([route("r", [to("v1", matches=[P("PathPrefix", "/"),
                                                      P("PathPrefix", "/a/b/c")]),
                                    to("v2", matches=[P("PathPrefix", "/a/b")])])], SVCS)
    assert order(res) == [("r", 0, 1), ("r", 1, 0), ("r", 0, 0)]


def test_grpc_precedence_service_then_method_then_headers() -> None:
    r = route("g", [to("v1", matches=[{"method": {"method": "LongMethodName"}}]),
                    to("v1", matches=[{"method": {"service": "a.B"}}]),
                    to("v1", matches=[{"method": {"service": "a.B", "method": "M"}}]),
                    to("v1", matches=[{"method": {"service": "a.B", "method": "M"},
                                       "headers": [{"name": "h", "value": "1"}]}])],
              kind=GRPC_ROUTE)
    assert [x[1] for x in order(build_tables([r], SVCS))] == [3, 2, 1, 0]


# ---- attachment ----------------------------------------------------------------------------


def test_parent_port_binds_only_that_port() -> None:
    r = route("r", [to("v1")], parent={"kind": "Service", "group": "", "name": "echo", "port": 9090})
    res = build_tables([r], SVCS)
    assert res.table_for("ns/echo", 80, "ns") is None
    assert res.table_for("ns/echo", 9090, "ns") is not None


def test_no_port_binds_every_port() -> None:
    res = build_tables([route("r", [to("v1")])], SVCS)
    assert {k[1] for k in res.tables} == {80, 9090}


def test_section_name_is_port_name() -> None:
    r = route("r", [to("v1")], parent={"kind": "Service", "group": "", "name": "echo",
                                       "sectionName": "grpc"})
    assert {k[1] for k in build_tables([r], SVCS).tables} == {9090}


@pytest.mark.parametrize("parent,why", [
    ({"kind": "Service", "group": "", "name": "echo", "port": 1234}, "port 1234"),
    ({"kind": "Service", "group": "", "name": "echo", "sectionName": "nope"}, "'nope'"),
    ({"kind": "Service", "group": "", "name": "missing"}, "not found"),
    ({"kind": "Service", "group": "", "name": "headless"}, "headless"),
])
def test_no_matching_parent(parent: dict[str, Any], why: str) -> None:
    res = build_tables([route("r", [to("v1")], parent=parent)], SVCS)
    assert not res.tables
    (ps,) = res.statuses
    acc = ps.condition("Accepted")
    assert acc is not None and (acc.status, acc.reason) == ("False", "NoMatchingParent")
    assert why in acc.message


def test_producer_route_applies_to_every_caller() -> None:
    res = build_tables([route("prod", [to("v1")])], SVCS)
    for caller in ("ns", "other", "third"):
        assert table(res, caller=caller).routes == ("HTTPRoute:ns/prod",)


def test_consumer_route_only_for_its_namespace_and_replaces_producer_routes() -> None:
    prod = route("prod", [to("v1")])
    cons = route("cons", [to("v2", matches=[P("PathPrefix", "/only")])], ns="other")
    res = build_tables([prod, cons], SVCS)
    assert table(res, caller="other").routes == ("HTTPRoute:other/cons",)
    assert table(res, caller="third").routes == ("HTTPRoute:ns/prod",)
    assert table(res, caller="ns").routes == ("HTTPRoute:ns/prod",)
    assert res.consumer_namespaces("ns/echo", 80) == {"other"}
    # consumer table is not merged with the producer's: /x from "other" finds no rule → 404
    assert [r.match.path for r in table(res, caller="other").rules] == [
        PathMatch("PathPrefix", "/only")]
    assert table(res, caller="other").no_match_status == 404


def test_consumer_route_scoped_per_port() -> None:
    cons = route("cons", [to("v2")], ns="other",
                 parent={"kind": "Service", "group": "", "name": "echo", "namespace": "ns",
                         "port": 9090})
    res = build_tables([route("prod", [to("v1")]), cons], SVCS)
    assert table(res, 80, "other").routes == ("HTTPRoute:ns/prod",)
    assert table(res, 9090, "other").routes == ("HTTPRoute:other/cons",)


def test_fallback_to_identity_route_when_routes_vanish() -> None:
    assert build_tables([route("r", [to("v1")])], SVCS).table_for("ns/echo", 80, "ns") is not None
    assert build_tables([], SVCS).table_for("ns/echo", 80, "ns") is None


def test_one_status_per_parent() -> None:
    r = route("r", [to("v1")], parents=[
        {"kind": "Service", "group": "", "name": "echo"},
        {"kind": "Service", "group": "", "name": "v1", "port": 80}])
    res = build_tables([r], SVCS)
    assert sorted(s.parent.name for s in res.statuses) == ["echo", "v1"]
    assert all(s.generation == 3 for s in res.statuses)


# ---- GRPCRoute vs HTTPRoute ----------------------------------------------------------------


def test_grpc_route_wins_conflict_and_loser_reported() -> None:
    h = route("h", [to("v1")], parent={"kind": "Service", "group": "", "name": "echo", "port": 9090})
    g = route("g", [to("v2")], kind=GRPC_ROUTE,
              parent={"kind": "Service", "group": "", "name": "echo", "port": 9090})
    res = build_tables([h, g], SVCS)
    t = table(res, 9090)
    assert t.kind == GRPC_ROUTE and t.routes == ("GRPCRoute:ns/g",)
    (c,) = res.conflicts
    assert (c.loser, c.winners, c.port) == ("HTTPRoute:ns/h", ("GRPCRoute:ns/g",), 9090)
    assert status(res, "h", "Accepted") == ("False", "Conflicted")
    assert status(res, "g", "Accepted") == ("True", "Accepted")


def test_http_route_keeps_ports_where_it_does_not_conflict() -> None:
    h = route("h", [to("v1")])
    g = route("g", [to("v2")], kind=GRPC_ROUTE,
              parent={"kind": "Service", "group": "", "name": "echo", "port": 9090})
    res = build_tables([h, g], SVCS)
    assert table(res, 80).kind == HTTP_ROUTE and table(res, 9090).kind == GRPC_ROUTE
    assert status(res, "h", "Accepted") == ("True", "Accepted")
    assert len(res.conflicts) == 1


# ---- backends ------------------------------------------------------------------------------


def test_weights_and_weight_zero() -> None:
    r = route("r", [{"backendRefs": [{"name": "v1", "port": 80, "weight": 0},
                                     {"name": "v2", "port": 80, "weight": 7}]}])
    (rule,) = table(build_tables([r], SVCS)).rules
    assert [(b.name, b.weight) for b in rule.backends] == [("v1", 0), ("v2", 7)]
    assert rule.direct_status is None


def test_all_weights_zero_answers_500() -> None:
    r = route("r", [{"backendRefs": [{"name": "v1", "port": 80, "weight": 0}]}])
    (rule,) = table(build_tables([r], SVCS)).rules
    assert rule.direct_status == 500


@pytest.mark.parametrize("ref,reason", [
    ({"name": "nope", "port": 80}, "BackendNotFound"),
    ({"name": "v1", "port": 81}, "BackendNotFound"),
    ({"name": "v1"}, "BackendNotFound"),
    ({"name": "v1", "port": 80, "kind": "ServiceImport", "group": "multicluster.x-k8s.io"},
     "InvalidKind"),
    ({"name": "dns", "port": 80}, "InvalidKind"),  # ExternalName: no mesh backend
])
def test_unresolved_backend_gets_its_share_as_error(ref: dict[str, Any], reason: str) -> None:
    r = route("r", [{"backendRefs": [ref, {"name": "v2", "port": 80}]}])
    res = build_tables([r], SVCS)
    (rule,) = table(res).rules
    bad, good = rule.backends
    assert not bad.valid and bad.reason == reason and good.valid
    assert rule.direct_status is None  # the rest keeps working
    assert status(res, "r", "ResolvedRefs") == ("False", reason)
    assert status(res, "r", "Accepted") == ("True", "Accepted")


def test_all_backends_invalid_answers_500_grpc_503() -> None:
    h = route("h", [{"backendRefs": [{"name": "nope", "port": 80}]}])
    g = route("g", [{"backendRefs": [{"name": "nope", "port": 80}]}], kind=GRPC_ROUTE,
              parent={"kind": "Service", "group": "", "name": "v1"})
    res = build_tables([h, g], SVCS)
    assert table(res).rules[0].direct_status == 500
    t = res.table_for("ns/v1", 80, "ns")
    assert t is not None and t.rules[0].direct_status == 503  # Envoy sends gRPC UNAVAILABLE


def test_cross_namespace_backend_needs_no_reference_grant() -> None:
    """GEP-1294: a mesh route sends to a Service in any namespace, with no ReferenceGrant."""
    r = route("r", [{"backendRefs": [{"name": "ext", "namespace": "other", "port": 8080}]}])
    res = build_tables([r], SVCS)
    [backend] = table(res).rules[0].backends
    assert (backend.valid, backend.namespace, backend.name) == (True, "other", "ext")
    assert status(res, "r", "ResolvedRefs") == ("True", "ResolvedRefs")


def test_backend_level_filters() -> None:
    r = route("r", [{"backendRefs": [{"name": "v1", "port": 80, "filters": [
        {"type": "RequestHeaderModifier", "requestHeaderModifier": {"set": [{"name": "A",
                                                                            "value": "1"}]}},
        {"type": "URLRewrite", "urlRewrite": {"hostname": "v1.example"}}]}]}])
    b = table(build_tables([r], SVCS)).rules[0].backends[0]
    assert b.request_headers is not None and b.request_headers.set == (("a", "1"),)
    assert b.host_rewrite == "v1.example"


# ---- filters, timeouts, retries, names -----------------------------------------------------


def test_rule_filters_timeouts_retry_and_name() -> None:
    r = route("r", [{
        "name": "primary",
        "filters": [
            {"type": "RequestHeaderModifier", "requestHeaderModifier": {
                "set": [{"name": "X-Set", "value": "s"}], "add": [{"name": "X-Add", "value": "a"}],
                "remove": ["X-Gone"]}},
            {"type": "ResponseHeaderModifier", "responseHeaderModifier": {"remove": ["Server"]}},
            {"type": "RequestMirror", "requestMirror": {"backendRef": {"name": "v2", "port": 80},
                                                        "fraction": {"numerator": 1,
                                                                     "denominator": 3}}},
            {"type": "URLRewrite", "urlRewrite": {"hostname": "h", "path": {
                "type": "ReplacePrefixMatch", "replacePrefixMatch": "/new"}}}],
        "matches": [P("PathPrefix", "/old")],
        "backendRefs": [{"name": "v1", "port": 80}],
        "timeouts": {"request": "10s", "backendRequest": "2s500ms"},
        "retry": {"codes": [503, 502], "attempts": 3, "backoff": "100ms"}}])
    (rule,) = table(build_tables([r], SVCS)).rules
    assert rule.name == "primary"
    assert rule.request_headers is not None and rule.request_headers.remove == ("x-gone",)
    assert rule.request_headers.set == (("x-set", "s"),)
    assert rule.response_headers is not None and rule.response_headers.remove == ("server",)
    (m,) = rule.mirrors
    assert (m.backend.name, m.numerator, m.denominator) == ("v2", 1, 3)
    assert rule.rewrite is not None and rule.rewrite.hostname == "h"
    assert (rule.request_timeout_s, rule.backend_timeout_s) == (10.0, 2.5)
    assert rule.retry is not None and rule.retry.codes == (503, 502) and rule.retry.attempts == 3
    assert rule.retry.backoff_s == pytest.approx(0.1)


def test_rule_session_persistence_wins_over_the_backends_policy() -> None:
    """GEP-1619: a rule's sessionPersistence (its cookie scoped to the match's path) wins;
    a rule without one takes its backend Service's policy; a type we do not implement
    makes the rule invalid (not silently unsticky)."""
    from dataclasses import replace

    from agent.scope.services import SessionPersistence, TrafficPolicy
    policy = SessionPersistence("Header", "x-shard")
    svcs = {**SVCS, "ns/v2": replace(SVCS["ns/v2"], traffic=TrafficPolicy(session=policy))}
    r = route("r", [
        to("v2", matches=[P("PathPrefix", "/cart")],
           sessionPersistence={"sessionName": "cart", "type": "Cookie"}),
        to("v2", matches=[P("PathPrefix", "/shop")]),
        to("v1", matches=[P("PathPrefix", "/plain")]),
        to("v1", matches=[{"headers": [{"name": "x-a", "value": "1"}]}],
           sessionPersistence={"sessionName": "hdr"}),
    ])
    res = build_tables([r], svcs)
    got = {("headers" if rule.match.headers else rule.match.path.value): rule.effective_session
           for rule in table(res).rules}
    assert got == {"/cart": SessionPersistence("Cookie", "cart", None, "/cart"),
                   "/shop": policy, "/plain": None,
                   "headers": SessionPersistence("Cookie", "hdr", None, "/")}
    bad = route("bad", [to("v1", sessionPersistence={"type": "Magic"})])
    assert status(build_tables([bad], SVCS), "bad", "Accepted")[0] == "False"


def test_redirect_rule() -> None:
    r = route("r", [{"filters": [{"type": "RequestRedirect", "requestRedirect": {
        "scheme": "https", "hostname": "x.example", "port": 8443, "statusCode": 301,
        "path": {"type": "ReplaceFullPath", "replaceFullPath": "/n"}}}]}])
    (rule,) = table(build_tables([r], SVCS)).rules
    assert rule.redirect is not None and rule.direct_status is None
    assert (rule.redirect.scheme, rule.redirect.port, rule.redirect.status) == ("https", 8443, 301)


@pytest.mark.parametrize("flt,reason", [
    ({"type": "Bogus"}, "UnsupportedValue"),
    ({"type": "CORS", "cors": {}}, "UnsupportedValue"),
    ({"type": "RequestRedirect", "requestRedirect": {"statusCode": 305}}, "UnsupportedValue"),
    ({"type": "RequestRedirect", "requestRedirect": {"scheme": "ftp"}}, "UnsupportedValue"),
])
def test_unsupported_filter_rejects_rule_and_is_reported(flt: dict[str, Any], reason: str) -> None:
    bad = route("bad", [{"filters": [flt], "backendRefs": [{"name": "v1", "port": 80}]}])
    res = build_tables([bad], SVCS)
    assert status(res, "bad", "Accepted") == ("False", reason)
    assert res.table_for("ns/echo", 80, "ns") is None  # nothing attached: identity route


def test_partially_invalid_route_keeps_valid_rules() -> None:
    r = route("r", [to("v1", matches=[P("PathPrefix", "/ok")]),
                    {"matches": [P("Bogus", "/x")], "backendRefs": [{"name": "v1", "port": 80}]}])
    res = build_tables([r], SVCS)
    assert [x.match.path for x in table(res).rules] == [PathMatch("PathPrefix", "/ok")]
    assert status(res, "r", "Accepted") == ("True", "Accepted")
    assert status(res, "r", "PartiallyInvalid") == ("True", "UnsupportedValue")


def test_extension_ref_answers_500_not_skipped() -> None:
    r = route("r", [{"filters": [{"type": "ExtensionRef", "extensionRef": {
        "group": "x.io", "kind": "Thing", "name": "t"}}], "backendRefs": [{"name": "v1",
                                                                            "port": 80}]}])
    res = build_tables([r], SVCS)
    assert table(res).rules[0].direct_status == 500
    assert status(res, "r", "ResolvedRefs") == ("False", "InvalidKind")


@pytest.mark.parametrize("rule", [
    {"filters": [{"type": "RequestRedirect", "requestRedirect": {}}],
     "backendRefs": [{"name": "v1", "port": 80}]},
    {"filters": [{"type": "RequestRedirect", "requestRedirect": {}},
                 {"type": "URLRewrite", "urlRewrite": {}}]},
])
def test_incompatible_filters(rule: dict[str, Any]) -> None:
    assert status(build_tables([route("r", [rule])], SVCS), "r", "Accepted") == (
        "False", "IncompatibleFilters")


def test_replace_prefix_needs_one_prefix_match() -> None:
    r = route("r", [to("v1", matches=[P("Exact", "/a")], filters=[
        {"type": "URLRewrite", "urlRewrite": {"path": {"type": "ReplacePrefixMatch",
                                                       "replacePrefixMatch": "/b"}}}])])
    assert status(build_tables([r], SVCS), "r", "Accepted") == ("False", "UnsupportedValue")


def test_grpc_route_rejects_http_only_filters() -> None:
    g = route("g", [to("v1", filters=[{"type": "RequestRedirect", "requestRedirect": {}}])],
              kind=GRPC_ROUTE)
    assert status(build_tables([g], SVCS), "g", "Accepted") == ("False", "UnsupportedValue")


def test_durations() -> None:
    assert parse_duration("1h2m3s4ms") == pytest.approx(3723.004)
    assert parse_duration("0s") == 0.0
    with pytest.raises(Exception, match="invalid duration"):
        parse_duration("1.5s")


def test_404_status_is_carried() -> None:
    assert table(build_tables([route("r", [to("v1")])], SVCS)).no_match_status == 404
