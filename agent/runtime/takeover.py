"""Two agents on one node for a moment: the new one takes over, the old one drains.

A node-shared proxy's restart hits every pod of the node, so an upgrade must never be a
stop-then-start. A second ``aether-agent run`` on the same ``--run-dir`` finds the first one
answering on the status socket and takes over, in this order:

1. **hello** — the new agent (B) learns the old one's (A) control socket, Envoy slot, proxy
   cgroup and Envoy pid. B then runs its own Envoy in the *other* slot
   (``<run-dir>/envoy`` or ``<run-dir>/envoy-b``: bootstrap, admin, xDS socket, pid file), in
   B's own cgroup.
2. **freeze** — A answers every CNI request from now on with try-again (kubelet retries) and
   returns once its requests in flight are done, so no ADD or DEL is served by both agents
   or half-applied, and B reads a pod state nobody is changing.
3. B loads the records, programs every pod's table with a RETURN for *both* proxies'
   cgroups (B names A's cgroup through ``/proc/<A's Envoy>/root``: in a container B cannot
   see A's cgroup by path), sets ``tcp_migrate_req`` in each pod netns, and waits until its
   Envoy holds every pod's listener, bound beside A's (SO_REUSEPORT: the kernel spreads new
   connections over both) and its Services are loaded.
4. B renames its CNI and status sockets over A's (a client connects to one or the other,
   never to nothing) and sends **commit**: A stops its metrics server (B binds the port),
   its loops, and drains its Envoy — its listeners close at once (the kernel moves their
   queued connections to B's sockets), HTTP connections are closed cleanly after their
   current request, L4 connections keep going.
5. A, on SIGTERM, gives its remaining connections ``--drain-seconds``, stops its Envoy and
   exits without touching tables, pins or records. B, once A's Envoy is gone, takes A's
   RETURN out of every table.

This module holds the plain parts (slots, names, messages) and the client side of the
control socket; ``agent.runtime.app`` runs both sides.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from agent.cni import protocol

SLOTS = ("envoy", "envoy-b")  # where an agent's Envoy lives under the run dir
CONTROL_DIR = "agents"  # <run-dir>/agents/<instance>.sock: each agent's own control socket


def other_slot(slot: str) -> str:
    return SLOTS[1] if slot == SLOTS[0] else SLOTS[0]


def xds_socket(run_dir: str, slot: str) -> str:
    """The first slot keeps the path of every agent before take-overs (an adopted Envoy's
    bootstrap names it)."""
    if slot == SLOTS[0]:
        return os.path.join(run_dir, "xds.sock")
    return os.path.join(run_dir, slot, "xds.sock")


SERVING_SLOT = "serving-slot"  # <run-dir>/serving-slot: the slot of the agent serving now


def slot_envoy_alive(run_dir: str, slot: str) -> bool:
    """Whether the keeper named by the slot's pid file runs that slot's Envoy."""
    import psutil
    try:
        with open(os.path.join(run_dir, slot, "envoy.pid")) as f:
            proc = psutil.Process(int(f.read().strip()))
        return (os.path.join(run_dir, slot, "bootstrap.json") in proc.cmdline()
                and proc.status() != psutil.STATUS_ZOMBIE)
    except (OSError, ValueError, psutil.Error):
        return False


def choose_slot(recorded: str | None, alive: list[str]) -> tuple[str, str | None]:
    """A plain start's slot (and a leftover slot whose Envoy must go): the serving agent's
    recorded slot if its Envoy lives (it is adopted), else a slot whose Envoy lives, else the
    recorded one. A crash in the middle of a take-over can leave both alive."""
    ours = recorded if recorded in SLOTS else SLOTS[0]
    if alive and ours not in alive:
        ours = alive[0]
    return ours, next((s for s in alive if s != ours), None)


def read_serving_slot(run_dir: str) -> str | None:
    try:
        with open(os.path.join(run_dir, SERVING_SLOT)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def write_serving_slot(run_dir: str, slot: str) -> None:
    tmp = os.path.join(run_dir, f".{SERVING_SLOT}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(slot)
    os.replace(tmp, os.path.join(run_dir, SERVING_SLOT))


def control_socket(run_dir: str, instance: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in instance) or "agent"
    return os.path.join(run_dir, CONTROL_DIR, f"{safe}.sock")


def peer_cgroup_name(envoy_pid: int, nft_path: str) -> str:
    """How this agent's nft names the cgroup of another agent's Envoy: through that process's
    root, where its own cgroup2 mount shows it (``nft`` resolves the path relative to
    /sys/fs/cgroup once, at load; the kernel then matches by cgroup id)."""
    return f"../../../proc/{envoy_pid}/root/sys/fs/cgroup/{nft_path.lstrip('/')}"


def held_cgroup_name(fd: int) -> str:
    """nft's name for a cgroup directory this process holds open as ``fd``."""
    return f"../../../proc/self/fd/{fd}"


@dataclass(frozen=True)
class Peer:
    """The agent being taken over, as its hello answered."""

    pid: int
    instance: str
    control: str
    slot: str
    envoy_pid: int | None
    proxy_cgroup: str | None  # as the peer's nft names it
    proxy_cgroup_level: int
    version: str

    @classmethod
    def from_hello(cls, answer: dict[str, Any]) -> Peer:
        h = answer["hello"]
        return cls(pid=int(h["pid"]), instance=str(h["instance"]), control=str(h["control"]),
                   slot=str(h["slot"]), envoy_pid=None if h.get("envoy_pid") is None
                   else int(h["envoy_pid"]), proxy_cgroup=h.get("proxy_cgroup"),
                   proxy_cgroup_level=int(h.get("proxy_cgroup_level") or 0),
                   version=str(h.get("version") or "?"))

    def cgroup_for_rules(self) -> tuple[str, int] | None:
        """(nft name, level) of the peer's proxy cgroup, held open by this process: the name
        goes through our own fd table, so it still resolves when the peer's Envoy has exited
        (an ADD rendered at that moment must not fail on a vanished /proc entry). None when
        the peer has no cgroup match or its cgroup cannot be opened."""
        if self.proxy_cgroup is None or self.envoy_pid is None:
            return None
        path = os.path.join("/sys/fs/cgroup", peer_cgroup_name(self.envoy_pid,
                                                               self.proxy_cgroup))
        try:
            fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        return held_cgroup_name(fd), self.proxy_cgroup_level


def find_peer(run_dir: str, timeout: float = 5.0) -> Peer | None:
    """The agent serving this run dir now, or None (nobody answers: a plain start)."""
    path = os.path.join(run_dir, "status.sock")
    if not os.path.exists(path):
        return None
    try:
        answer = protocol.call(path, {"command": "hello", "from_pid": os.getpid()}, timeout)
    except (OSError, ValueError):
        return None
    if not answer.get("ok") or "hello" not in answer:
        return None  # an agent from before take-overs: it cannot be drained, so start plain
    return Peer.from_hello(answer)


def ask(peer: Peer, command: str, timeout: float = 60.0, **fields: Any) -> dict[str, Any]:
    answer = protocol.call(peer.control, {"command": command, **fields}, timeout)
    if not answer.get("ok"):
        raise RuntimeError(f"agent pid {peer.pid} refused {command}: {answer.get('msg')}")
    return answer


def wait_pid_gone(pid: int | None, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while pid is not None and time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return pid is None or not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
