"""The unix socket the `aether-cni` shim talks to (and the status socket uses the same shape).

Root-only (mode 0600): whoever can write here can change a pod's capture. One thread per
connection; a slow or malformed client cannot block other pods' ADDs.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import threading
from collections.abc import Callable
from typing import Any

from agent.cni import protocol as p

log = logging.getLogger("aether.server")

Handler = Callable[[Any], dict[str, Any]]


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    request_queue_size = 256  # a burst of pod starts must not see EAGAIN
    handle_request_fn: Handler


class _Conn(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(10.0)
        try:
            raw = p.recv_all(sock)
            try:
                request = json.loads(raw)
            except ValueError as e:
                answer: dict[str, Any] = {"ok": False, "code": p.ERR_DECODE,
                                          "msg": "request is not valid JSON", "details": str(e)}
            else:
                answer = self.server.handle_request_fn(request)
        except p.ProtocolError as e:
            answer = {"ok": False, "code": p.ERR_BAD_REQUEST, "msg": str(e), "details": ""}
        except OSError as e:
            log.warning("client connection failed: %s", e)
            return
        try:
            sock.sendall(json.dumps(answer).encode())
        except OSError as e:
            log.warning("client went away before the answer: %s", e)


class UnixJsonServer:
    """Serve `handler(request) -> answer` on a root-only unix socket."""

    def __init__(self, path: str, handler: Handler, name: str = "cni") -> None:
        self.path = path
        self.name = name
        self._handler = handler
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        if os.path.exists(self.path):
            os.unlink(self.path)  # stale from a previous run
        old = os.umask(0o177)
        try:
            server = _Server(self.path, _Conn)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        server.handle_request_fn = self._handler
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name=f"{self.name}-server",
                                        daemon=True)
        self._thread.start()
        log.info("serving %s socket at %s", self.name, self.path)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
