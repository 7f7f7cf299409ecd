"""Rule rendering against golden files (regenerate with AETHER_UPDATE_GOLDEN=1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.capture.policy import ANN_EXCLUDE_PORTS, ANN_EXCLUDE_RANGES, ANN_REDIRECT_ALL, decide
from agent.capture.rules import fingerprint, normalize_listing, render_rules, render_ruleset
from agent.common.config import NodeConfig
from agent.source.model import NamespaceMeta, PodMeta

GOLDEN = Path(__file__).parent / "golden"
NS = NamespaceMeta("app", labels={"aether.io/managed": "true"})
# the production shape: the proxy's own cgroup v2 is known (agent.netns.cgroup)
NODE = NodeConfig(proxy_cgroup="unified/aether-proxy", proxy_cgroup_level=1)

CASES = {
    "redirect_all_default": {},
    "scoped": {ANN_REDIRECT_ALL: "false"},
    "exclusions": {ANN_EXCLUDE_PORTS: "5432,8000-8010,9000",
                   ANN_EXCLUDE_RANGES: "10.0.0.0/8,10.1.0.0/16,203.0.113.7,fd00::/8"},
    "scoped_exclusions": {ANN_REDIRECT_ALL: "false", ANN_EXCLUDE_PORTS: "3306"},
}


def _matches_golden(name: str, text: str) -> None:
    path = GOLDEN / f"{name}.nft"
    if os.environ.get("AETHER_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name: str) -> None:
    d = decide(PodMeta("app", "p", annotations=CASES[name]), NS, NODE, True)
    assert d.policy is not None
    text = render_ruleset(d.policy)
    _matches_golden(name, text)


def test_rule_order_is_the_contract() -> None:
    d = decide(PodMeta("app", "p", annotations=CASES["exclusions"]), NS, NODE, True)
    assert d.policy is not None
    rules = render_rules(d.policy)
    assert rules[0].startswith('meta mark & 0x000000ff == 0x000000ae socket cgroupv2 level 1 '
                               '"unified/aether-proxy" return')
    assert "redirect to :15001" in rules[-1]
    assert all("redirect" not in r for r in rules[:-1])


def test_custom_ports_and_mark() -> None:
    node = NodeConfig(capture_port=16001, mesh_port=19000, passthrough_mark=0x4A00,
                      passthrough_mark_mask=0xFF00)
    d = decide(PodMeta("app", "p", annotations={ANN_REDIRECT_ALL: "false"}), NS, node, True)
    assert d.policy is not None
    text = render_ruleset(d.policy)
    assert "meta mark & 0x0000ff00 == 0x00004a00 return" in text
    assert "tcp dport 19000 tcp flags & (syn | ack) == syn redirect to :16001" in text


def test_mark_alone_never_returns_when_the_proxy_cgroup_is_known() -> None:
    """The mark RETURN is bound to the proxy's cgroup: no rule RETURNs on the mark alone."""
    d = decide(PodMeta("app", "p"), NS, NODE, True)
    assert d.policy is not None
    marked = [r for r in render_rules(d.policy) if "meta mark" in r]
    assert marked and all("socket cgroupv2 level 1" in r for r in marked)


def test_without_a_cgroup_match_the_rule_says_so() -> None:
    d = decide(PodMeta("app", "p"), NS, NodeConfig(), True)
    assert d.policy is not None
    first = render_rules(d.policy)[0]
    assert "socket cgroupv2" not in first and "mark only" in first


def test_cgroup_path_cannot_break_out_of_its_quotes() -> None:
    d = decide(PodMeta("app", "p"), NS, NodeConfig(proxy_cgroup='x" return', proxy_cgroup_level=1),
               True)
    assert d.policy is not None
    with pytest.raises(ValueError):
        render_rules(d.policy)


def test_fingerprint_ignores_handles() -> None:
    a = {"nftables": [{"metainfo": {"version": "1"}}, {"table": {"name": "aether", "handle": 3}}]}
    b = {"nftables": [{"metainfo": {"version": "2"}}, {"table": {"name": "aether", "handle": 9}}]}
    assert normalize_listing(a) == [{"table": {"name": "aether"}}]
    assert fingerprint(a) == fingerprint(b)


