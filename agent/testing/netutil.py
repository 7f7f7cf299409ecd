"""Sockets inside and outside pod namespaces, for tests, benchmarks and the demo."""

from __future__ import annotations

import http.server
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from agent.netns.enter import run_in_netns

SO_ORIGINAL_DST = 80
SOL_IPV6 = 41
SO_MARK = 36


def original_dst(conn: socket.socket) -> tuple[str, int]:
    """The pre-NAT destination of a redirected connection (IPv4 or IPv6)."""
    if conn.family == socket.AF_INET6:
        raw = conn.getsockopt(SOL_IPV6, SO_ORIGINAL_DST, 28)
        port = struct.unpack_from("!H", raw, 2)[0]
        addr = socket.inet_ntop(socket.AF_INET6, raw[8:24])
        return addr, port
    raw = conn.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port = struct.unpack_from("!H", raw, 2)[0]
    return socket.inet_ntop(socket.AF_INET, raw[4:8]), port


def _listen(family: int, addr: str, port: int) -> socket.socket:
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    s.bind((addr, port))
    s.listen(128)
    return s


@dataclass
class Recorder:
    """Accepts on some sockets, answers a tag, records (peer, original dst)."""

    tag: bytes
    sockets: list[socket.socket]
    seen: list[tuple[str, tuple[str, int]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Recorder:
        for s in self.sockets:
            threading.Thread(target=self._loop, args=(s,), daemon=True).start()
        return self

    def _loop(self, s: socket.socket) -> None:
        s.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, peer = s.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                self.seen.append((peer[0], original_dst(conn)))
            except OSError:
                self.seen.append((peer[0], ("", 0)))
            try:
                conn.sendall(self.tag)
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self._stop.set()
        for s in self.sockets:
            s.close()


def capture_listener(netns: str, port: int = 15001) -> Recorder:
    """A stand-in for Envoy: listens on the capture port inside the pod netns."""

    def make() -> list[socket.socket]:
        return [_listen(socket.AF_INET, "127.0.0.1", port),
                _listen(socket.AF_INET6, "::1", port)]

    return Recorder(b"captured", run_in_netns(netns, make)).start()


def host_server(port: int = 0, tag: bytes = b"direct") -> tuple[Recorder, int]:
    """A server in the host netns on every address; returns it and its port."""
    s4 = _listen(socket.AF_INET, "0.0.0.0", port)
    port = s4.getsockname()[1]
    s6 = _listen(socket.AF_INET6, "::", port)
    return Recorder(tag, [s4, s6]).start(), port


def netns_server(netns: str, addr: str, port: int, tag: bytes) -> Recorder:
    fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
    return Recorder(tag, [run_in_netns(netns, lambda: _listen(fam, addr, port))]).start()


def dial(netns: str, addr: str, port: int, mark: int | None = None,
         timeout: float = 2.0) -> str:
    """Connect from inside netns and return what the server answered, or the error name."""

    def work() -> str:
        fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            if mark is not None:
                s.setsockopt(socket.SOL_SOCKET, SO_MARK, mark)
            s.connect((addr, port))
            data = s.recv(64)
            return data.decode() or "eof"
        except OSError as e:
            return f"error:{type(e).__name__}:{e.errno}"
        finally:
            s.close()

    return run_in_netns(netns, work)


class ClosingHTTPServer(http.server.ThreadingHTTPServer):
    """A threading HTTP server whose ``shutdown`` also closes its listening socket and every
    connection it accepted. A test process runs hundreds of these; a kept-alive connection
    from an Envoy whose pod netns is gone never gets its FIN, so its handler thread would
    hold the socket for the process's lifetime, and past 1024 fds libnftables (select())
    refuses to load rules."""

    daemon_threads = True

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def shutdown(self) -> None:
        super().shutdown()
        self.server_close()
        with self._open_lock:
            conns = list(self._open)
        for c in conns:  # wakes the handler blocked in recv; it closes the socket
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def http_echo_server(netns: str, addr: str, port: int, pod_name: str, status: int = 200) -> Any:
    """An HTTP backend inside a pod netns that answers with its pod name and the request it
    saw (method, path, host, headers) as JSON — what the demo and GAMMA tests assert on.
    ``/status/<code>`` answers that status (with the same body); ``/delay/<ms>`` answers
    that late (at most 10 s); ``status``, what every other request is answered with."""
    import json as _json

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # an idle kept-alive connection ends: a peer whose netns went away never sends FIN,
        # and its handler thread would otherwise hold the socket for the process's lifetime
        timeout = 20

        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            body = _json.dumps({
                "pod": pod_name, "method": self.command, "path": self.path,
                "host": self.headers.get("Host", ""),
                "headers": {k.lower(): v for k, v in self.headers.items()},
            }).encode()
            code = status
            if self.path.startswith("/delay/") and self.path[7:].isdigit():
                time.sleep(min(int(self.path[7:]), 10_000) / 1000)  # /delay/<ms>: answer late
            if self.path.startswith("/status/") and self.path[8:11].isdigit():
                code = int(self.path[8:11])  # /status/503: answer that status
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("X-Pod", pod_name)
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _answer  # noqa: N815

        def log_message(self, *args: Any) -> None:
            return

    fam = socket.AF_INET6 if ":" in addr else socket.AF_INET

    class Server(ClosingHTTPServer):
        address_family = fam

    def make() -> Server:
        return Server((addr, port), Handler)

    srv = run_in_netns(netns, make)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def http_get_from(netns: str, host: str, port: int, path: str = "/",
                  headers: dict[str, str] | None = None, count: int = 1,
                  timeout: float = 5.0, request_id: str | None = None, method: str = "GET"
                  ) -> list[tuple[int, dict[str, str], bytes]]:
    """`count` GETs (or ``method``) from inside netns (new connection each): (status,
    headers, body).

    With ``request_id``, request i carries ``x-request-id: <request_id>-<i>``: Envoy keeps
    it, so an access log line (e.g. the mesh's failure log) names the request it is about."""
    import http.client

    def work() -> list[tuple[int, dict[str, str], bytes]]:
        out = []
        for i in range(count):
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
            sent = dict(headers or {})
            if request_id is not None:
                sent["x-request-id"] = f"{request_id}-{i}"
            try:
                conn.request(method, path, headers=sent)
                r = conn.getresponse()
                out.append((r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()))
            except OSError as e:
                out.append((0, {"error": f"{type(e).__name__}: {e}"}, b""))
            finally:
                conn.close()
        return out

    return run_in_netns(netns, work, timeout=max(30.0, count * timeout))


def recv_upto(sock: socket.socket, n: int) -> bytes:
    """Read until ``n`` bytes came or the peer closed (fewer, then)."""
    got = b""
    while len(got) < n:
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def host_get(ip: str, port: int, path: str = "/healthz") -> int:
    """A GET from the node's own netns, as kubelet's HTTP probe makes it (0: no answer)."""
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://{ip}:{port}{path}", timeout=3) as r:
            return int(r.status)
    except OSError:
        return 0


def read_first(netns: str, ip: str, port: int, wait: float = 3.0) -> bytes:
    """Connect from ``netns`` and read without sending anything: what the server says first
    (b"": it closed, or nothing came within ``wait`` s)."""
    def work() -> bytes:
        s = socket.create_connection((ip, port), timeout=5)
        s.settimeout(wait)
        try:
            return s.recv(100)
        except OSError:
            return b""
        finally:
            s.close()
    return run_in_netns(netns, work)
