"""The agent process's garbage-collector settings, set once at start, and its pause while
listing.

Listing a cluster allocates millions of small dicts and strings (a page of 500 Pods decodes
into ~250k objects), and CPython's default cycle collector runs a young collection every 700
allocations and, every so often, walks the whole long-lived heap — the cluster's objects.
Measured on the initial list of 30k Pods + 10k Services: 18.6 s of agent CPU with the default
thresholds, 11.8 s with these, 10.1 s with the collector off. Nothing the agent keeps forms
reference cycles in bulk (plain dicts, tuples, strings, slotted records), so collecting
less often costs no memory; the collector stays on for what does.

Even with these thresholds, the collections during the initial lists of 100k Pods + 10k
Services took ~2 s of a ~17 s start (152 young collections and a middle one of 0.6 s, timed
with ``gc.callbacks``): each walks what the lists have just decoded, none of it garbage. So
the collector is paused while any kind is being listed (``listing``) and resumes when the
last list ends; the cycles made meanwhile (few: tracebacks, a client's internals) wait for
the next collection, and nothing is lost. Timed the same way with the pause: 0.7 s of
collections. (The start's wall time moves by more than that between runs, 27–33 s.)
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

#: (young, middle, old): a young collection every 50k net allocations instead of 700.
THRESHOLDS = (50_000, 20, 10)

_lock = threading.Lock()
_listing = 0  # lists under way
_resume = False  # the collector was on when the first of them began


def tune_gc() -> tuple[int, int, int]:
    """Apply THRESHOLDS; returns the previous ones."""
    before = gc.get_threshold()
    gc.set_threshold(*THRESHOLDS)
    return (before[0], before[1], before[2])


@contextlib.contextmanager
def listing() -> Iterator[None]:
    """The collector off while this (and any other) list runs; back on, as it was, after
    the last. Nested and concurrent uses count; one that finds it off leaves it off."""
    global _listing, _resume
    with _lock:
        if _listing == 0:
            _resume = gc.isenabled()
            gc.disable()
        _listing += 1
    try:
        yield
    finally:
        with _lock:
            _listing -= 1
            if _listing == 0 and _resume:
                gc.enable()
