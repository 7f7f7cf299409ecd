"""GAMMA tables → Envoy protos, checked as protos, by ``envoy --mode validate``, and live."""

from __future__ import annotations

import http.client
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)

from agent.envoy.bootstrap import build_bootstrap, write_bootstrap
from agent.envoy.http_routes import (
    HTTP_PROTOCOL_OPTIONS_KEY,
    hcm_for,
    http_inspector_listener_filter,
    redirect_variants,
    route_configuration,
    service_port_chains,
    upstream_http_protocol_options,
)
from agent.envoy.resources import service_chain, service_cluster_name
from agent.envoy.supervisor import find_envoy_binary
from agent.scope.model import ServiceView
from agent.scope.route_tables import GRPC_ROUTE, HTTP_ROUTE, Match, PathMatch, Redirect, build_tables
from agent.scope.routes import route_from_object
from agent.scope.services import Service, ServicePort

SVCS = {
    "ns/echo": Service("ns", "echo", ("10.96.0.10",),
                       (ServicePort(80, "http"), ServicePort(8080, "alt"),
                        ServicePort(9090, "grpc", app_protocol="kubernetes.io/h2c"))),
    "ns/v1": Service("ns", "v1", ("10.96.0.11",), (ServicePort(80),)),
    "ns/v2": Service("ns", "v2", ("10.96.0.12",), (ServicePort(80),)),
}


def rules_of(rules: list[dict[str, Any]], kind: str = HTTP_ROUTE, port: int = 80
             ) -> list[rc.Route]:
    r = route_from_object(kind, {"metadata": {"name": "r", "namespace": "ns"}, "spec": {
        "parentRefs": [{"group": "", "kind": "Service", "name": "echo"}], "rules": rules}})
    t = build_tables([r], SVCS).table_for("ns/echo", port, "ns")
    assert t is not None
    return list(route_configuration(t, service_cluster_name).virtual_hosts[0].routes)


def one(rule: dict[str, Any], **kw: Any) -> rc.Route:
    routes = rules_of([rule], **kw)
    assert routes[-1].name == "no-match" and routes[-1].direct_response.status == 404
    return routes[0]


B1 = {"name": "v1", "port": 80}


# ---- matches -------------------------------------------------------------------------------


def test_path_matches() -> None:
    routes = rules_of([{"matches": [{"path": {"type": "Exact", "value": "/e"}},
                                    {"path": {"type": "PathPrefix", "value": "/v2/"}},
                                    {"path": {"type": "PathPrefix", "value": "/"}},
                                    {"path": {"type": "RegularExpression", "value": "/r.*"}}],
                        "backendRefs": [B1]}])
    assert routes[0].match.path == "/e"
    assert routes[1].match.safe_regex.regex == "/r.*"
    assert routes[2].match.path_separated_prefix == "/v2"  # whole segments, trailing / ignored
    assert routes[3].match.prefix == "/"
    assert routes[4].name == "no-match"


def test_header_query_method_matches() -> None:
    r = one({"matches": [{"method": "PUT", "headers": [
        {"name": "X-Env", "value": "a"}, {"type": "RegularExpression", "name": "V", "value": "1|2"}],
        "queryParams": [{"name": "Q", "value": "z"}]}], "backendRefs": [B1]})
    hs = {h.name: h.string_match for h in r.match.headers}
    assert hs[":method"].exact == "PUT" and hs["x-env"].exact == "a"
    assert hs["v"].safe_regex.regex == "1|2"
    (q,) = r.match.query_parameters
    assert (q.name, q.string_match.exact) == ("Q", "z")


def test_grpc_path_matching() -> None:
    routes = rules_of([{"matches": [
        {"method": {"service": "pkg.Svc", "method": "Get"}},
        {"method": {"service": "pkg.Svc"}},
        {"method": {"method": "Get"}},
        {"method": {"type": "RegularExpression", "service": "pkg\\..*", "method": "G.t"}},
        {}], "backendRefs": [B1]}], kind=GRPC_ROUTE, port=9090)
    by_name = {r.name.rsplit("|", 1)[-1]: r.match for r in routes[:-1]}
    assert by_name["0"].path == "/pkg.Svc/Get"
    assert by_name["1"].prefix == "/pkg.Svc/"
    assert by_name["2"].safe_regex.regex == "^/[^/]+/Get$"
    assert by_name["3"].safe_regex.regex == "^/(?:pkg\\..*)/(?:G.t)$"
    assert by_name["4"].prefix == "/"
    action = routes[0].route
    assert action.cluster_not_found_response_code == rc.RouteAction.SERVICE_UNAVAILABLE
    assert action.timeout.ToNanoseconds() == 0  # streams are not cut at Envoy's 15 s default


