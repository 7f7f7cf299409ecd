"""GAMMA conformance-style suite: HTTPRoute / GRPCRoute attached to Services, end to end.

Real Envoy, real pod netns (reference CNI + aether-cni), backends that echo what they received
(pod name, method, path, host, headers) and clients in two namespaces (``gamma``, the
producer, and ``consumer``). Each test attaches its routes to a Service of its own (named
after the test, ClusterIP nothing routes) whose identity route leads to ``echo-v1-0``, so
"route applied" (another backend, or the ``x-gamma-route`` header a rule sets) and "route not
applied" are never confused; the routes are removed when the test ends. Route status
conditions are tested against the test API server elsewhere (a manifest directory has no
status to write to).
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from integration.conftest import until
from integration.gamma_harness import (
    ALT_PORT,
    CONSUMER_NS,
    CONVERGE_TIMEOUT,
    GRPC,
    GRPC_PORT,
    H2C,
    PRODUCER_NS,
    VERSIONS,
    Answer,
    GammaNode,
    Svc,
    SvcPort,
    backend,
    mark,
    parent,
    path,
    route,
    rule,
    summary,
)

pytestmark = [
    pytest.mark.integration,
]

V1, V2, V3 = "echo-v1-0", "echo-v2-0", "echo-v3-0"
OTHER_MESH = "other.example/mesh"
OWNER_KEY = "aether.io/mesh-controller"

# One Service per test (identity route → echo-v1-0 unless said otherwise).
TARGETS = [
    Svc("t-identity", VERSIONS),
    Svc("t-named", VERSIONS),
    Svc("t-podip"),
    Svc("t-path-exact"), Svc("t-path-prefix"), Svc("t-path-regex"),
    Svc("t-hdr-exact"), Svc("t-hdr-regex"), Svc("t-query-exact"), Svc("t-query-regex"),
    Svc("t-method"), Svc("t-or"), Svc("t-404"),
    Svc("t-prec-exact"), Svc("t-prec-prefix"), Svc("t-prec-method"), Svc("t-prec-headers"),
    Svc("t-prec-query"), Svc("t-prec-age"), Svc("t-prec-name"), Svc("t-prec-rule"),
    Svc("t-reqhdr"), Svc("t-resphdr"),
    Svc("t-redirect", ports=(SvcPort(), SvcPort(ALT_PORT, 8080, "http-alt"))),
    Svc("t-rewrite"), Svc("t-rewrite-prefix"), Svc("t-mirror"), Svc("t-mirror-pct"),
    Svc("t-timeout"), Svc("t-retry"),
    Svc("t-weights"), Svc("t-weight0"), Svc("t-missing"), Svc("t-be-filters"),
    Svc("t-consumer", ports=(SvcPort(), SvcPort(ALT_PORT, 8080, "http-alt"))),
    Svc("t-xns", namespace=CONSUMER_NS),  # no endpoints: only its route answers
    Svc("t-section", ports=(SvcPort(), SvcPort(ALT_PORT, 8080, "http-alt"))),
    Svc("t-vanish"),
    Svc("t-detect", ports=(SvcPort(app_protocol=None),)),
    Svc("t-opaque", ports=(SvcPort(app_protocol="kubernetes.io/wss"),)),
    Svc("t-grpc-weights", ports=GRPC), Svc("t-grpc-conflict", ports=GRPC),
    Svc("t-own-route"), Svc("t-own-both"), Svc("t-own-control"), Svc("t-move"),
    Svc("t-own-svc", annotations={OWNER_KEY: OTHER_MESH}),
    Svc("t-budget"), Svc("t-budget-be", ("v3",)),
    # the gRPC backends behind each HTTP/2 appProtocol
    *(Svc(f"t-ap-{name}", VERSIONS, (SvcPort(GRPC_PORT, GRPC_PORT, "rpc", proto),))
      for name, proto in (("grpc", "grpc"), ("http2", "http2"), ("h2c", "h2c"), ("k8s-h2c", H2C))),
]


@pytest.fixture(scope="module")
def g(bridge_name: str) -> Iterator[GammaNode]:
    node = GammaNode(bridge_name, TARGETS)
    try:
        node.start()
        yield node
    finally:
        node.close()


def _to(pod: str) -> Any:
    return lambda a: a.pod == pod


def _marked(value: str, pod: str | None = None) -> Any:
    return lambda a: a.route_mark == value and (pod is None or a.pod == pod)


def _expect(g: GammaNode, target: str, cases: list[tuple[str, dict[str, Any], str]], **kw: Any) -> None:
    """Every (path, request options, expected pod or 'status N') case, all reported at once."""
    wrong = []
    for p, opts, want in cases:
        got = g.one(target, p, **{**kw, **opts})
        if got.pod != want:
            wrong.append(f"{opts.get('method', 'GET')} {p} {opts.get('headers') or ''}: "
                         f"want {want}, got {got.brief()}")
    assert not wrong, "\n".join(wrong) + "\n" + g.envoy_evidence(target)


# ---- the mesh without routes (must hold before and after GAMMA wiring) ---------------------


@pytest.mark.parametrize("client", ["gamma/client", "consumer/client"])
@pytest.mark.parametrize("version", VERSIONS)
def test_backend_services_reachable(g: GammaNode, client: str, version: str) -> None:
    answers = g.http(f"echo-{version}", "/l4", client=client, count=5)
    assert pods(answers) == {f"echo-{version}-0": 5}, summary(answers)
    seen = answers[0].seen
    assert (seen["method"], seen["path"], seen["host"]) == ("GET", "/l4", f"echo-{version}")


def pods(answers: list[Answer]) -> Counter[str]:
    return Counter(a.pod for a in answers)


def test_identity_route_spreads_over_endpoints(g: GammaNode) -> None:
    answers = g.http("t-identity", "/", count=60)
    assert set(pods(answers)) == {V1, V2, V3}, summary(answers)
    assert not any(a.route_mark for a in answers)


@pytest.mark.parametrize("version", VERSIONS)
def test_grpc_services_reachable(g: GammaNode, version: str) -> None:
    out = g.grpc_calls(f"grpc-{version}", [{"method": "/echo.Echo/Ping", "count": 3}])
    assert [a.pod for a in out] == [f"echo-{version}-0"] * 3, out
    assert out[0].answer["method"] == "/echo.Echo/Ping"


def test_grpc_identity_route(g: GammaNode) -> None:
    """No route on echo-grpc (appProtocol kubernetes.io/h2c): its calls are still balanced
    per request, so 99 unary calls on one client connection reach every endpoint in turn
    (per-connection L4 balancing would pin them all to one)."""
    out = g.grpc_calls("echo-grpc", [{"method": "/echo.Echo/Other", "count": 99}])
    assert all(a.ok for a in out), out[:3]
    seen = Counter(a.pod for a in out)
    assert set(seen) == {V1, V2, V3}, seen
    assert min(seen.values()) >= 25, seen  # round robin: about a third each
    assert out[0].answer["method"] == "/echo.Echo/Other"


@pytest.mark.parametrize("proto", ["grpc", "http2", "h2c", "k8s-h2c"])
def test_every_http2_app_protocol_balances_per_request_without_a_route(g: GammaNode,
                                                                     proto: str) -> None:
    """appProtocol grpc, http2, h2c and kubernetes.io/h2c, no route: 100 unary calls on one
    client connection are spread over the three endpoints (L4 would pin them to one)."""
    out = g.grpc_calls(f"t-ap-{proto}", [{"method": "/echo.Echo/Ping", "count": 100}])
    assert all(a.ok for a in out), out[:3]
    seen = Counter(a.pod for a in out)
    assert set(seen) == {V1, V2, V3} and min(seen.values()) >= 25, seen


# One unary call as an HTTP/1.1 client can send it: a gRPC message frame ("ping").
_GRPC_OVER_HTTP1 = {"headers": {"Content-Type": "application/grpc", "TE": "trailers"},
                    "body": b"\x00\x00\x00\x00\x04ping"}


@pytest.mark.parametrize("proto", ["grpc", "http2", "h2c", "k8s-h2c"])
def test_an_http2_app_protocol_speaks_http2_to_the_backend_whatever_the_client_speaks(
        g: GammaNode, proto: str) -> None:
    """An HTTP/1.1 client's gRPC call to a port whose appProtocol is HTTP/2 reaches its
    HTTP/2-only backend (a gRPC server, which cannot read HTTP/1.1) and is answered: Envoy
    spoke HTTP/2 upstream whatever the client spoke."""
    answers = g.http(f"t-ap-{proto}", "/echo.Echo/Ping", method="POST", port=GRPC_PORT,
                     count=3, **_GRPC_OVER_HTTP1)
    assert all(a.status == 200 and a.headers.get("content-type") == "application/grpc"
               and b'"pod": "echo-' in a.body for a in answers), summary(answers)


def test_plain_service_routed_by_cluster_ip_not_host(g: GammaNode) -> None:
    for dialled, host, want in (("echo-v1", "echo-v2", V1), ("echo-v2", "echo-v3", V2),
                                ("echo-v3", "echo-v1.gamma.svc.cluster.local", V3)):
        answers = g.http(dialled, "/host", headers={"Host": host}, count=5)
        assert pods(answers) == {want: 5}, f"{dialled} with Host {host}: {summary(answers)}"
        assert answers[0].seen["host"] == host


def _podip_route() -> dict[str, Any]:
    return route("podip", parent("t-podip"), [rule(backend("echo-v2"), filters=[mark("podip")])])


def test_pod_ip_bypasses_service_routes(g: GammaNode) -> None:
    """Dialling a pod IP is not dialling a Service: t-podip's route (→ echo-v2, marked) does
    not apply to echo-v1-0's own address, even though t-podip selects that pod."""
    with g.routes("podip", _podip_route()):
        answers = g.http("t-podip", "/direct", ip=g.pod_ip(V1), port=8080, count=10)
        assert pods(answers) == {V1: 10}, summary(answers)
        assert not any(a.route_mark for a in answers), summary(answers)
        assert answers[0].seen["path"] == "/direct"


