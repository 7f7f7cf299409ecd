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
import ctypes
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


#: glibc's ``mallopt`` parameters, and their values.
M_MMAP_THRESHOLD = -3
M_TRIM_THRESHOLD = -1
#: Over the 128 KiB buffers libnftables allocates for every transaction, under a LIST page
#: (~350 KB).
MMAP_THRESHOLD = 256 * 1024
#: How much free memory a heap's top may keep before glibc gives it back: those buffers, so
#: the next transaction does not fault them in again.
TRIM_THRESHOLD = 1024 * 1024


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at 256 KiB (and its trim threshold at 1 MiB); True when set.

    By default glibc raises the threshold, up to 32 MiB, each time a mapped block is freed.
    The agent's big transient buffers (LIST pages of ~350 KB, serialized xDS responses of
    MBs) then come from the heap instead of their own mappings, and what they leave there
    when freed is held between the long-lived objects: at 100k Pods + 10k Services the
    agent's RSS at ready was 305 MB with the moving threshold and 282 MB with it fixed (one
    ``agent_scale`` run each, bench/README.md). A fixed threshold maps and unmaps those
    buffers instead (a syscall each, for buffers that cost far more to fill).

    Not at glibc's own 128 KiB: every libnftables transaction (two or three an ADD) mallocs
    buffers of 128 KiB + a page (five for a one-table transaction, counted with strace),
    which that threshold maps, faults in page by page and unmaps each time (a sixth of the
    agent's CPU under concurrent ADDs, in ``perf``). Measured under 16 concurrent ADDs
    (``bench.cni_add``, A/B, 2 runs each): the agent's CPU per ADD 4.85 ms at 128 KiB,
    2.75 ms at 256 KiB; RSS at 100k Pods unchanged (282 MB). Not glibc (musl): nothing to do, False."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except (OSError, AttributeError):
        return False


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
