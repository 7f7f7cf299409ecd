"""agent.heap: the collector thresholds and handing freed malloc memory back."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

from agent import heap

ROOT = Path(__file__).resolve().parent.parent


def test_tune_gc_sets_the_thresholds_and_returns_the_old_ones() -> None:
    before = gc.get_threshold()
    try:
        assert heap.tune_gc() == before
        assert gc.get_threshold() == heap.THRESHOLDS
    finally:
        gc.set_threshold(*before)


def test_the_trimmer_trims_at_most_every_period() -> None:
    now = [100.0]
    calls: list[float] = []

    def fake() -> bool:
        calls.append(now[0])
        return True

    t = heap.Trimmer(every_s=60.0, clock=lambda: now[0], do_trim=fake)
    assert t.maybe()  # the first one at once (after the initial lists)
    now[0] += 59.0
    assert not t.maybe()
    now[0] += 1.0
    assert t.maybe()
    assert calls == [100.0, 160.0] and t.trims == 2
    nothing = heap.Trimmer(do_trim=lambda: False)
    assert not nothing.maybe() and nothing.trims == 0


SCENARIO = """
import gc, psutil
from agent import heap
p = psutil.Process()
big = bytearray(4 * 1024 * 1024)  # freed, it raises glibc's mmap threshold to 4 MB,
del big                           # as the agent's first multi-MB LIST page does
held, blocks = [], []
for _ in range(400):
    blocks.append(bytearray(256 * 1024))  # below the threshold now: from the heap
    held.append(bytearray(1024))  # malloc'd too (pymalloc stops at 512 B): pins the heap
del blocks
gc.collect()
before = p.memory_info().rss
print(heap.trim(), before, p.memory_info().rss)
"""


def test_trim_gives_freed_heap_memory_back() -> None:
    """Page-sized buffers freed under small live allocations stay in RSS until trimmed
    (glibc, this machine's C library; a fresh process, so malloc starts as the agent's)."""
    out = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True,
                         check=True, timeout=60, cwd=ROOT).stdout.split()
    assert out[0] == "True"
    before, after = int(out[1]), int(out[2])
    assert before - after > 60 * 1024 * 1024, (before, after)
