"""The take-over's load and plumbing (#40), shared by integration/test_takeover.py and
bench/takeover.py: cgroups as a container runtime makes them, echo servers in pod netns,
the captured client's traffic counted per kind, and the agents' control sockets.

Test support, not agent code: nothing in ``agent`` imports it.
"""

from __future__ import annotations

import http.client
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psutil

from agent.cni import protocol
from agent.netns.cgroup import cgroup2_mount
from agent.netns.enter import run_in_netns
from agent.testing.kubelet import Pod
from agent.testing.netutil import recv_upto

# the Services the load goes to: web (appProtocol http) and raw (L4); ext is a pod not in
# the mesh (passthrough)
WEB_IP, RAW_IP = "10.96.74.10", "10.96.74.11"
EXT_PORT, RAW_PORT = 7100, 7000


def services() -> list[dict[str, Any]]:
    """The manifests of web (``appProtocol: http``, port 80 → 8080) and raw (L4)."""
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "app"},
         "spec": {"clusterIP": WEB_IP, "clusterIPs": [WEB_IP], "selector": {"app": "web"},
                  "ports": [{"name": "http", "port": 80, "targetPort": 8080,
                             "appProtocol": "http"}]}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "raw", "namespace": "app"},
         "spec": {"clusterIP": RAW_IP, "clusterIPs": [RAW_IP], "selector": {"app": "raw"},
                  "ports": [{"name": "tcp", "port": RAW_PORT, "targetPort": RAW_PORT}]}}]


def new_cgroup(name: str) -> str:
    """A fresh cgroup v2 (a hybrid host keeps the hierarchy at /sys/fs/cgroup/unified)."""
    with open("/proc/self/mountinfo") as f:
        mount = cgroup2_mount(f.read())
    assert mount is not None, "the take-over test needs cgroup v2"
    path = os.path.join(mount, f"aether-test-{name}-{uuid.uuid4().hex[:6]}")
    os.mkdir(path)
    return path


def in_cgroup(path: str) -> list[str]:
    """A command prefix that starts the command in cgroup ``path`` (as a runtime would)."""
    return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', path]


def kill_cgroup(path: str) -> None:
    """What the runtime does at the end of the grace period: everything left dies."""
    for root, _dirs, _files in os.walk(path, topdown=False):
        try:
            with open(os.path.join(root, "cgroup.kill"), "w") as f:
                f.write("1")
        except OSError:
            pass


def remove_cgroup(path: str) -> None:
    kill_cgroup(path)
    for root, _dirs, _files in os.walk(path, topdown=False):
        for _ in range(50):
            try:
                os.rmdir(root)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)


def pod_socket(netns: str) -> socket.socket:
    """A TCP socket of the pod's netns (it stays there wherever it is used)."""
    return run_in_netns(netns, lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))


