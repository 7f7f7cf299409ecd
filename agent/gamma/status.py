"""Write GAMMA route status: our ``status.parents`` entries, nobody else's, only on change.

``StatusWriter.sync`` turns ``ParentStatus`` records into each route's desired
``status.parents`` (others' entries kept in place; ours replaced in place, appended, or
dropped when the route/parent is no longer ours) and PUTs the ``/status`` subresource with
the live resourceVersion, re-reading on 409. It remembers what the API returned, so an
unchanged status costs no request, and it writes only while the lease says we lead.
``StatusLoop`` is the debounced background pass (the SliceProjector pattern).
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Protocol

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from agent.gamma import DEFAULT_CONTROLLER_NAME
from agent.gamma.conditions import GATEWAY_GROUP, ParentStatus
from agent.kube.client import raw_options
from agent.kube.rest import CustomObjects
from agent.runtime.loops import DebouncedLoop
from agent.scope.routes import ParentRef

log = logging.getLogger("aether.gamma.status")

JSON = dict[str, Any]
RouteKey = tuple[str, str, str]  # kind, namespace, name
PLURALS = {"HTTPRoute": "httproutes", "GRPCRoute": "grpcroutes"}
VERSION = "v1"
MAX_PARENTS = 32  # RouteStatus.parents maxItems


class Leader(Protocol):
    def is_leader(self) -> bool: ...


class AlwaysLeader:
    """For a single agent (tests, one-node clusters): no election."""

    def is_leader(self) -> bool:
        return True


class StatusWriteError(Exception):
    """Some routes could not be written this pass; the rest were, and the pass is retried."""


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _int(v: Any) -> int | None:
    try:
        return int(v) if v is not None else None
    except (TypeError, ValueError):
        return None


def ref_key(ref: Mapping[str, Any], route_ns: str) -> tuple[Any, ...] | None:
    """A status/spec parentRef → comparable key; None if it is not a Service parent."""
    group = ref.get("group")
    if (GATEWAY_GROUP if group is None else group) != "" or ref.get("kind") != "Service":
        return None  # an omitted group means gateway.networking.k8s.io: not a Service
    return (str(ref.get("namespace") or route_ns), str(ref.get("name") or ""),
            _int(ref.get("port")), ref.get("sectionName") or None)


def parent_key(p: ParentRef) -> tuple[Any, ...]:
    return (p.namespace, p.name, p.port, p.section_name)


def echo_ref(route: Mapping[str, Any], p: ParentRef) -> JSON:
    """The parentRef as the route's spec wrote it (what kubectl users match against)."""
    ns = str((route.get("metadata") or {}).get("namespace") or "default")
    for ref in (route.get("spec") or {}).get("parentRefs") or []:
        if isinstance(ref, dict) and ref_key(ref, ns) == parent_key(p):
            out: JSON = {"group": "", "kind": "Service", "name": p.name}
            if ref.get("namespace"):
                out["namespace"] = ref["namespace"]
            if p.port is not None:
                out["port"] = p.port
            if p.section_name is not None:
                out["sectionName"] = p.section_name
            return out
    out = {"group": "", "kind": "Service", "name": p.name, "namespace": p.namespace}
    if p.port is not None:
        out["port"] = p.port
    if p.section_name is not None:
        out["sectionName"] = p.section_name
    return out


def _strip_times(parents: Any) -> Any:
    """Status compared without lastTransitionTime (it changes nothing a user acts on)."""
    out = []
    for e in parents or []:
        e = dict(e) if isinstance(e, dict) else e
        if isinstance(e, dict) and isinstance(e.get("conditions"), list):
            e["conditions"] = [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                               if isinstance(c, dict) else c for c in e["conditions"]]
        out.append(e)
    return out


