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


@contextmanager
def background_slice() -> Iterator[None]:
    """Run one slice of background work, then pause (outside the slice) in proportion."""
    with _one_at_a_time:
        started = time.monotonic()
        try:
            yield
        finally:
            busy = time.monotonic() - started
    time.sleep(max(MIN_PAUSE_S, busy * YIELD))