# ---- routing needs the GAMMA wiring from here on -------------------------------------------


def test_pod_ip_bypass_while_route_is_live(g: GammaNode) -> None:
    with g.routes("podip", _podip_route()):
        g.converge(_marked("podip", V2), "t-podip's route sends its ClusterIP to echo-v2",
                   "t-podip", samples=3)
        answers = g.http("t-podip", "/direct", ip=g.pod_ip(V1), port=8080, count=10)
        assert pods(answers) == {V1: 10}, summary(answers)
        assert not any(a.route_mark for a in answers), summary(answers)


def test_route_by_cluster_ip_with_misleading_host(g: GammaNode) -> None:
    """The echo route table follows the ClusterIP dialled, whatever the Host header says."""
    with g.routes("echo-host", route("echo-host", parent("echo"),
                                     [rule(backend("echo-v3"), filters=[mark("echo")])])):
        g.converge(_marked("echo", V3), "echo's route applies", "echo", samples=3)
        for host in ("echo-v2", "echo-v2.gamma.svc.cluster.local", "t-identity"):
            answers = g.http("echo", "/", headers={"Host": host}, count=10)
            assert all(a.pod == V3 and a.route_mark == "echo" for a in answers), (
                f"Host {host}: {summary(answers)}")
            assert answers[0].seen["host"] == host  # the Host header itself is not rewritten
        # ...and echo-v2's ClusterIP with Host: echo is still plain echo-v2 (no route there)
        answers = g.http("echo-v2", "/", headers={"Host": "echo"}, count=5)
        assert pods(answers) == {V2: 5} and not any(a.route_mark for a in answers), summary(answers)


# ---- matches -------------------------------------------------------------------------------


def test_match_path_exact(g: GammaNode) -> None:
    with g.routes("path-exact", route("path-exact", parent("t-path-exact"), [
            rule(backend("echo-v2"), matches=[path("Exact", "/exact")])])):
        g.converge(_to(V2), "Exact /exact → echo-v2", "t-path-exact", "/exact")
        _expect(g, "t-path-exact", [
            ("/exact", {}, V2), ("/exact?q=1", {}, V2), ("/exact/", {}, "status 404"),
            ("/exactly", {}, "status 404"), ("/exact/x", {}, "status 404"), ("/", {}, "status 404")])


def test_match_path_prefix_whole_segments(g: GammaNode) -> None:
    with g.routes("path-prefix", route("path-prefix", parent("t-path-prefix"), [
            rule(backend("echo-v2"), matches=[path("PathPrefix", "/v2")]),
            rule(backend("echo-v3"), matches=[path("PathPrefix", "/")])])):
        g.converge(_to(V2), "PathPrefix /v2 → echo-v2", "t-path-prefix", "/v2")
        _expect(g, "t-path-prefix", [
            ("/v2", {}, V2), ("/v2/", {}, V2), ("/v2/x", {}, V2), ("/v2/x/y?z=1", {}, V2),
            ("/v2x", {}, V3), ("/v2x/y", {}, V3), ("/v", {}, V3), ("/", {}, V3), ("/v3/v2", {}, V3)])


def test_match_path_prefix_trailing_slash_ignored(g: GammaNode) -> None:
    with g.routes("path-prefix", route("path-prefix", parent("t-path-prefix"), [
            rule(backend("echo-v2"), matches=[path("PathPrefix", "/v2/")]),
            rule(backend("echo-v3"), matches=[path("PathPrefix", "/")])])):
        g.converge(_to(V2), "PathPrefix /v2/ → echo-v2", "t-path-prefix", "/v2/x")
        _expect(g, "t-path-prefix", [("/v2", {}, V2), ("/v2/x", {}, V2), ("/v2x", {}, V3)])


def test_match_path_regex(g: GammaNode) -> None:
    with g.routes("path-regex", route("path-regex", parent("t-path-regex"), [
            rule(backend("echo-v2"), matches=[path("RegularExpression", "/re/[0-9]+")]),
            rule(backend("echo-v3"), matches=[path("PathPrefix", "/")])])):
        g.converge(_to(V2), "regex /re/[0-9]+ → echo-v2", "t-path-regex", "/re/123")
        _expect(g, "t-path-regex", [
            ("/re/123", {}, V2), ("/re/7?x=y", {}, V2), ("/re/abc", {}, V3), ("/re/", {}, V3),
            ("/", {}, V3)])


def test_match_header_exact_case_insensitive_name(g: GammaNode) -> None:
    with g.routes("hdr-exact", route("hdr-exact", parent("t-hdr-exact"), [
            rule(backend("echo-v2"), matches=[{"headers": [{"name": "X-Team", "value": "blue"}]}]),
            rule(backend("echo-v3"))])):
        g.converge(_to(V2), "header X-Team: blue → echo-v2", "t-hdr-exact",
                   headers={"x-team": "blue"})
        _expect(g, "t-hdr-exact", [
            ("/", {"headers": {"x-team": "blue"}}, V2), ("/", {"headers": {"X-TEAM": "blue"}}, V2),
            ("/", {"headers": {"X-Team": "Blue"}}, V3), ("/", {"headers": {"X-Team": "blue2"}}, V3),
            ("/", {}, V3)])


def test_match_header_regex(g: GammaNode) -> None:
    with g.routes("hdr-regex", route("hdr-regex", parent("t-hdr-regex"), [
            rule(backend("echo-v2"), matches=[{"headers": [
                {"type": "RegularExpression", "name": "x-Version", "value": "v[23]"}]}]),
            rule(backend("echo-v3"))])):
        g.converge(_to(V2), "header x-version ~ v[23] → echo-v2", "t-hdr-regex",
                   headers={"x-version": "v2"})
        _expect(g, "t-hdr-regex", [
            ("/", {"headers": {"X-VERSION": "v3"}}, V2), ("/", {"headers": {"x-version": "v4"}}, V3),
            ("/", {}, V3)])