# ---- filters -------------------------------------------------------------------------------


def test_header_modifiers() -> None:
    r = one({"filters": [
        {"type": "RequestHeaderModifier", "requestHeaderModifier": {
            "set": [{"name": "X-S", "value": "100%"}], "add": [{"name": "X-A", "value": "a"}],
            "remove": ["X-R"]}},
        {"type": "ResponseHeaderModifier", "responseHeaderModifier": {
            "add": [{"name": "X-B", "value": "b"}]}}], "backendRefs": [B1]})
    s, a = r.request_headers_to_add
    assert (s.header.key, s.header.value, s.append_action) == (
        "x-s", "100%%", s.OVERWRITE_IF_EXISTS_OR_ADD)  # '%' is literal, not a formatter
    assert (a.header.key, a.append_action) == ("x-a", a.APPEND_IF_EXISTS_OR_ADD)
    assert list(r.request_headers_to_remove) == ["x-r"]
    assert r.response_headers_to_add[0].header.key == "x-b"


@pytest.mark.parametrize("prefix,repl,kind,expect", [
    ("/foo", "/xyz", "prefix", "/xyz"),
    ("/foo", "/xyz/", "prefix", "/xyz"),
    ("/foo/", "/xyz", "prefix", "/xyz"),
    ("/foo", "", "regex", ("^/foo/*", "/")),
    ("/foo", "/", "regex", ("^/foo/*", "/")),
    ("/", "/xyz", "regex", ("^/", "/xyz/")),
])
def test_url_rewrite_prefix(prefix: str, repl: str, kind: str, expect: Any) -> None:
    r = one({"matches": [{"path": {"type": "PathPrefix", "value": prefix}}], "filters": [
        {"type": "URLRewrite", "urlRewrite": {"hostname": "h.example", "path": {
            "type": "ReplacePrefixMatch", "replacePrefixMatch": repl}}}], "backendRefs": [B1]})
    assert r.route.host_rewrite_literal == "h.example"
    if kind == "prefix":
        assert r.route.prefix_rewrite == expect
    else:
        rr = r.route.regex_rewrite
        assert (rr.pattern.regex, rr.substitution) == expect


def test_url_rewrite_full_path() -> None:
    r = one({"filters": [{"type": "URLRewrite", "urlRewrite": {"path": {
        "type": "ReplaceFullPath", "replaceFullPath": "/full"}}}], "backendRefs": [B1]})
    assert (r.route.regex_rewrite.pattern.regex, r.route.regex_rewrite.substitution) == (
        "^/.*$", "/full")


@pytest.mark.parametrize("mirror,num,den", [
    ({}, None, None),
    ({"percent": 25}, 25, "HUNDRED"),
    ({"fraction": {"numerator": 1, "denominator": 10000}}, 1, "TEN_THOUSAND"),
    ({"fraction": {"numerator": 1, "denominator": 3}}, 333333, "MILLION"),
])
def test_mirror_fraction(mirror: dict[str, Any], num: int | None, den: str | None) -> None:
    r = one({"filters": [{"type": "RequestMirror", "requestMirror": {
        "backendRef": {"name": "v2", "port": 80}, **mirror}}], "backendRefs": [B1]})
    (mp,) = r.route.request_mirror_policies
    assert mp.cluster == "svc|ns|v2|80"
    if num is None:
        assert not mp.HasField("runtime_fraction")
    else:
        fp = mp.runtime_fraction.default_value
        assert fp.numerator == num and fp.DESCRIPTOR.fields_by_name["denominator"].enum_type \
            .values_by_number[fp.denominator].name == den