def echo_server(netns: str, port: int) -> socket.socket:
    lst = run_in_netns(netns, lambda: socket.create_server(("0.0.0.0", port), backlog=512))

    def one(c: socket.socket) -> None:
        with c:
            try:
                while data := c.recv(65536):
                    c.sendall(data)
            except OSError:
                pass

    def serve() -> None:
        while True:
            try:
                c, _ = lst.accept()
            except OSError:
                return
            threading.Thread(target=one, args=(c,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return lst


class Load:
    """The traffic that must not notice the take-over, counted per kind."""

    def __init__(self, client: Pod, ext_ip: str) -> None:
        self.client, self.ext_ip = client, ext_ip
        self.stop = threading.Event()
        self.ok: dict[str, int] = {"passthrough": 0, "service": 0, "http": 0}
        self.failures: list[tuple[float, str, str]] = []
        self.http_retries = 0
        self.long_cut: list[float] = []  # when each long-lived connection broke, if it did
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _fail(self, kind: str, err: BaseException | str) -> None:
        with self._lock:
            self.failures.append((time.time(), kind, repr(err)))

    def _new_connections(self, kind: str, ip: str, port: int) -> None:
        n = 0
        while not self.stop.wait(0.025):
            n += 1
            payload = f"{kind}-{n}".encode()
            s = pod_socket(self.client.netns)
            try:
                s.settimeout(5)
                s.connect((ip, port))
                s.sendall(payload)
                got = recv_upto(s, len(payload))
                if got != payload:
                    raise OSError(f"echo {got!r} != {payload!r}")
                with self._lock:
                    self.ok[kind] += 1
            except OSError as e:
                self._fail(kind, e)
            finally:
                s.close()

    def _http(self) -> None:
        conn: http.client.HTTPConnection | None = None
        netns = self.client.netns

        class InPod(http.client.HTTPConnection):
            def connect(self) -> None:
                self.sock = pod_socket(netns)
                self.sock.settimeout(self.timeout)
                self.sock.connect((self.host, self.port))

        def once(c: http.client.HTTPConnection) -> int:
            c.request("GET", "/", headers={"Host": "web"})
            r = c.getresponse()
            r.read()
            if r.getheader("connection", "").lower() == "close":
                c.close()
            return r.status

        while not self.stop.wait(0.025):
            if conn is None:
                conn = InPod(WEB_IP, 80, timeout=5)
            try:
                status = once(conn)
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                # a kept-alive connection closed cleanly under us: retried once, as HTTP
                # clients do for an idempotent request
                conn.close()
                conn = InPod(WEB_IP, 80, timeout=5)
                with self._lock:
                    self.http_retries += 1
                try:
                    status = once(conn)
                except (OSError, http.client.HTTPException) as e:
                    self._fail("http", e)
                    conn.close()
                    conn = None
                    continue
            except (OSError, http.client.HTTPException) as e:
                self._fail("http", e)
                conn.close()
                conn = None
                continue
            if status == 200:
                with self._lock:
                    self.ok["http"] += 1
            else:
                self._fail("http", f"HTTP {status}")

    def _long_lived(self, i: int) -> None:
        s = pod_socket(self.client.netns)
        s.settimeout(5)
        try:
            s.connect((RAW_IP, RAW_PORT))
            while not self.stop.wait(0.2):
                s.sendall(f"long-{i}".encode())
                if s.recv(64) != f"long-{i}".encode():
                    raise OSError("long-lived echo mismatch or closed")
        except OSError:
            with self._lock:
                self.long_cut.append(time.time())
        finally:
            s.close()

    def counts(self, kinds: tuple[str, ...]) -> tuple[dict[str, int], dict[str, int]]:
        """A consistent snapshot: successes and failures by kind."""
        with self._lock:
            return ({k: self.ok[k] for k in kinds},
                    {k: sum(1 for f in self.failures if f[1] == k) for k in kinds})

    def failures_since(self, n: int) -> list[tuple[float, str, str]]:
        """The first few failures after the ``n``-th."""
        with self._lock:
            return self.failures[n:n + 5]

    def start(self) -> None:
        targets: list[Callable[[], None]] = [
            lambda: self._new_connections("passthrough", self.ext_ip, EXT_PORT),
            lambda: self._new_connections("service", RAW_IP, RAW_PORT),
            self._http,
            *[(lambda i=i: self._long_lived(i)) for i in range(4)],
        ]
        for t in targets:
            th = threading.Thread(target=t, daemon=True)
            th.start()
            self.threads.append(th)

    def finish(self) -> None:
        self.stop.set()
        for th in self.threads:
            th.join(15)


def control(run_dir: str, instance: str, command: str) -> dict[str, Any]:
    return protocol.call(os.path.join(run_dir, "agents", f"{instance}.sock"),
                         {"command": command}, 5)


def envoys_of(run_dir: str) -> list[int]:
    out = []
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd and os.path.basename(cmd[0]) == "envoy" and any(run_dir in a for a in cmd):
            out.append(p.info["pid"])
    return out


def answers(run_dir: str, instance: str) -> bool:
    try:
        return bool(control(run_dir, instance, "ready")["ready"])
    except OSError:
        return False


def works(load: Load) -> bool:
    try:
        for ip, port in ((load.ext_ip, EXT_PORT), (RAW_IP, RAW_PORT)):
            s = pod_socket(load.client.netns)
            s.settimeout(3)
            with s:
                s.connect((ip, port))
                s.sendall(b"x")
                if s.recv(8) != b"x":
                    return False
        s = pod_socket(load.client.netns)
        s.settimeout(3)
        with s:
            s.connect((WEB_IP, 80))
            s.sendall(b"GET / HTTP/1.1\r\nHost: web\r\nConnection: close\r\n\r\n")
            return s.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False
