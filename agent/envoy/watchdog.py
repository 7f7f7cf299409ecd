"""Is a silent Envoy hung, or busy? The decision the envoy watchdog acts on.

An Envoy whose admin does not answer is either hung (SIGSTOP, a deadlock: its main thread
burns no CPU) or busy on its main thread (applying 10k clusters from one CDS push takes it
10-20 s on a small node, during which the admin, served by the same thread, is silent).
Killing a busy Envoy throws that work away and the restarted one must redo it — at cluster
scale a kill-restart loop. So silence alone is not a hang: silence with a main thread that
made no progress is. A busy silence is still bounded (``busy_timeout``), since a main thread
spinning forever serves nothing either.
"""

from __future__ import annotations

import os
from typing import Literal

Verdict = Literal["answering", "silent", "busy", "hung"]

#: The main thread used at least this share of one CPU over the last check: it is working.
BUSY_CPU_SHARE = 0.2


def verdict(silent_s: float, cpu_delta_s: float | None, window_s: float, hang_timeout: float,
            busy_timeout: float) -> Verdict:
    """``silent_s``: seconds since the admin last answered (0: it answers). ``cpu_delta_s``:
    the main thread's CPU seconds over the last ``window_s`` (None: unreadable)."""
    if silent_s <= 0:
        return "answering"
    working = (cpu_delta_s is not None and window_s > 0
               and cpu_delta_s >= BUSY_CPU_SHARE * window_s)
    if silent_s < hang_timeout:
        return "silent"
    if working and silent_s < busy_timeout:
        return "busy"
    return "hung"


def stat_fields(path: str) -> list[bytes] | None:
    """The fields of a /proc ``stat`` file after the command name (field 3, the state, is
    index 0); None if the process is gone. The name (field 2) may hold spaces and
    parentheses: the fields follow the last ')'."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2:].split()


def main_thread_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) of ``pid``'s main thread, from /proc; None if gone."""
    fields = stat_fields(f"/proc/{pid}/task/{pid}/stat")
    if fields is None:
        return None
    try:
        ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    except (IndexError, ValueError):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")
