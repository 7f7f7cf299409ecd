"""The node's addresses (STRICT's kubelet-probe exemption) from one raw netlink dump."""

from __future__ import annotations

from pyroute2 import IPRoute

from agent.netns.addresses import _dump_addresses, node_addresses, usable


def test_the_dump_reads_what_pyroute2_reads() -> None:
    """Every address of this netns, each its own (IFA_LOCAL, else IFA_ADDRESS), as the
    netlink library reports them; loopback and link-local dropped after."""
    with IPRoute() as ipr:
        expected = [m.get_attr("IFA_LOCAL") or m.get_attr("IFA_ADDRESS") for m in ipr.get_addr()]
    got = _dump_addresses()
    assert sorted(got) == sorted(a for a in expected if a)
    assert "127.0.0.1" in got  # loopback is in the dump ...
    assert "127.0.0.1" not in node_addresses()  # ... and not a node address
    assert node_addresses() == usable(got)