def test_match_query_exact(g: GammaNode) -> None:
    with g.routes("query-exact", route("query-exact", parent("t-query-exact"), [
            rule(backend("echo-v2"), matches=[{"queryParams": [{"name": "env", "value": "canary"}]}]),
            rule(backend("echo-v3"))])):
        g.converge(_to(V2), "?env=canary → echo-v2", "t-query-exact", "/?env=canary")
        _expect(g, "t-query-exact", [
            ("/?env=canary", {}, V2), ("/p?a=1&env=canary", {}, V2), ("/?env=prod", {}, V3),
            ("/?env=canary2", {}, V3), ("/?other=canary", {}, V3), ("/", {}, V3)])


def test_match_query_regex(g: GammaNode) -> None:
    with g.routes("query-regex", route("query-regex", parent("t-query-regex"), [
            rule(backend("echo-v2"), matches=[{"queryParams": [
                {"type": "RegularExpression", "name": "id", "value": "[0-9]+"}]}]),
            rule(backend("echo-v3"))])):
        g.converge(_to(V2), "?id=[0-9]+ → echo-v2", "t-query-regex", "/?id=42")
        _expect(g, "t-query-regex", [
            ("/?id=42", {}, V2), ("/x?id=7&y=z", {}, V2), ("/?id=abc", {}, V3), ("/?id=", {}, V3),
            ("/", {}, V3)])


def test_match_method(g: GammaNode) -> None:
    with g.routes("method", route("method", parent("t-method"), [
            rule(backend("echo-v2"), matches=[{"method": "DELETE"}]),
            rule(backend("echo-v3"), matches=[{"method": "POST", **path("PathPrefix", "/p")}])])):
        g.converge(_to(V2), "DELETE → echo-v2", "t-method", method="DELETE")
        _expect(g, "t-method", [
            ("/", {"method": "DELETE"}, V2), ("/any/path", {"method": "DELETE"}, V2),
            ("/p", {"method": "POST"}, V3), ("/p/q", {"method": "POST"}, V3),
            ("/", {"method": "POST"}, "status 404"), ("/p", {"method": "GET"}, "status 404"),
            ("/", {"method": "PUT"}, "status 404")])
        answers = g.http("t-method", "/p", method="POST")
        assert answers[0].seen["method"] == "POST", answers[0].brief()


def test_matches_are_ored_and_fields_anded(g: GammaNode) -> None:
    with g.routes("or", route("or", parent("t-or"), [
            rule(backend("echo-v2"), matches=[
                path("Exact", "/or-a"),
                {"headers": [{"name": "x-or", "value": "yes"}]},
                {**path("PathPrefix", "/and"), "headers": [{"name": "x-and", "value": "1"}],
                 "queryParams": [{"name": "q", "value": "1"}], "method": "GET"}]),
            rule(backend("echo-v3"))])):
        g.converge(_to(V2), "/or-a → echo-v2", "t-or", "/or-a")
        _expect(g, "t-or", [
            ("/or-a", {}, V2), ("/elsewhere", {"headers": {"x-or": "yes"}}, V2),
            ("/and/x?q=1", {"headers": {"x-and": "1"}}, V2), ("/elsewhere", {}, V3),
            ("/and/x?q=1", {}, V3), ("/and/x", {"headers": {"x-and": "1"}}, V3),
            ("/and/x?q=1", {"headers": {"x-and": "1"}, "method": "POST"}, V3)])


def test_no_match_is_404(g: GammaNode) -> None:
    with g.routes("404", route("r404", parent("t-404"), [
            rule(backend("echo-v2"), matches=[path("PathPrefix", "/only")])])):
        g.converge(_to(V2), "/only → echo-v2", "t-404", "/only")
        for p in ("/", "/other", "/onlyx"):
            answers = g.http("t-404", p, count=3)
            assert [a.status for a in answers] == [404] * 3, f"{p}: {summary(answers)}"
            assert not any(a.seen for a in answers), "a backend answered a request no rule matches"


# ---- precedence ----------------------------------------------------------------------------


def test_precedence_exact_over_prefix(g: GammaNode) -> None:
    with g.routes("prec-exact", route("prec-exact", parent("t-prec-exact"), [
            rule(backend("echo-v2"), matches=[path("PathPrefix", "/pre")]),
            rule(backend("echo-v3"), matches=[path("Exact", "/pre/x")])])):
        g.converge(_to(V2), "/pre/y → echo-v2", "t-prec-exact", "/pre/y")
        _expect(g, "t-prec-exact", [("/pre/x", {}, V3), ("/pre/y", {}, V2), ("/pre", {}, V2)])


def test_precedence_longest_prefix(g: GammaNode) -> None:
    with g.routes("prec-prefix", route("prec-prefix", parent("t-prec-prefix"), [
            rule(backend("echo-v2"), matches=[path("PathPrefix", "/a")]),
            rule(backend("echo-v3"), matches=[path("PathPrefix", "/a/b")])])):
        g.converge(_to(V2), "/a/x → echo-v2", "t-prec-prefix", "/a/x")
        _expect(g, "t-prec-prefix", [("/a/b", {}, V3), ("/a/b/c", {}, V3), ("/a/bc", {}, V2),
                                     ("/a", {}, V2)])


def test_precedence_method(g: GammaNode) -> None:
    with g.routes("prec-method", route("prec-method", parent("t-prec-method"), [
            rule(backend("echo-v2"), matches=[{**path("PathPrefix", "/m"),
                                               "headers": [{"name": "x-h", "value": "1"}]}]),
            rule(backend("echo-v3"), matches=[{**path("PathPrefix", "/m"), "method": "POST"}])])):
        g.converge(_to(V2), "GET /m x-h:1 → echo-v2", "t-prec-method", "/m", headers={"x-h": "1"})
        # method outranks header count: POST with the header goes to the method rule
        _expect(g, "t-prec-method", [("/m", {"method": "POST", "headers": {"x-h": "1"}}, V3),
                                     ("/m", {"headers": {"x-h": "1"}}, V2)])


def test_precedence_most_headers(g: GammaNode) -> None:
    with g.routes("prec-headers", route("prec-headers", parent("t-prec-headers"), [
            rule(backend("echo-v2"), matches=[{"headers": [{"name": "x-a", "value": "1"}],
                                               "queryParams": [{"name": "q", "value": "1"}]}]),
            rule(backend("echo-v3"), matches=[{"headers": [{"name": "x-a", "value": "1"},
                                                           {"name": "x-b", "value": "2"}]}])])):
        g.converge(_to(V2), "x-a:1 ?q=1 → echo-v2", "t-prec-headers", "/?q=1", headers={"x-a": "1"})
        # header count outranks query count
        _expect(g, "t-prec-headers", [("/?q=1", {"headers": {"x-a": "1", "x-b": "2"}}, V3),
                                      ("/?q=1", {"headers": {"x-a": "1"}}, V2)])


def test_precedence_most_query_params(g: GammaNode) -> None:
    with g.routes("prec-query", route("prec-query", parent("t-prec-query"), [
            rule(backend("echo-v2"), matches=[{"queryParams": [{"name": "a", "value": "1"}]}]),
            rule(backend("echo-v3"), matches=[{"queryParams": [{"name": "a", "value": "1"},
                                                               {"name": "b", "value": "2"}]}])])):
        g.converge(_to(V2), "?a=1 → echo-v2", "t-prec-query", "/?a=1")
        _expect(g, "t-prec-query", [("/?a=1&b=2", {}, V3), ("/?b=2&a=1", {}, V3), ("/?a=1", {}, V2)])


