"""The test API server's watch streams: a WATCH from a resourceVersion (replayed from the
event log, or ``ERROR`` 410 Expired from before the compaction point), then live events,
bookmarks, and the clean or abrupt end a test asks for, as chunked HTTP.

``WatchStreams`` adds the streaming to ``agent.testing.apiserver_store.VersionedStore``; its
own module so that the stream loop reads apart from the store and the routing.
"""

from __future__ import annotations

import contextlib
import copy
import json
import queue
import select
import socket
import time
from http.server import BaseHTTPRequestHandler
from typing import Any

from agent.testing.apiserver_protocol import JSON, ApiError, Resource, _parse_selector, status_object
from agent.testing.apiserver_store import VersionedStore, _Watch

_CLOSE = "close"  # watch-queue sentinels: end the stream cleanly / cut the connection
_ABORT = "abort"


class WatchStreams(VersionedStore):
    """The WATCH requests of ``FakeApiServer`` (one handler thread per stream)."""

    bookmark_interval: float  # set by FakeApiServer

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


def _send_chunk(h: BaseHTTPRequestHandler, obj: JSON) -> None:
    data = json.dumps(obj).encode() + b"\n"
    h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
    h.wfile.flush()