def desired_parents(route: Mapping[str, Any], ours: list[ParentStatus], controller_name: str,
                    now: str | None = None) -> list[JSON]:
    """The route's ``status.parents`` with our entries set to ``ours`` (see module docstring).

    lastTransitionTime is kept when a condition's status did not change.
    """
    now = now or _now()
    ns = str((route.get("metadata") or {}).get("namespace") or "default")
    live = [e for e in ((route.get("status") or {}).get("parents") or []) if isinstance(e, dict)]
    want: dict[tuple[Any, ...], ParentStatus] = {}
    for ps in ours:
        want.setdefault(parent_key(ps.parent), ps)  # first record per parent wins

    def entry(ps: ParentStatus, old: Mapping[str, Any] | None) -> JSON:
        old_conds = {c.get("type"): c for c in (old or {}).get("conditions") or []
                     if isinstance(c, dict)}
        conds = []
        for c in ps.conditions:
            prev = old_conds.get(c.type)
            keep = prev is not None and prev.get("status") == c.status and prev.get("lastTransitionTime")
            conds.append({"type": c.type, "status": c.status, "reason": c.reason,
                          "message": c.message[:32768], "observedGeneration": ps.generation,
                          "lastTransitionTime": prev["lastTransitionTime"] if keep and prev else now})
        return {"parentRef": echo_ref(route, ps.parent), "controllerName": controller_name,
                "conditions": conds}

    out: list[JSON] = []
    done: set[tuple[Any, ...]] = set()
    for e in live:
        if e.get("controllerName") != controller_name:
            out.append(copy.deepcopy(e))
            continue
        key = ref_key(e.get("parentRef") or {}, ns)
        if key is None or key not in want or key in done:
            continue  # no longer ours (or a duplicate): drop our stale entry
        done.add(key)
        out.append(entry(want[key], e))
    for key, ps in want.items():
        if key not in done:
            if len(out) >= MAX_PARENTS:
                log.warning("%s %s/%s: status.parents full (%d), %s not reported", ps.route_kind,
                            ps.ns, ps.name, MAX_PARENTS, ps.parent.key)
                break
            out.append(entry(ps, None))
    return out


def has_ours(route: Mapping[str, Any], controller_name: str) -> bool:
    parents = (route.get("status") or {}).get("parents") or []
    return any(isinstance(e, dict) and e.get("controllerName") == controller_name for e in parents)


class StatusWriter:
    """Our entries in HTTPRoute/GRPCRoute ``status.parents`` (see module docstring)."""

    def __init__(self, api: client.ApiClient, controller_name: str = DEFAULT_CONTROLLER_NAME,
                 lease: Leader | None = None, *, timeout: float = 5.0, attempts: int = 5) -> None:
        self.custom = CustomObjects(api)  # raw JSON in and out
        self.controller_name = controller_name
        self.lease: Leader = lease or AlwaysLeader()
        self.timeout = timeout
        self.attempts = attempts
        self._live: dict[RouteKey, JSON] = {}
        self._adopted = False
        self.writes = 0
        self.conflicts = 0

    # -- API -------------------------------------------------------------------------------
    def _opts(self) -> dict[str, Any]:
        return raw_options(self.timeout)

    @staticmethod
    def _json(resp: Any) -> JSON:
        data: JSON = json.loads(resp.data) if resp.data else {}
        return data

    def adopt(self) -> int:
        """List every route once: the cache, and the routes carrying our (maybe stale) entries."""
        live: dict[RouteKey, JSON] = {}
        for kind, plural in PLURALS.items():
            resp = self.custom.list_custom_object_for_all_namespaces(
                GATEWAY_GROUP, VERSION, plural, **self._opts())
            for item in self._json(resp).get("items") or []:
                meta = item.get("metadata") or {}
                item.setdefault("apiVersion", f"{GATEWAY_GROUP}/{VERSION}")
                item.setdefault("kind", kind)
                live[(kind, str(meta.get("namespace") or "default"), str(meta.get("name")))] = item
        self._live = live
        self._adopted = True
        return len(live)

    def resync(self) -> None:
        """Forget the cache: the next pass relists (repairs entries others edited)."""
        self._adopted = False

    def _get(self, key: RouteKey) -> JSON | None:
        kind, ns, name = key
        try:
            resp = self.custom.get_namespaced_custom_object(
                GATEWAY_GROUP, VERSION, ns, PLURALS[kind], name, **self._opts())
        except ApiException as e:
            if e.status == 404:
                self._live.pop(key, None)
                return None
            raise
        obj = self._json(resp)
        self._live[key] = obj
        return obj

    # -- reconcile -------------------------------------------------------------------------
    def sync(self, statuses: list[ParentStatus]) -> int:
        """Converge every touched route on ``statuses``; returns writes sent (0 if not leader).

        Touched: routes named in ``statuses`` and routes still carrying our entries. Raises
        StatusWriteError after trying every route if any failed.
        """
        if not self.lease.is_leader():
            self._adopted = False  # whoever led meanwhile wrote: start from the API again
            return 0
        if not self._adopted:
            self.adopt()
        by_route: dict[RouteKey, list[ParentStatus]] = {}
        for ps in statuses:
            if ps.route_kind in PLURALS:
                by_route.setdefault(ps.route_key, []).append(ps)
        keys = set(by_route) | {k for k, o in self._live.items() if has_ours(o, self.controller_name)}
        sent, failed = 0, []
        for key in sorted(keys):
            if not self.lease.is_leader():
                break  # lost the lease mid-pass: the new leader owns the rest
            try:
                sent += self._reconcile(key, by_route.get(key, []))
            except Exception as e:  # noqa: BLE001 - keep going, retry the pass
                failed.append(f"{key[0]} {key[1]}/{key[2]}: {_why(e)}")
        self.writes += sent
        if failed:
            raise StatusWriteError("; ".join(failed))
        return sent

    def _reconcile(self, key: RouteKey, ours: list[ParentStatus]) -> int:
        kind, ns, name = key
        live = self._live.get(key) or self._get(key)
        sent = 0
        for _ in range(self.attempts):
            if live is None:
                return sent  # the route is gone: nothing to report on
            parents = desired_parents(live, ours, self.controller_name)
            current = (live.get("status") or {}).get("parents") or []
            if _strip_times(parents) == _strip_times(current):
                return sent
            body = copy.deepcopy(live)
            body.setdefault("apiVersion", f"{GATEWAY_GROUP}/{VERSION}")
            body.setdefault("kind", kind)
            body["status"] = {**(live.get("status") or {}), "parents": parents}
            sent += 1
            try:
                resp = self.custom.replace_namespaced_custom_object_status(
                    GATEWAY_GROUP, VERSION, ns, PLURALS[kind], name, body, **self._opts())
            except ApiException as e:
                if e.status == 409:  # changed since we read it: re-read, merge again
                    self.conflicts += 1
                    live = self._get(key)
                    continue
                if e.status == 404:
                    self._live.pop(key, None)
                    return sent
                raise
            self._live[key] = self._json(resp)
            log.debug("%s %s/%s status written (%d parents)", kind, ns, name, len(parents))
            return sent
        raise StatusWriteError(f"{kind} {ns}/{name}: still conflicting after {self.attempts} tries")


