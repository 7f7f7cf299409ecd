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
