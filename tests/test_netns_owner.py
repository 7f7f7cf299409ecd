"""StateStore.netns_owner: which record holds a netns, without a stat per record per ADD."""

from __future__ import annotations

from pathlib import Path

from agent.capture.policy import CapturePolicy
from agent.cni.state import CapturedPod, StateStore


def _pod(cid: str) -> CapturedPod:
    return CapturedPod(cid, f"uid-{cid}", "shop", f"pod-{cid}", "default", f"/pins/{cid}",
                       f"/proc/1/{cid}", "eth0", ["10.0.0.1"],
                       CapturePolicy(True, 15001, 18081, 0xAE, 0xFF), "fp", "managed")


class Namespaces:
    """path -> identity, counting reads (a stat each, in the real one)."""

    def __init__(self) -> None:
        self.of: dict[str, tuple[int, int]] = {}
        self.reads = 0

    def identity(self, path: str) -> tuple[int, int]:
        self.reads += 1
        if path not in self.of:
            raise FileNotFoundError(path)
        return self.of[path]


def _store(tmp_path: Path, n: int) -> tuple[StateStore, Namespaces]:
    store, ns = StateStore(str(tmp_path)), Namespaces()
    for i in range(n):
        store.put(_pod(f"c{i}"))
        ns.of[f"/pins/c{i}"] = (4, 1000 + i)
    return store, ns


def test_the_owner_is_found_and_the_asker_excluded(tmp_path: Path) -> None:
    store, ns = _store(tmp_path, 5)
    owner = store.netns_owner((4, 1003), ns.identity)
    assert owner is not None and owner.container_id == "c3"
    assert store.netns_owner((4, 1003), ns.identity, exclude="c3") is None
    assert store.netns_owner((4, 9999), ns.identity) is None


def test_later_adds_read_only_the_matching_namespace(tmp_path: Path) -> None:
    store, ns = _store(tmp_path, 100)
    store.netns_owner((4, 9999), ns.identity)  # first ask: every record's netns read once
    assert ns.reads == 100
    ns.reads = 0
    for _ in range(10):
        assert store.netns_owner((4, 9999), ns.identity) is None  # a new pod's netns
    assert ns.reads == 0
    assert store.netns_owner((4, 1042), ns.identity) is not None
    assert ns.reads == 1  # the match, confirmed


def test_a_gone_namespace_owns_nothing_even_when_its_inode_comes_back(tmp_path: Path) -> None:
    store, ns = _store(tmp_path, 3)
    store.netns_owner((4, 9999), ns.identity)  # identities remembered
    del ns.of["/pins/c1"]  # c1's namespace is gone; a new netns gets its inode
    assert store.netns_owner((4, 1001), ns.identity) is None
    ns.of["/pins/c1"] = (4, 5555)  # the path now holds another namespace
    assert store.netns_owner((4, 1001), ns.identity) is None
    owner = store.netns_owner((4, 5555), ns.identity)
    assert owner is not None and owner.container_id == "c1"


def test_a_replaced_or_removed_record_is_read_afresh(tmp_path: Path) -> None:
    store, ns = _store(tmp_path, 2)
    store.netns_owner((4, 9999), ns.identity)
    ns.of["/pins/c0"] = (4, 7777)  # re-pinned: the same path, a new namespace
    store.put(_pod("c0"))
    owner = store.netns_owner((4, 7777), ns.identity)
    assert owner is not None and owner.container_id == "c0"
    store.remove("c0")
    assert store.netns_owner((4, 7777), ns.identity) is None
