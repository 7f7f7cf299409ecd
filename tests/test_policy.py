"""Capture decision and annotation parsing: pure, no root."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agent.capture.policy import (
    ANN_EXCLUDE_PORTS,
    ANN_EXCLUDE_RANGES,
    ANN_REDIRECT_ALL,
    decide,
    parse_cidrs,
    parse_ports,
)
from agent.common.config import NodeConfig
from agent.source.model import NamespaceMeta, PodMeta

NODE = NodeConfig()
MANAGED_NS = NamespaceMeta("app", labels={"aether.io/managed": "true"})
PLAIN_NS = NamespaceMeta("plain")


def pod(ns: str = "app", labels: dict[str, str] | None = None,
        ann: dict[str, str] | None = None, **kw: object) -> PodMeta:
    return PodMeta(ns, "p", "uid", labels or {}, ann or {}, **kw)  # type: ignore[arg-type]


def test_namespace_label_enrolls() -> None:
    d = decide(pod(), MANAGED_NS, NODE, True)
    assert d.captured and d.policy and d.policy.redirect_all
    assert "namespace label" in d.reason


def test_pod_label_enrolls_and_opt_out_wins() -> None:
    assert decide(pod("plain", {"aether.io/managed": "true"}), PLAIN_NS, NODE, True).captured
    d = decide(pod(labels={"aether.io/managed": "false"}), MANAGED_NS, NODE, True)
    assert not d.captured and "opt-out" in d.reason


def test_unmanaged_system_agent_and_hostnetwork_not_captured() -> None:
    assert not decide(pod("plain"), PLAIN_NS, NODE, True).captured
    assert not decide(pod("plain"), None, NODE, True).captured
    sys_ns = NamespaceMeta("kube-system", labels={"aether.io/managed": "true"})
    assert not decide(pod("kube-system", {"aether.io/managed": "true"}), sys_ns, NODE, True).captured
    agent = pod("aether-system", {"app.kubernetes.io/name": "aether-agent",
                                  "aether.io/managed": "true"})
    assert not decide(agent, None, NODE, True).captured
    custom = NodeConfig(system_namespaces=("infra",))
    assert not decide(pod("infra", {"aether.io/managed": "true"}), None, custom, True).captured
    assert not decide(pod(host_network=True), MANAGED_NS, NODE, True).captured


def test_redirect_all_precedence() -> None:
    def mode(default: bool, value: str | None) -> bool:
        ann = {} if value is None else {ANN_REDIRECT_ALL: value}
        d = decide(pod(ann=ann), MANAGED_NS, NODE, default)
        assert d.policy is not None
        return d.policy.redirect_all

    assert mode(True, None) is True
    assert mode(False, None) is False
    assert mode(True, "false") is False
    assert mode(False, "true") is True
    assert mode(False, " TRUE ") is True
    d = decide(pod(ann={ANN_REDIRECT_ALL: "yes"}), MANAGED_NS, NODE, True)
    assert d.policy and d.policy.redirect_all is True
    assert [p.entry for p in d.problems] == ["yes"]


def test_ports_parse_merge_and_report() -> None:
    ranges, problems = parse_ports("5432, 8000-8010,8005, x, 0, 65536, 9-3,,  ")
    assert ranges == ((5432, 5432), (8000, 8010))
    assert [p.entry for p in problems] == ["x", "0", "65536", "9-3"]
    assert parse_ports("1,2,3")[0] == ((1, 3),)


def test_cidrs_parse_collapse_and_report() -> None:
    v4, v6, problems = parse_cidrs("10.0.0.0/8, 10.1.0.0/16, 192.168.1.7, fd00::1, ::/0, 1.2.3.4/33, x")
    assert v4 == ("10.0.0.0/8", "192.168.1.7/32")
    assert v6 == ("::/0",)
    assert [p.entry for p in problems] == ["1.2.3.4/33", "x"]
    v4, _, _ = parse_cidrs("10.0.0.5/24")  # host bits set: normalised, not rejected
    assert v4 == ("10.0.0.0/24",)


def test_decision_carries_exclusions_and_every_problem() -> None:
    d = decide(pod(ann={ANN_EXCLUDE_PORTS: "53,abc", ANN_EXCLUDE_RANGES: "10.0.0.0/8,zz"}),
               MANAGED_NS, NODE, True)
    assert d.policy is not None
    assert d.policy.exclude_ports == ((53, 53),)
    assert d.policy.exclude_v4 == ("10.0.0.0/8",)
    assert {p.annotation for p in d.problems} == {ANN_EXCLUDE_PORTS, ANN_EXCLUDE_RANGES}


def test_policy_json_roundtrip() -> None:
    d = decide(pod(ann={ANN_EXCLUDE_PORTS: "1-5", ANN_EXCLUDE_RANGES: "fd00::/8"}),
               MANAGED_NS, NODE, False)
    assert d.policy is not None
    from agent.capture.policy import CapturePolicy
    assert CapturePolicy.from_json(d.policy.to_json()) == d.policy


@given(st.text(max_size=300))
def test_ports_never_raise_and_account_for_every_entry(s: str) -> None:
    ranges, problems = parse_ports(s)
    for lo, hi in ranges:
        assert 1 <= lo <= hi <= 65535
    entries = [e.strip() for e in s.replace("\n", ",").split(",") if e.strip()]
    assert len(problems) <= len(entries)


@given(st.lists(st.one_of(st.ip_addresses().map(str), st.text(max_size=20)), max_size=30))
def test_cidrs_never_raise(items: list[str]) -> None:
    v4, v6, problems = parse_cidrs(",".join(items))
    assert all(":" not in n for n in v4) and all(":" in n for n in v6)
