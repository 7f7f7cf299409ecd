"""A small in-memory Kubernetes API server that speaks the real HTTP protocol.

No kube-apiserver can run in the test environment, so tests drive the real ``kubernetes``
client (and the agent's sources) against this server instead of mocking the client: the
wire format, selectors, watch streaming, 410 Expired and fault injection are what the agent
sees in production. It is deliberately small: one global resourceVersion counter, an event
log for watch replay, JSON merge patch for every object-patch flavour, no auth, no
admission, no validation beyond what tests need.

This module holds the resource table (``RESOURCES``), the server's lifecycle and the test
controls (``FakeApiServer``); the rest is layered under it by what it holds: the rules for
objects (``apiserver_protocol``: Status, patches, selectors), the store and its versions
(``apiserver_store``), watch streaming (``apiserver_watch``) and HTTP routing
(``apiserver_http``).
"""

from __future__ import annotations

import contextlib
import copy
import socket
import threading
import uuid
from collections.abc import Iterable
from http.server import ThreadingHTTPServer
from pathlib import Path

import yaml

from agent.testing.apiserver_http import ApiRouting, _make_handler
from agent.testing.apiserver_protocol import (
    JSON,
    ApiError,
    Resource,
    _body_of,
    json_patch,
    merge_patch,
    status_object,
)
from agent.testing.apiserver_store import ListPage, StoreKey
from agent.testing.apiserver_watch import _ABORT, _CLOSE

__all__ = [  # where they were before the split
    "JSON", "ApiError", "ListPage", "Resource", "StoreKey", "json_patch", "merge_patch", "status_object",
]

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


class FakeApiServer(ApiRouting):
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
        super().__init__(RESOURCES, history_limit)
        self.bookmark_interval = bookmark_interval
        self.requests = []
        self._host, self._port = host, port
        self._conns = set()
        self._fail = []
        self._delay = 0.0
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def _resource_table(self) -> tuple[Resource, ...]:
        return RESOURCES

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