def test_the_releasing_table_redirects_nothing_but_keeps_conntrack_in_use() -> None:
    """A released pod's interim table: no redirect, yet a conntrack user (without one the
    kernel unhooks conntrack and open proxied connections lose their NAT)."""
    from agent.capture.rules import render_releasing
    text = render_releasing()
    assert "redirect" not in text
    assert "type nat hook output" in text
    assert "ct state" in text
    assert text.startswith("table inet aether\ndelete table inet aether\n")  # one transaction


def test_a_first_add_creates_the_table_plainly() -> None:
    """No delete of a hooked table inside the first ADD's transaction (that costs the kernel
    ~10 ms); `create` fails where a table exists, and the replace form applies then."""
    from agent.capture.rules import render_create, render_table
    d = decide(PodMeta("app", "p"), NS, NodeConfig(node_name="n"), True)
    assert d.policy is not None
    text = render_create(d.policy)
    first, rest = text.split("\n", 1)
    assert first.startswith('create table inet aether { comment "aether capture redirect-all')
    assert rest == render_table(d.policy)  # the comment rides on create, the body adds the chain
    assert "delete table" not in text


def test_strict_steers_other_inbound_connections_to_the_proxy() -> None:
    """STRICT: a prerouting chain sends every new inbound TCP connection to the inbound
    (mTLS-only) listener, except the mesh port itself, loopback and the node's addresses."""
    from agent.capture.policy import ANN_PEER_AUTH
    from agent.capture.rules import render_inbound_rules
    node = NodeConfig(proxy_cgroup="unified/aether-proxy", proxy_cgroup_level=1,
                      node_addresses=("10.214.0.1", "fd00::1"))
    d = decide(PodMeta("app", "p", annotations={ANN_PEER_AUTH: "strict"}), NS, node, True)
    assert d.policy is not None and d.policy.strict
    text = render_ruleset(d.policy)
    _matches_golden("strict", text)
    assert "type nat hook prerouting priority -100" in text
    rules = render_inbound_rules(d.policy)
    # the steering rule is last: nothing after it, every exemption before it
    assert rules[-1].startswith("tcp flags & (syn | ack) == syn redirect to :15008")
    assert all("redirect" not in r for r in rules[:-1])
    assert any(r.startswith("ip saddr 10.214.0.1 return") for r in rules)
    assert any(r.startswith("ip6 saddr fd00::1 return") for r in rules)
    # permissive pods get no inbound chain at all
    p = decide(PodMeta("app", "p"), NS, node, True)
    assert p.policy is not None and "prerouting" not in render_ruleset(p.policy)


@pytest.mark.parametrize("name,addresses,ranges", [
    ("strict_ipv4_only", ("10.214.0.1",), "10.0.0.0/8"),
    ("strict_ipv6_only", ("fd00::1",), "fd00:aa::/48"),
])
def test_golden_single_family(name: str, addresses: tuple[str, ...], ranges: str) -> None:
    """A node and exclusions of one address family: their rules only for that family (no
    empty set of the other, which nft would refuse); the fixed returns keep both."""
    from agent.capture.policy import ANN_PEER_AUTH
    node = NodeConfig(proxy_cgroup="unified/aether-proxy", proxy_cgroup_level=1,
                      node_addresses=addresses)
    d = decide(PodMeta("app", "p", annotations={ANN_PEER_AUTH: "strict",
                                                 ANN_EXCLUDE_RANGES: ranges}), NS, node, True)
    assert d.policy is not None
    text = render_ruleset(d.policy)
    _matches_golden(name, text)
    other = "ip6 " if name.endswith("ipv4_only") else "ip "
    mine = [line.strip() for line in text.splitlines()
            if "exclude-outbound" in line or "the node" in line]
    assert len(mine) == 2 and not any(line.startswith(other) for line in mine), mine
