"""The one event model both sources feed: an in-memory object store that emits WatchEvents.

The Kubernetes watcher and the manifest directory both end in ``ObjectStore``: a watch event is
applied as is, a LIST (initial, or the relist after 410 Gone) and a directory re-read are
applied as a *replacement* of everything of that kind. A replacement is turned back into
ordinary events by diffing, so subscribers (the mesh model) never need to know which backend,
or whether a relist happened: missed deletions arrive as synthetic DELETED events and the
index converges to the truth either way.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from agent.source.base import WatchEvent

log = logging.getLogger("aether.source.events")

ObjKey = tuple[str, str, str]  # kind, namespace ("" for cluster-scoped), name
Callback = Callable[[WatchEvent], object]

#: Kinds without a namespace; everything else defaults to "default" like kubectl does.
CLUSTER_SCOPED = frozenset({"Namespace", "Node"})


def object_key(kind: str, obj: Mapping[str, Any]) -> ObjKey:
    """The store key of an object (same rule as the manifest loader)."""
    meta = obj.get("metadata") or {}
    ns = "" if kind in CLUSTER_SCOPED else str(meta.get("namespace") or "default")
    return (kind, ns, str(meta.get("name") or ""))


def _same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Equal resourceVersions mean unchanged (cheap); otherwise compare the content."""
    if a is b:  # an unchanged manifest file hands out the very same objects
        return True
    rva = (a.get("metadata") or {}).get("resourceVersion")
    rvb = (b.get("metadata") or {}).get("resourceVersion")
    if rva and rvb and rva == rvb:
        return True
    return a == b


def diff_snapshots(
    old: Mapping[ObjKey, dict[str, Any]], new: Mapping[ObjKey, dict[str, Any]]
) -> list[WatchEvent]:
    """Events that turn ``old`` into ``new``: ADDED/MODIFIED first, then DELETED, each sorted.

    Additions come first so that a rename (delete + add) never leaves a moment with neither.
    """
    events: list[WatchEvent] = []
    for key in sorted(new):
        before = old.get(key)
        if before is None:
            events.append(WatchEvent("ADDED", key[0], new[key]))
        elif not _same(before, new[key]):
            events.append(WatchEvent("MODIFIED", key[0], new[key]))
    for key in sorted(old):
        if key not in new:
            events.append(WatchEvent("DELETED", key[0], old[key]))
    return events


class Stub(Mapping[str, Any]):
    """An object of a thin kind as the store shows it: its name, namespace and
    resourceVersion — all a relist's diff and a synthetic DELETED need. The body lives on
    only in its one consumer's model (at 100k Pods the bodies of remote pods and
    EndpointSlices were ~60 MB held twice). Made on reading: the store holds only the
    resourceVersion (``_held``), beside the key that names the object."""

    __slots__ = ("_name", "_namespace", "_rv")

    def __init__(self, name: str, namespace: str, rv: str) -> None:
        self._name, self._namespace, self._rv = name, namespace, rv

    def __getitem__(self, key: str) -> Any:
        if key != "metadata":
            raise KeyError(key)
        meta = {"name": self._name, "resourceVersion": self._rv}
        if self._namespace:
            meta["namespace"] = self._namespace
        return meta

    def __iter__(self) -> Iterator[str]:
        return iter(("metadata",))

    def __len__(self) -> int:
        return 1

    def __repr__(self) -> str:
        return f"Stub({self._namespace}/{self._name}@{self._rv})"


def _held(obj: Mapping[str, Any]) -> Any:
    """What a thin kind holds of ``obj``: its resourceVersion (an int when it is a plain
    decimal, as the API's are: 28 bytes, not 55), or the object whole when it has none (a
    manifest file's object: only its content says whether a re-read changed it)."""
    if isinstance(obj, (int, str)):
        return obj  # held already
    meta = obj.get("metadata") or {}
    rv = str(meta.get("resourceVersion") or "")
    if not rv:
        return obj
    return int(rv) if rv.isascii() and rv.isdigit() and rv[0] != "0" else rv


def _shown(key: ObjKey, held: Any) -> Any:
    """A held value as readers get it: a thin kind's resourceVersion as its ``Stub``."""
    if isinstance(held, (int, str)):
        return Stub(key[2], key[1], str(held))
    return held


#: How a kind's objects are keyed inside the store: ObjKey tuples, or for a thin kind the
#: interned ``<ns>/<name>`` (the very string the mesh model keys a remote pod by: at 100k
#: MeshPods a tuple each, and the name string it alone kept, were ~14 MB).
Inner = ObjKey | str


def _inner(key: ObjKey) -> str:
    return sys.intern(f"{key[1]}/{key[2]}")


def _outer(kind: str, inner: Inner) -> ObjKey:
    if isinstance(inner, str):
        ns, _, name = inner.partition("/")  # names and namespaces hold no "/"
        return (kind, ns, name)
    return inner


