"""The agent's side of the pod's DNS: start the DNS process, tell it which pods to serve,
answer its name lookups from the mesh model, and start it again if it dies.

The process (``agent.dns.server``) joins the proxy's cgroup first thing, like Envoy, so its
forwarded queries pass the pods' capture rules; everything it knows of the mesh it asks
here, one name at a time.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import psutil

log = logging.getLogger("aether.dns")

_MAX = 65536
PID_FILE = "dns.pid"
LOOKUP_WORKERS = 8
#: (kind "service" or "import", namespace, name) → addresses, () for no address, None for
#: no such name
NameLookup = Callable[[str, str, str], "tuple[str, ...] | None"]


class DnsUnavailable(RuntimeError):
    """The DNS process did not confirm (it is down, or refused the pod)."""


@dataclass(frozen=True)
class DnsSettings:
    mesh_domain: str = "aether.internal"
    port: int = 15053
    mark: int = 0
    timeout: float = 5.0
    max_inflight: int = 64
    run_dir: str = ""  # where the pid file is (and what names the process)


class DnsProcess:
    """One DNS process for the node. Thread-safe; ``serve`` returns once the pod's sockets
    are bound in its netns (so a pod never starts with a redirect to nothing)."""

    def __init__(self, settings: DnsSettings, cgroup: str | None = None,
                 lookup: NameLookup | None = None) -> None:
        self.settings = settings
        self.cgroup = cgroup or ""
        self.lookup: NameLookup = lookup or (lambda _k, _ns, _n: None)
        self._lock = threading.Lock()  # the process and its channel
        self._send_lock = threading.Lock()
        self._replies: dict[int, tuple[threading.Event, list[dict[str, Any]]]] = {}
        self._seq = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._chan: socket.socket | None = None
        self._served: dict[str, tuple[str, str]] = {}  # container id → (pod key, netns path)
        self._stopping = False
        self.starts = 0
        self.lookups = 0
        self._pool = ThreadPoolExecutor(LOOKUP_WORKERS, thread_name_prefix="aether-dns-lookup")

    # ---- the process ----------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            self._ensure_locked()

    def _ensure_locked(self) -> socket.socket:
        if self._chan is not None and self._proc is not None and self._proc.poll() is None:
            return self._chan
        self._kill_locked()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        args = json.dumps({"mesh_domain": self.settings.mesh_domain, "port": self.settings.port,
                           "mark": self.settings.mark, "timeout": self.settings.timeout,
                           "max_inflight": self.settings.max_inflight})
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "agent.dns.server", self.cgroup, str(theirs.fileno()), args,
             self.settings.run_dir],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, close_fds=True)
        theirs.close()
        if self.settings.run_dir:
            try:
                with open(os.path.join(self.settings.run_dir, PID_FILE), "w") as f:
                    f.write(f"{self._proc.pid}\n")
            except OSError as e:
                log.warning("cannot record the pod DNS pid: %s", e)
        self._chan = ours
        self.starts += 1
        threading.Thread(target=self._read, args=(ours,), name="aether-dns-control",
                         daemon=True).start()
        if self.starts > 1:
            log.warning("the pod DNS process was gone; started it again (pid %d)",
                        self._proc.pid)
        return ours

    def _kill_locked(self) -> None:
        if self._chan is not None:
            self._chan.close()
            self._chan = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None

    def pid(self) -> int | None:
        p = self._proc
        return p.pid if p is not None and p.poll() is None else None

    def stop(self, linger: bool = False) -> None:
        """Stop serving. ``linger`` (a restart, Envoy kept): the process outlives this agent
        and serves the pods until the next agent's DNS serves them (``retire_previous``)."""
        with self._lock:
            self._stopping = True
            if linger and self._chan is not None and self.pid() is not None:
                try:
                    self._chan.send(json.dumps({"op": "linger", "seq": 0}).encode())
                    self._chan.close()
                    self._chan = None
                    self._proc = None  # not ours to reap any more
                    return
                except OSError:
                    pass
            self._kill_locked()

    def previous(self) -> psutil.Process | None:
        """The DNS process the previous agent on this run dir left serving (its pid file
        names it, its command line says it is one), or None."""
        if not self.settings.run_dir:
            return None
        try:
            with open(os.path.join(self.settings.run_dir, PID_FILE)) as f:
                pid = int(f.read().strip() or 0)
            proc = psutil.Process(pid)
            cmd = proc.cmdline()
        except (OSError, ValueError, psutil.Error):
            return None
        mine = self._proc.pid if self._proc is not None else None
        if pid == mine or "agent.dns.server" not in cmd or self.settings.run_dir not in cmd:
            return None
        return proc

    def retire_previous(self, proc: psutil.Process | None) -> None:
        """Stop the previous agent's DNS process once this one serves the pods (both hold
        each pod's DNS port meanwhile, SO_REUSEPORT)."""
        if proc is None:
            return
        try:
            proc.terminate()
            proc.wait(3)
        except psutil.TimeoutExpired:
            proc.kill()
        except psutil.Error:
            return
        log.info("the previous agent's pod DNS (pid %d) stopped: this agent's serves %d pods",
                 proc.pid, len(self._served))

    # ---- the channel ----------------------------------------------------------------
    def _read(self, chan: socket.socket) -> None:
        while True:
            try:
                msg = chan.recv(_MAX)
            except OSError:
                msg = b""
            if not msg:
                break
            try:
                doc = json.loads(msg)
            except ValueError:
                continue
            if doc.get("op") == "lookup":  # on a worker: a held first call waits there
                self._pool.submit(self._answer, chan, doc)
                continue
            waiting = self._replies.get(int(doc.get("seq") or 0))
            if waiting is not None:
                waiting[1].append(doc)
                waiting[0].set()
        for event, _box in list(self._replies.values()):
            event.set()  # the process is gone: nobody waits for it
        if not self._stopping:
            threading.Thread(target=self._revive, name="aether-dns-revive", daemon=True).start()

    def _answer(self, chan: socket.socket, doc: dict[str, Any]) -> None:
        self.lookups += 1
        try:
            ips = self.lookup(str(doc["kind"]), str(doc["ns"]), str(doc["name"]))
        except Exception:  # noqa: BLE001 - a lookup failure is SERVFAIL-free: the name is unknown
            log.exception("DNS lookup of %s/%s", doc.get("ns"), doc.get("name"))
            ips = None
        reply = {"op": "answer", "seq": doc["seq"], "ips": None if ips is None else list(ips)}
        try:
            with self._send_lock:
                chan.send(json.dumps(reply).encode())
        except OSError:
            pass

    def _call(self, msg: dict[str, Any], fd: int | None = None, timeout: float = 5.0
              ) -> dict[str, Any]:
        with self._lock:
            chan = self._ensure_locked()
            self._seq += 1
            seq = self._seq
        event, box = threading.Event(), cast(list[dict[str, Any]], [])
        self._replies[seq] = (event, box)
        try:
            data = json.dumps({**msg, "seq": seq}).encode()
            with self._send_lock:
                if fd is None:
                    chan.send(data)
                else:
                    socket.send_fds(chan, [data], [fd])
            if not event.wait(timeout) or not box:
                raise DnsUnavailable(f"the pod DNS process did not answer {msg['op']}")
            return dict(box[0])
        except OSError as e:
            raise DnsUnavailable(f"the pod DNS process: {e}") from e
        finally:
            self._replies.pop(seq, None)

    # ---- pods -----------------------------------------------------------------------
    def serve(self, container_id: str, pod_key: str, netns: str) -> None:
        """Bind the pod's DNS sockets in ``netns``; DnsUnavailable if they are not."""
        fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
        try:
            got = self._call({"op": "serve", "id": container_id, "pod": pod_key}, fd=fd)
        finally:
            os.close(fd)
        if not got.get("ok"):
            raise DnsUnavailable(f"DNS for {pod_key} not served: {got.get('error')}")
        self._served[container_id] = (pod_key, netns)

    def unserve(self, container_id: str) -> None:
        if self._served.pop(container_id, None) is None:
            return
        try:
            self._call({"op": "stop", "id": container_id})
        except DnsUnavailable as e:
            log.warning("DNS of %s: %s (its sockets go with the process)", container_id, e)

    def serving_any(self) -> bool:
        return bool(self._served)

    def serving(self, container_id: str) -> bool:
        return container_id in self._served

    def stats(self) -> dict[str, Any]:
        try:
            got = self._call({"op": "stats"}, timeout=2.0)
        except DnsUnavailable as e:
            return {"up": False, "error": str(e), "served": len(self._served)}
        return {"up": True, "pid": self.pid(), "starts": self.starts, "lookups": self.lookups,
                "served": len(self._served), **(got.get("stats") or {})}

    def _revive(self) -> None:
        """The process died: start another and serve every pod again (a pod's DNS is down
        from the death to here: its queries are refused, none leaves uncaptured)."""
        for attempt in range(50):
            if self._stopping:
                return
            try:
                self.start()
            except OSError as e:
                log.error("the pod DNS process cannot start: %s", e)
                time.sleep(min(5.0, 0.2 * (attempt + 1)))
                continue
            break
        for cid, (key, netns) in list(self._served.items()):
            try:
                self.serve(cid, key, netns)
            except (OSError, DnsUnavailable) as e:
                log.error("DNS of %s not served again: %s", key, e)
        log.info("the pod DNS process serves %d pods again", len(self._served))
