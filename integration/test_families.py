"""Which loopback families a pod's capture listener can bind (asked before Envoy is)."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator

import pytest

from agent.netns.families import NoLoopback, loopback_families


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"aet-fam-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def test_lo_down_then_up_then_ipv6_disabled(netns: str) -> None:
    path = f"/var/run/netns/{netns}"
    with pytest.raises(NoLoopback, match="is lo up"):
        loopback_families(path)  # a fresh netns: lo down (127.0.0.1 would bind, carry nothing)
    subprocess.run(["ip", "-n", netns, "link", "set", "lo", "up"], check=True)
    assert loopback_families(path) == (True, True)
    for key in ("all", "lo"):
        subprocess.run(["nsenter", f"--net={path}", "sysctl", "-qw",
                        f"net.ipv6.conf.{key}.disable_ipv6=1"], check=True)
    assert loopback_families(path) == (True, False)
