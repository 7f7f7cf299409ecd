"""A small in-memory Kubernetes API server that speaks the real HTTP protocol.

No kube-apiserver can run in the test environment, so tests drive the real ``kubernetes``
client (and the agent's sources) against this server instead of mocking the client: the
wire format, selectors, watch streaming, 410 Expired and fault injection are what the agent
sees in production. It is deliberately small: one global resourceVersion counter, an event
log for watch replay, JSON merge patch for every object-patch flavour, no auth, no
admission, no validation beyond what tests need.
"""

from __future__ import annotations

import contextlib
import copy
import json
import queue
import secrets
import select
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

JSON = dict[str, Any]


@dataclass(frozen=True)
class Resource:
    """One row of the resource table: adding a resource type is adding one of these."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    status: bool = False  # has a /status subresource (status is ignored on main updates)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"


_GW = "gateway.networking.k8s.io"

RESOURCES: tuple[Resource, ...] = (
    Resource("", "v1", "namespaces", "Namespace", namespaced=False, status=True),
    Resource("", "v1", "pods", "Pod", status=True),
    Resource("", "v1", "services", "Service", status=True),
    Resource("", "v1", "events", "Event"),
    Resource("", "v1", "configmaps", "ConfigMap"),
    Resource("", "v1", "serviceaccounts", "ServiceAccount"),
    Resource("", "v1", "nodes", "Node", namespaced=False, status=True),
    Resource("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice"),
    Resource(_GW, "v1", "httproutes", "HTTPRoute", status=True),
    Resource(_GW, "v1", "grpcroutes", "GRPCRoute", status=True),
    Resource(_GW, "v1alpha2", "backendlbpolicies", "BackendLBPolicy", status=True),
    Resource("coordination.k8s.io", "v1", "leases", "Lease"),
    Resource("apps", "v1", "daemonsets", "DaemonSet", status=True),
    Resource("aether.io", "v1alpha1", "meshpods", "MeshPod"),
    Resource("security.aether.io", "v1alpha1", "authorizationpolicies", "AuthorizationPolicy"),
)

_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}

_CLOSE = "close"  # watch-queue sentinels: end the stream cleanly / cut the connection
_ABORT = "abort"


def status_object(code: int, message: str, reason: str | None = None, **details: Any) -> JSON:
    """A metav1.Status in the exact shape the real apiserver returns for failures."""
    obj: JSON = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason or _REASONS.get(code, "Unknown"),
        "code": code,
    }
    if details:
        obj["details"] = details
    return obj


class ApiError(Exception):
    """Raised inside request handling; becomes a Status response."""

    def __init__(self, code: int, message: str, reason: str | None = None, **details: Any):
        super().__init__(message)
        self.status = status_object(code, message, reason, **details)
        self.code = code


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (also used for strategic merge: lists are replaced)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(422, f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def json_patch(doc: Any, ops: Any) -> Any:
    """Minimal RFC 6902: add, remove, replace, test."""
    if not isinstance(ops, list):
        raise ApiError(400, "json patch body must be a list of operations")
    doc = copy.deepcopy(doc)
    for op in ops:
        kind, parts = op.get("op"), _pointer(op.get("path", ""))
        if not parts:
            if kind in ("add", "replace"):
                doc = copy.deepcopy(op.get("value"))
                continue
            raise ApiError(422, f"unsupported root operation {kind!r}")
        parent = doc
        for part in parts[:-1]:
            try:
                parent = parent[int(part)] if isinstance(parent, list) else parent[part]
            except (KeyError, IndexError, ValueError, TypeError) as exc:
                raise ApiError(422, f"path {op.get('path')!r} not found") from exc
        last = parts[-1]
        try:
            if kind == "test":
                cur = parent[int(last)] if isinstance(parent, list) else parent[last]
                if cur != op.get("value"):
                    raise ApiError(422, f"test failed at {op.get('path')!r}")
            elif kind == "remove":
                del parent[int(last) if isinstance(parent, list) else last]
            elif kind in ("add", "replace"):
                value = copy.deepcopy(op.get("value"))
                if isinstance(parent, list):
                    if last == "-":
                        parent.append(value)
                    elif kind == "add":
                        parent.insert(int(last), value)
                    else:
                        parent[int(last)] = value
                else:
                    if kind == "replace" and last not in parent:
                        raise ApiError(422, f"path {op.get('path')!r} not found")
                    parent[last] = value
            else:
                raise ApiError(422, f"unsupported json patch op {kind!r}")
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise ApiError(422, f"path {op.get('path')!r} not found") from exc
    return doc


def _parse_selector(text: str) -> list[tuple[str, str, str]]:
    """`a=b,c!=d,e,!f` → [(key, op, value)]; set-based `in`/`notin` are not supported."""
    terms: list[tuple[str, str, str]] = []
    for raw in text.split(","):
        term = raw.strip()
        if not term:
            continue
        if "!=" in term:
            k, v = term.split("!=", 1)
            terms.append((k.strip(), "!=", v.strip()))
        elif "==" in term:
            k, v = term.split("==", 1)
            terms.append((k.strip(), "=", v.strip()))
        elif "=" in term:
            k, v = term.split("=", 1)
            terms.append((k.strip(), "=", v.strip()))
        elif " in " in term or " notin " in term:
            raise ApiError(400, f"set-based selector not supported by the test server: {term!r}")
        elif term.startswith("!"):
            terms.append((term[1:].strip(), "!exists", ""))
        else:
            terms.append((term, "exists", ""))
    return terms


def _field(obj: JSON, path: str) -> str | None:
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return None if cur is None else str(cur)


def _matches(
    obj: JSON, labels: list[tuple[str, str, str]], fields: list[tuple[str, str, str]]
) -> bool:
    have = (obj.get("metadata") or {}).get("labels") or {}
    for key, op, value in labels:
        if op == "exists" and key not in have:
            return False
        if op == "!exists" and key in have:
            return False
        if op == "=" and have.get(key) != value:
            return False
        if op == "!=" and have.get(key) == value:
            return False
    for key, op, value in fields:
        got = _field(obj, key) or ""
        if op == "=" and got != value:
            return False
        if op == "!=" and got == value:
            return False
    return True


def _check_preconditions(obj: JSON, options: Any) -> None:
    """DeleteOptions.preconditions (uid, resourceVersion), as the real server checks them:
    a mismatch is 409 Conflict and nothing is deleted."""
    pre = (options or {}).get("preconditions") if isinstance(options, dict) else None
    for field_name, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
        want = (pre or {}).get(field_name)
        have = (obj.get("metadata") or {}).get(field_name)
        if want and want != have:
            raise ApiError(409, f"Precondition failed: {label} in precondition: {want}, "
                           f"{label} in object meta: {have}", "Conflict")


def _body_of(obj: JSON) -> JSON:
    """The parts of an object whose change bumps metadata.generation."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "kind", "apiVersion")}


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


