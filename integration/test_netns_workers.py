"""Netns workers (agent.netns.enter): a pooled thread runs each operation inside the pod's
namespace and is provably back in the agent's own before it takes another; one that cannot
prove it never runs again. Real namespaces, root only."""

from __future__ import annotations

import subprocess
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from agent.netns import enter


@pytest.fixture
def netns() -> Iterator[list[str]]:
    names = [f"aet-w{uuid.uuid4().hex[:8]}" for _ in range(16)]
    for n in names:
        subprocess.run(["ip", "netns", "add", n], check=True)
    try:
        yield [f"/var/run/netns/{n}" for n in names]
    finally:
        for n in names:
            subprocess.run(["ip", "netns", "del", n], check=False)


def _where() -> tuple[enter.NetnsId, int, threading.Thread]:
    return (enter.netns_identity("/proc/thread-self/ns/net"), threading.get_native_id(),
            threading.current_thread())


def test_a_worker_works_inside_and_is_home_before_its_next_job(netns: list[str]) -> None:
    home = enter.netns_identity("/proc/self/ns/net")
    first, tid, _ = enter.run_in_netns(netns[0], _where)
    assert first == enter.netns_identity(netns[0]) != home
    # the thread that did it is back in the agent's netns, waiting for work
    assert enter.netns_identity(f"/proc/self/task/{tid}/ns/net") == home
    second, tid2, _ = enter.run_in_netns(netns[1], _where)
    assert second == enter.netns_identity(netns[1])
    assert tid2 == tid  # reused, not a new thread per operation


def test_a_worker_that_cannot_prove_it_is_home_never_runs_again(
        netns: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(enter, "_go_home", lambda: False)
    _, _, stranded = enter.run_in_netns(netns[0], _where)
    stranded.join(timeout=5)
    assert not stranded.is_alive()  # it ended instead of going back to the pool
    monkeypatch.undo()
    _, _, other = enter.run_in_netns(netns[1], _where)
    assert other is not stranded


def test_concurrent_operations_each_see_their_own_namespace(netns: list[str]) -> None:
    home = enter.netns_identity("/proc/self/ns/net")
    for _ in range(3):
        with ThreadPoolExecutor(16) as pool:
            seen = list(pool.map(lambda p: enter.run_in_netns(p, _where)[0], netns))
        assert seen == [enter.netns_identity(p) for p in netns]
    assert enter.netns_identity("/proc/thread-self/ns/net") == home


def test_a_failing_operation_still_brings_its_worker_home(netns: list[str]) -> None:
    home = enter.netns_identity("/proc/self/ns/net")
    tids: list[int] = []

    def boom() -> None:
        tids.append(threading.get_native_id())
        raise ValueError("the work failed")

    with pytest.raises(ValueError, match="the work failed"):
        enter.run_in_netns(netns[0], boom)
    assert enter.netns_identity(f"/proc/self/task/{tids[0]}/ns/net") == home
