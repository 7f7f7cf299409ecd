"""agent.common.limits: the open-file limit the node Envoy inherits."""

from __future__ import annotations

import resource
import subprocess
import sys

from agent.common.limits import NOFILE_TARGET, nofile_plan

INF = resource.RLIM_INFINITY


def test_the_plan_never_lowers_and_stops_at_nr_open() -> None:
    assert nofile_plan(20_000, 20_000, 1 << 20) == (NOFILE_TARGET, NOFILE_TARGET)
    assert nofile_plan(1024, 524_288, 1 << 20) == (NOFILE_TARGET, NOFILE_TARGET)
    assert nofile_plan(1024, 524_288, 65_536) == (524_288, 524_288)  # hard never lowered
    assert nofile_plan(2_000_000, 2_000_000, 1 << 21) == (2_000_000, 2_000_000)
    assert nofile_plan(1024, INF, 1 << 20) == (NOFILE_TARGET, INF)
    assert nofile_plan(INF, INF, 1 << 20) == (INF, INF)


def test_a_child_started_after_raising_inherits_the_limit() -> None:
    """What Envoy gets, started by the keeper from an agent that called raise_nofile: the
    soft limit up to the hard one, and the hard one too with CAP_SYS_RESOURCE."""
    code = (
        "import resource, subprocess, sys\n"
        "from agent.common.limits import raise_nofile\n"
        "before = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "now = raise_nofile()\n"
        "child = subprocess.run([sys.executable, '-c', 'import resource; "
        "print(*resource.getrlimit(resource.RLIMIT_NOFILE))'], capture_output=True, text=True)\n"
        "print(*before, *now, child.stdout.strip())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    b_soft, b_hard, soft, hard, c_soft, c_hard = map(int, out.stdout.split())
    assert (c_soft, c_hard) == (soft, hard)
    assert soft == hard >= b_hard
    with open("/proc/sys/fs/nr_open") as f:
        nr_open = int(f.read())
    if _has_cap_sys_resource():  # the hard limit itself is raised
        assert hard == max(b_hard, min(NOFILE_TARGET, nr_open))
    else:  # root without it (this sandbox, the DaemonSet): the hard limit as it was
        assert hard == b_hard


def _has_cap_sys_resource() -> bool:
    with open("/proc/self/status") as f:
        eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    return bool(eff >> 24 & 1)  # CAP_SYS_RESOURCE