def test_precedence_oldest_route(g: GammaNode) -> None:
    """Same match on two routes: the older one wins (alphabetical order would say a-newer)."""
    with g.routes("prec-age",
                  route("a-newer", parent("t-prec-age"), [rule(backend("echo-v2"))],
                        created="2026-03-01T00:00:00Z"),
                  route("b-older", parent("t-prec-age"), [rule(backend("echo-v3"))],
                        created="2026-01-01T00:00:00Z")):
        answers = g.converge(lambda a: a.pod != V1, "t-prec-age routed", "t-prec-age", samples=5)
        assert pods(answers) == {V3: 5}, summary(answers) + "\n" + g.envoy_evidence("t-prec-age")


def test_precedence_namespace_name_alphabetical(g: GammaNode) -> None:
    with g.routes("prec-name",
                  route("b-route", parent("t-prec-name"), [rule(backend("echo-v2"))]),
                  route("a-route", parent("t-prec-name"), [rule(backend("echo-v3"))])):
        answers = g.converge(lambda a: a.pod != V1, "t-prec-name routed", "t-prec-name", samples=5)
        assert pods(answers) == {V3: 5}, summary(answers) + "\n" + g.envoy_evidence("t-prec-name")


def test_precedence_rule_order(g: GammaNode) -> None:
    with g.routes("prec-rule", route("prec-rule", parent("t-prec-rule"), [
            rule(backend("echo-v3"), matches=[path("PathPrefix", "/r")]),
            rule(backend("echo-v2"), matches=[path("PathPrefix", "/r")]),
            rule(backend("echo-v2"), matches=[path("PathPrefix", "/s")])])):
        g.converge(_to(V2), "/s → echo-v2", "t-prec-rule", "/s")
        _expect(g, "t-prec-rule", [("/r", {}, V3), ("/r/x", {}, V3)])


# ---- filters -------------------------------------------------------------------------------


def test_request_header_modifier(g: GammaNode) -> None:
    with g.routes("reqhdr", route("reqhdr", parent("t-reqhdr"), [rule(backend("echo-v2"), filters=[
            {"type": "RequestHeaderModifier", "requestHeaderModifier": {
                "set": [{"name": "X-Set", "value": "new"}, {"name": "x-fresh", "value": "f 100%"}],
                "add": [{"name": "X-Add", "value": "b"}],
                "remove": ["X-Remove"]}}])])):
        g.converge(_to(V2), "t-reqhdr → echo-v2", "t-reqhdr")
        a = g.one("t-reqhdr", "/h", headers={"x-set": "old", "x-add": "a", "x-remove": "gone",
                                             "x-keep": "kept"})
        seen = a.seen_headers
        assert a.pod == V2, a.brief()
        assert seen.get("x-set") == "new", seen
        assert seen.get("x-fresh") == "f 100%", seen
        assert [v.strip() for v in seen.get("x-add", "").split(",")] == ["a", "b"], seen
        assert "x-remove" not in seen, seen
        assert seen.get("x-keep") == "kept", seen


def test_response_header_modifier(g: GammaNode) -> None:
    with g.routes("resphdr", route("resphdr", parent("t-resphdr"), [rule(backend("echo-v2"), filters=[
            {"type": "ResponseHeaderModifier", "responseHeaderModifier": {
                "set": [{"name": "X-Backend-Header", "value": "changed"}],
                "add": [{"name": "x-resp-add", "value": "added"}],
                "remove": ["X-POD"]}}])])):
        a = g.converge(lambda a: a.seen.get("pod") == V2, "t-resphdr → echo-v2", "t-resphdr")[0]
        assert a.headers.get("x-backend-header") == "changed", a.headers
        assert a.headers.get("x-resp-add") == "added", a.headers
        assert "x-pod" not in a.headers, a.headers
        assert a.headers.get("content-type") == "application/json", a.headers


def test_request_redirect(g: GammaNode) -> None:
    def redirect(prefix: str, code: int | None = None, **spec: Any) -> dict[str, Any]:
        if code is not None:
            spec["statusCode"] = code
        return rule(matches=[path("PathPrefix", prefix)],
                    filters=[{"type": "RequestRedirect", "requestRedirect": spec}])

    full = {"type": "ReplaceFullPath", "replaceFullPath": "/replaced"}
    with g.routes("redirect", route("redirect", parent("t-redirect", port=None), [
            redirect("/scheme", scheme="https"),
            redirect("/host", 301, hostname="example.com"),
            redirect("/port", port=8443),
            redirect("/full", path=full),
            redirect("/old", 301, path={"type": "ReplacePrefixMatch", "replacePrefixMatch": "/new"}),
            redirect("/combo", 302, scheme="https", hostname="secure.example", port=8443,
                     path={"type": "ReplaceFullPath", "replaceFullPath": "/landing"}),
            redirect("/s303", 303), redirect("/s307", 307), redirect("/s308", 308),
            rule(backend("echo-v2"), matches=[path("PathPrefix", "/probe")])])):
        g.converge(_to(V2), "t-redirect routes /probe", "t-redirect", "/probe")
        cases = [  # (port, Host, path, status, Location)
            (80, "t-redirect", "/scheme/x", 302, "https://t-redirect/scheme/x"),
            (80, "t-redirect:80", "/scheme/x", 302, "https://t-redirect/scheme/x"),
            (80, "t-redirect", "/host/y", 301, "http://example.com/host/y"),
            (80, "t-redirect", "/port", 302, "http://t-redirect:8443/port"),
            (80, "t-redirect", "/full/a/b", 302, "http://t-redirect/replaced"),
            (80, "t-redirect", "/old/x/y", 301, "http://t-redirect/new/x/y"),
            (80, "t-redirect", "/old", 301, "http://t-redirect/new"),
            (80, "t-redirect", "/combo/z", 302, "https://secure.example:8443/landing"),
            (80, "t-redirect", "/s303", 303, "http://t-redirect/s303"),
            (80, "t-redirect", "/s307", 307, "http://t-redirect/s307"),
            (80, "t-redirect", "/s308", 308, "http://t-redirect/s308"),
            # no scheme, no port: the Service port (the mesh's listener port) is kept
            (ALT_PORT, f"t-redirect:{ALT_PORT}", "/full", 302, f"http://t-redirect:{ALT_PORT}/replaced"),
            (ALT_PORT, "t-redirect", "/full", 302, f"http://t-redirect:{ALT_PORT}/replaced"),
        ]
        wrong = []
        for port, host, p, status, location in cases:
            a = g.one("t-redirect", p, port=port, headers={"Host": host})
            got = (a.status, a.headers.get("location"))
            if got != (status, location):
                wrong.append(f"port {port} Host {host} {p}: want {status} {location}, got {a.brief()}")
        assert not wrong, "\n".join(wrong) + "\n" + g.envoy_evidence("t-redirect")


def test_request_redirect_scheme_change_from_service_port(g: GammaNode) -> None:
    """Dialled on 8081 (Host t-redirect:8081), a redirect to https with no port: the port is
    https's well-known 443, and HTTPRequestRedirectFilter.port says implementations SHOULD NOT
    add it to the Location header ("https://t-redirect/scheme", not ".../t-redirect:443/...")."""
    with g.routes("redirect", route("redirect", parent("t-redirect", port=None), [
            rule(matches=[path("PathPrefix", "/scheme")],
                 filters=[{"type": "RequestRedirect", "requestRedirect": {"scheme": "https"}}]),
            rule(backend("echo-v2"), matches=[path("PathPrefix", "/probe")])])):
        g.converge(_to(V2), "t-redirect routes /probe", "t-redirect", "/probe", port=ALT_PORT)
        for host in (f"t-redirect:{ALT_PORT}", "t-redirect"):
            a = g.one("t-redirect", "/scheme", port=ALT_PORT, headers={"Host": host})
            assert (a.status, a.headers.get("location")) == (302, "https://t-redirect/scheme"), (
                f"Host {host}: {a.brief()}\n{g.envoy_evidence('t-redirect')}")


