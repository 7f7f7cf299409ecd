"""The agent's open-file limit, which its Envoy inherits.

The node Envoy holds two descriptors per proxied connection (plus listeners in every pod's
netns) for the whole node, where a sidecar holds one pod's. At the 20,000 of the machine the
benchmarks run on, a burst of connections made it fail ``socket(2)`` with EMFILE and crash
(bench/README.md, eleventh session). So ``aether-agent run`` raises its soft limit to the
hard one (allowed to anyone: containers commonly get a hard limit of 524288 or 1048576 from
their runtime, the systemd unit sets LimitNOFILE) and, when it may (CAP_SYS_RESOURCE, which
the DaemonSet does not grant), the hard one to ``NOFILE_TARGET`` within ``fs.nr_open``. Envoy,
started afterwards through the keeper, inherits both. A limit left under 65536 is logged as a
warning.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("aether.limits")

#: What containerd and systemd services commonly get: enough for a node's connections.
NOFILE_TARGET = 1 << 20
NR_OPEN = "/proc/sys/fs/nr_open"


def nofile_plan(soft: int, hard: int, nr_open: int, target: int = NOFILE_TARGET) -> tuple[int, int]:
    """The (soft, hard) to ask for: never lower either; the hard limit up to ``target`` within
    ``nr_open`` (refused without CAP_SYS_RESOURCE: see raise_nofile), the soft one to it."""
    ceiling = min(target, nr_open)
    if hard == resource.RLIM_INFINITY:  # any soft value is allowed: the same ceiling
        return (soft if soft == resource.RLIM_INFINITY else max(soft, ceiling)), hard
    new_hard = max(hard, ceiling)
    return new_hard, new_hard


def raise_nofile(target: int = NOFILE_TARGET) -> tuple[int, int]:
    """Raise RLIMIT_NOFILE as far as allowed; returns the (soft, hard) now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        with open(NR_OPEN) as f:
            nr_open = int(f.read().strip())
    except (OSError, ValueError):
        nr_open = hard
    want = nofile_plan(soft, hard, nr_open, target)
    if want != (soft, hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, want)
        except (OSError, ValueError):  # no CAP_SYS_RESOURCE: the soft limit up to the hard one
            if soft != hard:
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    now = resource.getrlimit(resource.RLIMIT_NOFILE)
    level = logging.WARNING if now[0] != resource.RLIM_INFINITY and now[0] < 65536 else logging.INFO
    log.log(level, "open files limit %s (was %s/%s); Envoy inherits it", f"{now[0]}/{now[1]}",
            soft, hard)
    return now
