"""Which loopback families a pod netns has, read over netlink inside it (pyroute2).

The pod's capture listener binds 127.0.0.1 and/or [::1] in the pod netns. Asking Envoy for a
family the pod does not have (IPv6 disabled by sysctl, common on IPv4-only clusters) makes the
bind fail, Envoy NACK the listener and the ADD fail; so the agent looks first and asks only
for what exists.
"""

from __future__ import annotations

import socket

from agent.netns.enter import run_in_netns


class NoLoopback(Exception):
    """Neither 127.0.0.1 nor ::1 exists in the netns: nothing to bind a listener to."""


def loopback_families(netns: str, timeout: float = 5.0) -> tuple[bool, bool]:
    """(has 127.0.0.1, has ::1) on the netns' loopback; raises NoLoopback when neither."""
    from pyroute2 import IPRoute

    def work() -> tuple[bool, bool]:
        with IPRoute() as ipr:
            found = {(a["family"], a.get_attr("IFA_ADDRESS")) for a in ipr.get_addr()}
        return (socket.AF_INET, "127.0.0.1") in found, (socket.AF_INET6, "::1") in found

    v4, v6 = run_in_netns(netns, work, timeout=timeout)
    if not (v4 or v6):
        raise NoLoopback(f"netns {netns} has neither 127.0.0.1 nor ::1 (is lo up?)")
    return v4, v6
