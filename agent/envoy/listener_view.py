"""Envoy's own view of the pod capture listeners, for ``aether-agent status``.

What the agent intends (the listeners it serves over xDS) and what Envoy holds can differ:

- a listener Envoy rejected (NACK: its bind failed, its config is invalid) is not there —
  ``/config_dump`` shows it with an ``error_state`` holding Envoy's reason, until the next
  successful LDS update clears it (then only the xDS server's last NACK still names it);
- a listener still warming, or draining because it is being removed, accepts nothing new;
- an admin ``drain_listeners`` stops every listener: Envoy closes their sockets but keeps
  listing them as active, counts them in ``listener_manager.listener_stopped``, and from then
  on ignores (and ACKs) every new listener until it restarts.

So status asks Envoy: ``/config_dump?resource=dynamic_listeners`` masked to each listener's
name and states (small even with thousands of Services in the mesh listeners), and the one
``listener_manager.listener_stopped`` counter. ``ListenerProbe`` makes those two requests
under one time budget and caches the answer briefly; the parsing and the per-listener
verdict are pure functions.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.envoy.resources import LISTENER_TYPE

# States a pod listener can be in, as status reports them. Only LIVE is healthy.
LIVE = "live"
MISSING = "missing"
REJECTED = "rejected"
WARMING = "warming"
DRAINING = "draining"
STOPPED = "stopped"
STALE = "stale"  # serving an older version: Envoy rejected the newer one
UNKNOWN = "unknown"

NOT_ANSWERING = "envoy admin not answering"

CONFIG_DUMP_PATH = "/config_dump?resource=dynamic_listeners&mask=" + ",".join((
    "name", "active_state.last_updated", "warming_state.last_updated",
    "draining_state.last_updated", "error_state.details", "error_state.last_update_attempt"))
STOPPED_STAT = "listener_manager.listener_stopped"
STOPPED_PATH = "/stats?format=json&filter=" + urllib.parse.quote(
    "^" + STOPPED_STAT.replace(".", r"\.") + "$")


@dataclass(frozen=True)
class EnvoyListeners:
    """What Envoy holds, by listener name. ``error`` set: Envoy did not answer (all unknown)."""

    active: frozenset[str] = frozenset()
    warming: frozenset[str] = frozenset()
    draining: frozenset[str] = frozenset()
    errors: Mapping[str, str] = field(default_factory=dict)  # name → Envoy's details
    stopped: int = 0  # listener_manager.listener_stopped
    error: str | None = None


@dataclass(frozen=True)
class ListenerState:
    state: str
    detail: str = ""

    @property
    def live(self) -> bool:
        return self.state == LIVE

    def __str__(self) -> str:
        return f"{self.state}: {self.detail}" if self.detail else self.state


def parse_config_dump(doc: Mapping[str, Any]) -> EnvoyListeners:
    """``/config_dump?resource=dynamic_listeners`` (masked or not) → per-name states.

    With ``resource=`` the dump is ``{"configs": [DynamicListener, ...]}``; a full dump
    (``ListenersConfigDump`` under ``configs``) holds them under ``dynamic_listeners``. An
    error not tied to a name comes as a nameless entry; its failed configuration, when the
    dump carries it, still names the listener."""
    entries: list[Mapping[str, Any]] = []
    for cfg in doc.get("configs") or []:
        if not isinstance(cfg, Mapping):
            continue
        if "dynamic_listeners" in cfg:
            entries += [e for e in cfg.get("dynamic_listeners") or [] if isinstance(e, Mapping)]
        elif str(cfg.get("@type", "")).endswith("ListenersConfigDump.DynamicListener") or (
                {"name", "active_state", "warming_state", "draining_state", "error_state"}
                & cfg.keys()):
            entries.append(cfg)
    active: set[str] = set()
    warming: set[str] = set()
    draining: set[str] = set()
    errors: dict[str, str] = {}
    for e in entries:
        err = e.get("error_state")
        name = str(e.get("name") or "")
        if not name and isinstance(err, Mapping):
            failed = err.get("failed_configuration")
            name = str(failed.get("name") or "") if isinstance(failed, Mapping) else ""
        if not name:
            continue
        if "active_state" in e:
            active.add(name)
        if "warming_state" in e:
            warming.add(name)
        if "draining_state" in e:
            draining.add(name)
        if isinstance(err, Mapping):
            detail = str(err.get("details") or "rejected").strip()
            errors.setdefault(name, detail)
    return EnvoyListeners(frozenset(active), frozenset(warming), frozenset(draining), errors)


def parse_stopped(doc: Mapping[str, Any]) -> int:
    """``/stats?format=json`` → the ``listener_manager.listener_stopped`` counter (0 if absent)."""
    for s in doc.get("stats") or []:
        if isinstance(s, Mapping) and s.get("name") == STOPPED_STAT:
            try:
                return int(s.get("value") or 0)
            except (TypeError, ValueError):
                return 0
    return 0


def nack_names(name: str, detail: str) -> bool:
    """Whether Envoy's NACK message names this listener (pure).
    Envoy: "Error adding/updating listener(s) capture-a: <why>" (one line per listener)."""
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", detail) is not None


def _nack_naming(name: str, last_nack: Mapping[str, Any] | None) -> str:
    """The xDS server's last listener NACK, when Envoy's message names this listener."""
    if not last_nack or last_nack.get("type_url") != LISTENER_TYPE:
        return ""
    detail = str(last_nack.get("error_detail") or "").strip()
    return detail if nack_names(name, detail) else ""


def listener_state(name: str, view: EnvoyListeners,
                   last_nack: Mapping[str, Any] | None = None) -> ListenerState:
    """One pod listener's state as Envoy holds it. Only ``live`` is healthy."""
    if view.error is not None:
        return ListenerState(UNKNOWN, view.error)
    if name in view.active:
        if view.stopped:
            return ListenerState(STOPPED, "Envoy stopped its listeners (admin drain_listeners): "
                                          "sockets closed, connections refused until Envoy restarts")
        if name in view.errors:
            return ListenerState(STALE, f"serving an older version; Envoy rejected the update: "
                                        f"{view.errors[name]}")
        return ListenerState(LIVE)
    if name in view.errors:
        return ListenerState(REJECTED, view.errors[name])
    if name in view.warming:
        return ListenerState(WARMING, "Envoy has not finished initializing it")
    if name in view.draining:
        return ListenerState(DRAINING, "Envoy is removing it")
    nack = _nack_naming(name, last_nack)
    if nack:
        return ListenerState(REJECTED, nack)
    if view.stopped:
        return ListenerState(MISSING, "Envoy ignores new listeners since its listeners were "
                                      "stopped (admin drain_listeners)")
    return ListenerState(MISSING, "Envoy does not hold it")


