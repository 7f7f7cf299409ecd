"""Concurrent ADDs share the node Envoy's publishes (EnvoySink._publish_shared)."""

from __future__ import annotations

import threading
import time

from agent.envoy.sink import EnvoySink


class _Sink:
    """The parts of EnvoySink that _publish_shared uses, with a slow fake publish."""

    _publish_shared = EnvoySink._publish_shared

    def __init__(self, fail_first: bool = False) -> None:
        self._lock = threading.Lock()
        self._batch = threading.Condition(threading.Lock())
        self._ticket = self._covered = 0
        self._covered_version = ""
        self._batch_busy = False
        self._incoming: dict[str, object] = {}
        self._pods: dict[str, object] = {}
        self._rejected: dict[str, str] = {"p3": "an earlier NACK"}
        self.shared_publishes = 0
        self.published: list[frozenset[str]] = []
        self.fail_first = fail_first

    def _publish(self) -> str:
        time.sleep(0.05)  # build + push: long enough for the others to queue up
        if self.fail_first:
            self.fail_first = False
            raise RuntimeError("push failed")
        self.published.append(frozenset(self._pods))
        return str(len(self.published))

    def add(self, pod: str) -> tuple[str, str]:
        try:
            return pod, self._publish_shared(pod, object())
        except RuntimeError:
            return pod, ""


def _run(sink: _Sink, n: int) -> dict[str, str]:
    out: dict[str, str] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(*sink.add(f"p{i}")))
               for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_a_lone_add_publishes_at_once() -> None:
    sink = _Sink()
    started = time.monotonic()
    assert sink.add("p0") == ("p0", "1")
    assert time.monotonic() - started < 0.5
    assert sink.published == [frozenset({"p0"})] and sink.shared_publishes == 0


def test_sixteen_concurrent_adds_share_a_few_publishes_each_holding_its_pod() -> None:
    sink = _Sink()
    versions = _run(sink, 16)
    assert len(sink.published) <= 3  # the first alone, then the ones that queued behind it
    assert sink.shared_publishes >= 13
    for pod, version in versions.items():
        # the version an ADD waits for holds its listener
        assert pod in sink.published[int(version) - 1], (pod, version)
    assert "p3" not in sink._rejected  # a re-added pod's old rejection is forgotten


def test_a_failed_publish_is_retried_by_the_waiters_not_reported_as_theirs() -> None:
    sink = _Sink(fail_first=True)
    versions = _run(sink, 8)
    failed = [p for p, v in versions.items() if not v]
    assert len(failed) == 1  # only the ADD whose own publish failed sees the failure
    for pod, version in versions.items():
        if version:
            assert pod in sink.published[int(version) - 1]
