"""Kubernetes Events off the CNI path: a bounded queue drained by one thread.

An ADD that finds a malformed annotation reports it as an Event, but the pod's start must not
wait for the API server (unreachable, it would cost each such ADD the request timeout). The
Event is queued and sent by a worker; when the queue is full (API server down for long) new
Events are dropped and counted, never blocking.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from agent.source.base import PodEvent

log = logging.getLogger("aether.events")

DEFAULT_CAPACITY = 256


class EventQueue:
    def __init__(self, send: Callable[[PodEvent], None], capacity: int = DEFAULT_CAPACITY) -> None:
        self._send = send
        self._queue: queue.Queue[PodEvent] = queue.Queue(maxsize=capacity)
        self.sent = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="event-queue", daemon=True)
        self._thread.start()

    def put(self, event: PodEvent) -> None:
        """Never blocks: a full queue drops the Event (counted, logged at powers of two)."""
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1
            if self.dropped & (self.dropped - 1) == 0:
                log.warning("event queue full: dropped an Event for %s/%s (%s); %d dropped so "
                            "far", event.namespace, event.pod, event.reason, self.dropped)

    def _run(self) -> None:
        while True:
            event = self._queue.get()
            try:
                self._send(event)  # sources log their own failures (best effort)
                self.sent += 1
            except Exception:  # noqa: BLE001 - the worker must outlive any one Event
                log.exception("recording an Event for %s/%s failed", event.namespace, event.pod)
            finally:
                self._queue.task_done()

    def join(self, timeout: float = 5.0) -> bool:
        """For tests and shutdown: wait until every queued Event was handed over."""
        done = threading.Event()

        def wait() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=wait, daemon=True).start()
        return done.wait(timeout)

    def status(self) -> dict[str, int]:
        return {"queued": self._queue.qsize(), "sent": self.sent, "dropped": self.dropped}
