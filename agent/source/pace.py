"""Background work in slices, so CNI threads are never starved of the GIL for long.

Loading a big manifest file leaves work in the agent's own process however it is parsed:
unpickling the child's result, comparing and applying tens of thousands of objects to the
store and the mesh model. A thread that runs that flat out holds the GIL most of the time,
and every CNI ADD thread that gives it up for a syscall waits for it again (up to the 5 ms
switch interval each time, hundreds of times per ADD). Every such loop runs its work in
``background_slice()``s instead: one slice at a time across all of them (they never add
up), each followed by a pause ``YIELD`` times as long as the slice took — at most a third
of the GIL for background work while anything else wants it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

#: Pause after a slice, as a multiple of the slice's own duration.
YIELD = 2.0
#: The shortest pause (a sleep releases the GIL even when the slice was very short).
MIN_PAUSE_S = 0.001

_one_at_a_time = threading.Lock()
_local = threading.local()  # .paused: seconds ``breathe`` slept inside the current slice


@contextmanager
def background_slice() -> Iterator[None]:
    """Run one slice of background work, then pause (outside the slice) in proportion."""
    with _one_at_a_time:
        started = time.monotonic()
        _local.paused = 0.0
        try:
            yield
        finally:
            busy = time.monotonic() - started - _local.paused
            _local.paused = 0.0
    time.sleep(max(MIN_PAUSE_S, busy * YIELD))


def breathe(busy_s: float) -> None:
    """For one long piece of work done in chunks (a Namespace edit re-evaluating 50k pods):
    after a chunk that kept the thread busy ``busy_s``, pause in the same proportion as
    between slices. Callers release their own locks first. Inside a ``background_slice`` the
    pause is not counted as the slice's work (it would double the pause after it)."""
    pause = max(MIN_PAUSE_S, busy_s * YIELD)
    time.sleep(pause)
    _local.paused = getattr(_local, "paused", 0.0) + pause
