"""The node Envoy's default workers follow the CPUs the agent may use, not the machine's."""

from __future__ import annotations

import os

import pytest

from agent.envoy import cpus


def test_cpu_max_quota_is_read_as_cpus() -> None:
    assert cpus.quota_cpus("max 100000") is None
    assert cpus.quota_cpus("150000 100000\n") == 1.5
    assert cpus.quota_cpus("50000 100000") == 0.5
    assert cpus.quota_cpus("garbage") is None


def test_affinity_bounds_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0})
    assert cpus.usable_cpus() == 1
    assert cpus.default_envoy_workers() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(8)))
    assert 1 <= cpus.usable_cpus() <= 8  # and a cgroup quota, if any, lowers it further
