"""HTTP fields of AuthorizationPolicies on undeclared ports (#41): a pod whose policies name
methods, paths or hosts gets a detection listener of its own, deciding after detection."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from envoy.extensions.filters.http.rbac.v3 import rbac_pb2 as http_rbac_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.filters.network.rbac.v3 import rbac_pb2 as net_rbac_pb2
from envoy.extensions.filters.network.tcp_proxy.v3 import tcp_proxy_pb2

from agent.authz.policy import needs_http, parse_policy
from agent.authz.rbac import HTTP_RBAC, NETWORK_RBAC, PEER_STATE, PORT_STATE, network_rbac_filters
from agent.envoy import mtls
from agent.envoy.pieces import ORIGINAL_DST_LOCAL_STATE
from agent.envoy.resources import CLUSTER_TYPE, LISTENER_TYPE, NodeXdsState, PodListener, ResourceBuilder
from agent.identity.svid import Svid, spiffe_id

TD = "cluster.local"


def _p(name: str, spec: dict[str, Any]) -> Any:
    return parse_policy({"metadata": {"name": name, "namespace": "app"}, "spec": spec})


GET_FROM_A = _p("a-reads", {"rules": [
    {"from": [{"source": {"principals": [f"{TD}/ns/app/sa/a"], "ipBlocks": ["10.1.0.0/16"]}}],
     "to": [{"operation": {"methods": ["GET"], "ports": ["8080"]}}]}]})
FROM_A = _p("a", {"rules": [{"from": [{"source": {"principals": [f"{TD}/ns/app/sa/a"]}}]}]})


def test_only_policies_naming_http_fields_need_detection() -> None:
    assert needs_http([GET_FROM_A]) and not needs_http([FROM_A])
    # an unreadable policy is enforced fail closed at L4: it needs nothing detected
    broken = _p("broken", {"action": "ALOW", "rules": [{"to": [{"operation": {
        "methods": ["GET"]}}]}]})
    assert broken.error and not needs_http([broken])


def test_past_the_internal_hop_the_id_is_filter_state_and_the_port_the_restored_one() -> None:
    (f,) = network_rbac_filters([GET_FROM_A, FROM_A], mtls.DETECTED, scope="c1",
                                trust_domain=TD)
    # L4 there: the ALLOW needing GET matches nothing, the other is enforced
    assert set(f.rules.policies) == {"app/a[0]"}
    http = mtls.build_inbound_detect_listener("c1", (GET_FROM_A,), TD)
    hcm = hcm_pb2.HttpConnectionManager()
    http.filter_chains[0].filters[-1].typed_config.Unpack(hcm)
    rbac = http_rbac_pb2.RBAC()
    hcm.http_filters[0].typed_config.Unpack(rbac)
    (no_allow,) = rbac.rules.policies["~no_allow"].principals
    source, operation = no_allow.not_id.and_ids.ids
    ids = source.and_ids.ids
    assert ids[0].filter_state.key == PEER_STATE
    assert ids[0].filter_state.string_match.exact == f"spiffe://{TD}/ns/app/sa/a"
    # the caller's address as the header restored it, not the internal socket's
    assert ids[1].remote_ip.address_prefix == "10.1.0.0"
    port, method = operation.and_ids.ids
    assert port.filter_state.key == PORT_STATE
    assert port.filter_state.string_match.exact == "8080"
    assert method.header.name == ":method"


def test_the_pods_own_detection_listener_decides_after_detecting() -> None:
    lis = mtls.build_inbound_detect_listener("c1", (GET_FROM_A, FROM_A), TD)
    assert lis.name == "inbound-detect-c1" and lis.HasField("internal_listener")
    # the header first (the IDs), then the address the caller named, then detection
    assert [f.name for f in lis.listener_filters] == [
        "envoy.filters.listener.proxy_protocol", "envoy.filters.listener.original_dst",
        "envoy.filters.listener.http_inspector"]
    http = lis.filter_chains[0]
    assert [f.name for f in http.filters] == ["envoy.filters.network.set_filter_state",
                                              "envoy.filters.network.http_connection_manager"]
    hcm = hcm_pb2.HttpConnectionManager()
    http.filters[-1].typed_config.Unpack(hcm)
    assert hcm.stat_prefix == "inbound-detect-c1"
    assert [f.name for f in hcm.http_filters] == [HTTP_RBAC, "envoy.filters.http.router"]
    tcp = [f.name for f in lis.default_filter_chain.filters]
    assert tcp == ["envoy.filters.network.set_filter_state", NETWORK_RBAC,
                   "envoy.filters.network.tcp_proxy"]
    rbac = net_rbac_pb2.RBAC()
    lis.default_filter_chain.filters[1].typed_config.Unpack(rbac)
    assert rbac.stat_prefix == "aether_authz.c1.allow.any."
    # the node's shared one is as it was: no RBAC, no restored address
    shared = mtls.build_inbound_detect_listener()
    assert shared.name == mtls.INBOUND_DETECT
    assert "envoy.filters.listener.original_dst" not in [f.name for f in shared.listener_filters]
    assert [f.name for f in shared.default_filter_chain.filters] == [
        "envoy.filters.network.tcp_proxy"]
    c = mtls.build_inbound_detect_cluster(1.0, "c1")
    assert c.name == "inbound-detect-c1"
    assert c.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address \
        .envoy_internal_address.server_listener_name == "inbound-detect-c1"


def _detect_chain(policies: Any) -> Any:
    lis = mtls.build_inbound_listener("c1", "/run/netns/c1", "app/server", ("10.1.0.7",),
                                      mtls.MeshTls(TD, {}, "B"), ipv6=False, policies=policies)
    return next(c for c in lis.filter_chains if c.name == "mtls-v4")


def test_the_inbound_undeclared_chain_hands_over_to_the_pods_own_detection() -> None:
    chain = _detect_chain((GET_FROM_A,))
    names = [f.name for f in chain.filters]
    assert NETWORK_RBAC not in names  # decided past detection, not as bytes here
    tcp = tcp_proxy_pb2.TcpProxy()
    chain.filters[-1].typed_config.Unpack(tcp)
    assert tcp.cluster == "inbound-detect-c1"
    from envoy.extensions.filters.network.set_filter_state.v3 import set_filter_state_pb2
    cfg = set_filter_state_pb2.Config()
    chain.filters[0].typed_config.Unpack(cfg)
    fmt = {v.object_key: v.format_string.text_format_source.inline_string
           for v in cfg.on_new_connection}
    assert fmt[ORIGINAL_DST_LOCAL_STATE] == "10.1.0.7:%REQUESTED_SERVER_NAME%"
    # L4-only policies: judged here, handed to the node's detection
    chain = _detect_chain((FROM_A,))
    assert NETWORK_RBAC in [f.name for f in chain.filters]
    chain.filters[-1].typed_config.Unpack(tcp)
    assert tcp.cluster == mtls.INBOUND_DETECT


def _state(pods: tuple[PodListener, ...]) -> NodeXdsState:
    svid = Svid(spiffe_id(TD, "app", "server"), "CERT", "KEY", 0.0, 1e12, 0.0)
    return NodeXdsState(pods=pods, services=(),
                        mesh_tls=mtls.MeshTls(TD, {"app/server": svid}, "BUNDLE"))


def test_the_detection_listener_and_its_cluster_follow_the_pods_policies() -> None:
    pod = PodListener("c1", "/run/netns/c1", namespace="app", service_account="server",
                      ips=("10.1.0.7",), authz=(GET_FROM_A,))
    b = ResourceBuilder()
    out = b.build(_state((pod,)))
    assert "inbound-detect-c1" in out[LISTENER_TYPE] and "inbound-detect-c1" in out[CLUSTER_TYPE]
    # no HTTP field any more: the listener goes; the cluster stays while the pod is here
    # (a listener still draining may name it)
    out = b.build(_state((replace(pod, authz=(FROM_A,)),)))
    assert "inbound-detect-c1" not in out[LISTENER_TYPE]
    assert "inbound-detect-c1" in out[CLUSTER_TYPE]
    out = b.build(_state(()))
    assert "inbound-detect-c1" not in out[CLUSTER_TYPE]


def test_the_detected_requests_decisions_are_counted_under_the_pod() -> None:
    from agent.authz.stats import Decisions, decisions
    deny = _p("no-admin", {"action": "DENY", "rules": [{"to": [{"operation": {
        "paths": ["/admin*"]}}]}]})
    stats = [
        ("http.inbound-detect-c1.rbac.aether_authz.http.policy.app/no-admin[0].denied", 2),
        ("http.inbound-c1-http.rbac.aether_authz.http.policy.app/no-admin[0].denied", 1),
        ("http.inbound-detect-c1.rbac.aether_authz.http.policy.~no_allow.denied", 4),
    ]
    got = decisions(stats, {"c1": ("app", "server", (deny, GET_FROM_A))})
    assert got[Decisions("app", "server", "app/no-admin", "DENY", "deny")] == 3
    assert got[Decisions("app", "server", "*", "ALLOW", "deny")] == 4


def test_a_plaintext_caller_is_handed_to_the_pods_own_detection_without_an_identity() -> None:
    from envoy.extensions.filters.network.set_filter_state.v3 import set_filter_state_pb2

    from agent.envoy.judge import build_judge_listener
    from agent.envoy.pieces import TRANSITIVE
    lis = build_judge_listener("c1", "/run/netns/c1", ("10.1.0.7",), (GET_FROM_A,), 15006,
                               detect=True, workload="app/server")
    chain = lis.filter_chains[0]
    assert NETWORK_RBAC not in [f.name for f in chain.filters]
    tcp = tcp_proxy_pb2.TcpProxy()
    chain.filters[-1].typed_config.Unpack(tcp)
    assert tcp.cluster == "inbound-detect-c1" and not tcp.proxy_protocol_tlvs
    cfg = set_filter_state_pb2.Config()
    chain.filters[0].typed_config.Unpack(cfg)
    by_key = {v.object_key: v for v in cfg.on_new_connection}
    assert by_key[ORIGINAL_DST_LOCAL_STATE].format_string.text_format_source.inline_string == \
        "10.1.0.7:%DOWNSTREAM_LOCAL_PORT%"
    # where to deliver crosses the detection listener
    assert by_key[mtls.ORIGINAL_DST_ADDRESS_STATE].shared_with_upstream == TRANSITIVE
    assert by_key[mtls.DESTINATION_STATE].format_string.text_format_source.inline_string == \
        "app/server|%DOWNSTREAM_LOCAL_PORT%"
    # the mesh hop sends the whole XFCC value; a plaintext caller sends none, so the
    # detection listener's requests from it carry no XFCC
    inbound = mtls.build_inbound_listener("c1", "/run/netns/c1", "app/server", ("10.1.0.7",),
                                          mtls.MeshTls(TD, {}, "B"), ipv6=False,
                                          policies=(GET_FROM_A,))
    chain = next(c for c in inbound.filter_chains if c.name == "mtls-v4")
    chain.filters[-1].typed_config.Unpack(tcp)
    assert {t.type for t in tcp.proxy_protocol_tlvs} == {
        mtls.PEER_ID_TLV, mtls.LOCAL_ID_TLV, mtls.XFCC_TLV}
    own = mtls.build_inbound_detect_listener("c1", (GET_FROM_A,), TD)
    hcm = hcm_pb2.HttpConnectionManager()
    own.filter_chains[0].filters[-1].typed_config.Unpack(hcm)
    (added,) = hcm.route_config.virtual_hosts[0].routes[0].request_headers_to_add
    assert added.header.value == f"%FILTER_STATE({mtls.PROXY_TLV_STATE}:FIELD:xfcc)%"
