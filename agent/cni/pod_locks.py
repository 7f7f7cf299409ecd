"""One lock per container id, held by every lifecycle step on that container (a kubelet
request, a live enrollment or release, a reapply, a grace that ends): the steps on one pod
never interleave. A lock vanishes once no step holds it, so the table does not grow per pod."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager


class _PodLock:
    __slots__ = ("lock", "__weakref__")

    def __init__(self) -> None:
        self.lock = threading.Lock()


class PodLocks:
    """Per-container locks that vanish once no request holds them (no growth per pod)."""

    def __init__(self) -> None:
        self._locks: weakref.WeakValueDictionary[str, _PodLock] = weakref.WeakValueDictionary()
        self._guard = threading.Lock()

    @contextmanager
    def hold(self, container_id: str) -> Iterator[None]:
        with self._guard:
            lock = self._locks.get(container_id)
            if lock is None:
                lock = self._locks[container_id] = _PodLock()
        with lock.lock:
            yield
