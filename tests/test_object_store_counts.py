"""ObjectStore.counts: objects per kind for status, from the by-kind index."""

from __future__ import annotations

from agent.source.base import WatchEvent
from agent.source.events import ObjectStore


def _obj(kind: str, name: str) -> dict[str, object]:
    return {"kind": kind, "metadata": {"name": name, "namespace": "a"}}


def test_counts_follow_adds_and_deletes() -> None:
    store = ObjectStore()
    for kind, name in (("Pod", "p1"), ("Pod", "p2"), ("Service", "s")):
        store.apply(WatchEvent("ADDED", kind, _obj(kind, name)))
    assert store.counts() == {"Pod": 2, "Service": 1}
    store.apply(WatchEvent("DELETED", "Service", _obj("Service", "s")))
    assert store.counts() == {"Pod": 2}  # a kind with nothing left is not listed
