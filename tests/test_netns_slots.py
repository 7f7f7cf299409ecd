"""Operations inside pod namespaces are bounded (fds stay far below FD_SETSIZE), and a slot
is always given back."""

from __future__ import annotations

import threading

import pytest

from agent.netns import enter


def test_a_full_house_times_out_instead_of_opening_more(monkeypatch: pytest.MonkeyPatch) -> None:
    slots = threading.BoundedSemaphore(1)
    monkeypatch.setattr(enter, "_slots", slots)
    assert slots.acquire(timeout=1)  # every slot busy
    with pytest.raises(TimeoutError, match="already running"):
        enter.run_in_netns("/nonexistent", lambda: None, timeout=0.2)
    slots.release()


def test_the_slot_comes_back_when_the_operation_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    slots = threading.BoundedSemaphore(1)
    monkeypatch.setattr(enter, "_slots", slots)
    for _ in range(3):  # would time out on the second round if a slot leaked
        with pytest.raises(enter.NetnsGone):
            enter.run_in_netns("/nonexistent/netns", lambda: None, timeout=1.0)


def test_the_fd_guard_reads_the_lowest_free_fd() -> None:
    import os

    from agent.netns.nft import lowest_free_fd

    first = lowest_free_fd()
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(3)]
    try:
        assert held[0] == first  # what it named is what the next open got
        assert lowest_free_fd() not in held
        os.close(held[1])
        assert lowest_free_fd() == held[1]  # a hole is what the next socket takes
        held[1] = os.open(os.devnull, os.O_RDONLY)
    finally:
        for fd in held:
            os.close(fd)
    assert lowest_free_fd() == first
