"""The test API server's object store and versioning: objects, the global resourceVersion,
the event log that watches replay from, compaction, paged LISTs and encoded list items.

``VersionedStore`` is the state ``agent.testing.apiserver.FakeApiServer`` is built on, below
HTTP; a write emits its event to every registered ``_Watch`` whose selectors it concerns
(``agent.testing.apiserver_watch`` streams them). Its own module so that the storage rules
read apart from routing and streaming.
"""

from __future__ import annotations

import copy
import json
import queue
import secrets
import threading
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from agent.testing.apiserver_protocol import (
    JSON,
    ApiError,
    Resource,
    _body_of,
    _matches,
    _now,
    _parse_selector,
)


@dataclass(eq=False)
class _Watch:
    resource: Resource
    namespace: str | None
    labels: list[tuple[str, str, str]]
    fields: list[tuple[str, str, str]]
    queue: queue.Queue[Any] = field(default_factory=queue.Queue)

    def wants(self, namespace: str, obj: JSON) -> bool:
        if self.namespace is not None and namespace != self.namespace:
            return False
        return _matches(obj, self.labels, self.fields)

    def sees(self, ev: _Event) -> str | None:
        """The event type this watch gets (None: nothing). As the real server does, a
        change that makes an object start matching the selectors arrives as ADDED, one
        that makes it stop matching as DELETED."""
        if ev.resource != self.resource:
            return None
        now = self.wants(ev.namespace, ev.obj)
        if ev.type != "MODIFIED" or ev.old is None:
            return ev.type if now else None
        before = self.wants(ev.namespace, ev.old)
        if now:
            return "MODIFIED" if before else "ADDED"
        return "DELETED" if before else None


@dataclass
class _Event:
    rv: int
    type: str
    resource: Resource
    namespace: str
    obj: JSON
    old: JSON | None = None  # MODIFIED: what it was (selectors may match one, not the other)


StoreKey = tuple[str, str, str, str]  # (apiVersion, plural, namespace, name)


class _KindIndexedStore(dict[StoreKey, JSON]):
    """The stored objects, with each kind's keys kept apart and sorted only when a LIST asks
    (a real API server lists from a per-resource cache: a LIST of 10k Services never walks
    100k Pods). Every write path goes through ``__setitem__``/``pop``."""

    def __init__(self) -> None:
        super().__init__()
        self._kinds: dict[tuple[str, str], set[StoreKey]] = {}
        self._sorted: dict[tuple[str, str], list[StoreKey]] = {}

    def __setitem__(self, key: StoreKey, value: JSON) -> None:
        if key not in self:
            self._kinds.setdefault(key[:2], set()).add(key)
            self._sorted.pop(key[:2], None)
        super().__setitem__(key, value)

    def pop(self, key: StoreKey, *default: Any) -> Any:
        if key in self:
            self._kinds[key[:2]].discard(key)
            self._sorted.pop(key[:2], None)
        return super().pop(key, *default)

    def __delitem__(self, key: StoreKey) -> None:
        self.pop(key)

    def sorted_keys(self, api_version: str, plural: str) -> list[StoreKey]:
        kind = (api_version, plural)
        got = self._sorted.get(kind)
        if got is None:
            got = self._sorted[kind] = sorted(self._kinds.get(kind, ()))
        return got


class ListPage:
    """A LIST answer whose items are already encoded (``FakeApiServer._item_json``)."""

    def __init__(self, head: JSON, items: list[bytes]) -> None:
        self.head, self.items = head, items

    def encode(self) -> bytes:
        head = json.dumps(self.head).encode()
        return head[:-1] + b', "items": [' + b",".join(self.items) + b"]}"

    def as_json(self) -> JSON:
        out: JSON = json.loads(self.encode())
        return out


