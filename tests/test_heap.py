"""The collector's pause while lists run (agent.common.heap.listing)."""

from __future__ import annotations

import gc
import threading

from agent.common.heap import MMAP_THRESHOLD, listing


def test_the_collector_is_off_while_any_list_runs_and_back_on_after_the_last() -> None:
    assert gc.isenabled()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def second() -> None:
        first_in.wait(5)
        with listing():
            second_in.set()
            first_out.wait(5)
            seen["after the first ended"] = gc.isenabled()
    t = threading.Thread(target=second)
    t.start()
    try:
        with listing():
            seen["inside"] = gc.isenabled()
            first_in.set()
            second_in.wait(5)
        first_out.set()
        t.join(5)
    finally:
        first_out.set()
    assert seen == {"inside": False, "after the first ended": False}
    assert gc.isenabled()  # the last list out turned it back on


def test_a_list_that_fails_still_resumes_the_collector_and_one_off_stays_off() -> None:
    try:
        with listing():
            raise RuntimeError("cut stream")
    except RuntimeError:
        pass
    assert gc.isenabled()
    gc.disable()
    try:
        with listing():
            pass
        assert not gc.isenabled()  # it was off before: not ours to turn on
    finally:
        gc.enable()


_PROBE = """
import ctypes, sys
from agent.common.heap import fix_mmap_threshold
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()
elif sys.argv[1] == "128k":  # fixed at glibc's own starting threshold
    assert ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)
big = bytearray(1 << 20)  # mapped (over the threshold), then freed: glibc raises it to 1 MiB
del big
buf = bytearray(int(sys.argv[2]) << 10)
addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
for line in open("/proc/self/maps"):
    if line.rstrip().endswith("[heap]"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        print("heap" if lo <= addr < hi else "mapped")
        break
else:
    print("mapped")
"""


def _where(mode: str, kib: int) -> str:
    """Where a ``kib`` KiB buffer lands once a 1 MiB block was mapped and freed: glibc's
    moving threshold (``moving``), ours (``fixed``), fixed at glibc's start (``128k``)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", _PROBE, mode, str(kib)], check=True,
                          capture_output=True, text=True).stdout.strip()


def test_a_fixed_mmap_threshold_keeps_big_buffers_out_of_the_heap() -> None:
    """glibc's moving threshold puts a 512 KiB buffer in the heap once a 1 MiB block was
    freed; fixed, it gets a mapping of its own (unmapped when freed)."""
    assert _where("moving", 512) == "heap"
    assert _where("fixed", 512) == "mapped"


def test_libnftables_batch_pages_stay_in_the_heap() -> None:
    """The 128 KiB (+ a page) buffers of every libnftables transaction are not mapped and
    unmapped each time: the fixed threshold is above them (glibc's starting one is not)."""
    assert MMAP_THRESHOLD > 128 * 1024
    assert _where("fixed", 130) == "heap"
    assert _where("128k", 130) == "mapped"  # at glibc's starting threshold it would be
