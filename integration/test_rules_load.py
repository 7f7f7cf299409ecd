"""Property test (root): whatever the annotations say, the rendered ruleset loads into a real
netns through libnftables, and every rejected entry is reported."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.capture.policy import ANN_EXCLUDE_PORTS, ANN_EXCLUDE_RANGES, ANN_REDIRECT_ALL, decide
from agent.capture.rules import render_ruleset
from agent.common.config import NodeConfig
from agent.netns import nft
from agent.source.model import NamespaceMeta, PodMeta


@pytest.fixture(scope="module")
def scratch_netns() -> Iterator[str]:
    name = f"aet-fuzz-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    yield f"/var/run/netns/{name}"
    subprocess.run(["ip", "netns", "del", name], check=False)


port_entry = st.one_of(st.integers(-5, 70000).map(str),
                       st.tuples(st.integers(0, 66000), st.integers(0, 66000))
                       .map(lambda t: f"{t[0]}-{t[1]}"),
                       st.text(max_size=8))
cidr_entry = st.one_of(st.ip_addresses().map(str),
                       st.tuples(st.ip_addresses(v=4), st.integers(0, 40)).map(lambda t: f"{t[0]}/{t[1]}"),
                       st.tuples(st.ip_addresses(v=6), st.integers(0, 140)).map(lambda t: f"{t[0]}/{t[1]}"),
                       st.text(max_size=12))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(port_entry, max_size=40), st.lists(cidr_entry, max_size=40),
       st.sampled_from(["true", "false", "TRUE", " maybe ", ""]), st.booleans())
def test_rendered_ruleset_always_loads(scratch_netns: str, ports: list[str], cidrs: list[str],
                                       redirect: str, node_default: bool) -> None:
    ann = {ANN_EXCLUDE_PORTS: " , ".join(ports), ANN_EXCLUDE_RANGES: ",".join(cidrs),
           ANN_REDIRECT_ALL: redirect}
    d = decide(PodMeta("app", "p", annotations=ann),
               NamespaceMeta("app", labels={"aether.io/managed": "true"}), NodeConfig(), node_default)
    assert d.captured and d.policy is not None
    rejected = {p.entry for p in d.problems}
    entries = [e.strip() for e in ann[ANN_EXCLUDE_PORTS].replace("\n", ",").split(",")]
    for e in entries:
        if e and e not in rejected:  # accepted entries are valid ports or ranges
            lo, _, hi = e.partition("-")
            assert 1 <= int(lo) <= 65535 and (not hi or int(lo) <= int(hi) <= 65535)
    fp = nft.apply_ruleset(scratch_netns, render_ruleset(d.policy))
    assert fp == nft.live_fingerprint(scratch_netns)


def test_a_created_tables_fingerprint_is_reused_only_where_it_is_true() -> None:
    """The second fresh netns given the same plain `create` skips the read-back; what it
    returns is what the kernel there holds. A replace (the table existed) is read back."""
    from agent.capture.rules import render_create

    d = decide(PodMeta("app", "p", annotations={ANN_EXCLUDE_PORTS: "7011"}),
               NamespaceMeta("app", labels={"aether.io/managed": "true"}), NodeConfig(), True)
    assert d.policy is not None
    create, full = render_create(d.policy), render_ruleset(d.policy)
    names = [f"aet-fp-{uuid.uuid4().hex[:6]}" for _ in range(2)]
    for n in names:
        subprocess.run(["ip", "netns", "add", n], check=True)
    try:
        first, second = (f"/var/run/netns/{n}" for n in names)
        fp1 = nft.apply_ruleset(first, full, first=create)
        assert nft.created_fingerprints.get(create) == fp1
        fp2 = nft.apply_ruleset(second, full, first=create)  # from the cache
        assert fp2 == fp1 == nft.live_fingerprint(second)
        # someone changed the table in the first netns: a re-apply replaces and reads back
        subprocess.run(["ip", "netns", "exec", names[0], "nft", "add rule inet aether output "
                        "tcp dport 9 return"], check=True)
        assert nft.live_fingerprint(first) != fp1
        assert nft.apply_ruleset(first, full, first=create) == fp1 == nft.live_fingerprint(first)
    finally:
        for n in names:
            subprocess.run(["ip", "netns", "del", n], check=False)
