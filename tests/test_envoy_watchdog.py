"""The envoy watchdog's hung-or-busy decision (agent.envoy.watchdog)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from agent.envoy.watchdog import main_thread_cpu, verdict


def test_answering_is_never_hung() -> None:
    assert verdict(0.0, None, 1.0, 15.0, 180.0) == "answering"
    assert verdict(0.0, 0.0, 1.0, 15.0, 180.0) == "answering"


def test_short_silence_is_only_silence() -> None:
    assert verdict(5.0, 0.0, 1.0, 15.0, 180.0) == "silent"
    assert verdict(14.9, 1.0, 1.0, 15.0, 180.0) == "silent"


def test_silent_and_idle_is_hung() -> None:
    # SIGSTOP or a deadlock: the main thread burns nothing
    assert verdict(15.0, 0.0, 1.0, 15.0, 180.0) == "hung"
    assert verdict(20.0, 0.05, 1.0, 15.0, 180.0) == "hung"  # below the busy share


def test_silent_but_working_is_busy_until_the_busy_timeout() -> None:
    # applying a 10k-cluster push: the admin is silent, the main thread at full CPU
    assert verdict(30.0, 0.95, 1.0, 15.0, 180.0) == "busy"
    assert verdict(179.0, 0.3, 1.0, 15.0, 180.0) == "busy"
    assert verdict(180.0, 1.0, 1.0, 15.0, 180.0) == "hung"  # spinning forever serves nothing


def test_unreadable_cpu_falls_back_to_silence_alone() -> None:
    assert verdict(15.0, None, 1.0, 15.0, 180.0) == "hung"


def test_main_thread_cpu_follows_a_busy_process_and_not_a_stopped_one() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        first = main_thread_cpu(busy.pid)
        time.sleep(0.5)
        second = main_thread_cpu(busy.pid)
        assert first is not None and second is not None
        assert second - first > 0.1
        os.kill(busy.pid, 19)  # SIGSTOP
        time.sleep(0.1)
        stopped = main_thread_cpu(busy.pid)
        time.sleep(0.5)
        assert main_thread_cpu(busy.pid) == stopped
    finally:
        busy.kill()
        busy.wait()
    assert main_thread_cpu(busy.pid) is None  # reaped: gone
