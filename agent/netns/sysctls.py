"""The one pod-netns sysctl capture changes: ``net.ipv4.tcp_tw_reuse``, from 2 to 1.

Capture puts the node Envoy in the middle of every connection, and Envoy's upstream sockets
live in the pods' netns. Whoever sends the first FIN keeps the connection's 4-tuple in
TIME_WAIT for 60 s, and on a relayed connection that is often Envoy: towards the
application, when the caller closes first, and towards the destination's :15008. Inside a
server pod every delivery goes from the pod's own address to the pod's own address and the
application's port, whoever the caller is. So one (source, destination, port) triple holds
every caller's TIME_WAIT: the port range (28,232 ports by default) runs out at about 470
new connections a second, and every connect() first scans the whole range. bench.mesh_mtls
measured that at 60 % of the node Envoy's CPU, with the rate down to a third. Without the
mesh, each caller's TIME_WAIT is keyed by its own address, and nothing runs out.

With ``tcp_tw_reuse`` 1 a new outgoing connection may take over a TIME_WAIT 4-tuple once
that is a second old; TCP timestamps protect it against old segments (PAWS). The kernel's
default, 2, allows this on loopback only. Only the value 2 is changed. A value a pod set
itself (0 or 1, through its securityContext sysctls) is left as it is. The setting affects
outgoing connections only, the pod's own included, and dies with the netns. A pod released
from capture keeps it: that is harmless, and restoring it would race the pod's own
connections.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

TW_REUSE = "/proc/sys/net/ipv4/tcp_tw_reuse"
#: the kernel's default: reuse for loopback traffic only
KERNEL_DEFAULT = "2"


def reuse_time_wait_here(path: str = TW_REUSE) -> str | None:
    """Set ``tcp_tw_reuse`` to 1 in the calling thread's netns if it is the kernel default.
    Returns the value now in force, or None when it cannot be read or written. A read-only
    /proc/sys is logged, not fatal: capture does not depend on it."""
    try:
        with open(path) as f:
            value = f.read().strip()
        if value != KERNEL_DEFAULT:
            return value
        with open(path, "w") as f:
            f.write("1")
        return "1"
    except OSError as e:
        log.warning("tcp_tw_reuse not set in the pod's netns (%s): a pod taking many new "
                    "mesh connections may run out of local ports", e)
        return None


MIGRATE_REQ = "/proc/sys/net/ipv4/tcp_migrate_req"


def migrate_requests_here(path: str = MIGRATE_REQ) -> bool:
    """Set ``net.ipv4.tcp_migrate_req`` to 1 in the calling thread's netns (Linux ≥ 5.14).

    During a take-over both agents' Envoys listen on the capture port in the pod's netns
    (one SO_REUSEPORT group). When the old one closes its sockets, connections in their
    accept queues would be reset; with this set the kernel moves them to the new Envoy's
    sockets instead, so not one queued connection is lost. It changes nothing else (only
    closing reuseport listeners are affected). False when the kernel lacks it or /proc/sys
    is read-only: the take-over then reports it, since a queued connection could be reset."""
    try:
        with open(path) as f:
            if f.read().strip() == "1":
                return True
        with open(path, "w") as f:
            f.write("1")
        return True
    except OSError as e:
        log.warning("tcp_migrate_req not set in the pod's netns (%s): connections queued on a "
                    "closing listener during a take-over would be reset", e)
        return False