class ObjectStore:
    """Thread-safe index of the latest object per (kind, ns, name), with ordered callbacks.

    Callbacks run under the store lock, in event order, on the thread that applied the
    event; they must be quick and must not block on other sources (reading the store back is
    fine: the lock is reentrant). A failing callback is logged and does not stop the others.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        # the objects by kind, the only index: readers ask for one kind of a store holding
        # 100k Pods, and a second, flat index cost a dict entry an object
        self._kinds: dict[str, dict[Inner, Any]] = {}  # objects, or a thin kind's _held
        self._subscribers: list[Callback] = []
        self._thin: frozenset[str] = frozenset()

    def thin(self, kinds: Iterable[str]) -> None:
        """Keep only a ``Stub`` of these kinds' objects from now on (and of those held).

        For kinds whose one reader is a subscriber that keeps what it needs of each object
        (the mesh model: remote pods, EndpointSlices). ``get``/``of_kind`` then return stubs,
        and a later subscriber's replay leaves these kinds out: it could not use them."""
        with self._lock:
            self._thin = self._thin | frozenset(kinds)
            for kind in self._thin:
                objs = self._kinds.get(kind) or {}
                self._kinds[kind] = {_inner(_outer(kind, k)): _held(obj) for k, obj in objs.items()}

    def _key(self, key: ObjKey) -> Inner:
        return _inner(key) if key[0] in self._thin else key

    def _items(self, kind: str) -> list[tuple[ObjKey, Any]]:
        """A kind's (ObjKey, held) pairs."""
        return [(_outer(kind, k), o) for k, o in (self._kinds.get(kind) or {}).items()]

    # ---- reading ---------------------------------------------------------------------------

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            objs = self._kinds.get(kind)
            key = (kind, namespace, name)
            held = objs.get(self._key(key)) if objs else None
            return None if held is None else _shown(key, held)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        with self._lock:
            return [_shown(k, o) for k, o in sorted(self._items(kind))]

    def snapshot(self) -> dict[ObjKey, dict[str, Any]]:
        with self._lock:
            return {k: _shown(k, o) for kind in self._kinds for k, o in self._items(kind)}

    def counts(self) -> dict[str, int]:
        """Objects held per kind, from the by-kind index (no pass over the objects)."""
        with self._lock:
            return {kind: len(objs) for kind, objs in self._kinds.items() if objs}

    def __len__(self) -> int:
        with self._lock:
            return sum(len(objs) for objs in self._kinds.values())

    # ---- subscribing -----------------------------------------------------------------------

    def on_event(self, callback: Callback, replay: bool = True) -> Callable[[], None]:
        """Subscribe; with replay the current contents arrive first as ADDED. Returns unsubscribe."""
        with self._lock:
            if replay:
                objects = {k: o for kind, objs in self._kinds.items() if kind not in self._thin
                           for k, o in objs.items()}
                for key in sorted(objects):
                    self._call(callback, WatchEvent("ADDED", key[0], objects[key]))
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def _call(self, callback: Callback, event: WatchEvent) -> None:
        try:
            callback(event)
        except Exception:  # one broken subscriber must not starve the rest
            log.exception("event subscriber failed on %s %s", event.type, event.kind)

    def _publish(self, event: WatchEvent) -> None:
        for cb in list(self._subscribers):
            self._call(cb, event)

    # ---- writing ---------------------------------------------------------------------------

    def apply(self, event: WatchEvent) -> WatchEvent | None:
        """Apply one event; returns what was published (normalised), None if it changed nothing.

        ADDED for a known object becomes MODIFIED, MODIFIED for an unknown one becomes ADDED,
        a DELETED for an unknown object is dropped: watches replayed after a reconnect or a
        relist racing a watch must not produce phantom changes.
        """
        key = object_key(event.kind, event.obj)
        with self._lock:
            objs = self._kinds.setdefault(event.kind, {})
            inner = self._key(key)
            old = objs.get(inner)
            if old is not None:
                old = _shown(key, old)
            if event.type == "DELETED":
                if old is None:
                    return None
                del objs[inner]
                out = WatchEvent("DELETED", event.kind, event.obj)
            else:
                if old is not None and _same(old, event.obj):
                    return None
                objs[inner] = _held(event.obj) if event.kind in self._thin else event.obj
                out = WatchEvent("ADDED" if old is None else "MODIFIED", event.kind, event.obj)
            self._publish(out)
            return out

    def replace_kind(self, kind: str, objects: Iterable[dict[str, Any]]) -> list[WatchEvent]:
        """Make ``objects`` the complete set of ``kind`` (a LIST or relist); returns the diff."""
        new = {object_key(kind, o): o for o in objects}
        with self._lock:
            old = {k: _shown(k, o) for k, o in self._items(kind)}
            events = diff_snapshots(old, new)
            for ev in events:
                self.apply(ev)
            return events

    def replace_all(
        self, objects: Mapping[ObjKey, dict[str, Any]], kinds: Iterable[str] | None = None
    ) -> list[WatchEvent]:
        """Replace every kind in ``kinds`` (default: the kinds present either side) at once."""
        with self._lock:
            wanted = set(kinds) if kinds is not None else (
                {k[0] for k in objects} | {k for k, objs in self._kinds.items() if objs}
            )
            old = {k: _shown(k, o) for kind in wanted for k, o in self._items(kind)}
            new = {k: o for k, o in objects.items() if k[0] in wanted}
            events = diff_snapshots(old, new)
            for ev in events:
                self.apply(ev)
            return events
