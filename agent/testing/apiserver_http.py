"""The test API server's HTTP side: discovery, URL routing, verbs, fault injection and
the request handler class ``ThreadingHTTPServer`` runs.

``ApiRouting`` turns a request into a store operation or a watch stream
(``agent.testing.apiserver_watch``) and the answer, or an ``ApiError``, into JSON. Its own
module so that routing reads apart from the store and from the server's lifecycle and test
controls (``agent.testing.apiserver``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import socket
import time
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlsplit

from agent.testing.apiserver_protocol import (
    JSON,
    ApiError,
    Resource,
    _check_preconditions,
    json_patch,
    merge_patch,
)
from agent.testing.apiserver_store import ListPage
from agent.testing.apiserver_watch import WatchStreams


class ApiRouting(WatchStreams):
    """Request handling of ``FakeApiServer``: everything between a request and the store."""

    requests: list[tuple[str, str]]  # set by FakeApiServer, as the fields below
    _conns: set[socket.socket]
    _fail: list[int]
    _delay: float

    def _resource_table(self) -> tuple[Resource, ...]:
        """The resources discovery lists (``FakeApiServer``: ``apiserver.RESOURCES`` as it is)."""
        raise NotImplementedError

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
        for r in self._resource_table():
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
            rs = [r for r in self._resource_table() if r.api_version == gv]
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


def _send_json(h: BaseHTTPRequestHandler, code: int, obj: JSON | ListPage) -> None:
    data = obj.encode() if isinstance(obj, ListPage) else json.dumps(obj).encode()
    h.send_response(code)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)


def _make_handler(server: ApiRouting) -> type[BaseHTTPRequestHandler]:
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
