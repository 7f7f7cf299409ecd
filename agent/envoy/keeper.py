"""A tiny parent for Envoy that outlives the agent.

Envoy asks the kernel to signal it when its parent dies (parent-death signal), so an Envoy
forked straight from the agent would die with an agent crash and drop every pod's traffic.
The keeper is that parent instead: it forwards stop signals and exits with Envoy's status,
so the agent's supervisor still sees crashes and a restarted agent can adopt the keeper.
With ``--cgroup DIR`` it first moves itself into the proxy's cgroup, so Envoy is born there and
every socket it opens carries that cgroup (what the pod rules' mark RETURN is bound to).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import FrameType


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "--cgroup":
        with open(os.path.join(argv[1], "cgroup.procs"), "w") as f:
            f.write("0")
        argv = argv[2:]
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("usage: python -m agent.envoy.keeper [--cgroup DIR] -- ENVOY ARGS...",
              file=sys.stderr)
        return 2
    proc = subprocess.Popen(argv)

    def forward(signum: int, _frame: FrameType | None) -> None:
        proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    rc = proc.wait()
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
