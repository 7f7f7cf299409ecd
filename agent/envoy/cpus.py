"""How many CPUs this process may really use: its affinity mask and its cgroup's CPU quota
(cgroup v2 `cpu.max` of its own cgroup and every parent), not `os.cpu_count()`, which counts
the machine's. The node Envoy's default worker count is half of that."""

from __future__ import annotations

import math
import os

from agent.netns.cgroup import cgroup2_mount, own_cgroup2_path


def quota_cpus(cpu_max: str) -> float | None:
    """`cpu.max` text ("max 100000" or "<quota> <period>") → CPUs allowed, None if unlimited
    (pure)."""
    parts = cpu_max.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def usable_cpus() -> int:
    """min(affinity, the tightest cgroup v2 quota on the way from our cgroup to the root)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        with open("/proc/self/mountinfo") as f:
            mount = cgroup2_mount(f.read())
        with open("/proc/self/cgroup") as f:
            own = own_cgroup2_path(f.read())
    except OSError:
        return max(1, n)
    if mount is None or own is None:
        return max(1, n)
    path = os.path.join(mount, own.lstrip("/"))
    limit: float | None = None
    while path.startswith(mount):
        try:
            with open(os.path.join(path, "cpu.max")) as f:
                q = quota_cpus(f.read())
            if q is not None:
                limit = q if limit is None else min(limit, q)
        except OSError:
            pass
        if os.path.normpath(path) == os.path.normpath(mount):
            break
        path = os.path.dirname(path)
    if limit is not None:
        n = min(n, max(1, math.ceil(limit)))
    return max(1, n)


def default_envoy_workers() -> int:
    """Half the usable CPUs, at least one: the node Envoy shares them with the pods it serves."""
    return max(1, usable_cpus() // 2)