def test_url_rewrite_hostname_and_full_path(g: GammaNode) -> None:
    with g.routes("rewrite", route("rewrite", parent("t-rewrite"), [
            rule(backend("echo-v2"), matches=[path("PathPrefix", "/host")], filters=[
                {"type": "URLRewrite", "urlRewrite": {"hostname": "rewritten.example"}}]),
            rule(backend("echo-v2"), matches=[path("PathPrefix", "/full")], filters=[
                {"type": "URLRewrite", "urlRewrite": {"hostname": "both.example", "path": {
                    "type": "ReplaceFullPath", "replaceFullPath": "/replaced"}}}])])):
        g.converge(_to(V2), "t-rewrite /host → echo-v2", "t-rewrite", "/host/x")
        a = g.one("t-rewrite", "/host/x?k=v")
        assert (a.seen["host"], a.seen["path"]) == ("rewritten.example", "/host/x?k=v"), a.brief()
        a = g.one("t-rewrite", "/full/deep/path")
        assert (a.seen["host"], a.seen["path"]) == ("both.example", "/replaced"), a.brief()
        a = g.one("t-rewrite", "/full?k=v")
        assert a.seen["path"].split("?")[0] == "/replaced", a.brief()


def test_url_rewrite_prefix(g: GammaNode) -> None:
    """The spec's ReplacePrefixMatch table (HTTPPathModifier), one prefix per row group."""
    def rewrite(prefix: str, replacement: str) -> dict[str, Any]:
        return rule(backend("echo-v2"), matches=[path("PathPrefix", prefix)], filters=[
            {"type": "URLRewrite", "urlRewrite": {"path": {
                "type": "ReplacePrefixMatch", "replacePrefixMatch": replacement}}}])

    with g.routes("rewrite-prefix", route("rewrite-prefix", parent("t-rewrite-prefix"), [
            rewrite("/p1", "/xyz"), rewrite("/p2/", "/xyz/"), rewrite("/p3", ""), rewrite("/p4", "/"),
            rewrite("/", "/root")])):
        g.converge(_to(V2), "t-rewrite-prefix → echo-v2", "t-rewrite-prefix", "/p1/bar")
        cases = [("/p1/bar", "/xyz/bar"), ("/p1", "/xyz"), ("/p1/", "/xyz/"),
                 ("/p2/bar", "/xyz/bar"),
                 ("/p3/bar", "/bar"), ("/p3/", "/"), ("/p3", "/"),
                 ("/p4/bar", "/bar"), ("/p4/", "/"), ("/p4", "/"),
                 ("/p1x", "/root/p1x"), ("/other/x", "/root/other/x")]
        wrong = []
        for p, want in cases:
            a = g.one("t-rewrite-prefix", p)
            if a.seen.get("path") != want:
                wrong.append(f"{p}: want backend path {want}, got {a.brief()}")
        assert not wrong, "\n".join(wrong) + "\n" + g.envoy_evidence("t-rewrite-prefix")


def test_request_mirror(g: GammaNode) -> None:
    with g.routes("mirror", route("mirror", parent("t-mirror"), [rule(backend("echo-v2"), filters=[
            {"type": "RequestMirror", "requestMirror": {"backendRef": backend("echo-v3")}}])])):
        g.converge(_to(V2), "t-mirror → echo-v2", "t-mirror")
        tag = f"/mirror/{uuid.uuid4().hex}"
        answers = g.http("t-mirror", tag, count=3)
        assert pods(answers) == {V2: 3}, summary(answers)
        copies: list[dict[str, Any]] = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # mirrored requests are sent asynchronously
            copies = [r for r in g.echo[V3].requests() if r["path"] == tag]
            if len(copies) >= 3:
                break
            time.sleep(0.1)
        assert len(copies) == 3, (f"mirror backend echo-v3 saw {len(copies)} copies of {tag}\n"
                                  f"{g.envoy_evidence('t-mirror')}")
        assert not [r for r in g.echo[V1].requests() if r["path"] == tag]
        assert copies[0]["method"] == "GET"


def test_request_mirror_percent(g: GammaNode) -> None:
    with g.routes("mirror-pct", route("mirror-pct", parent("t-mirror-pct"), [rule(
            backend("echo-v2"), filters=[{"type": "RequestMirror", "requestMirror": {
                "backendRef": backend("echo-v3"), "percent": 50}}])])):
        g.converge(_to(V2), "t-mirror-pct → echo-v2", "t-mirror-pct")
        tag = f"/mirror-pct/{uuid.uuid4().hex}"
        answers = g.http("t-mirror-pct", tag, count=400, keepalive=True)
        assert pods(answers) == {V2: 400}, summary(answers)
        time.sleep(1.0)  # mirrored requests are sent asynchronously
        copies = len([r for r in g.echo[V3].requests() if r["path"] == tag])
        assert 140 <= copies <= 260, f"50% mirror sent {copies} of 400 copies"


def test_timeouts_request(g: GammaNode) -> None:
    """timeouts.request bounds the whole request: a slow backend answers 504 in time."""
    with g.routes("timeout", route("timeout", parent("t-timeout"), [rule(
            backend("echo-v2"), timeouts={"request": "300ms"})])):
        g.converge(_to(V2), "t-timeout → echo-v2", "t-timeout")
        t0 = time.monotonic()
        slow = g.http("t-timeout", "/slow", headers={"x-delay-ms": "2000"}, timeout=10)
        took = time.monotonic() - t0
        assert slow[0].status == 504, summary(slow)
        assert took < 1.5, f"the 300ms request timeout took {took:.2f}s"
        fast = g.http("t-timeout", "/fast", headers={"x-delay-ms": "50"})
        assert fast[0].status == 200 and fast[0].pod == V2


def test_retry_on_codes(g: GammaNode) -> None:
    """retry (v1.2 experimental): 503s from the backend are retried up to `attempts` times."""
    with g.routes("retry", route("retry", parent("t-retry"), [rule(
            backend("echo-v2"), retry={"codes": [503], "attempts": 3, "backoff": "10ms"})])):
        g.converge(_to(V2), "t-retry → echo-v2", "t-retry")
        tag = uuid.uuid4().hex
        got = g.http("t-retry", f"/r/{tag}", headers={"x-fail-first": "2"})
        assert got[0].status == 200 and got[0].pod == V2, summary(got)
        tries = [r for r in g.echo[V2].requests() if r["path"] == f"/r/{tag}"]
        assert len(tries) == 3, f"backend saw {len(tries)} tries, want 2 failures + 1 success"


def _first_tries_fail_at_once(g: GammaNode, n: int) -> list[Answer]:
    """``n`` requests to t-budget at once, each on a path of its own whose first try fails
    (503 after 1 s, all together) and whose retry succeeds."""
    from concurrent.futures import ThreadPoolExecutor
    tag = uuid.uuid4().hex
    headers = {"x-fail-first": "1", "x-delay-ms": "1000"}
    with ThreadPoolExecutor(n) as pool:
        return [a for got in pool.map(lambda i: g.http("t-budget", f"/b/{tag}/{i}",
                                                         headers=headers), range(n))
                for a in got]


