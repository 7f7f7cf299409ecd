"""The collector's pause while lists run (agent.heap.listing)."""

from __future__ import annotations

import gc
import threading

from agent.heap import listing


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
from agent.heap import fix_mmap_threshold
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()
big = bytearray(1 << 20)  # mapped (over the threshold), then freed: glibc raises it to 1 MiB
del big
buf = bytearray(512 << 10)
addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
for line in open("/proc/self/maps"):
    if line.rstrip().endswith("[heap]"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        print("heap" if lo <= addr < hi else "mapped")
        break
else:
    print("mapped")
"""


def test_a_fixed_mmap_threshold_keeps_big_buffers_out_of_the_heap() -> None:
    """glibc's moving threshold puts a 512 KiB buffer in the heap once a 1 MiB block was
    freed; fixed, it gets a mapping of its own (unmapped when freed)."""
    import subprocess
    import sys

    def where(mode: str) -> str:
        return subprocess.run([sys.executable, "-c", _PROBE, mode], check=True,
                              capture_output=True, text=True).stdout.strip()

    assert where("moving") == "heap"
    assert where("fixed") == "mapped"
