"""The agent's servers under floods and trickles (no root): a cap on concurrent connections
answered "busy" at once, and one deadline per request, not per recv."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.cni.server import UnixJsonServer
from agent.ops.metrics import METRICS_MAX_CONNECTIONS, Metrics, MetricsServer


@pytest.fixture
def server(tmp_path: Path) -> Iterator[UnixJsonServer]:
    srv = UnixJsonServer(str(tmp_path / "s.sock"), lambda raw: b"answer:" + raw, "test",
                         busy_answer=b"busy", max_connections=2, deadline_s=0.6)
    srv.start()
    yield srv
    srv.stop()


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(path)
    return s


def _ask(path: str, payload: bytes) -> bytes:
    """As both shims do: a busy server may answer and close before the request is written
    (EPIPE); its answer is still there to read."""
    with _connect(path) as s:
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass
        return s.recv(1 << 16)


def test_connections_over_the_cap_are_answered_busy_at_once(server: UnixJsonServer) -> None:
    idle = [_connect(server.path) for _ in range(2)]  # hold both slots, send nothing
    try:
        time.sleep(0.1)
        started = time.monotonic()
        assert _ask(server.path, b"x") == b"busy"
        assert time.monotonic() - started < 0.5
    finally:
        for s in idle:
            s.close()
    # the slots come back: a held slot is released by its deadline or its close
    deadline = time.monotonic() + 3
    while _ask(server.path, b"x") != b"answer:x":
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_trickling_client_gets_one_deadline_not_one_per_recv(server: UnixJsonServer) -> None:
    s = _connect(server.path)
    stop = threading.Event()

    def trickle() -> None:
        try:
            while not stop.wait(0.2):
                s.sendall(b"x")  # every 0.2 s: a per-recv timeout of 0.6 s would never fire
        except OSError:
            pass

    t = threading.Thread(target=trickle, daemon=True)
    started = time.monotonic()
    t.start()
    try:
        assert s.recv(100) == b""  # the server gave up and closed, without an answer
        assert time.monotonic() - started < 2.0
    finally:
        stop.set()
        s.close()


def test_metrics_server_caps_idle_connections() -> None:
    srv = MetricsServer(Metrics(), "127.0.0.1", 0, lambda: True, lambda: (True, "")).start()
    idle = []
    try:
        for _ in range(METRICS_MAX_CONNECTIONS):
            idle.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5))
        time.sleep(0.2)
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
        conn.request("GET", "/healthz")
        assert conn.getresponse().status == 503  # busy, at once
        for s in idle:
            s.close()
        deadline = time.monotonic() + 5
        while True:
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
            conn.request("GET", "/healthz")
            if conn.getresponse().status == 200:
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        for s in idle:
            s.close()
        srv.stop()


def test_handler_threads_are_reused_across_connections(server: UnixJsonServer) -> None:
    """A burst of ADDs reuses the handler threads of the connections before it instead of
    starting one per connection; concurrent connections still get a thread each."""
    srv = server._server
    assert srv is not None

    def idle(n: int = 1) -> None:  # a handler counts itself idle just after its answer went
        deadline = time.monotonic() + 3
        while srv._idle < n:
            assert time.monotonic() < deadline
            time.sleep(0.005)

    for i in range(20):
        assert _ask(server.path, b"%d" % i) == b"answer:%d" % i
        idle()
    assert srv.handler_threads_started == 1
    held = [_connect(server.path) for _ in range(2)]  # two at once: a second thread
    try:
        time.sleep(0.1)
    finally:
        for s in held:
            s.close()
    idle(2)
    assert _ask(server.path, b"y") == b"answer:y"
    assert srv.handler_threads_started == 2