def test_weighted_clusters_zero_weight_and_invalid_share() -> None:
    r = one({"backendRefs": [{"name": "v1", "port": 80, "weight": 3},
                             {"name": "v2", "port": 80, "weight": 0},
                             {"name": "gone", "port": 80, "weight": 1, "filters": []},
                             {"name": "v2", "port": 80, "weight": 2, "filters": [
                                 {"type": "RequestHeaderModifier", "requestHeaderModifier": {
                                     "set": [{"name": "x-b", "value": "2"}]}}]}]})
    cws = [(c.name, c.weight.value) for c in r.route.weighted_clusters.clusters]
    assert cws == [("svc|ns|v1|80", 3), ("aether-invalid-backend|ns|gone|80", 1),
                   ("svc|ns|v2|80", 2)]
    assert r.route.weighted_clusters.clusters[2].request_headers_to_add[0].header.key == "x-b"
    assert r.route.cluster_not_found_response_code == rc.RouteAction.INTERNAL_SERVER_ERROR


def test_single_backend_is_plain_cluster_and_no_backends_is_500() -> None:
    assert one({"backendRefs": [B1]}).route.cluster == "svc|ns|v1|80"
    assert one({}).direct_response.status == 500
    assert one({"backendRefs": [{"name": "v1", "port": 80, "weight": 0}]}).direct_response.status \
        == 500


def test_timeouts_and_retries() -> None:
    a = one({"backendRefs": [B1], "timeouts": {"request": "10s", "backendRequest": "2s"},
             "retry": {"codes": [500, 503], "attempts": 2, "backoff": "50ms"}}).route
    assert a.timeout.ToMilliseconds() == 10000
    p = a.retry_policy
    assert p.retry_on == "connect-failure,refused-stream,reset,retriable-status-codes"
    assert list(p.retriable_status_codes) == [500, 503] and p.num_retries.value == 2
    assert p.per_try_timeout.ToMilliseconds() == 2000
    assert p.retry_back_off.base_interval.ToMilliseconds() == 50
    b = one({"backendRefs": [B1], "timeouts": {"backendRequest": "1s"}}).route
    assert b.timeout.ToNanoseconds() == 0 and b.retry_policy.num_retries.value == 0
    assert b.retry_policy.per_try_timeout.ToMilliseconds() == 1000
    assert not one({"backendRefs": [B1]}).route.HasField("retry_policy")


def test_named_rule_in_route_name() -> None:
    assert one({"name": "canary", "backendRefs": [B1]}).name == "HTTPRoute:ns/r|canary|0"


# ---- redirects: the Location header per the spec's port rules -------------------------------

ROOT = Match(path=PathMatch("PathPrefix", "/"))


def variants(r: Redirect, port: int = 80) -> list[tuple[str | None, dict[str, Any]]]:
    out = []
    for auth, a in redirect_variants(r, ROOT, port):
        out.append((auth, {f.name: v for f, v in a.ListFields()}))
    return out


def test_redirect_codes() -> None:
    for code, name in ((301, "MOVED_PERMANENTLY"), (302, "FOUND"), (303, "SEE_OTHER"),
                       (307, "TEMPORARY_REDIRECT"), (308, "PERMANENT_REDIRECT")):
        ((_, a),) = variants(Redirect(hostname="h", status=code))
        assert rc.RedirectAction.RedirectResponseCode.Name(a.get("response_code", 0)) == name


def test_redirect_port_rules() -> None:
    # hostname only, Service port 80: http:80 → no port; Envoy drops the request's port
    assert variants(Redirect(hostname="h")) == [(None, {"host_redirect": "h", "response_code": 1})]
    # hostname only, Service port 8080: the listener (Service) port is used
    assert variants(Redirect(hostname="h"), 8080) == [
        (None, {"host_redirect": "h", "port_redirect": 8080, "response_code": 1})]
    # explicit port
    assert variants(Redirect(port=9000)) == [(None, {"port_redirect": 9000, "response_code": 1})]
    # scheme https, no port: 443 → omitted; portless authority → plain, else force 443
    (a1, v1), (a2, v2) = variants(Redirect(scheme="https"), 8080)
    assert a1 is not None and "(:80)?" in a1 and "port_redirect" not in v1
    assert a2 is None and v2["port_redirect"] == 443
    # scheme https + explicit 8443: printed
    ((_, v),) = variants(Redirect(scheme="https", port=8443))
    assert v["port_redirect"] == 8443 and v["scheme_redirect"] == "https"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _envoy() -> str:
    return find_envoy_binary()  # a dependency: a missing binary fails the test, never skips


def _static_listener(name: str, port: int, hcm: hcm_pb2.HttpConnectionManager
                     ) -> listener_pb2.Listener:
    lis = listener_pb2.Listener(name=name)
    lis.address.socket_address.address = "127.0.0.1"
    lis.address.socket_address.port_value = port
    f = lis.filter_chains.add().filters.add(name="envoy.filters.network.http_connection_manager")
    f.typed_config.Pack(hcm)
    return lis