class FakeApiServer:
    """In-memory Kubernetes API server on 127.0.0.1 for tests (see module docstring).

    Use as a context manager or call start()/stop(). Test controls are plain methods.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        bookmark_interval: float = 1.0,
        history_limit: int = 10_000,
    ) -> None:
        self.bookmark_interval = bookmark_interval
        self.history_limit = history_limit
        self.requests: list[tuple[str, str]] = []
        self._host, self._port = host, port
        self._lock = threading.RLock()
        self._by_path = {(r.api_version, r.plural): r for r in RESOURCES}
        self._by_kind = {(r.api_version, r.kind): r for r in RESOURCES}
        self._store = _KindIndexedStore()
        self._rv = 0
        self._compacted_rv = 0
        self._history: deque[_Event] = deque()
        self._watches: set[_Watch] = set()
        self._conns: set[socket.socket] = set()
        self._fail: list[int] = []
        # LIST continue tokens -> (resourceVersion of the snapshot, objects still to serve)
        self._continues: dict[str, tuple[int, list[JSON]]] = {}
        # list items encoded once per stored version (the real API server's watch cache
        # encodes an object once, not once per client): key -> (the stored dict, its JSON)
        self._encoded: dict[tuple[str, str, str, str], tuple[JSON, bytes]] = {}
        self._pages = 0
        self._expire_next = 0
        self.lists = 0  # LIST requests served (each page counts)
        self._delay = 0.0
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> FakeApiServer:
        handler = _make_handler(self)
        self._httpd = ThreadingHTTPServer((self._host, self._port), handler)
        self._httpd.daemon_threads = True
        self._port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="fake-apiserver",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and cut every open connection, so clients see the server gone."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        self.drop_watches(abrupt=True)
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self._port}"

    def kubeconfig(self, path: str | Path) -> str:
        """Write a no-auth kubeconfig pointing at this server; returns the path."""
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": "fake",
        }
        Path(path).write_text(yaml.safe_dump(doc))
        return str(path)

    # ---- test controls ---------------------------------------------------------------------

    @property
    def resource_version(self) -> str:
        """The current global resourceVersion."""
        with self._lock:
            return str(self._rv)

    def put_object(self, obj: JSON) -> JSON:
        """Create or replace from a manifest (status included), emitting ADDED/MODIFIED."""
        res = self._resource_for(obj)
        meta = obj.get("metadata") or {}
        ns = str(meta.get("namespace") or "default") if res.namespaced else ""
        name = str(meta.get("name") or "")
        if not name:
            raise ValueError("put_object needs metadata.name")
        with self._lock:
            old = self._store.get((res.api_version, res.plural, ns, name))
            new = copy.deepcopy(obj)
            new["apiVersion"], new["kind"] = res.api_version, res.kind
            m = new.setdefault("metadata", {})
            m.pop("resourceVersion", None)
            if res.namespaced:
                m["namespace"] = ns
            if old is None:
                return self._insert(res, ns, new)
            om = old["metadata"]
            m.setdefault("uid", om.get("uid"))
            m.setdefault("creationTimestamp", om.get("creationTimestamp"))
            gen = int(om.get("generation") or 1)
            m["generation"] = gen + 1 if _body_of(new) != _body_of(old) else gen
            return self._replace(res, ns, name, old, new)

    def get_object(
        self, kind: str, name: str, namespace: str | None = None, api_version: str = "v1"
    ) -> JSON | None:
        """A copy of a stored object, or None."""
        res = self._resource_for({"apiVersion": api_version, "kind": kind})
        ns = (namespace or "default") if res.namespaced else ""
        with self._lock:
            obj = self._store.get((res.api_version, res.plural, ns, name))
            return copy.deepcopy(obj) if obj is not None else None

    def delete_object(
        self, kind: str, name: str, namespace: str | None = None, api_version: str = "v1"
    ) -> bool:
        """Delete (emitting DELETED); False if it did not exist."""
        res = self._resource_for({"apiVersion": api_version, "kind": kind})
        ns = (namespace or "default") if res.namespaced else ""
        with self._lock:
            if (res.api_version, res.plural, ns, name) not in self._store:
                return False
            self._remove(res, ns, name)
            return True

    def bulk_load(self, objects: Iterable[JSON], encode: bool = False) -> int:
        """Store objects as they are, with no events and no copies (a cluster's worth for a
        benchmark); watches from before the load get 410. Returns how many. ``encode``
        also encodes each as a list item now, so a benchmark's first LIST does not pay for
        it on the machine under test (a real API server serves from memory, elsewhere)."""
        n = 0
        with self._lock:
            for obj in objects:
                res = self._resource_for(obj)
                m = obj.setdefault("metadata", {})
                ns = str(m.get("namespace") or "default") if res.namespaced else ""
                if res.namespaced:
                    m["namespace"] = ns
                m.setdefault("uid", str(uuid.uuid4()))
                m.setdefault("creationTimestamp", "2026-11-30T10:00:00Z")
                m["resourceVersion"] = self._next_rv()
                self._store[(res.api_version, res.plural, ns, m["name"])] = obj
                if encode:
                    self._item_json(res, obj)
                n += 1
            self._history.clear()
            self._compacted_rv = self._rv
        return n

    def list_objects(self, kind: str, limit: int = 0, token: str = "",
                     api_version: str = "v1") -> JSON:
        """A LIST (all namespaces) as a client gets it, paged with ``limit``/``token``;
        raises ``ApiError`` (410) for an expired token."""
        res = self._resource_for({"apiVersion": api_version, "kind": kind})
        query = {"limit": str(limit)} if limit else {}
        if token:
            query["continue"] = token
        with self._lock:
            return self._list(res, None, query).as_json()

    def expire_continues(self, count: int = 1) -> None:
        """The next ``count`` LIST requests with a continue token get 410 Expired (as after
        an etcd compaction between two pages)."""
        with self._lock:
            self._expire_next += count

    def compact(self) -> None:
        """Forget the event history: watches from any older resourceVersion now get 410."""
        with self._lock:
            self._history.clear()
            self._compacted_rv = self._rv

    def drop_watches(self, abrupt: bool = False) -> int:
        """End every open watch stream (cleanly, or by cutting the connection); returns count."""
        with self._lock:
            watches = list(self._watches)
            self._watches.clear()  # dropped now: no further events, watch_count drops at once
        for w in watches:
            w.queue.put(_ABORT if abrupt else _CLOSE)
        return len(watches)

    @property
    def watch_count(self) -> int:
        with self._lock:
            return len(self._watches)

    def fail_next(self, n: int, status: int = 500) -> None:
        """The next n requests (any verb, watches included) get a Status error."""
        with self._lock:
            self._fail.extend([status] * n)

    def clear_faults(self) -> None:
        """Drop queued failures and the delay: the API is healthy again."""
        with self._lock:
            self._fail.clear()
        self._delay = 0.0

    def delay(self, seconds: float) -> None:
        """Sleep this long before answering every request (0 to turn off)."""
        self._delay = seconds

    def events_for(self, namespace: str, pod: str) -> list[JSON]:
        """core/v1 Events recorded against one pod, oldest first."""
        with self._lock:
            out = [
                copy.deepcopy(obj)
                for (gv, plural, ns, _), obj in self._store.items()
                if gv == "v1" and plural == "events" and ns == namespace
                and (obj.get("involvedObject") or {}).get("name") == pod
            ]
        return sorted(out, key=lambda e: int(e["metadata"]["resourceVersion"]))

    def clear_requests(self) -> None:
        with self._lock:
            self.requests.clear()

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

    # ---- HTTP dispatch ---------------------------------------------------------------------

    def _route(self, path: str) -> tuple[Resource, str | None, str | None, str | None]:
        """URL path → (resource, namespace or None for all, name, subresource)."""
        segs = [s for s in path.split("/") if s]
        if len(segs) >= 2 and segs[0] == "api":
            gv, rest = segs[1], segs[2:]
        elif len(segs) >= 3 and segs[0] == "apis":
            gv, rest = f"{segs[1]}/{segs[2]}", segs[3:]
        else:
            raise ApiError(404, "the server could not find the requested resource")
        ns: str | None = None
        if (
            len(rest) >= 3
            and rest[0] == "namespaces"
            and (gv, rest[2]) in self._by_path
            and self._by_path[(gv, rest[2])].namespaced
        ):
            ns, rest = rest[1], rest[2:]
        if not rest or (gv, rest[0]) not in self._by_path or len(rest) > 3:
            raise ApiError(404, "the server could not find the requested resource")
        res = self._by_path[(gv, rest[0])]
        if not res.namespaced:
            ns = ""
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if sub is not None and not (sub == "status" and res.status):
            raise ApiError(404, "the server could not find the requested resource")
        if name is not None and ns is None:
            raise ApiError(404, "the server could not find the requested resource")
        return res, ns, name, sub

    def _discovery(self, path: str) -> JSON | None:
        p = path.rstrip("/")
        if p == "/version":
            return {"major": "1", "minor": "31", "gitVersion": "v1.31.0-aether-fake"}
        if p == "/api":
            return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
        groups: dict[str, list[str]] = {}
        for r in RESOURCES:
            if r.group and r.version not in groups.setdefault(r.group, []):
                groups[r.group].append(r.version)
        if p == "/apis":
            return {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [
                    {
                        "name": g,
                        "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
                        "preferredVersion": {"groupVersion": f"{g}/{vs[0]}", "version": vs[0]},
                    }
                    for g, vs in groups.items()
                ],
            }
        gv = p[len("/api/"):] if p.startswith("/api/") else p[len("/apis/"):]
        if (p.startswith("/api/") or p.startswith("/apis/")) and gv.count("/") == (
            0 if p.startswith("/api/") else 1
        ):
            rs = [r for r in RESOURCES if r.api_version == gv]
            if rs:
                items = []
                for r in rs:
                    items.append(
                        {"name": r.plural, "kind": r.kind, "namespaced": r.namespaced,
                         "singularName": r.kind.lower(),
                         "verbs": ["create", "delete", "get", "list", "patch", "update",
                                   "watch"]}
                    )
                    if r.status:
                        items.append({"name": f"{r.plural}/status", "kind": r.kind,
                                      "namespaced": r.namespaced, "singularName": "",
                                      "verbs": ["get", "patch", "update"]})
                return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv,
                        "resources": items}
        return None

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        """Serve one request; a client that hung up (timeout, stop()) is not an error."""
        try:
            self._handle_request(h, method)
        except OSError:
            h.close_connection = True

    def _handle_request(self, h: BaseHTTPRequestHandler, method: str) -> None:
        url = urlsplit(h.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        with self._lock:
            self.requests.append((method, url.path))
            fail = self._fail.pop(0) if self._fail else None
        if self._delay:
            time.sleep(self._delay)
        try:
            if fail is not None:
                raise ApiError(fail, f"injected failure ({fail})")
            if method == "GET":
                disc = self._discovery(url.path)
                if disc is not None:
                    _send_json(h, 200, disc)
                    return
            res, ns, name, sub = self._route(url.path)
            if method == "GET" and name is None and query.get("watch") in ("true", "1"):
                self._watch(h, res, ns, query)
                return
            body: Any = None
            if raw:
                try:
                    body = json.loads(raw)
                except ValueError as exc:
                    raise ApiError(400, f"invalid JSON body: {exc}") from exc
            code, out = self._dispatch(
                method, res, ns, name, sub, query, body, h.headers.get("Content-Type") or ""
            )
            _send_json(h, code, out)
        except ApiError as err:
            _send_json(h, err.code, err.status)

    def _dispatch(
        self,
        method: str,
        res: Resource,
        ns: str | None,
        name: str | None,
        sub: str | None,
        query: dict[str, str],
        body: Any,
        ctype: str,
    ) -> tuple[int, JSON | ListPage]:
        with self._lock:
            if name is None:
                if method == "GET":
                    return 200, self._list(res, ns, query)
                if method == "POST" and ns is not None:
                    return self._create(res, ns, body)
                raise ApiError(405, f"method {method} not allowed on a collection")
            assert ns is not None
            key = (res.api_version, res.plural, ns, name)
            old = self._store.get(key)
            if old is None:
                raise ApiError(
                    404, f'{res.plural} "{name}" not found', name=name, kind=res.plural
                )
            if method == "GET":
                return 200, copy.deepcopy(old)
            if method == "DELETE" and sub is None:
                _check_preconditions(old, body)
                return 200, self._remove(res, ns, name)
            if method == "PUT":
                new = self._updated(res, old, body, sub)
                return 200, self._replace(res, ns, name, old, new)
            if method == "PATCH":
                base = ctype.split(";")[0].strip()
                if base == "application/json-patch+json":
                    patched = json_patch(old, body)
                elif base in (
                    "application/merge-patch+json",
                    "application/strategic-merge-patch+json",
                    "application/apply-patch+yaml",
                    "application/json",
                ):
                    patched = merge_patch(old, body)
                else:
                    raise ApiError(415, f"unsupported patch content type {base!r}")
                new = self._updated(res, old, patched, sub)
                return 200, self._replace(res, ns, name, old, new)
            raise ApiError(405, f"method {method} not allowed")

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

    def _watch(
        self, h: BaseHTTPRequestHandler, res: Resource, ns: str | None, query: dict[str, str]
    ) -> None:
        w = _Watch(
            res,
            ns if res.namespaced else None,
            _parse_selector(query.get("labelSelector", "")),
            _parse_selector(query.get("fieldSelector", "")),
        )
        rv_param = query.get("resourceVersion", "")
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        expired: JSON | None = None
        with self._lock:
            if rv_param in ("", "0"):
                initial = [
                    {"type": "ADDED", "object": copy.deepcopy(obj)}
                    for (gv, plural, ons, _), obj in sorted(
                        self._store.items(), key=_rv_of
                    )
                    if gv == res.api_version and plural == res.plural and w.wants(ons, obj)
                ]
            else:
                try:
                    since = int(rv_param)
                except ValueError as exc:
                    raise ApiError(400, f"invalid resourceVersion {rv_param!r}") from exc
                if since < self._compacted_rv:
                    msg = f"too old resource version: {since} ({self._compacted_rv})"
                    expired = {"type": "ERROR", "object": status_object(410, msg, "Expired")}
                    initial = []
                else:
                    initial = [
                        {"type": seen, "object": copy.deepcopy(e.obj)}
                        for e in self._history
                        if e.rv > since and (seen := w.sees(e)) is not None
                    ]
            if expired is None:
                self._watches.add(w)
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        abrupt = False
        try:
            if expired is not None:
                _send_chunk(h, expired)
            else:
                for ev in initial:
                    _send_chunk(h, ev)
                abrupt = self._pump(h, w, timeout, bookmarks)
            if abrupt:
                h.close_connection = True
                with contextlib.suppress(OSError):
                    h.connection.shutdown(socket.SHUT_RDWR)
            else:
                h.wfile.write(b"0\r\n\r\n")
                h.wfile.flush()
        except OSError:
            h.close_connection = True
        finally:
            with self._lock:
                self._watches.discard(w)

    def _pump(
        self, h: BaseHTTPRequestHandler, w: _Watch, timeout: float | None, bookmarks: bool
    ) -> bool:
        """Stream queued events until timeout/drop/disconnect; True if the cut is abrupt."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last_sent = time.monotonic()
        while True:
            wait = 0.1
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    return False
            try:
                item = w.queue.get(timeout=wait)
            except queue.Empty:
                if _peer_closed(h.connection):
                    raise ConnectionResetError("watch client went away") from None
                if bookmarks and time.monotonic() - last_sent >= self.bookmark_interval:
                    with self._lock:
                        if not w.queue.empty():
                            continue
                        rv = str(self._rv)
                    obj = {"kind": w.resource.kind, "apiVersion": w.resource.api_version,
                           "metadata": {"resourceVersion": rv}}
                    _send_chunk(h, {"type": "BOOKMARK", "object": obj})
                    last_sent = time.monotonic()
                continue
            if item == _CLOSE:
                return False
            if item == _ABORT:
                return True
            _send_chunk(h, item)
            last_sent = time.monotonic()