class VersionedStore:
    """The stored objects and their versions (see the module docstring); guarded by
    ``_lock``, which ``FakeApiServer`` also takes for its own state."""

    def __init__(self, resources: Iterable[Resource], history_limit: int) -> None:
        table = tuple(resources)
        self.history_limit = history_limit
        self._lock = threading.RLock()
        self._by_path = {(r.api_version, r.plural): r for r in table}
        self._by_kind = {(r.api_version, r.kind): r for r in table}
        self._store = _KindIndexedStore()
        self._rv = 0
        self._compacted_rv = 0
        self._history: deque[_Event] = deque()
        self._watches: set[_Watch] = set()
        # LIST continue tokens -> (resourceVersion of the snapshot, objects still to serve)
        self._continues: dict[str, tuple[int, list[JSON]]] = {}
        # list items encoded once per stored version (the real API server's watch cache
        # encodes an object once, not once per client): key -> (the stored dict, its JSON)
        self._encoded: dict[tuple[str, str, str, str], tuple[JSON, bytes]] = {}
        self._pages = 0
        self._expire_next = 0
        self.lists = 0  # LIST requests served (each page counts)

    # ---- store (call with the lock held) ---------------------------------------------------

    def _resource_for(self, obj: JSON) -> Resource:
        key = (str(obj.get("apiVersion") or ""), str(obj.get("kind") or ""))
        res = self._by_kind.get(key)
        if res is None:
            raise ValueError(f"unknown resource {key[0]} {key[1]}")
        return res

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _emit(self, type_: str, res: Resource, ns: str, obj: JSON, old: JSON | None = None
              ) -> None:
        ev = _Event(int(obj["metadata"]["resourceVersion"]), type_, res, ns, copy.deepcopy(obj),
                    old)
        self._history.append(ev)
        while len(self._history) > self.history_limit:
            self._compacted_rv = self._history.popleft().rv
        for w in self._watches:
            seen = w.sees(ev)
            if seen is not None:
                w.queue.put({"type": seen, "object": ev.obj})

    def _insert(self, res: Resource, ns: str, obj: JSON) -> JSON:
        m = obj["metadata"]
        m.setdefault("uid", str(uuid.uuid4()))
        m.setdefault("creationTimestamp", _now())
        m.setdefault("generation", 1)
        m["resourceVersion"] = self._next_rv()
        self._store[(res.api_version, res.plural, ns, m["name"])] = obj
        self._emit("ADDED", res, ns, obj)
        return copy.deepcopy(obj)

    def _replace(self, res: Resource, ns: str, name: str, old: JSON, new: JSON) -> JSON:
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        if new == old:  # no-op updates do not bump resourceVersion (as the real apiserver)
            return copy.deepcopy(old)
        new["metadata"]["resourceVersion"] = self._next_rv()
        self._store[(res.api_version, res.plural, ns, name)] = new
        self._emit("MODIFIED", res, ns, new, old)
        return copy.deepcopy(new)

    def _remove(self, res: Resource, ns: str, name: str) -> JSON:
        obj = self._store.pop((res.api_version, res.plural, ns, name))
        self._encoded.pop((res.api_version, res.plural, ns, name), None)
        obj["metadata"]["resourceVersion"] = self._next_rv()
        self._emit("DELETED", res, ns, obj)
        return copy.deepcopy(obj)

    def _updated(self, res: Resource, old: JSON, new: JSON, sub: str | None) -> JSON:
        """Apply real-apiserver update rules: status subresource split, immutable metadata."""
        if not isinstance(new, dict):
            raise ApiError(400, "body must be a JSON object")
        want_rv = (new.get("metadata") or {}).get("resourceVersion")
        if want_rv and want_rv != old["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                f'Operation cannot be fulfilled on {res.plural} "{old["metadata"]["name"]}": '
                "the object has been modified; please apply your changes to the latest "
                "version and try again",
            )
        if sub == "status":
            merged = copy.deepcopy(old)
            if "status" in new:
                merged["status"] = copy.deepcopy(new["status"])
            else:
                merged.pop("status", None)
            return merged
        merged = copy.deepcopy(new)
        merged["apiVersion"], merged["kind"] = res.api_version, res.kind
        m = merged.setdefault("metadata", {})
        om = old["metadata"]
        for key in ("name", "namespace", "uid", "creationTimestamp"):
            if key in om:
                m[key] = om[key]
        if res.status:
            if "status" in old:
                merged["status"] = copy.deepcopy(old["status"])
            else:
                merged.pop("status", None)
        gen = int(om.get("generation") or 1)
        m["generation"] = gen + 1 if _body_of(merged) != _body_of(old) else gen
        return merged

    def _create(self, res: Resource, ns: str, body: Any) -> tuple[int, JSON]:
        if not isinstance(body, dict):
            raise ApiError(400, "body must be a JSON object")
        obj = copy.deepcopy(body)
        obj["apiVersion"], obj["kind"] = res.api_version, res.kind
        m = obj.setdefault("metadata", {})
        if not m.get("name") and m.get("generateName"):
            m["name"] = m["generateName"] + secrets.token_hex(3)[:5]
        if not m.get("name"):
            raise ApiError(422, f"{res.kind} is invalid: metadata.name: Required value")
        if res.namespaced:
            if m.get("namespace") and m["namespace"] != ns:
                raise ApiError(400, "the namespace of the object does not match the request")
            m["namespace"] = ns
        for key in ("uid", "resourceVersion", "creationTimestamp", "generation"):
            m.pop(key, None)
        if (res.api_version, res.plural, ns, m["name"]) in self._store:
            raise ApiError(
                409,
                f'{res.plural} "{m["name"]}" already exists',
                "AlreadyExists",
                name=m["name"],
                kind=res.plural,
            )
        return 201, self._insert(res, ns, obj)

    def _list(self, res: Resource, ns: str | None, query: dict[str, str]) -> ListPage:
        """A LIST, paged as the real server pages it when ``limit`` is given: each page ends
        with ``metadata.continue`` (and ``remainingItemCount``) while items remain; a
        continue token serves the next page of the same snapshot (same resourceVersion), and
        one that is unknown or older than the compaction point is 410 Expired."""
        token = query.get("continue", "")
        limit = int(query["limit"]) if query.get("limit", "").isdigit() else 0
        if token:
            snap = self._continues.pop(token, None)
            if self._expire_next > 0:
                self._expire_next -= 1
                snap = None
            if snap is None or snap[0] < self._compacted_rv:
                raise ApiError(410, "The provided continue parameter is too old to display a "
                               "consistent list result. You can start a new list without the "
                               "continue parameter.", "Expired")
            rv, objs = snap
        else:
            labels = _parse_selector(query.get("labelSelector", ""))
            fields = _parse_selector(query.get("fieldSelector", ""))
            rv = self._rv
            objs = []  # the stored dicts themselves: writes replace them, so this is a snapshot
            for key in self._store.sorted_keys(res.api_version, res.plural):
                ons = key[2]
                if ns is not None and res.namespaced and ons != ns:
                    continue
                if _matches(self._store[key], labels, fields):
                    objs.append(self._store[key])
        page, rest = (objs[:limit], objs[limit:]) if limit > 0 else (objs, [])
        meta: JSON = {"resourceVersion": str(rv)}
        if rest:
            self._pages += 1
            nxt = f"{rv}-{self._pages}"
            self._continues[nxt] = (rv, rest)
            meta["continue"] = nxt
            meta["remainingItemCount"] = len(rest)
        self.lists += 1
        return ListPage({"kind": res.list_kind, "apiVersion": res.api_version, "metadata": meta},
                        [self._item_json(res, obj) for obj in page])

    def _item_json(self, res: Resource, obj: JSON) -> bytes:
        """A list item's JSON (no kind/apiVersion, as the real server omits them), encoded
        once per stored version: writes replace the stored dict, which the cache notices."""
        m = obj.get("metadata") or {}
        key = (res.api_version, res.plural, str(m.get("namespace") or ""), str(m.get("name")))
        hit = self._encoded.get(key)
        if hit is not None and hit[0] is obj:
            return hit[1]
        item = {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}
        data = json.dumps(item).encode()
        self._encoded[key] = (obj, data)
        return data
