"""AuthorizationPolicy → Envoy RBAC (agent.authz.rbac), and the real Envoy accepting it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from envoy.config.rbac.v3 import rbac_pb2
from google.protobuf.json_format import MessageToDict

from agent.authz.policy import parse_policy
from agent.authz.rbac import http_rbac_filters, network_rbac_filters
from agent.envoy.supervisor import find_envoy_binary


def _p(name: str, spec: dict[str, Any]) -> Any:
    return parse_policy({"metadata": {"name": name, "namespace": "app"}, "spec": spec})


POLICIES = [
    _p("allow-a", {"rules": [{"from": [{"source": {"principals": ["cluster.local/ns/app/sa/a"],
                                                   "notIpBlocks": ["10.9.0.0/16"]}},
                                       {"source": {"namespaces": ["other*"]}}],
                              "to": [{"operation": {"ports": ["8080"]}}]}]}),
    _p("deny-admin", {"action": "DENY", "rules": [{"to": [{"operation": {
        "paths": ["/admin*"], "methods": ["POST"], "hosts": ["*.example.com"]}}]}]}),
    _p("get-only", {"rules": [{"to": [{"operation": {"methods": ["GET"]}}]}]}),
    _p("watch", {"action": "AUDIT", "rules": [{}]}),
    _p("broken", {"action": "DENY", "rules": [{"when": [{"key": "request.auth.claims"}]}]}),
]


def test_one_filter_per_deny_and_audit_policy_one_for_the_allows_in_istios_order() -> None:
    net = network_rbac_filters(POLICIES, scope="c1")
    assert [f.rules.action for f in net[:3]] == [rbac_pb2.RBAC.DENY, rbac_pb2.RBAC.DENY,
                                                 rbac_pb2.RBAC.ALLOW]
    # AUDIT: shadow ALLOW rules, nothing enforced, a match counted as shadow_allowed
    assert not net[3].HasField("rules") and set(net[3].shadow_rules.policies) == {
        "app/watch[0]"}
    # each filter's stats name the pod and the policy (its index) or the ALLOW set
    assert [f.stat_prefix for f in net] == [
        "aether_authz.c1.deny.1.", "aether_authz.c1.deny.4.", "aether_authz.c1.allow.any.",
        "aether_authz.c1.audit.3."]
    # L4: the DENY's HTTP-only fields are dropped (it covers the whole port); the unreadable
    # DENY matches everything
    assert net[0].rules.policies["app/deny-admin[0]"].permissions[0].any
    assert net[1].rules.policies["app/broken"].principals[0].any
    # L4: the ALLOW needing a method matches nothing there (no policy rendered for it)
    assert set(net[2].rules.policies) == {"app/allow-a[0]"}
    src = net[2].rules.policies["app/allow-a[0]"].principals
    first = src[0].and_ids.ids
    assert first[0].authenticated.principal_name.exact == "spiffe://cluster.local/ns/app/sa/a"
    assert first[1].not_id.direct_remote_ip.address_prefix == "10.9.0.0"
    assert "ns/other[^/]*/sa" in src[1].authenticated.principal_name.safe_regex.regex
    # HTTP: one filter (each costs every request): a DENY engine of the DENY policies and
    # ~no_allow (what no ALLOW admits), the AUDIT policies as its shadow rules
    (f,) = http_rbac_filters(POLICIES)
    assert f.rules.action == rbac_pb2.RBAC.DENY and f.track_per_rule_stats
    assert set(f.rules.policies) == {"app/deny-admin[0]", "app/broken", "~no_allow",
                                     "~multi_uri_san"}
    # a certificate with more than one URI SAN (their comma-joined list) is refused
    multi = f.rules.policies["~multi_uri_san"].principals[0].filter_state
    assert multi.key == "aether.peer" and multi.string_match.contains == ","
    assert sorted(f.rules.policies)[-1] == "~no_allow"  # Envoy reports a DENY policy first
    assert f.rules_stat_prefix == "aether_authz.http."
    assert set(f.shadow_rules.policies) == {"app/watch[0]"}
    assert f.shadow_rules.action == rbac_pb2.RBAC.ALLOW
    assert f.shadow_rules_stat_prefix == "aether_authz.audit.all."
    # the ALLOW rules folded into principals: the peer and the port from filter state
    (no_allow,) = f.rules.policies["~no_allow"].principals
    admits = no_allow.not_id.or_ids.ids
    assert len(admits) == 2  # allow-a's rule and get-only's
    a_rule = admits[0].and_ids.ids
    assert a_rule[0].or_ids.ids[0].and_ids.ids[0].filter_state.key == "aether.peer"
    assert a_rule[1].filter_state.key == "aether.port"
    assert a_rule[1].filter_state.string_match.exact == "8080"
    assert admits[1].header.name == ":method"
    # only AUDIT: shadow rules alone; no policy: no filter
    (audit,) = http_rbac_filters([POLICIES[3]])
    assert not audit.HasField("rules") and audit.HasField("shadow_rules")
    assert http_rbac_filters([]) == []


def test_an_allow_without_rules_renders_a_filter_that_denies_all() -> None:
    (f,) = network_rbac_filters([_p("none", {})])
    assert f.rules.action == rbac_pb2.RBAC.ALLOW and not f.rules.policies


def _typed(name: str, msg: Any, type_url: str) -> dict[str, Any]:
    return {"name": name, "typed_config": {"@type": type_url, **MessageToDict(msg)}}


def test_envoy_accepts_the_rendered_filters(tmp_path: Path) -> None:
    net_t = "type.googleapis.com/envoy.extensions.filters.network.rbac.v3.RBAC"
    http_t = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC"
    tcp = {"name": "envoy.filters.network.tcp_proxy", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
        "stat_prefix": "t", "cluster": "c"}}
    hcm = {"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager"
                 ".v3.HttpConnectionManager",
        "stat_prefix": "h", "route_config": {"virtual_hosts": [{"name": "v", "domains": ["*"],
                                                                 "routes": [{"match": {"prefix": "/"},
                                                                             "route": {"cluster": "c"}}]}]},
        "http_filters": [*[_typed(f"{'envoy.filters.http.rbac'}", f, http_t)
                           for f in http_rbac_filters(POLICIES)],
                         {"name": "envoy.filters.http.router", "typed_config": {
                             "@type": "type.googleapis.com/envoy.extensions.filters.http.router"
                                      ".v3.Router"}}]}}
    listeners = [
        {"name": "l4", "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
         "filter_chains": [{"filters": [*[_typed("envoy.filters.network.rbac", f, net_t)
                                          for f in network_rbac_filters(POLICIES)], tcp]}]},
        {"name": "http", "address": {"socket_address": {"address": "127.0.0.1",
                                                        "port_value": 0}},
         "filter_chains": [{"filters": [hcm]}]}]
    boot = {"static_resources": {"listeners": listeners, "clusters": [{
        "name": "c", "type": "STATIC", "load_assignment": {"cluster_name": "c", "endpoints": [
            {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
                "address": "127.0.0.1", "port_value": 9}}}}]}]}}]}}
    p = tmp_path / "b.json"
    p.write_text(json.dumps(boot))
    out = subprocess.run([find_envoy_binary(), "--mode", "validate", "-c", str(p), "-l", "warn"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_namespaces_of_the_mesh_trust_domain_are_prefix_matches() -> None:
    p = _p("ns", {"rules": [{"from": [{"source": {"namespaces": ["other", "team*", "*x"]}}]}]})
    (f,) = network_rbac_filters([p], trust_domain="cluster.local")
    ids = f.rules.policies["app/ns[0]"].principals[0].or_ids.ids
    got = [i.authenticated.principal_name for i in ids]
    assert got[0].prefix == "spiffe://cluster.local/ns/other/sa/"
    assert got[1].prefix == "spiffe://cluster.local/ns/team"
    assert got[2].safe_regex.regex  # a suffix pattern needs the regex