def test_live_redirect_locations_and_prefix_table(tmp_path: Path) -> None:
    """Real Envoy answers the spec's Location for each case (Service port 8080)."""
    envoy = _envoy()
    cases = [
        ("/a", {"hostname": "new.example"}),
        ("/b", {"scheme": "https"}),
        ("/c", {}),
        ("/d", {"scheme": "http", "port": 80}),
        ("/e", {"hostname": "new.example", "port": 80, "scheme": "https"}),
        ("/f", {"path": {"type": "ReplaceFullPath", "replaceFullPath": "/full"}}),
    ]
    rules = [{"matches": [{"path": {"type": "Exact", "value": p}}],
              "filters": [{"type": "RequestRedirect", "requestRedirect": rr}]} for p, rr in cases]
    for prefix, repl in (("/p", ""), ("/q", "/xyz"), ("/s/", "/")):
        rules.append({"matches": [{"path": {"type": "PathPrefix", "value": prefix}}],
                      "filters": [{"type": "RequestRedirect", "requestRedirect": {
                          "path": {"type": "ReplacePrefixMatch", "replacePrefixMatch": repl}}}]})
    r = route_from_object(HTTP_ROUTE, {"metadata": {"name": "r", "namespace": "ns"}, "spec": {
        "parentRefs": [{"group": "", "kind": "Service", "name": "echo", "port": 8080}],
        "rules": rules}})
    t = build_tables([r], SVCS).table_for("ns/echo", 8080, "ns")
    assert t is not None
    port = _free_port()
    b = build_bootstrap("n", str(tmp_path / "xds.sock"), str(tmp_path / "admin.sock"), dynamic=False,
                        static_listeners=[_static_listener("l", port,
                                                           hcm_for(t, service_cluster_name))])
    cfg = tmp_path / "b.json"
    write_bootstrap(str(cfg), b)
    proc = subprocess.Popen([envoy, "-c", str(cfg), "-l", "warn", "--base-id",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def get(path: str, host: str) -> tuple[int, str | None]:
            deadline = time.monotonic() + 20
            while True:
                try:
                    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                    c.request("GET", path, headers={"Host": host})
                    resp = c.getresponse()
                    return resp.status, resp.getheader("location")
                except OSError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise
                    time.sleep(0.1)

        for host in ("echo:8080", "echo"):
            assert get("/a", host) == (302, "http://new.example:8080/a")
            assert get("/e", host) == (302, "https://new.example:80/e")
            assert get("/f?x=1", host)[1] == "http://echo:8080/full?x=1"
        # scheme https, no port → 443, omitted; a request port is replaced by 443, which Envoy
        # can only print (it keeps the request host verbatim otherwise): right port, shown.
        assert get("/b", "echo") == (302, "https://echo/b")
        assert get("/b", "echo:80") == (302, "https://echo/b")
        assert get("/b", "echo:8080") == (302, "https://echo:443/b")
        assert get("/d", "echo") == (302, "http://echo/d")
        assert get("/c", "echo:8080") == (302, "http://echo:8080/c")
        assert get("/c", "echo") == (302, "http://echo:8080/c")  # the Service port, always
        # /d with a request port: the port is right (80), Envoy must print it
        assert get("/d", "echo:8080")[1] == "http://echo:80/d"
        # ReplacePrefixMatch, the spec's trailing-slash table
        assert get("/p/bar?q=1", "echo:8080")[1] == "http://echo:8080/bar?q=1"
        assert get("/p", "echo:8080")[1] == "http://echo:8080/"
        assert get("/p/", "echo:8080")[1] == "http://echo:8080/"
        assert get("/q/bar", "echo:8080")[1] == "http://echo:8080/xyz/bar"
        assert get("/q", "echo:8080")[1] == "http://echo:8080/xyz"
        assert get("/q/", "echo:8080")[1] == "http://echo:8080/xyz/"
        assert get("/s/bar", "echo:8080")[1] == "http://echo:8080/bar"
        assert get("/px", "echo:8080")[0] == 404  # whole segments only
        assert get("/nothing", "echo:8080")[0] == 404
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# ---- chains and Envoy validation -----------------------------------------------------------


def view() -> ServiceView:
    s = SVCS["ns/echo"]
    return ServiceView(key=s.key, namespace=s.namespace, name=s.name, cluster_ips=s.cluster_ips,
                       ports=s.ports, names=())


def test_service_port_chains_shapes() -> None:
    r = route_from_object(HTTP_ROUTE, {"metadata": {"name": "r", "namespace": "ns"}, "spec": {
        "parentRefs": [{"group": "", "kind": "Service", "name": "echo"}],
        "rules": [{"backendRefs": [B1]}]}})
    res = build_tables([r], SVCS)
    v = view()
    p80, p8080, p9090 = v.ports
    detect = service_port_chains(v, p8080, res.table_for(v.key, 8080, "ns"), tcp_chain=service_chain,
                                 cluster_name=service_cluster_name)
    assert [list(c.filter_chain_match.application_protocols) for c in detect] == [
        ["http/1.1", "h2c"], []]
    assert detect[0].filters[-1].name == "envoy.filters.network.http_connection_manager"
    assert detect[1].filters[-1].name == "envoy.filters.network.tcp_proxy"
    only_http = service_port_chains(v, p9090, res.table_for(v.key, 9090, "ns"),
                                    tcp_chain=service_chain, cluster_name=service_cluster_name)
    assert len(only_http) == 1 and not only_http[0].filter_chain_match.application_protocols
    assert service_port_chains(v, p80, None, tcp_chain=service_chain,
                               cluster_name=service_cluster_name)[0].filters[-1].name \
        == "envoy.filters.network.tcp_proxy"
    tcp_app = ServicePort(5432, "pg", app_protocol="postgresql")
    assert len(service_port_chains(v, tcp_app, res.table_for(v.key, 80, "ns"),
                                   tcp_chain=service_chain, cluster_name=service_cluster_name)) == 1


def test_envoy_validates_generated_config(tmp_path: Path) -> None:
    """A listener whose chains come from service_port_chains (detect + h2c gRPC ports), plus
    the clusters they name as static 127.0.0.1 clusters: Envoy accepts all of it."""
    envoy = _envoy()
    h = route_from_object(HTTP_ROUTE, {"metadata": {"name": "h", "namespace": "ns"}, "spec": {
        "parentRefs": [{"group": "", "kind": "Service", "name": "echo", "port": 8080}],
        "rules": [
            {"matches": [{"path": {"type": "PathPrefix", "value": "/v2"}, "method": "GET",
                          "headers": [{"name": "x", "value": "1"}],
                          "queryParams": [{"type": "RegularExpression", "name": "q",
                                           "value": "a+"}]}],
             "filters": [{"type": "RequestHeaderModifier", "requestHeaderModifier": {
                 "set": [{"name": "a", "value": "1%"}], "remove": ["b"]}},
                 {"type": "RequestMirror", "requestMirror": {
                     "backendRef": {"name": "v2", "port": 80}, "percent": 10}},
                 {"type": "URLRewrite", "urlRewrite": {"hostname": "x", "path": {
                     "type": "ReplacePrefixMatch", "replacePrefixMatch": "/"}}}],
             "backendRefs": [{"name": "v1", "port": 80, "weight": 1},
                             {"name": "nope", "port": 80, "weight": 1}],
             "timeouts": {"request": "5s", "backendRequest": "1s"},
             "retry": {"codes": [503], "attempts": 2, "backoff": "10ms"}},
            {"matches": [{"path": {"type": "Exact", "value": "/r"}}],
             "filters": [{"type": "RequestRedirect", "requestRedirect": {"scheme": "https"}}]},
            {"matches": [{"path": {"type": "RegularExpression", "value": "/re/.*"}}],
             "filters": [{"type": "URLRewrite", "urlRewrite": {"path": {
                 "type": "ReplaceFullPath", "replaceFullPath": "/x"}}}],
             "backendRefs": [{"name": "v2", "port": 80}]}]}})
    g = route_from_object(GRPC_ROUTE, {"metadata": {"name": "g", "namespace": "ns"}, "spec": {
        "parentRefs": [{"group": "", "kind": "Service", "name": "echo", "port": 9090}],
        "rules": [{"matches": [{"method": {"service": "pkg.Svc", "method": "Get"}},
                               {"method": {"type": "RegularExpression", "method": "Li.*"}}],
                   "backendRefs": [{"name": "v1", "port": 80}]}]}})
    res = build_tables([h, g], SVCS)
    v = view()
    chains = []
    for p in v.ports:
        chains += service_port_chains(v, p, res.table_for(v.key, p.port, "ns"),
                                      tcp_chain=service_chain, cluster_name=service_cluster_name)
    assert len(chains) == 4  # 80: tcp (no route), 8080: http + tcp, 9090: http
    lis = listener_pb2.Listener(name="capture-x", filter_chains=chains)
    lis.address.socket_address.address = "127.0.0.1"
    lis.address.socket_address.port_value = 15001
    odst = lis.listener_filters.add(name="envoy.filters.listener.original_dst")
    from envoy.extensions.filters.listener.original_dst.v3 import original_dst_pb2
    odst.typed_config.Pack(original_dst_pb2.OriginalDst())
    insp = http_inspector_listener_filter([8080])
    assert insp is not None
    lis.listener_filters.append(insp)
    lis.continue_on_listener_filters_timeout = True
    clusters = []
    for ns, name, port, app in (("ns", "echo", 80, None), ("ns", "echo", 8080, None),
                                ("ns", "echo", 9090, "kubernetes.io/h2c"), ("ns", "v1", 80, None),
                                ("ns", "v2", 80, None)):
        c = cluster_pb2.Cluster(name=service_cluster_name(ns, name, port),
                                type=cluster_pb2.Cluster.STATIC)
        c.connect_timeout.FromSeconds(1)
        c.load_assignment.cluster_name = c.name
        sa = c.load_assignment.endpoints.add().lb_endpoints.add().endpoint.address.socket_address
        sa.address, sa.port_value = "127.0.0.1", 18000
        c.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS_KEY].Pack(
            upstream_http_protocol_options(app))
        clusters.append(c)
    b = build_bootstrap("n", str(tmp_path / "xds.sock"), 15000, dynamic=False,
                        static_listeners=[lis], static_clusters=clusters)
    cfg = tmp_path / "b.json"
    write_bootstrap(str(cfg), b)
    out = subprocess.run([envoy, "--mode", "validate", "-c", str(cfg), "-l", "warn"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_upstream_protocol_options() -> None:
    assert upstream_http_protocol_options("kubernetes.io/h2c").HasField("explicit_http_config")
    assert upstream_http_protocol_options(None).HasField("use_downstream_protocol_config")


def test_http_inspector_only_for_detect_ports() -> None:
    assert http_inspector_listener_filter([]) is None
    one_port = http_inspector_listener_filter([8080])
    assert one_port is not None
    assert one_port.filter_disabled.not_match.destination_port_range.start == 8080
    two = http_inspector_listener_filter([81, 8080])
    assert two is not None and len(two.filter_disabled.not_match.or_match.rules) == 2


def test_an_http_port_is_balanced_per_request_without_a_route() -> None:
    """appProtocol grpc / kubernetes.io/h2c / http and no route: the HTTP codec with one
    route to the Service itself (no timeout), so requests on one connection are balanced;
    ports with no appProtocol stay L4."""
    from envoy.extensions.filters.network.http_connection_manager.v3 import (
        http_connection_manager_pb2 as hcm_pb2,
    )

    from agent.envoy.resources import chain_for, service_cluster_name
    from agent.scope.model import ServiceView
    from agent.scope.services import ServicePort
    ports = (ServicePort(9090, "rpc", "TCP", 9090, "grpc"),
             ServicePort(9091, "h2", "TCP", 9091, "kubernetes.io/h2c"),
             ServicePort(80, "web", "TCP", 8080, "http"), ServicePort(81, "raw", "TCP", 81, None))
    view = ServiceView("app/s", "app", "s", ("10.96.0.9",), ports, ("s",))
    for port in ports:
        chains = chain_for(view, port, None, None)
        chains = chains if isinstance(chains, list) else [chains]
        names = [f.name for c in chains for f in c.filters]
        if port.port in (9090, 9091, 80):
            assert names == ["envoy.filters.network.set_filter_state",
                             "envoy.filters.network.http_connection_manager"], names
            hcm = hcm_pb2.HttpConnectionManager()
            chains[0].filters[-1].typed_config.Unpack(hcm)
            route = hcm.route_config.virtual_hosts[0].routes[0]
            assert route.route.cluster == service_cluster_name("app", "s", port.port)
            assert route.route.timeout.ToNanoseconds() == 0  # streams are not cut
        else:
            assert "envoy.filters.network.http_connection_manager" not in names, names