AdminRequest = Callable[[str, str, str, float], tuple[int, str]]


class ListenerProbe:
    """Envoy's listener view over its admin, cheap and time-bounded for status.

    One refresh is two small admin GETs sharing ``timeout`` (a hung Envoy — accepted
    connection, no answer — costs at most that); the answer is kept ``ttl`` seconds for the
    same ``key`` (callers pass what would change it: xDS versions, the Envoy pid), and
    concurrent callers share one refresh."""

    def __init__(self, admin: str, request: AdminRequest | None = None, ttl: float = 1.0,
                 timeout: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        if request is None:
            from agent.envoy.supervisor import admin_request
            request = admin_request
        self.admin = admin
        self.request = request
        self.ttl = ttl
        self.timeout = timeout
        self.clock = clock
        self.fetches = 0
        self._lock = threading.Lock()
        self._cached: tuple[float, object, EnvoyListeners] | None = None

    def view(self, key: object = None) -> EnvoyListeners:
        with self._lock:
            now = self.clock()
            c = self._cached
            if c is not None and c[1] == key and now - c[0] < self.ttl:
                return c[2]
            view = self._fetch()
            self._cached = (self.clock(), key, view)
            return view

    def _get(self, path: str, deadline: float) -> Any:
        left = deadline - self.clock()
        if left <= 0:
            raise TimeoutError("time budget spent")
        code, body = self.request(self.admin, "GET", path, left)
        if code != 200:
            raise ValueError(f"HTTP {code} for {path.partition('?')[0]}: {body.strip()[:200]}")
        return json.loads(body)

    def _fetch(self) -> EnvoyListeners:
        self.fetches += 1
        deadline = self.clock() + self.timeout
        try:
            view = parse_config_dump(self._get(CONFIG_DUMP_PATH, deadline))
            stopped = parse_stopped(self._get(STOPPED_PATH, deadline))
        except (OSError, ValueError, http.client.HTTPException) as e:  # timeouts, bad JSON
            return EnvoyListeners(error=f"{NOT_ANSWERING} ({type(e).__name__}: {e})"
                                  if str(e) else f"{NOT_ANSWERING} ({type(e).__name__})")
        return EnvoyListeners(view.active, view.warming, view.draining, view.errors, stopped)
