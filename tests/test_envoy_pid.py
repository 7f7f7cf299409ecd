"""EnvoySupervisor.pid under a keeper: found once, remembered while it is the keeper's child."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from agent.envoy import supervisor as sup


def _child_of(pid: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kid = sup.envoy_child(pid, timeout=0.1)
        if kid is not None:
            return kid
    raise AssertionError("no child")


def test_the_envoy_pid_is_remembered_until_it_stops_being_the_keepers_child(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a keeper whose child (standing in for Envoy) we can replace
    keeper = subprocess.Popen(["sh", "-c", "while :; do sleep 30 & wait $!; done"])
    try:
        s = sup.EnvoySupervisor.__new__(sup.EnvoySupervisor)
        s._lock = threading.Lock()
        s._proc = keeper
        s.use_keeper = True
        s._envoy_pid = None
        first = _child_of(keeper.pid)
        scans = []
        real = sup.envoy_child
        monkeypatch.setattr(sup, "envoy_child", lambda pid, timeout=2.0: scans.append(pid)
                            or real(pid, timeout))
        assert s.pid == first and len(scans) == 1
        assert [s.pid for _ in range(20)] == [first] * 20 and len(scans) == 1  # no rescans
        subprocess.run(["kill", str(first)], check=True)  # "Envoy" restarts under the keeper
        deadline = time.monotonic() + 5
        while (now := s.pid) in (first, None) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert now not in (first, None) and sup._parent_of(now) == keeper.pid
        assert len(scans) >= 2
    finally:
        keeper.kill()
        keeper.wait()
