"""The unix socket the `aether-cni` shim talks to (and the status socket uses the same shape).

Root-only (mode 0600): whoever can write here can change a pod's capture. One thread per
connection, at most ``MAX_CONNECTIONS`` at once: the next one is answered "busy, try again" on
the accept thread and closed, so a flood can neither exhaust threads nor push the agent's fd
numbers towards FD_SETSIZE (libnftables select()s on its netlink socket and aborts the process
on an fd ≥ 1024). A request must arrive whole within ``REQUEST_DEADLINE_S`` (one deadline per
request, not per recv), so slow clients cannot hold their slots either.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from typing import Any

from agent.cni import protocol as p
from agent.common.bounded import BoundedThreadingMixIn

log = logging.getLogger("aether.server")

Handler = Callable[[Any], dict[str, Any]]
RawHandler = Callable[[bytes], bytes]


def json_handler(handler: Handler) -> RawHandler:
    """Adapt a dict → dict handler (the status socket) to raw bytes."""

    def raw(data: bytes) -> bytes:
        try:
            request = json.loads(data)
        except ValueError as e:
            answer: dict[str, Any] = {"ok": False, "code": p.ERR_DECODE,
                                      "msg": "request is not valid JSON", "details": str(e)}
        else:
            try:
                answer = handler(request)
            except Exception as e:  # a bug must still answer, never close the connection
                log.exception("request handler failed")
                answer = {"ok": False, "msg": "internal error", "details": repr(e)}
        return json.dumps(answer).encode()

    return raw


MAX_CONNECTIONS = 256  # a node-wide burst of pod starts fits; fds stay far below FD_SETSIZE
REQUEST_DEADLINE_S = 10.0


class _Server(BoundedThreadingMixIn, socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    request_queue_size = 256  # a burst of pod starts must not see EAGAIN
    handle_request_fn: RawHandler
    oversize_answer: bytes
    deadline_s: float = REQUEST_DEADLINE_S


class _Conn(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        try:
            raw = p.recv_all(sock, deadline=time.monotonic() + self.server.deadline_s)
            if not raw:
                return  # a liveness probe: connect and close
            answer = self.server.handle_request_fn(raw)
        except p.ProtocolError as e:
            log.warning("rejected a request on %s: %s", self.server.server_address, e)
            try:
                sock.sendall(self.server.oversize_answer)
                sock.shutdown(socket.SHUT_WR)
                _drain(sock, seconds=1.0)  # let the client read the answer, not a reset
            except OSError:
                pass
            return
        except OSError as e:
            log.warning("client connection failed: %s", e)
            return
        try:
            sock.sendall(answer)
        except OSError as e:
            log.warning("client went away before the answer: %s", e)


def _drain(sock: socket.socket, seconds: float, limit: int = 64 << 20) -> None:
    sock.settimeout(seconds)
    seen = 0
    try:
        while seen < limit:
            chunk = sock.recv(1 << 16)
            if not chunk:
                return
            seen += len(chunk)
    except OSError:
        return


class UnixJsonServer:
    """Serve `handler(request bytes) -> answer bytes` on a root-only unix socket."""

    def __init__(self, path: str, handler: RawHandler, name: str = "cni",
                 oversize_answer: bytes = b'{"ok": false, "msg": "request too large"}',
                 busy_answer: bytes = b'{"ok": false, "msg": "agent busy, try again"}',
                 max_connections: int = MAX_CONNECTIONS,
                 deadline_s: float = REQUEST_DEADLINE_S) -> None:
        self.path = path
        self.name = name
        self._handler = handler
        self._oversize = oversize_answer
        self._busy = busy_answer
        self._max = max_connections
        self._deadline = deadline_s
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._inode: tuple[int, int] | None = None  # the socket file we bound

    def start(self, replace: bool = False) -> None:
        """Bind and serve. ``replace``: another agent serves this path now (a take-over):
        bind beside it and rename over it, so every client connects to one of the two and
        none finds no socket."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        bind_at = f"{self.path}.{os.getpid()}.new" if replace else self.path
        for stale in (bind_at,) if replace else (self.path,):
            if os.path.exists(stale):
                os.unlink(stale)  # stale from a previous run
        old = os.umask(0o177)
        try:
            server = _Server(bind_at, _Conn)
        finally:
            os.umask(old)
        os.chmod(bind_at, 0o600)
        st = os.stat(bind_at)
        self._inode = (st.st_dev, st.st_ino)
        if replace:
            os.replace(bind_at, self.path)
        server.handle_request_fn = self._handler
        server.oversize_answer = self._oversize
        server.busy_answer = self._busy
        server.max_connections = self._max
        server.deadline_s = self._deadline
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name=f"{self.name}-server",
                                        daemon=True)
        self._thread.start()
        log.info("serving %s socket at %s", self.name, self.path)

    @property
    def refused(self) -> int:
        """Connections answered "busy" because the cap was reached."""
        return self._server.refused if self._server is not None else 0

    def owns_path(self) -> bool:
        """Whether the path is still the socket we bound (a successor may have taken it)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return self._inode == (st.st_dev, st.st_ino)

    def stop(self) -> None:
        """Stop serving; the path is removed only while it is still ours."""
        mine = self.owns_path()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if mine:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
