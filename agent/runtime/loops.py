"""A background pass that follows a changing model: debounced, retried, resynced.

Route status and EndpointSlice projection both turn the in-memory model into API writes: a
burst of model changes should become one pass, a failed pass (API down) is retried with
exponential backoff, a periodic resync repairs what someone else edited, and the first pass
waits for the source's initial sync (a half-filled store looks like everything vanished).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("aether.loops")


class DebouncedLoop:
    """Subclasses implement ``pass_once`` (raise on failure) and may override the hooks."""

    thread_name = "debounced-loop"
    what = "pass"  # for log lines

    def __init__(self, interval: float = 0.5, resync_s: float = 300.0,
                 max_backoff: float = 30.0, poll: float | None = None) -> None:
        self.interval = interval
        self.resync_s = resync_s
        self.max_backoff = max_backoff
        self.poll = poll  # wake up this often even when idle (None: only for the resync)
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._synced: Callable[[float], bool] | None = None
        self.passes = 0
        self.failures = 0
        self.last_error: str | None = None

    # -- hooks -------------------------------------------------------------------------------
    def pass_once(self) -> None:
        raise NotImplementedError

    def should_pass(self, fired: bool, resynced: bool) -> bool:
        return fired or resynced

    def on_resync(self) -> None:
        return None

    def describe_error(self, e: Exception) -> str:
        return f"{type(e).__name__}: {e}"

    # -- loop --------------------------------------------------------------------------------
    def start(self, synced: Callable[[float], bool] | None = None) -> None:
        self._synced = synced
        self._stop.clear()
        self._dirty.set()  # the first pass converges whatever is there
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def mark_dirty(self) -> None:
        self._dirty.set()

    def stop_loop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._dirty.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            self._thread = None

    def _run(self) -> None:
        while self._synced is not None and not self._synced(1.0):
            if self._stop.is_set():
                return
        next_resync = time.monotonic() + self.resync_s
        while not self._stop.is_set():
            wait = self.poll if self.poll is not None else next_resync - time.monotonic()
            fired = self._dirty.wait(timeout=max(0.0, wait))
            if self._stop.is_set():
                return
            resynced = time.monotonic() >= next_resync
            if resynced:
                self.on_resync()
                next_resync = time.monotonic() + self.resync_s
            try:
                go = self.should_pass(fired, resynced)
            except Exception as e:  # noqa: BLE001 - a hook failing must not end the loop
                log.warning("%s: %s", self.what, self.describe_error(e))
                go = False
            if not go:
                continue
            if self._stop.wait(self.interval):  # debounce: a burst becomes one pass
                return
            self._dirty.clear()
            if not self.run_once():
                backoff = min(self.max_backoff, self.interval * 2 ** min(self.failures, 10))
                if self._stop.wait(backoff):
                    return
                self._dirty.set()

    def run_once(self) -> bool:
        """One pass; False (logged, counted) if it must be retried."""
        try:
            self.pass_once()
        except Exception as e:  # noqa: BLE001 - the API being down must not kill the agent
            self.failures += 1
            self.last_error = self.describe_error(e)
            log.warning("%s failed (attempt %d), retrying: %s", self.what, self.failures,
                        self.last_error)
            return False
        self.passes += 1
        self.failures = 0
        self.last_error = None
        return True