def test_the_retry_budget_bounds_concurrent_retries(g: GammaNode) -> None:
    """A route retrying 503s, 8 requests whose first tries fail together: with the agent's
    default budget (20 % of active requests, at least 3 concurrent retries) 3 or more are
    retried and answered; with an XBackendTrafficPolicy on the backend Service allowing 1
    concurrent retry, at most 2 are (the rest get the 503, counted as retry overflow)."""
    cluster = "cluster.svc|gamma|t-budget-be|80"
    with g.routes("budget", route("budget", parent("t-budget"), [rule(
            backend("t-budget-be"), retry={"codes": [503], "attempts": 2, "backoff": "10ms"})])):
        g.converge(_to(V3), "t-budget → echo-v3", "t-budget")
        got = _first_tries_fail_at_once(g, 8)
        assert sum(a.status == 200 for a in got) >= 3, summary(got)
        g.write("budget-policy", [{
            "apiVersion": "gateway.networking.x-k8s.io/v1alpha1", "kind": "XBackendTrafficPolicy",
            "metadata": {"name": "t-budget-be", "namespace": PRODUCER_NS},
            "spec": {"targetRefs": [{"group": "", "kind": "Service", "name": "t-budget-be"}],
                     "retryConstraint": {"budget": {"percent": 1, "interval": "10s"},
                                         "minRetryRate": {"count": 1, "interval": "1s"}}}}])
        try:
            until(lambda: g.cluster_thresholds("svc|gamma|t-budget-be|80").get(
                "retry_budget", {}).get("min_retry_concurrency") == 1,
                "the policy's budget never reached Envoy", timeout=CONVERGE_TIMEOUT)
            before = g.node.stat(f"{cluster}.upstream_rq_retry_overflow")
            got = _first_tries_fail_at_once(g, 8)
            assert sum(a.status == 200 for a in got) <= 2, summary(got)
            assert sum(a.status == 503 for a in got) >= 6, summary(got)
            assert g.node.stat(f"{cluster}.upstream_rq_retry_overflow") - before >= 6
        finally:
            g.remove("budget-policy")


# ---- backends ------------------------------------------------------------------------------


def _split(g: GammaNode, target: str, n: int, **kw: Any) -> Counter[str]:
    return pods(g.http(target, "/w", count=n, keepalive=True, **kw))


def test_weights_split(g: GammaNode) -> None:
    weights = {V1: 20, V2: 30, V3: 50}
    with g.routes("weights", route("weights", parent("t-weights"), [rule(
            backend("echo-v1", 20), backend("echo-v2", 30), backend("echo-v3", 50),
            filters=[mark("weights")])])):
        g.converge(_marked("weights"), "t-weights route applies", "t-weights", samples=3)
        n = 1000
        got = _split(g, "t-weights", n)
        total = sum(weights.values())
        off = {p: round(100 * got.get(p, 0) / n - 100 * w / total, 1) for p, w in weights.items()}
        assert sum(got[p] for p in weights) == n, got
        assert all(abs(d) <= 5 for d in off.values()), f"split {dict(got)} of {n}: off by {off} points"


def test_weight_zero_never_hit(g: GammaNode) -> None:
    with g.routes("weight0", route("weight0", parent("t-weight0"), [rule(
            backend("echo-v2", 1), backend("echo-v3", 0), filters=[mark("weight0")])])):
        g.converge(_marked("weight0", V2), "t-weight0 route applies", "t-weight0", samples=3)
        got = _split(g, "t-weight0", 300)
        assert got == {V2: 300}, got


def test_missing_backend_share_is_500(g: GammaNode) -> None:
    with g.routes("missing", route("missing", parent("t-missing"), [rule(
            backend("echo-v2", 50), backend("does-not-exist", 50), filters=[mark("missing")])])):
        g.converge(lambda a: a.status == 500 or a.route_mark == "missing",
                   "t-missing route applies", "t-missing", samples=3)
        n = 1000
        got = _split(g, "t-missing", n)
        assert set(got) == {V2, "status 500"}, got
        assert abs(100 * got["status 500"] / n - 50) <= 5, f"{dict(got)} of {n}"


def test_backend_level_filters(g: GammaNode) -> None:
    def tagged(name: str, value: str) -> dict[str, Any]:
        return backend(name, 1, filters=[
            {"type": "RequestHeaderModifier",
             "requestHeaderModifier": {"set": [{"name": "x-backend", "value": value}]}},
            {"type": "ResponseHeaderModifier",
             "responseHeaderModifier": {"set": [{"name": "x-served-by", "value": value}]}}])

    with g.routes("be-filters", route("be-filters", parent("t-be-filters"), [
            rule(tagged("echo-v2", "two"), tagged("echo-v3", "three"))])):
        g.converge(lambda a: a.pod in (V2, V3), "t-be-filters routed", "t-be-filters", samples=3)
        answers = g.http("t-be-filters", "/", count=40, keepalive=True)
        want = {V2: "two", V3: "three"}
        assert set(pods(answers)) == {V2, V3}, summary(answers)
        for a in answers:
            assert a.seen_headers.get("x-backend") == want[a.pod], a.brief()
            assert a.headers.get("x-served-by") == want[a.pod], a.headers


# ---- attachment ----------------------------------------------------------------------------


def test_callers_moving_to_their_own_listener_lose_no_connection(g: GammaNode) -> None:
    """Callers in namespaces without consumer routes share the internal listener ``mesh``;
    a namespace's first consumer route gives its callers ``mesh-<ns>`` (the listener goes
    out before their cluster moves to it), which they keep while they have pods. New
    connections from that namespace all the while, to the route's target and to a Service
    without routes, all answer; so does a kept-alive connection opened before the route
    came, and one opened while it was there, after it has gone (no listener either crossed
    was removed), and again after the agent restarts with its Envoy adopted."""
    import http.client
    import threading

    from agent.netns.enter import run_in_netns

    answers: list[tuple[str, Answer]] = []
    stop = threading.Event()

    def stream() -> None:
        while not stop.is_set():
            for target in ("t-move", "echo-v2"):
                answers.extend((target, a) for a in g.http(target, "/", client="consumer/client",
                                                           count=5, timeout=3.0))

    def mesh_listeners(want: list[str]) -> list[str]:
        """Envoy's internal listeners once they are ``want`` (an earlier test's routes may
        still be on their way), or as they are after 10 s."""
        deadline = time.monotonic() + 10
        while True:
            got = sorted(n for n in g.node.listeners() if n == "mesh" or n.startswith("mesh-"))
            if got == want or time.monotonic() > deadline:
                return got
            time.sleep(0.2)

    def opened() -> http.client.HTTPConnection:
        c = http.client.HTTPConnection(g.ips["echo-v2"], 80, timeout=5)
        c.connect()  # in the client's netns: the socket stays there
        return c

    kept = [run_in_netns(g.pods["consumer/client"].netns, opened, timeout=10)]

    def ask_kept() -> list[int]:
        """Each kept-alive connection's answer to one more request."""
        out = []
        for c in kept:
            c.request("GET", "/", headers={"Host": "echo-v2"})
            r = c.getresponse()
            r.read()
            out.append(r.status)
        return out

    own = ["mesh", f"mesh-{CONSUMER_NS}"]
    # the first test with a consumer route (placed so): the namespace still shares ``mesh``
    assert mesh_listeners(["mesh"]) == ["mesh"]
    assert ask_kept() == [200]
    worker = threading.Thread(target=stream, daemon=True)
    worker.start()
    try:
        time.sleep(1.0)
        with g.routes("move",
                      route("consumer", parent("t-move", namespace=PRODUCER_NS),
                            [rule(backend("echo-v3", namespace=PRODUCER_NS),
                                  filters=[mark("consumer")])], namespace=CONSUMER_NS)):
            g.converge(_marked("consumer", V3), "the consumer client gets its route", "t-move",
                       client="consumer/client", samples=3)
            assert mesh_listeners(own) == own
            # a second one, through the namespace's own listener
            kept.append(run_in_netns(g.pods["consumer/client"].netns, opened, timeout=10))
            assert ask_kept() == [200, 200]
            time.sleep(1.0)
        g.converge(lambda a: a.pod == V1 and a.route_mark is None, "the route is gone",
                   "t-move", client="consumer/client", samples=3)
        time.sleep(3.0)  # past Envoy's drain time (--drain-time-s 2)
        assert mesh_listeners(own) == own  # kept while the namespace has pods
        assert ask_kept() == [200, 200]
        # the agent dies and a new one adopts its Envoy: it learns from Envoy which listener
        # each namespace's cluster reaches and keeps the namespace's own one (a builder
        # starting blank would drop it: the namespace has no consumer route any more)
        pid = g.node.envoy_pid()
        assert g.agent.proc is not None
        g.agent.proc.kill()
        g.agent.proc.wait()
        g.agent.start()
        assert g.node.envoy_pid() == pid  # adopted
        assert "adopted envoy holds" in g.agent.logs()
        g.converge(lambda a: a.pod == V1 and a.route_mark is None, "the new agent serves",
                   "t-move", client="consumer/client", samples=3)
        time.sleep(3.0)  # past the drain time of any listener the new agent removed
        assert mesh_listeners(own) == own
        assert ask_kept() == [200, 200]
    finally:
        stop.set()
        worker.join(30)
        for c in kept:
            c.close()
    failed = [f"{target}: {a.brief()}" for target, a in answers if a.status != 200]
    assert len(answers) >= 50 and not failed, f"{len(failed)}/{len(answers)} failed: {failed[:5]}"


