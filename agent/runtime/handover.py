"""Both sides of a take-over as the running agent plays them (the steps: ``takeover``).

``agent.runtime.takeover`` holds the plain parts and the client of the control socket; this
module holds what the agent does with them, split out of ``agent.runtime.app`` (the
composition): the replaced agent's gate (``HandoverGate``: serving, frozen, retired; the CNI
requests in flight; the thaw when the commit never comes; the drain), the successor's wait
for its own listeners and its commit, and the control socket's requests.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from agent import __version__
from agent.cni import request as cni_request
from agent.cni.handler import ListenerSink
from agent.common.config import NodeConfig
from agent.runtime.status_doc import NO_PROXY, listener_states
from agent.runtime.takeover import Peer, ask, control_socket, wait_pid_gone

log = logging.getLogger("aether.agent")

TRY_AGAIN = cni_request.encode((1, '{"cniVersion": "1.0.0", "code": 11, '
                                '"msg": "aether agent handing over to its '
                                'successor: try again"}'))


class HandoverGate:
    """The replaced side: "serving", "frozen" (a successor is taking over: CNI answers
    try-again) or "retired" (the successor serves; this agent's Envoy drains until SIGTERM)."""

    def __init__(self) -> None:
        self.role = "serving"
        self.cond = threading.Condition()
        self.inflight = 0
        self.try_again = 0  # CNI requests answered try-again during a take-over
        self.frozen_at = 0.0
        self.peer_state = ""  # the replaced agent (on the successor): "draining", then "gone"
        self.sigterm_at: float | None = None

    def serve(self, handle: Callable[[bytes], bytes], raw: bytes) -> bytes:
        """The CNI handler behind the hand-over gate: once a successor is taking over, each
        request is answered try-again (kubelet retries it, and the successor serves it)."""
        with self.cond:
            if self.role != "serving":
                self.try_again += 1
                log.info("CNI request answered try-again: %s", "a successor is taking over"
                         if self.role == "frozen" else "the successor serves this node")
                return TRY_AGAIN
            self.inflight += 1
        try:
            return handle(raw)
        finally:
            with self.cond:
                self.inflight -= 1
                self.cond.notify_all()

    def freeze(self, successor: str, successor_pid: int | None, timeout: float,
               on_frozen: Callable[[], None]) -> dict[str, Any]:
        """No CNI request served from now on, the ones in flight finished, then
        ``on_frozen`` (live enrollment stopped); thawed again if the commit never comes."""
        with self.cond:
            if self.role == "retired":
                return {"ok": False, "msg": "already retired: another agent serves"}
            self.role, self.frozen_at = "frozen", time.monotonic()
            done = self.cond.wait_for(lambda: self.inflight == 0, timeout)
        on_frozen()
        log.warning("take-over by %s: CNI requests are answered try-again until it serves",
                    successor)
        threading.Thread(target=self.thaw_unless_committed,
                         args=(self.frozen_at, successor_pid), name="takeover-thaw",
                         daemon=True).start()
        if not done:
            return {"ok": False, "msg": f"requests still in flight after {timeout:.0f}s"}
        return {"ok": True}

    def thaw_unless_committed(self, frozen_at: float, successor_pid: int | None,
                              bound: float = 300.0) -> None:
        """A successor that dies (or never commits) must not leave the node without an
        agent serving CNI: serve again."""
        deadline = frozen_at + bound
        while time.monotonic() < deadline:
            dead = successor_pid is not None and wait_pid_gone(successor_pid, 0.0)
            with self.cond:
                if self.role != "frozen" or self.frozen_at != frozen_at:
                    return
                if dead:
                    self.role = "serving"
                    self.cond.notify_all()
                    log.error("the successor (pid %d) died before committing its take-over: "
                              "serving CNI requests again", successor_pid)
                    return
            time.sleep(0.2)
        with self.cond:
            if self.role != "frozen" or self.frozen_at != frozen_at:
                return
            self.role = "serving"
            self.cond.notify_all()
        log.error("the successor never committed its take-over within %.0fs: serving CNI "
                  "requests again", bound)

    def thaw(self) -> dict[str, Any]:
        with self.cond:
            if self.role == "frozen":
                self.role = "serving"
            self.cond.notify_all()
        log.warning("take-over abandoned by the successor: serving CNI requests again")
        return {"ok": True}

    def commit(self, retire: Callable[[], None]) -> dict[str, Any]:
        """The successor serves every pod now: ``retire`` lets go of what is the successor's
        (metrics port, CNI socket; Envoy drains) and stops every loop."""
        with self.cond:
            if self.role != "frozen":
                return {"ok": False, "msg": f"not frozen ({self.role})"}
            self.role = "retired"
            self.cond.notify_all()
        retire()
        log.warning("retired: the successor serves this node; draining until SIGTERM")
        return {"ok": True}

    def await_outcome(self, timeout: float = 60.0) -> None:
        """A take-over under way: SIGTERM waits for its outcome."""
        with self.cond:
            self.cond.wait_for(lambda: self.role != "frozen", timeout)

    def drain_progress(self, sink: ListenerSink, instance: str, drain_seconds: float
                       ) -> dict[str, Any]:
        left = getattr(sink, "open_connections", None)
        out: dict[str, Any] = {"role": self.role, "pid": os.getpid(), "instance": instance,
                               "connections_left": left() if callable(left) else None,
                               "cni_try_again": self.try_again}
        if self.sigterm_at is not None:
            out["seconds_left"] = round(max(0.0, self.sigterm_at + drain_seconds
                                            - time.monotonic()), 1)
        else:
            out["seconds_left"] = None  # the drain's clock starts at SIGTERM
        return out

    def takeover_state(self, sink: ListenerSink, instance: str, peer: Peer | None
                       ) -> dict[str, Any]:
        """Which agent serves, and the one being replaced with its drain progress."""
        out: dict[str, Any] = {"role": self.role, "instance": instance, "pid": os.getpid(),
                               "slot": getattr(sink, "slot", None),
                               "cni_try_again": self.try_again}
        if peer is None:
            return out
        replaced: dict[str, Any] = {"pid": peer.pid, "instance": peer.instance,
                                    "version": peer.version, "slot": peer.slot,
                                    "state": self.peer_state or "taking over"}
        if self.peer_state == "draining":
            try:
                replaced.update(ask(peer, "drain", timeout=1.0)["drain"])
                replaced["state"] = "draining"
            except (OSError, RuntimeError, ValueError) as e:
                replaced["drain_error"] = str(e)
        out["replaced"] = replaced
        return out


def hello(node: NodeConfig, sink: ListenerSink, instance: str, role: str) -> dict[str, Any]:
    """What a successor needs to run beside this agent."""
    sink_pid = getattr(sink, "pid", None)
    return {"pid": os.getpid(), "instance": instance, "version": __version__,
            "control": control_socket(node.run_dir, instance),
            "slot": getattr(sink, "slot", "envoy"),
            "envoy_pid": sink_pid if isinstance(sink_pid, int) else None,
            "proxy_cgroup": node.proxy_cgroup,
            "proxy_cgroup_level": node.proxy_cgroup_level, "role": role}


# -- the successor's side --------------------------------------------------------------------
def await_own_listeners(sink: ListenerSink, container_ids: list[str], peer: Peer | None,
                        timeout: float = 120.0) -> None:
    """Before taking the sockets: this agent's Envoy ready, with every recorded pod's
    listener bound (beside the old Envoy's) and its Services in."""
    ids = container_ids
    deadline = time.monotonic() + timeout
    ready = getattr(sink, "ready", None)
    while True:
        states = listener_states(sink, ids)
        waiting = [cid for cid in ids if states[cid][0] not in ("live", NO_PROXY)]
        envoy_ok = bool(ready()) if callable(ready) else True
        if envoy_ok and not waiting:
            log.info("take-over: own Envoy holds all %d pod listeners", len(ids))
            return
        if time.monotonic() > deadline:
            if peer is not None:
                try:
                    ask(peer, "thaw", timeout=10.0)
                except (OSError, RuntimeError, ValueError):
                    pass
            raise RuntimeError(f"take-over abandoned: after {timeout:.0f}s own Envoy "
                               f"{'ready' if envoy_ok else 'not ready'}, {len(waiting)} "
                               "pod listeners not live; the old agent serves on")
        time.sleep(0.1)


def commit_takeover(gate: HandoverGate, peer: Peer, node: NodeConfig, stopped: threading.Event,
                    reprogram_all: Callable[[], None]) -> None:
    ask(peer, "commit", timeout=30.0)
    gate.peer_state = "draining"
    log.info("took over from pid %d: its Envoy drains; it exits on SIGTERM", peer.pid)
    threading.Thread(target=_after_peer, args=(gate, peer, node, stopped, reprogram_all),
                     name="takeover-peer", daemon=True).start()


def _after_peer(gate: HandoverGate, peer: Peer, node: NodeConfig, stopped: threading.Event,
                reprogram_all: Callable[[], None]) -> None:
    """Once the replaced agent's Envoy is gone, its RETURN leaves every pod's table."""
    while not stopped.is_set():
        if wait_pid_gone(peer.envoy_pid, 1.0) and wait_pid_gone(peer.pid, 0.0):
            break
    if stopped.is_set():
        return
    gate.peer_state = "gone"
    # the held cgroup fd stays open: an ADD rendered a moment ago may still name it
    node.peer_proxy.set(None)
    log.info("the replaced agent (pid %d) and its Envoy are gone: its RETURN leaves the "
             "pod tables", peer.pid)
    reprogram_all()


# -- the control socket ----------------------------------------------------------------------
class ControlHost(Protocol):
    """The running agent as its control socket answers for it (``agent.runtime.app.Agent``)."""

    @property
    def role(self) -> str: ...

    def hello(self) -> dict[str, Any]: ...
    def freeze(self, successor: str, successor_pid: int | None = None,
               timeout: float = 60.0) -> dict[str, Any]: ...
    def thaw(self) -> dict[str, Any]: ...
    def commit(self) -> dict[str, Any]: ...
    def drain_progress(self) -> dict[str, Any]: ...
    def readiness_checks(self) -> dict[str, bool]: ...


def control_request(agent: ControlHost, request: Any,
                    otherwise: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """This agent's own socket (``<run-dir>/agents/<instance>.sock``): a successor's
    hand-over, and what is asked of this agent rather than of whoever serves (anything else
    goes to ``otherwise``: the status socket's requests)."""
    if not isinstance(request, dict):
        return {"ok": False, "msg": "expected a JSON object"}
    command = request.get("command")
    if command == "hello":
        return {"ok": True, "hello": agent.hello()}
    if command == "freeze":
        pid = request.get("pid")
        return agent.freeze(str(request.get("successor") or "?"),
                            pid if isinstance(pid, int) else None)
    if command == "thaw":
        return agent.thaw()
    if command == "commit":
        return agent.commit()
    if command == "drain":
        return {"ok": True, "drain": agent.drain_progress()}
    if command == "ready":
        failing = [k for k, ok in agent.readiness_checks().items() if not ok]
        if agent.role != "serving":
            failing.append(agent.role)
        return {"ok": True, "ready": not failing, "failing": failing, "role": agent.role}
    return otherwise(request)