def _rv_of(item: tuple[Any, JSON]) -> int:
    return int(item[1]["metadata"]["resourceVersion"])


def _peer_closed(sock: socket.socket) -> bool:
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


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


def _send_json(h: BaseHTTPRequestHandler, code: int, obj: JSON | ListPage) -> None:
    data = obj.encode() if isinstance(obj, ListPage) else json.dumps(obj).encode()
    h.send_response(code)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)


def _send_chunk(h: BaseHTTPRequestHandler, obj: JSON) -> None:
    data = json.dumps(obj).encode() + b"\n"
    h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
    h.wfile.flush()


def _make_handler(server: FakeApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            with server._lock:
                server._conns.add(self.connection)

        def finish(self) -> None:
            with server._lock:
                server._conns.discard(self.connection)
            with contextlib.suppress(OSError):
                super().finish()

        def handle(self) -> None:
            with contextlib.suppress(OSError):  # clients hanging up is routine
                super().handle()

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            server._handle(self, "GET")

        def do_POST(self) -> None:
            server._handle(self, "POST")

        def do_PUT(self) -> None:
            server._handle(self, "PUT")

        def do_PATCH(self) -> None:
            server._handle(self, "PATCH")

        def do_DELETE(self) -> None:
            server._handle(self, "DELETE")

    return Handler
