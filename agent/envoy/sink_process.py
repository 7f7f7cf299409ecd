"""The node Envoy process as the sink runs it: spawned under the supervisor or adopted
from a previous agent, watched for hangs, retired for a successor, stopped.

Split from ``agent.envoy.sink`` (a mixin of ``EnvoySink``, whose ``__init__`` sets the
state declared here): the process side of the sink, apart from what it publishes.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psutil

from agent.envoy import watchdog
from agent.envoy.supervisor import EnvoySupervisor, LogTailer
from agent.envoy.watchdog import main_thread_cpu
from agent.envoy.xds import XdsServer

log = logging.getLogger("aether.envoy")


class EnvoyProcess:
    """``EnvoySink``'s Envoy: spawn, adoption, the hang watchdog, retire and stop."""

    # set by EnvoySink.__init__
    admin: str
    bootstrap_path: str
    pid_path: str
    xds: XdsServer
    supervisor: EnvoySupervisor
    tailer: LogTailer
    hang_timeout: float
    hang_busy_timeout: float
    busy_silences: int
    hang_kills: int
    retired_at: float | None
    _adopted: psutil.Process | None
    _retired_adopted: psutil.Process | None
    _stopping: threading.Event
    # from the other parts of EnvoySink
    check_envoy_netns: Callable[[str], bool]
    if TYPE_CHECKING:
        @property
        def pid(self) -> int | None: ...

    def _watchdog(self) -> None:
        """A hung Envoy (SIGSTOP, deadlock) keeps its sockets open: the kernel still accepts
        into the backlog, so nothing crashes and nothing restarts it. Kill it when its admin
        stops answering for hang_timeout and its main thread makes no progress (a main thread
        busy applying a big push is not hung: ``agent.envoy.watchdog``); the supervisor then
        restarts it with backoff."""
        from agent.envoy.supervisor import admin_request

        last_pid: int | None = None
        last_answer = time.monotonic()
        last_cpu: float | None = None
        last_check = time.monotonic()
        said_busy = False
        while not self._stopping.wait(1.0):
            pid = self.pid
            if pid != last_pid:
                last_pid, last_answer, last_cpu = pid, time.monotonic(), None
            if pid is None:
                continue
            self.check_envoy_netns("periodic check")
            answered = False
            try:
                admin_request(self.admin, "GET", "/ready", timeout=1.0)
                answered, last_answer = True, time.monotonic()
                if said_busy:
                    log.info("envoy pid=%d answers its admin again", pid)
                said_busy = False
            except Exception:  # noqa: BLE001 - no answer, a reset or a garbled one: silence
                pass
            now = time.monotonic()
            cpu = main_thread_cpu(pid)
            delta = None if cpu is None or last_cpu is None else cpu - last_cpu
            window, last_cpu, last_check = now - last_check, cpu, now
            silent = 0.0 if answered else now - last_answer
            state = watchdog.verdict(silent, delta, window, self.hang_timeout,
                                     self.hang_busy_timeout)
            if state == "busy" and not said_busy:
                said_busy = True
                self.busy_silences += 1
                log.warning("envoy pid=%d has not answered its admin for %.0fs, its main thread "
                            "busy (%.0f%% of a CPU): not hung, waiting up to %.0fs", pid, silent,
                            100 * (delta or 0) / max(window, 1e-6), self.hang_busy_timeout)
            elif state == "hung":
                log.error("envoy pid=%d has not answered its admin for %.0fs (hung); killing "
                          "it so the supervisor restarts it", pid, silent)
                self.hang_kills += 1
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                last_answer, said_busy = time.monotonic(), False

    def _spawn(self) -> None:
        self.supervisor.start()

    def _write_pid(self, pid: int) -> None:
        """The keeper's pid, rewritten on every (re)spawn, so a restarted agent adopts the
        Envoy that is actually running."""
        tmp = self.pid_path + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(pid))
        os.replace(tmp, self.pid_path)

    def _previous_envoy(self) -> psutil.Process | None:
        try:
            with open(self.pid_path) as f:
                pid = int(f.read().strip())
            proc = psutil.Process(pid)
            if self.bootstrap_path in proc.cmdline() and proc.status() != psutil.STATUS_ZOMBIE:
                return proc
        except (OSError, ValueError, psutil.Error):
            pass
        return None

    def _seed_from_adopted(self) -> None:
        """Tell the builder which internal listener each namespace's cluster reaches in the
        Envoy about to be adopted, and which it has (``agent.envoy.adopted``). Best effort:
        an Envoy that does not answer is rebuilt as if new (its first push may then move a
        cluster and add its listener together)."""
        from agent.envoy import adopted
        from agent.envoy.supervisor import admin_request

        def dump(path: str) -> dict[str, Any]:
            code, body = admin_request(self.admin, "GET", path, timeout=10.0)
            if code != 200:
                raise RuntimeError(f"{path}: HTTP {code}: {body[:200]}")
            got = json.loads(body or "{}")
            return got if isinstance(got, dict) else {}

        try:
            reach = adopted.namespace_reach(dump(adopted.CLUSTERS_PATH))
            names = adopted.listener_names(dump(adopted.LISTENERS_PATH))
        except Exception as e:  # noqa: BLE001 - an unreadable Envoy is handled as a new one
            log.warning("could not read the adopted envoy's internal listeners (%s); its first "
                        "push is built as for a new envoy", e)
            return
        self.xds.seed(reach, names)
        log.info("adopted envoy holds %d namespace cluster(s) and internal listener(s) %s",
                 len(reach), ", ".join(names) or "none")

    def _watch_adopted(self) -> None:
        """Supervise an adopted Envoy by polling; when it dies, start our own."""
        while not self._stopping.wait(0.2):
            proc = self._adopted
            if proc is None:
                return
            try:
                alive = proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                alive = False
            if not alive:
                log.error("adopted envoy pid=%d exited; starting a new one", proc.pid)
                self._adopted = None
                try:
                    self._spawn()
                except Exception:  # noqa: BLE001 - keep trying rather than die silently
                    log.exception("starting envoy failed; retrying")
                    self._adopted = proc
                    continue
                return

    def restart_adopted(self, why: str, timeout: float = 10.0) -> bool:
        """Stop the adopted Envoy (its keeper forwards the signal and exits with it); the
        adoption watch then starts our own. False when no Envoy is adopted."""
        proc = self._adopted
        if proc is None:
            return False
        log.warning("restarting the adopted envoy (keeper pid=%d): %s", proc.pid, why)
        try:
            proc.terminate()
            proc.wait(timeout)
        except psutil.TimeoutExpired:
            for p in [proc, *proc.children(recursive=True)]:
                try:
                    p.kill()
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        return True

    def _release_after(self, seconds: float) -> None:
        """The hold's bound: an agent whose Services never come (a source that never
        syncs) still serves its adopted Envoy, with what it knows."""
        if self._stopping.wait(seconds) or not self.xds.held:
            return
        log.warning("no Services after %.0fs; sending the adopted envoy what is known", seconds)
        self.xds.release()

    def wait_ready(self, timeout: float = 30.0) -> bool:
        from agent.envoy.supervisor import wait_for
        return wait_for(self.ready, timeout)

    def ready(self) -> bool:
        from agent.envoy.supervisor import admin_request
        try:
            code, body = admin_request(self.admin, "GET", "/ready", timeout=1.0)
        except OSError:
            return False
        return code == 200 and body.strip() == "LIVE"

    def retire(self) -> None:
        """A successor serves the node now: never restart this Envoy again, close its
        listeners at once (the successor's, in the same SO_REUSEPORT groups, get the queued
        connections: tcp_migrate_req) and make its HTTP connections close cleanly after
        their current request (failing health check: Connection: close, HTTP/2 GOAWAY). L4
        connections keep going until ``stop``."""
        from agent.envoy.supervisor import admin_request
        self.retired_at = time.monotonic()
        self.supervisor.detach()  # a crash now must not bring listeners back
        adopted, self._adopted = self._adopted, None
        if adopted is not None:
            self._retired_adopted = adopted
        for path in ("/healthcheck/fail", "/drain_listeners"):
            try:
                code, body = admin_request(self.admin, "POST", path, timeout=5.0)
                if code != 200:
                    log.error("retiring envoy: POST %s answered %d %s", path, code, body[:200])
            except OSError as e:
                log.error("retiring envoy: POST %s failed: %s", path, e)
        log.info("retired: envoy stopped listening; its open connections drain")

    def open_connections(self) -> int | None:
        """Downstream connections this Envoy still carries (a retiring one's drain)."""
        from agent.envoy.supervisor import admin_request
        try:
            code, body = admin_request(self.admin, "GET",
                                       "/stats?filter=^server.total_connections$", timeout=2.0)
        except OSError:
            return None
        for line in body.splitlines() if code == 200 else []:
            key, _, value = line.partition(": ")
            if key == "server.total_connections":
                return int(value)
        return None

    def stop(self, keep_envoy: bool = False) -> None:
        """Stop serving. ``keep_envoy``: leave the keeper and Envoy running with their last
        config (an agent upgrade or restart), for the next agent to adopt."""
        self._stopping.set()
        if keep_envoy:
            self.supervisor.detach()
            self.xds.stop()
            self.tailer.stop()
            log.info("agent stopping; envoy keeps serving its last config for the next agent")
            return
        adopted = self._adopted or self._retired_adopted
        if adopted is not None:
            try:
                adopted.terminate()
                adopted.wait(5)
            except psutil.Error:
                pass
        self.supervisor.stop()
        self.xds.stop()
        self.tailer.stop()
        try:
            os.unlink(self.pid_path)
        except FileNotFoundError:
            pass