def test_consumer_route_vs_producer_route(g: GammaNode) -> None:
    """A consumer route (in ns consumer) replaces the producer route for consumer pods only,
    and only on the ports it binds to."""
    with g.routes("consumer",
                  route("producer", parent("t-consumer", port=None),
                        [rule(backend("echo-v2"), filters=[mark("producer")])]),
                  route("consumer", parent("t-consumer", port=ALT_PORT, namespace=PRODUCER_NS),
                        [rule(backend("echo-v3", namespace=PRODUCER_NS), filters=[mark("consumer")])],
                        namespace=CONSUMER_NS)):  # its backendRef crosses namespaces, no grant
        g.converge(_marked("consumer", V3), "consumer client on 8081 gets the consumer route",
                   "t-consumer", client="consumer/client", port=ALT_PORT, samples=3)
        # each namespace listener gets its table in its own push: the producer client's too
        g.converge(_marked("producer", V2), "producer client on 8081 gets the producer route",
                   "t-consumer", client="gamma/client", port=ALT_PORT, samples=3)
        for client, port, want, who in (
                ("gamma/client", ALT_PORT, V2, "producer"),
                ("gamma/client", 80, V2, "producer"),
                ("consumer/client", 80, V2, "producer"),  # consumer route is bound to 8081 only
                ("consumer/client", ALT_PORT, V3, "consumer")):
            answers = g.http("t-consumer", "/", client=client, port=port, count=10)
            assert all(a.pod == want and a.route_mark == who for a in answers), (
                f"{client} → t-consumer:{port}: want {want} via the {who} route, got "
                f"{summary(answers)}\n{g.envoy_evidence('t-consumer')}")


def test_consumer_route_on_all_ports(g: GammaNode) -> None:
    with g.routes("consumer",
                  route("producer", parent("t-consumer", port=None),
                        [rule(backend("echo-v2"), filters=[mark("producer")])]),
                  route("consumer", parent("t-consumer", port=None, namespace=PRODUCER_NS),
                        [rule(backend("echo-v3", namespace=PRODUCER_NS), filters=[mark("consumer")])],
                        namespace=CONSUMER_NS)):  # its backendRef crosses namespaces, no grant
        g.converge(_marked("consumer", V3), "consumer client gets the consumer route",
                   "t-consumer", client="consumer/client", samples=3)
        g.converge(_marked("producer", V2), "producer client keeps the producer route",
                   "t-consumer", client="gamma/client", samples=3)
        for port in (80, ALT_PORT):
            a = g.one("t-consumer", "/", client="consumer/client", port=port)
            assert a.route_mark == "consumer", a.brief()
            a = g.one("t-consumer", "/", client="gamma/client", port=port)
            assert a.route_mark == "producer", a.brief()


def test_mesh_consumer_route(g: GammaNode) -> None:
    """Upstream MeshConsumerRoute (conformance/tests/mesh/mesh-consumer-route.go), both cases:
    a route in the consumer namespace, parent and backendRef the Service echo-v1 of the
    producer namespace, no ReferenceGrant anywhere (GEP-1294: none is needed in the mesh),
    sets ``X-Header-Set: set`` on answers to the consumer namespace's requests only."""
    consumer = route("mesh-consumer-route", parent("echo-v1", namespace=PRODUCER_NS), [rule(
        backend("echo-v1", namespace=PRODUCER_NS), filters=[
            {"type": "ResponseHeaderModifier",
             "responseHeaderModifier": {"set": [{"name": "X-Header-Set", "value": "set"}]}}])],
                     namespace=CONSUMER_NS)
    with g.routes("mesh-consumer-route", consumer):
        # request from consumer route's namespace modified by HTTPRoute
        g.converge(lambda a: a.status == 200 and a.pod == V1
                   and a.headers.get("x-header-set") == "set",
                   "the consumer namespace's answers carry X-Header-Set", "echo-v1",
                   client="consumer/client", samples=3)
        # request not from consumer route's namespace not modified by HTTPRoute
        for a in g.http("echo-v1", "/", client="gamma/client", count=5):
            assert (a.status, a.pod) == (200, V1), a.brief()
            assert "x-header-set" not in a.headers, a.headers
        problems = g.agent.status()["mesh"]["route_problems"]
        assert not any("mesh-consumer-route" in p for p in problems), problems


def test_producer_route_to_a_backend_in_a_third_namespace_needs_no_grant(g: GammaNode) -> None:
    """A producer route (route and parent Service in ``consumer``) whose backendRef is a
    Service of another namespace (``gamma``) reaches it with no ReferenceGrant (GEP-1294),
    and its status says ResolvedRefs."""
    with g.routes("xns", route("xns", parent("t-xns"), [
            rule(backend("echo-v3", namespace=PRODUCER_NS), filters=[mark("xns")])],
            namespace=CONSUMER_NS)):
        for client in g.clients:
            g.converge(_marked("xns", V3), f"{client} → consumer/t-xns → gamma/echo-v3",
                       "t-xns", client=client, samples=3)
        problems = g.agent.status()["mesh"]["route_problems"]
        assert not any("xns" in p for p in problems), problems


def test_named_route_rule(g: GammaNode) -> None:
    """Rules with a `name` (HTTPRouteNamedRouteRule) are accepted and routed, and the name
    is what Envoy calls the route (it shows in access logs and config dumps)."""
    with g.routes("named", route("named", parent("t-named"), [
            rule(backend("echo-v2"), matches=[path("PathPrefix", "/two")], filters=[mark("two")],
                 name="to-two"),
            rule(backend("echo-v3"), filters=[mark("rest")], name="the-rest")])):
        g.converge(_marked("two", V2), "the named rule /two routes", "t-named", "/two", samples=3)
        assert g.one("t-named", "/other").route_mark == "rest"
        names = {r.get("name", "") for vh in _virtual_hosts(g.config_dump(), "named")
                 for r in vh.get("routes", [])}
        assert any(n.endswith("|to-two|0") for n in names), names
        assert any(n.endswith("|the-rest|0") for n in names), names