def _why(e: Exception) -> str:
    if isinstance(e, ApiException):
        return f"HTTP {e.status} {e.reason}"
    return f"{type(e).__name__}: {e}"


class _Publisher(Protocol):
    def sync(self) -> object: ...


class StatusLoop(DebouncedLoop):
    """Background pass: ``mark_dirty()`` on model change → one debounced ``sync`` per burst.

    Also runs when this agent becomes leader (the previous leader may have left work) and
    every ``resync_s`` (relist: repairs entries someone else edited).
    """

    thread_name = "gamma-status"
    what = "route status pass"

    def __init__(self, compute: Callable[[], list[ParentStatus]], writer: StatusWriter,
                 interval: float = 0.5, *, resync_s: float = 300.0, leader_poll: float = 1.0,
                 max_backoff: float = 30.0, xmesh: _Publisher | None = None) -> None:
        super().__init__(interval, resync_s, max_backoff, poll=leader_poll)
        self.compute = compute
        self.writer = writer
        self.leader_poll = leader_poll
        self.xmesh = xmesh
        self._leading = False

    def start(self, synced: Callable[[float], bool] | None = None) -> None:
        """Start; the first pass waits for ``synced`` (a half-filled store would look like
        routes and Services vanished and write NoMatchingParent everywhere)."""
        super().start(synced)

    def on_resync(self) -> None:
        self.writer.resync()

    def should_pass(self, fired: bool, resynced: bool) -> bool:
        leading = self.writer.lease.is_leader()
        became = leading and not self._leading
        self._leading = leading
        if not leading:
            self._dirty.clear()  # the leader does the work; becoming leader triggers a pass
            return False
        return fired or became or resynced

    def pass_once(self) -> None:
        """One compute + sync (+ XMesh)."""
        self.writer.sync(self.compute())
        if self.xmesh is not None:
            self.xmesh.sync()

    def describe_error(self, e: Exception) -> str:
        return str(e) if isinstance(e, StatusWriteError) else _why(e)

    def stop(self, timeout: float = 5.0) -> None:
        self.stop_loop(timeout)

    def status(self) -> dict[str, Any]:
        return {"leader": self.writer.lease.is_leader(), "passes": self.passes,
                "writes": self.writer.writes, "conflicts": self.writer.conflicts,
                "failures": self.failures, "last_error": self.last_error}
