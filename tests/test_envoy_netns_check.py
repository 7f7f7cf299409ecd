"""The netns-leak check kills Envoy only for a leak, never for a bind's brief visit."""

from __future__ import annotations

import types
from collections.abc import Iterator

import pytest

from agent.envoy import sink
from agent.envoy.sink import EnvoySink

OURS = (1, 100)
POD = (1, 200)


def _fake(monkeypatch: pytest.MonkeyPatch, envoy_views: Iterator[tuple[int, int]]) -> list[int]:
    killed: list[int] = []

    def identity(path: str) -> tuple[int, int]:
        return OURS if path == "/proc/self/ns/net" else next(envoy_views)

    monkeypatch.setattr(sink, "netns_identity", identity)
    monkeypatch.setattr(sink.os, "kill", lambda pid, _sig: killed.append(pid))
    monkeypatch.setattr(sink, "NETNS_CONFIRM_INTERVAL_S", 0.0)
    return killed


def _sink() -> types.SimpleNamespace:
    return types.SimpleNamespace(pid=4242, _netns_killed=None, netns_restarts=0)


def test_a_bind_in_progress_is_not_a_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    killed = _fake(monkeypatch, iter([POD, POD, OURS]))
    s = _sink()
    assert EnvoySink.check_envoy_netns(s, "test") is True  # type: ignore[arg-type]
    assert killed == [] and s.netns_restarts == 0


def test_a_netns_that_stays_foreign_restarts_envoy_once(monkeypatch: pytest.MonkeyPatch) -> None:
    def always_pod() -> Iterator[tuple[int, int]]:
        while True:
            yield POD

    killed = _fake(monkeypatch, always_pod())
    s = _sink()
    assert EnvoySink.check_envoy_netns(s, "test") is False  # type: ignore[arg-type]
    assert EnvoySink.check_envoy_netns(s, "again") is False  # type: ignore[arg-type]
    assert killed == [4242] and s.netns_restarts == 1