def _virtual_hosts(dump: Any, route_name: str) -> list[dict[str, Any]]:
    """The virtual hosts of every inline route configuration naming ``route_name``."""
    found: list[dict[str, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "virtual_hosts" in node and route_name in str(node):
                found.extend(node["virtual_hosts"])
                return
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(dump)
    return found


def test_port_scoped_parent(g: GammaNode) -> None:
    with g.routes("echo-port", route("echo-port", parent("echo", port=ALT_PORT),
                                     [rule(backend("echo-v3"), filters=[mark("port-8081")])])):
        g.converge(_marked("port-8081", V3), "echo:8081 follows the port-scoped route", "echo",
                   port=ALT_PORT, samples=3)
        answers = g.http("echo", "/", count=30)
        assert not any(a.route_mark for a in answers), f"echo:80 was routed: {summary(answers)}"
        assert len(pods(answers)) >= 2, f"echo:80 should keep its identity route: {summary(answers)}"


def test_section_name_parent(g: GammaNode) -> None:
    with g.routes("section", route("section", parent("t-section", port=None, section="http-alt"),
                                   [rule(backend("echo-v3"), filters=[mark("section")])])):
        g.converge(_marked("section", V3), "t-section:8081 (http-alt) routed", "t-section",
                   port=ALT_PORT, samples=3)
        answers = g.http("t-section", "/", count=10)
        assert pods(answers) == {V1: 10} and not any(a.route_mark for a in answers), summary(answers)


def test_routes_vanish_identity_fallback(g: GammaNode) -> None:
    with g.routes("vanish", route("vanish", parent("t-vanish"),
                                  [rule(backend("echo-v2"), filters=[mark("vanish")])])):
        g.converge(_marked("vanish", V2), "t-vanish routed", "t-vanish", samples=3)
    answers = g.converge(lambda a: a.pod == V1 and not a.route_mark,
                         "t-vanish back on its identity route", "t-vanish", samples=5)
    assert answers[0].seen["path"] == "/"


def test_http_detected_without_app_protocol(g: GammaNode) -> None:
    with g.routes("detect", route("detect", parent("t-detect"),
                                  [rule(backend("echo-v2"), filters=[mark("detect")])])):
        g.converge(_marked("detect", V2), "t-detect (no appProtocol) routed as HTTP", "t-detect",
                   samples=3)


def test_non_http_app_protocol_keeps_l4(g: GammaNode) -> None:
    """A route on a port whose appProtocol is not HTTP cannot apply: the L4 chain stays."""
    with g.routes("opaque",
                  route("opaque", parent("t-opaque"), [rule(backend("echo-v2"), filters=[mark("opaque")])]),
                  route("opaque-control", parent("t-own-control"),
                        [rule(backend("echo-v2"), filters=[mark("opaque-control")])])):
        g.converge(_marked("opaque-control", V2), "the control route (same file) applies",
                   "t-own-control", samples=3)
        answers = g.http("t-opaque", "/", count=10)
        assert pods(answers) == {V1: 10} and not any(a.route_mark for a in answers), summary(answers)


# ---- GRPCRoute -----------------------------------------------------------------------------


def test_grpc_route_method_match_over_h2c(g: GammaNode) -> None:
    gb = {v: backend(f"grpc-{v}", port=GRPC_PORT) for v in VERSIONS}
    with g.routes("grpc", route("grpc", parent("echo-grpc", port=GRPC_PORT), [
            rule(gb["v2"], matches=[{"method": {"service": "echo.Echo", "method": "Ping"}}],
                 filters=[{"type": "RequestHeaderModifier",
                           "requestHeaderModifier": {"set": [{"name": "x-grpc-filter", "value": "ping"}]}}]),
            rule(gb["v1"], matches=[{"method": {"service": "echo.Echo"}}]),
            rule(gb["v3"], matches=[{"headers": [{"name": "X-Tenant", "value": "blue"}]},
                                          {"method": {"type": "RegularExpression",
                                                      "service": "admin\\.v[0-9]+\\.Admin",
                                                      "method": "Get.*"}}])],
            kind="GRPCRoute")):
        # echo-grpc's identity route spans every pod: the metadata the rule sets says "routed"
        g.grpc_converge(lambda a: a.pod == V2 and a.answer["metadata"].get("x-grpc-filter") == "ping",
                        "/echo.Echo/Ping → grpc-v2 via the route", "echo-grpc", "/echo.Echo/Ping")
        out = g.grpc_calls("echo-grpc", [
            {"method": "/echo.Echo/Ping", "count": 5},
            {"method": "/echo.Echo/Other", "count": 5},
            {"method": "/other.Svc/Call", "metadata": {"x-tenant": "blue"}, "count": 5},
            {"method": "/admin.v1.Admin/GetStatus", "count": 5},
            {"method": "/other.Svc/Call", "count": 3}])
        got = [a.pod for a in out]
        want = [V2] * 5 + [V1] * 5 + [V3] * 5 + [V3] * 5 + ["grpc UNIMPLEMENTED"] * 3
        assert got == want, f"{got}\n{g.envoy_evidence('echo-grpc')}"
        assert out[0].answer["method"] == "/echo.Echo/Ping"
        assert out[0].answer["metadata"].get("x-grpc-filter") == "ping", out[0].answer
        assert "x-grpc-filter" not in out[5].answer["metadata"], out[5].answer


def test_grpc_route_weights(g: GammaNode) -> None:
    with g.routes("grpc-weights", route("grpc-weights", parent("t-grpc-weights", port=GRPC_PORT), [
            rule(backend("grpc-v2", 75, port=GRPC_PORT), backend("grpc-v3", 25, port=GRPC_PORT),
                       backend("grpc-v1", 0, port=GRPC_PORT))], kind="GRPCRoute")):
        g.grpc_converge(lambda a: a.pod in (V2, V3), "t-grpc-weights routed", "t-grpc-weights",
                        "/echo.Echo/Ping", samples=5)
        n = 1000
        got = Counter(a.pod for a in g.grpc_calls("t-grpc-weights",
                                                  [{"method": "/echo.Echo/Ping", "count": n}]))
        assert set(got) == {V2, V3}, got
        assert abs(100 * got[V2] / n - 75) <= 5, f"{dict(got)} of {n}"


def test_grpc_route_wins_over_http_route(g: GammaNode) -> None:
    with g.routes("grpc-conflict",
                  route("conflict-grpc", parent("t-grpc-conflict", port=GRPC_PORT),
                        [rule(backend("grpc-v2", port=GRPC_PORT))], kind="GRPCRoute"),
                  route("conflict-http", parent("t-grpc-conflict", port=GRPC_PORT),
                        [rule(backend("grpc-v3", port=GRPC_PORT))], created="2025-01-01T00:00:00Z")):
        g.grpc_converge(lambda a: a.pod in (V2, V3), "t-grpc-conflict routed", "t-grpc-conflict",
                        "/echo.Echo/Ping", samples=5)
        out = g.grpc_calls("t-grpc-conflict", [{"method": "/echo.Echo/Ping", "count": 30}])
        assert Counter(a.pod for a in out) == {V2: 30}, (
            f"{Counter(a.pod for a in out)}\n{g.envoy_evidence('t-grpc-conflict')}")


# ---- ownership (docs/ownership.md) ---------------------------------------------------------


def test_ownership_route_for_other_mesh_is_ignored(g: GammaNode) -> None:
    with g.routes("own",
                  route("own-other", parent("t-own-route"), [rule(backend("echo-v2"),
                                                                  filters=[mark("other-mesh")])],
                        annotations={OWNER_KEY: OTHER_MESH}),
                  route("own-both", parent("t-own-both"), [rule(backend("echo-v2"),
                                                                filters=[mark("both")])],
                        annotations={OWNER_KEY: f"{OTHER_MESH}, aether.io/mesh"}),
                  route("own-svc", parent("t-own-svc"), [rule(backend("echo-v2"),
                                                              filters=[mark("svc-other")])]),
                  route("own-control", parent("t-own-control"), [rule(backend("echo-v2"),
                                                                      filters=[mark("control")])])):
        # the same manifest file: once these two apply, the agent has read the other two as well
        g.converge(_marked("control", V2), "the unannotated control route applies", "t-own-control",
                   samples=3)
        g.converge(_marked("both", V2), "a route naming aether among other meshes applies",
                   "t-own-both", samples=3)
        for target in ("t-own-route", "t-own-svc"):
            answers = g.http(target, "/", count=10)
            assert pods(answers) == {V1: 10} and not any(a.route_mark for a in answers), (
                f"{target} must keep its identity route: {summary(answers)}\n{g.envoy_evidence(target)}")


def test_agent_logged_no_traceback(g: GammaNode) -> None:
    logs = g.agent.logs()
    assert "Traceback" not in logs, logs[logs.index("Traceback") - 2000:][:6000]

