"""AuthorizationPolicies from the object store to the pods' inbound listeners (#41): the
index selecting pods, the mesh runtime publishing them with the Services, the sink giving
each pod listener its set, and the inbound chains carrying the RBAC filters."""

from __future__ import annotations

from typing import Any

from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)

from agent.authz.index import PolicyIndex
from agent.authz.policy import API_VERSION, KIND, parse_policy
from agent.authz.rbac import HTTP_RBAC, NETWORK_RBAC, PEER_STATE, PORT_STATE
from agent.common.config import NodeConfig
from agent.envoy import mtls
from agent.runtime.mesh import MeshRuntime
from agent.source.base import WatchEvent
from agent.source.watch import KIND_SPECS


def _obj(name: str, ns: str = "app", spec: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": name, "namespace": ns}, "spec": spec or {}}


ALLOW_A = _obj("allow-a", spec={"selector": {"matchLabels": {"app": "echo"}}, "rules": [
    {"from": [{"source": {"principals": ["cluster.local/ns/app/sa/a"]}}]}]})


def test_the_index_selects_by_namespace_labels_and_the_root_namespace() -> None:
    idx = PolicyIndex("aether-system")
    assert idx.upsert(ALLOW_A) is not None
    assert idx.upsert(ALLOW_A) is None  # the same policy again: no change
    idx.upsert(_obj("mesh-wide", "aether-system", {"action": "DENY", "rules": [{}]}))
    idx.upsert(_obj("other-ns", "other"))
    idx.upsert(_obj("broken", spec={"action": "NOPE"}))
    keys = [p.key for p in idx.for_pod("app", {"app": "echo"})]
    assert keys == ["aether-system/mesh-wide", "app/allow-a", "app/broken"]
    assert [p.key for p in idx.for_pod("app", {"app": "web"})] == [
        "aether-system/mesh-wide", "app/broken"]
    assert [k for k, _ in idx.problems()] == ["app/broken"]
    assert idx.remove("app", "allow-a") and not idx.remove("app", "allow-a")


def test_the_watcher_lists_the_kind() -> None:
    spec = KIND_SPECS[KIND]
    assert spec.path == "/apis/security.aether.io/v1alpha1/authorizationpolicies"


class _Sink:
    def __init__(self) -> None:
        self.authz: list[dict[str, Any]] = []

    def set_authz(self, by_pod: dict[str, Any], known: Any = None) -> int:
        self.authz.append(by_pod)
        return 0

    def set_services(self, views: Any, gamma: Any = None, learnable: Any = None) -> None:
        pass


def test_the_runtime_publishes_each_local_pods_policies_and_reports_bad_ones() -> None:
    rt = MeshRuntime(NodeConfig(node_name="n1", run_dir="/tmp/unused"))
    problems: list[tuple[str, str, str]] = []
    rt.on_policy_problem = lambda ns, name, _uid, why: problems.append((ns, name, why))
    rt.follow_objects()
    sink = _Sink()
    rt.sink = sink
    rt.model.register_local("u1", "app", "server", "server", ["10.1.0.5"],
                            labels={"app": "echo"}, ready=True)
    rt.model.register_local("u2", "app", "client", "a", ["10.1.0.6"], labels={}, ready=True)
    rt.objects.apply(WatchEvent("ADDED", KIND, ALLOW_A))
    rt.objects.apply(WatchEvent("ADDED", KIND, _obj("bad", spec={"rules": [
        {"from": [{"source": {"ipBlocks": ["10.0.0.0/99"]}}]}]})))
    rt.publish_now()
    got = sink.authz[-1]
    assert [p.key for p in got["app/server"]] == ["app/allow-a", "app/bad"]
    assert [p.key for p in got["app/client"]] == ["app/bad"]  # no selector: the namespace
    assert problems and problems[0][:2] == ("app", "bad") and "10.0.0.0/99" in problems[0][2]
    # and in status, for the operator (standalone mode has no Events)
    from agent.ops.status_view import render
    authz = rt.status()["authorization"]
    assert authz["policies"] == 2 and authz["pods_selected"] == 2
    assert "app/bad" in authz["problems"][0]
    human = render({"mesh": rt.status()})
    assert "authorization policies: 2" in human and "POLICY PROBLEM: app/bad" in human
    rt.objects.apply(WatchEvent("DELETED", KIND, ALLOW_A))
    rt.objects.apply(WatchEvent("DELETED", KIND, _obj("bad")))
    rt.publish_now()
    assert sink.authz[-1] == {}


def _chains(policies: Any) -> dict[str, Any]:
    lis = mtls.build_inbound_listener("c1", "/run/netns/c1", "app/server", ("10.1.0.7",),
                                      mtls.MeshTls("cluster.local", {}, "B"), ipv6=False,
                                      policies=policies)
    return {c.name: c for c in lis.filter_chains}


def test_inbound_chains_carry_rbac_ahead_of_the_relay_and_the_router() -> None:
    policy = parse_policy(ALLOW_A)
    plain, guarded = _chains(()), _chains((policy,))
    for name in ("mtls-v4", "mtls-tcp-v4"):
        names = [f.name for f in guarded[name].filters]
        # the filter state first, the RBAC before the relay; none without policies
        assert names[1] == NETWORK_RBAC and names[-1] == "envoy.filters.network.tcp_proxy"
        assert NETWORK_RBAC not in [f.name for f in plain[name].filters]
    hcm = hcm_pb2.HttpConnectionManager()
    guarded["mtls-http-v4"].filters[-1].typed_config.Unpack(hcm)
    # the peer's ID from its certificate into filter state first (what the RBAC matches)
    assert [f.name for f in hcm.http_filters] == [
        "envoy.filters.http.set_filter_state", HTTP_RBAC, "envoy.filters.http.router"]
    from envoy.extensions.filters.http.rbac.v3 import rbac_pb2 as http_rbac_pb2
    rbac = http_rbac_pb2.RBAC()
    hcm.http_filters[1].typed_config.Unpack(rbac)
    ident = rbac.rules.policies["~no_allow"].principals[0].not_id
    assert ident.filter_state.key == PEER_STATE
    assert ident.filter_state.string_match.exact == "spiffe://cluster.local/ns/app/sa/a"
    # and the port the caller named, set at accept
    from envoy.extensions.filters.network.set_filter_state.v3 import set_filter_state_pb2
    cfg = set_filter_state_pb2.Config()
    guarded["mtls-http-v4"].filters[0].typed_config.Unpack(cfg)
    assert {v.object_key: v.format_string.text_format_source.inline_string
            for v in cfg.on_new_connection}[PORT_STATE] == "%REQUESTED_SERVER_NAME%"
    plain["mtls-http-v4"].filters[-1].typed_config.Unpack(hcm)
    assert [f.name for f in hcm.http_filters] == ["envoy.filters.http.router"]
    # the loop guard is untouched
    assert [f.name for f in guarded["own-ports-v4"].filters] == [
        f.name for f in plain["own-ports-v4"].filters]


def test_a_selected_permissive_pod_has_its_plaintext_inbound_judged() -> None:
    from agent.capture.policy import decide, with_judged
    from agent.capture.rules import render_table
    from agent.source.model import NamespaceMeta, PodMeta
    node = NodeConfig(node_name="n1", node_addresses=("10.1.0.1",))
    pod = PodMeta(namespace="app", name="server", labels={"app": "echo"},
                  annotations={})
    ns = NamespaceMeta(name="app", labels={"aether.io/managed": "true"})
    plain = decide(pod, ns, node, False).policy
    assert plain is not None and not plain.judged and "prerouting" not in render_table(plain)
    node.authz.set(lambda n, labels: labels.get("app") == "echo")
    judged = decide(pod, ns, node, False).policy
    assert judged is not None and judged.judged and judged.node_sources_v4 == ("10.1.0.1",)
    table = render_table(judged)
    assert "hook prerouting" in table and "redirect to :15006" in table
    assert "tcp dport 15006 drop" in table and "ip saddr 10.1.0.1 return" in table
    assert "tcp dport 15008 return" in table
    # the live path gives what decide gives, and STRICT wins over judging
    assert with_judged(plain, True, node) == judged
    assert with_judged(judged, False, node) == plain
    strict = decide(PodMeta(namespace="app", name="s", labels={"app": "echo"}, annotations={
        "security.aether.io/peer-authentication": "strict"}), ns, node, False).policy
    assert strict is not None and strict.strict and not strict.judged
    # the record round-trips, and an unjudged policy keeps its old hash
    from agent.capture.policy import CapturePolicy
    assert CapturePolicy.from_json(judged.to_json()) == judged
    assert "judged" not in plain.to_json()


def test_the_judging_listener_applies_l4_rules_by_destination_port() -> None:
    from envoy.extensions.filters.network.rbac.v3 import rbac_pb2 as net_rbac_pb2

    from agent.envoy.judge import build_judge_listener
    policy = parse_policy(_obj("ports", spec={"rules": [
        {"from": [{"source": {"ipBlocks": ["10.9.0.0/16"]}}],
         "to": [{"operation": {"ports": ["8080"]}}]}]}))
    lis = build_judge_listener("c1", "/run/netns/c1", ("10.1.0.7",), (policy,), 15006)
    assert lis.name == "judge-c1" and lis.address.socket_address.port_value == 15006
    assert [f.name for f in lis.listener_filters] == ["envoy.filters.listener.original_dst"]
    names = [f.name for f in lis.filter_chains[0].filters]
    assert names[1] == NETWORK_RBAC and names[-1] == "envoy.filters.network.tcp_proxy"
    rbac = net_rbac_pb2.RBAC()
    lis.filter_chains[0].filters[1].typed_config.Unpack(rbac)
    perm = rbac.rules.policies["app/ports[0]"].permissions[0]
    assert perm.destination_port == 8080


def test_rbac_counters_become_decisions_per_workload_and_policy() -> None:
    from agent.authz.stats import Decisions, decisions
    deny = parse_policy(_obj("deny-c", spec={"action": "DENY", "rules": [{}]}))
    audit = parse_policy(_obj("watch", spec={"action": "AUDIT", "rules": [{}]}))
    allow = parse_policy(ALLOW_A)
    pols = (deny, audit, allow)
    stats = [
        ("aether_authz.u1.deny.0.rbac.denied", 2),
        ("aether_authz.u1.deny.0.rbac.allowed", 9),  # passed the DENY: not a decision
        ("http.inbound-u1-http.rbac.aether_authz.http.policy.app/deny-c[0].denied", 3),
        ("http.inbound-u1-http.rbac.aether_authz.http.denied", 3),  # the total: skipped
        ("aether_authz.u2.deny.0.rbac.denied", 1),  # another pod of the same workload
        ("http.inbound-u1-http.rbac.aether_authz.audit.all.policy.app/watch[0].shadow_allowed",
         4),
        ("http.inbound-u1-http.rbac.aether_authz.audit.all.shadow_allowed", 4),
        ("http.inbound-u1-http.rbac.aether_authz.audit.all.shadow_denied", 7),
        ("http.inbound-u1-http.rbac.aether_authz.http.allowed", 10),
        ("http.inbound-u1-http.rbac.aether_authz.http.policy.~no_allow.denied", 2),
        ("aether_authz.u1.allow.any.rbac.allowed", 5),
        ("aether_authz.u1.allow.any.rbac.denied", 6),
        ("aether_authz.gone.deny.0.rbac.denied", 50),  # a pod no longer here
        ("tcp.other.stat", 1),
    ]
    pods = {"u1": ("app", "server", pols), "u2": ("app", "server", pols)}
    got = decisions(stats, pods)
    assert got[Decisions("app", "server", "app/deny-c", "DENY", "deny")] == 6
    assert got[Decisions("app", "server", "app/watch", "AUDIT", "audit")] == 4
    assert got[Decisions("app", "server", "*", "ALLOW", "allow")] == 5 + 10
    assert got[Decisions("app", "server", "*", "ALLOW", "deny")] == 6 + 2
    assert len(got) == 4
    # a policy is there from the start, at zero
    assert decisions([], {"u1": ("app", "server", (deny,))}) == {
        Decisions("app", "server", "app/deny-c", "DENY", "deny"): 0}


def test_the_sink_keeps_an_adds_policies_until_the_mesh_holds_the_pod() -> None:
    import threading

    from agent.envoy.resources import PodListener
    from agent.envoy.sink import EnvoySink
    sink = EnvoySink.__new__(EnvoySink)  # its state only: no Envoy, no xDS server
    sink._lock = threading.Lock()
    policy = parse_policy(ALLOW_A)
    sink._pods = {"c1": PodListener("c1", "/n1", authz=(policy,)),
                  "c2": PodListener("c2", "/n2", authz=(policy,))}
    sink._pod_keys = {"c1": "app/known", "c2": "app/registering"}
    sink._pod_labels = {"c2": {"app": "echo"}}
    sink.authz_for = lambda ns, labels: (policy,) if labels.get("app") == "echo" else ()
    # the mesh holds only app/known, which no policy selects any more
    assert sink.set_authz({}, frozenset({"app/known"})) == 1
    assert sink._pods["c1"].authz == () and sink._pods["c2"].authz == (policy,)
    # no policy at all: every pod, known or not
    assert sink.set_authz({}, None) == 1 and sink._pods["c2"].authz == ()
    # a listener inserted after a policy change gets the policies as they are now
    assert sink._current_authz("c2", PodListener("c2", "/n2")).authz == (policy,)
