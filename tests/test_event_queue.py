"""Events leave through a bounded queue: put never blocks, a full queue drops and counts."""

from __future__ import annotations

import threading

from agent.source.base import PodEvent
from agent.source.event_queue import EventQueue


def _event(i: int) -> PodEvent:
    return PodEvent("ns", f"p{i}", "", "CaptureAnnotationInvalid", "bad")


def test_events_are_sent_in_order_off_the_callers_thread() -> None:
    seen: list[tuple[str, str]] = []
    q = EventQueue(lambda e: seen.append((e.pod, threading.current_thread().name)))
    for i in range(3):
        q.put(_event(i))
    assert q.join()
    assert [p for p, _ in seen] == ["p0", "p1", "p2"]
    assert {t for _, t in seen} == {"event-queue"}
    assert q.status() == {"queued": 0, "sent": 3, "dropped": 0}


def test_a_stuck_api_never_blocks_put_and_overflow_is_counted() -> None:
    gate = threading.Event()
    q = EventQueue(lambda e: gate.wait(10), capacity=4)
    for i in range(10):  # one in flight, four queued, five dropped; none of this blocks
        q.put(_event(i))
    st = q.status()
    assert st["dropped"] >= 5 and st["queued"] <= 4
    gate.set()
    assert q.join()
    assert q.status()["sent"] + q.status()["dropped"] == 10


def test_a_failing_send_does_not_stop_the_worker() -> None:
    sent: list[str] = []

    def send(e: PodEvent) -> None:
        if e.pod == "p0":
            raise RuntimeError("API down")
        sent.append(e.pod)

    q = EventQueue(send)
    q.put(_event(0))
    q.put(_event(1))
    assert q.join()
    assert sent == ["p1"]
