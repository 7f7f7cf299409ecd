"""Concurrent ADDs share the node Envoy's publishes (EnvoySink._publish_shared)."""

from __future__ import annotations

import threading
import time

from agent.envoy.sink import EnvoySink


class _Sink:
    """The parts of EnvoySink that _publish_shared uses, with a slow fake publish."""

    _publish_shared = EnvoySink._publish_shared
    _current_authz = EnvoySink._current_authz

    def __init__(self, fail_first: bool = False, publish_s: float = 0.05,
                 ack_s: float = 0.0) -> None:
        self.publish_s, self.ack_s = publish_s, ack_s
        self.ack_timeout = 10.0
        self._lock = threading.Lock()
        self._batch = threading.Condition(threading.Lock())
        self._ticket = self._covered = 0
        self._covered_version = ""
        self._covered_at = 0.0
        self._batch_busy = False
        self._incoming: dict[str, object] = {}
        self._pods: dict[str, object] = {}
        self._pod_labels: dict[str, dict[str, str]] = {}
        self.authz_for = None
        self._rejected: dict[str, str] = {"p3": "an earlier NACK"}
        self.shared_publishes = 0
        self.published: list[frozenset[str]] = []
        self.fail_first = fail_first

    def _await_envoy(self, version: str, until: float | None = None) -> None:
        time.sleep(self.ack_s)  # Envoy applying the push and ACKing it

    def _publish(self) -> str:
        time.sleep(self.publish_s)  # build + push: long enough for the others to queue up
        if self.fail_first:
            self.fail_first = False
            raise RuntimeError("push failed")
        self.published.append(frozenset(self._pods))
        return str(len(self.published))

    def add(self, pod: str) -> tuple[str, str]:
        try:
            return pod, self._publish_shared(pod, object())[0]
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


def test_adds_arriving_while_envoy_applies_a_push_gather_into_the_next() -> None:
    """A quick build and push, a slower ACK: ADDs arriving one after another while Envoy
    applies a push wait for its answer and go out together, not one push each."""
    sink = _Sink(publish_s=0.001, ack_s=0.06)
    out: dict[str, str] = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(*sink.add(f"p{i}")))
               for i in range(16)]
    for t in threads:
        t.start()
        time.sleep(0.008)
    for t in threads:
        t.join()
    assert len(sink.published) <= 4, [sorted(p) for p in sink.published]
    for pod, version in out.items():
        assert pod in sink.published[int(version) - 1], (pod, version)


class _Xds:
    def __init__(self, ack_after: float | None, nack: bool = False) -> None:
        self.t0, self.ack_after, self.nack = time.monotonic(), ack_after, nack
        self.held = False

    def wait_acked(self, version: str, timeout: float) -> bool:
        if self.ack_after is not None and time.monotonic() - self.t0 >= self.ack_after:
            return True
        time.sleep(timeout)
        return False

    def status(self) -> dict[str, object]:
        return {"last_nack": {"version": "7"} if self.nack else None,
                "connected_streams": 1}


def _awaited(xds: _Xds, version: str = "7") -> float:
    sink = EnvoySink.__new__(EnvoySink)
    sink.xds = xds  # type: ignore[assignment]
    started = time.monotonic()
    sink._await_envoy(version)
    return time.monotonic() - started


def test_the_batch_waits_for_the_ack_a_nack_or_the_cap_whichever_first() -> None:
    from agent.envoy import sink as sink_mod
    assert 0.1 <= _awaited(_Xds(ack_after=0.1)) < 0.4
    assert _awaited(_Xds(ack_after=None, nack=True)) < 0.2  # a NACK of this very version
    assert _awaited(_Xds(ack_after=None, nack=True), version="8") >= sink_mod.PIPELINE_WAIT_S
    assert sink_mod.PIPELINE_WAIT_S <= _awaited(_Xds(ack_after=None)) < \
        sink_mod.PIPELINE_WAIT_S + 0.3  # a silent Envoy holds the batch no longer


def test_a_follower_never_waits_for_a_push_past_its_own_deadline() -> None:
    """The batch ahead holds its push for Envoy's answer; an ADD whose deadline passes while
    it waits fails (as ``--listener-timeout`` says) and leaves nothing queued behind it."""
    from agent.envoy.sink import ListenerNotConfirmed
    sink = _Sink(publish_s=0.001, ack_s=0.5)
    lead = threading.Thread(target=sink.add, args=("p0",))
    lead.start()
    time.sleep(0.05)
    started = time.monotonic()
    try:
        sink._publish_shared("p1", object(), time.monotonic() + 0.1)
        raise AssertionError("the follower should have timed out")
    except ListenerNotConfirmed:
        pass
    assert time.monotonic() - started < 0.3
    assert "p1" not in sink._incoming
    lead.join()


def test_no_envoy_connected_holds_nothing() -> None:
    xds = _Xds(ack_after=None)
    xds.status = lambda: {"last_nack": None, "connected_streams": 0}  # type: ignore[method-assign]
    assert _awaited(xds) < 0.05


class _HeldXds:
    """An Envoy connected to a held xDS server: nothing is sent, so nothing is ACKed."""

    def __init__(self, held: bool) -> None:
        self.held = held
        self.waits = 0

    def status(self) -> dict[str, object]:
        return {"connected_streams": 1}

    def wait_acked(self, version: str, timeout: float) -> bool:
        self.waits += 1
        time.sleep(timeout)
        return False


class _HeldWaiter:
    _await_envoy = EnvoySink._await_envoy

    def __init__(self, held: bool) -> None:
        self.xds = _HeldXds(held)


def test_a_held_xds_server_is_not_waited_on_for_an_ack_it_cannot_send() -> None:
    """A take-over restores every recorded pod into its Envoy before the Services are in:
    waiting out PIPELINE_WAIT_S for each held publish cost 1 s a pod (a minute at 110)."""
    held = _HeldWaiter(held=True)
    started = time.monotonic()
    held._await_envoy("7")
    assert time.monotonic() - started < 0.05 and held.xds.waits == 0
    released = _HeldWaiter(held=False)  # the same Envoy once released: its ACK is waited for
    released._await_envoy("7", until=time.monotonic() + 0.2)
    assert released.xds.waits > 0
