"""A connection cap for the agent's threaded servers (CNI, status, metrics).

Every accepted connection costs a thread and an fd until it is answered. Uncapped, a flood of
idle connections (a pod can reach the metrics port through its own passthrough) exhausts
threads and pushes the agent's fd numbers past FD_SETSIZE, where libnftables' select() on its
netlink socket aborts the whole process. With the cap, the connection over it is answered
"busy" on the accept thread and closed at once; the fds in use stay bounded by the sum of the
caps (see docs/operations.md, "Limits").
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

log = logging.getLogger("aether.server")


# How long a handler thread waits for the next connection before it ends, and how many wait
IDLE_WORKER_S = 30.0
MAX_IDLE_WORKERS = 32


class BoundedThreadingMixIn:
    """For ``socketserver.ThreadingMixIn`` servers: at most ``max_connections`` handled at
    once; the next one gets ``busy_answer`` (best effort, 50 ms) and is closed. A handler
    thread that finished a connection waits ``IDLE_WORKER_S`` for the next one before it
    ends (at most ``MAX_IDLE_WORKERS`` wait): a burst of pod starts reuses threads instead of
    starting one per ADD."""

    max_connections: int = 64
    busy_answer: bytes = b""
    refused: int = 0
    _active: int = 0
    _active_lock: threading.Lock | None = None
    _idle: int = 0
    _handoff: queue.SimpleQueue[tuple[Any, Any]] | None = None
    handler_threads_started: int = 0

    def _slots(self) -> threading.Lock:
        if self._active_lock is None:
            self._active_lock = threading.Lock()
        return self._active_lock

    def process_request(self, request: Any, client_address: Any) -> None:
        refused = 0
        with self._slots():
            full = self._active >= self.max_connections
            if full:
                self.refused += 1
                refused = self.refused
            else:
                self._active += 1
        if full:
            if refused & (refused - 1) == 0:  # 1, 2, 4, 8, …: said, never a log flood
                log.warning("%s: %d connections at once (the cap): refused one as busy (%d "
                            "refused so far)", type(self).__name__, self.max_connections, refused)
            try:
                # take what the client already sent (closing on unread data would reset the
                # connection and lose our answer), never waiting for more
                request.setblocking(False)
                while request.recv(1 << 16):
                    pass
            except OSError:
                pass
            try:
                request.settimeout(0.05)
                if self.busy_answer:
                    request.sendall(self.busy_answer)
            except OSError:
                pass
            self.shutdown_request(request)  # type: ignore[attr-defined]
            return
        with self._slots():
            if self._handoff is None:
                self._handoff = queue.SimpleQueue()
            if self._idle:
                self._idle -= 1  # an idle handler takes it (the count is its promise)
                self._handoff.put((request, client_address))
                return
            self.handler_threads_started += 1
        threading.Thread(target=self._handler_loop, args=(request, client_address),
                         name=f"{type(self).__name__}-handler", daemon=True).start()

    def _handler_loop(self, request: Any, client_address: Any) -> None:
        handoff = self._handoff
        assert handoff is not None
        while True:
            self.process_request_thread(request, client_address)
            with self._slots():
                if self._idle >= MAX_IDLE_WORKERS:
                    return
                self._idle += 1
            try:
                request, client_address = handoff.get(timeout=IDLE_WORKER_S)
                continue
            except queue.Empty:
                pass
            with self._slots():
                # a connection handed off between the timeout and now is ours to serve
                if handoff.empty():
                    self._idle -= 1
                    return
            request, client_address = handoff.get()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)  # type: ignore[misc]
        finally:
            with self._slots():
                self._active -= 1
