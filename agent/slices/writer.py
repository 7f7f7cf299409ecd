"""Write the projected EndpointSlices: adopt what exists, send only changes, never crash.

``SliceWriter`` owns this node's slices (found by label, so a restarted agent adopts its
slices instead of duplicating them) and keeps the last state the API returned, so an
unchanged projection costs no request. ``SliceProjector`` is the background loop: model
changes only mark it dirty, and one debounced pass per burst recomputes and writes, so a
relist of 10k objects is one write per changed slice. Failures back off and retry; slices
are removed only when the node leaves for good (a restart keeps serving non-mesh traffic).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, Protocol

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from tenacity import RetryCallState, RetryError, Retrying, stop_after_attempt, wait_fixed

from agent.loops import DebouncedLoop
from agent.scope.model import ServiceView
from agent.slices.project import (
    JSON,
    SliceKey,
    desired_slices,
    exposed,
    local_pods,
    owned_selector,
    skip_reason,
)

log = logging.getLogger("aether.slices")

Desired = dict[SliceKey, JSON]
_COMPARED = ("addressType", "endpoints", "ports")


class SliceWriteError(Exception):
    """Some writes failed this pass; the rest went through and the pass is retried."""


def _empty(v: Any) -> bool:
    return v is None or v == "" or v == [] or v == {}


def _covers(live: Any, want: Any) -> bool:
    """``live`` has everything ``want`` says (server-side additions and defaults ignored)."""
    if isinstance(want, dict):
        if not isinstance(live, dict):
            return not want
        return all(_covers(live.get(k), v) if not _empty(v) else _empty(live.get(k))
                   for k, v in want.items())
    if isinstance(want, list):
        live = live or []
        return isinstance(live, list) and len(live) == len(want) and all(
            _covers(a, b) for a, b in zip(live, want, strict=True))
    return bool(live == want)


def unchanged(live: JSON, want: JSON) -> bool:
    """Would writing ``want`` over ``live`` change anything we own?"""
    lm, wm = live.get("metadata") or {}, want.get("metadata") or {}
    return (_covers(lm.get("labels") or {}, wm.get("labels") or {})
            and _covers(lm.get("ownerReferences") or [], wm.get("ownerReferences") or [])
            and all(_covers(live.get(k), want.get(k)) for k in _COMPARED))


class SliceWriter:
    """This node's EndpointSlices: list once (adoption), then create/replace/delete on diff."""

    def __init__(self, api: client.ApiClient, node_name: str, timeout: float = 5.0) -> None:
        self.discovery: Any = client.DiscoveryV1Api(api)  # raw JSON in and out (no model classes)
        self.node_name = node_name
        self.selector = owned_selector(node_name)
        self.timeout = timeout
        self._live: dict[SliceKey, JSON] = {}
        self._adopted = False
        self.writes = 0
        self.adopted_count = 0

    # -- API ---------------------------------------------------------------------------------
    def _json(self, resp: Any) -> JSON:
        data: JSON = json.loads(resp.data) if resp.data else {}
        return data

    def _opts(self) -> dict[str, Any]:
        return {"_preload_content": False, "_request_timeout": (self.timeout, self.timeout)}

    def adopt(self) -> int:
        """List the slices this node already owns (a restart adopts, never duplicates)."""
        resp = self.discovery.list_endpoint_slice_for_all_namespaces(
            label_selector=self.selector, **self._opts())
        items = self._json(resp).get("items") or []
        self._live = {(str(o["metadata"].get("namespace") or ""), str(o["metadata"]["name"])): o
                      for o in items if isinstance(o, dict) and o.get("metadata")}
        self._adopted = True
        self.adopted_count = len(self._live)
        return len(self._live)

    def resync(self) -> None:
        """Forget the cache: the next pass relists (repairs slices others edited or deleted)."""
        self._adopted = False

    @property
    def owned(self) -> list[SliceKey]:
        return sorted(self._live)

    # -- reconcile ---------------------------------------------------------------------------
    def reconcile(self, desired: Desired) -> int:
        """Converge our slices on ``desired``; returns the writes sent. Raises SliceWriteError
        (after trying everything) if any failed, so the caller retries with backoff."""
        if not self._adopted:
            self.adopt()
        sent, failed = 0, []
        for key in sorted(desired):
            want, live = desired[key], self._live.get(key)
            if live is not None and unchanged(live, want):
                continue
            try:
                sent += 1
                self._write(key, want, live)
            except Exception as e:  # noqa: BLE001 - any failure: keep going, retry the pass
                failed.append(f"{key[0]}/{key[1]}: {_why(e)}")
        for key in sorted(set(self._live) - set(desired)):
            try:
                sent += 1
                self._delete(key)
            except Exception as e:  # noqa: BLE001
                failed.append(f"delete {key[0]}/{key[1]}: {_why(e)}")
        self.writes += sent
        if failed:
            raise SliceWriteError("; ".join(failed))
        return sent

    def _write(self, key: SliceKey, want: JSON, live: JSON | None) -> None:
        ns, name = key
        if live is None:
            try:
                resp = self.discovery.create_namespaced_endpoint_slice(ns, want, **self._opts())
            except ApiException as e:
                if e.status == 409:  # exists but we did not know it: adopt it, replace next pass
                    self._live[key] = self._json(self.discovery.read_namespaced_endpoint_slice(
                        name, ns, **self._opts()))
                raise
            self._live[key] = self._json(resp)
            log.info("EndpointSlice %s/%s created", ns, name)
            return
        body = dict(want)
        body["metadata"] = {**want["metadata"],
                            "resourceVersion": (live.get("metadata") or {}).get("resourceVersion")}
        try:
            resp = self.discovery.replace_namespaced_endpoint_slice(name, ns, body, **self._opts())
        except ApiException as e:
            if e.status in (404, 409):  # deleted or changed behind our back: re-learn it
                self._live.pop(key, None)
                if e.status == 409:
                    self._live[key] = self._json(self.discovery.read_namespaced_endpoint_slice(
                        name, ns, **self._opts()))
            raise
        self._live[key] = self._json(resp)
        log.debug("EndpointSlice %s/%s updated", ns, name)

    def _delete(self, key: SliceKey) -> None:
        ns, name = key
        try:
            resp = self.discovery.delete_namespaced_endpoint_slice(name, ns, **self._opts())
            resp.release_conn()
        except ApiException as e:
            if e.status != 404:
                raise
        self._live.pop(key, None)
        log.info("EndpointSlice %s/%s deleted", ns, name)


def _why(e: Exception) -> str:
    if isinstance(e, ApiException):
        return f"HTTP {e.status} {e.reason}"
    return f"{type(e).__name__}: {e}"


class _Objects(Protocol):
    def of_kind(self, kind: str) -> list[JSON]: ...


class _Model(Protocol):
    def view(self, service_key: str) -> ServiceView | None: ...


def mesh_desired(objects: _Objects, model: _Model, node_name: str,
                 skipped: dict[str, str] | None = None) -> Desired:
    """The node's desired slices from the mesh: opted-in Services × their local registered
    endpoints. ``skipped`` (if given) is filled with opted-in Services refused, and why."""
    items = []
    for svc in objects.of_kind("Service"):
        if not exposed(svc):
            continue
        meta = svc.get("metadata") or {}
        key = f"{meta.get('namespace') or 'default'}/{meta.get('name') or ''}"
        reason = skip_reason(svc)
        if reason is not None:
            if skipped is not None:
                skipped[key] = reason
            continue
        items.append((svc, local_pods(model.view(key))))
    return desired_slices(node_name, items)


class SliceProjector(DebouncedLoop):
    """Background loop: mark_dirty() on model change → one debounced reconcile per burst."""

    thread_name = "slice-projector"
    what = "EndpointSlice projection"

    def __init__(self, compute: Callable[[], Desired], writer: SliceWriter, *,
                 interval: float = 0.5, resync_s: float = 300.0, max_backoff: float = 30.0) -> None:
        super().__init__(interval, resync_s, max_backoff)
        self.compute = compute
        self.writer = writer
        self.skipped: dict[str, str] = {}  # opted-in Services refused → why (status)

    @classmethod
    def for_mesh(cls, objects: _Objects, model: _Model, writer: SliceWriter,
                 **kw: Any) -> SliceProjector:
        """A projector fed by a MeshRuntime's ObjectStore and MeshModel."""
        skipped: dict[str, str] = {}
        warned: dict[str, str] = {}

        def compute() -> Desired:
            skipped.clear()
            out = mesh_desired(objects, model, writer.node_name, skipped)
            for key, why in skipped.items():
                if warned.get(key) != why:
                    log.warning("%s=true on Service %s ignored: %s",
                                "aether.io/expose-endpoints", key, why)
            warned.clear()
            warned.update(skipped)
            return out

        proj = cls(compute, writer, **kw)
        proj.skipped = skipped
        return proj

    def start(self, synced: Callable[[float], bool] | None = None) -> None:
        """Start the loop; the first pass waits for ``synced`` (the source's initial LIST):
        a half-filled store would look like endpoints vanished and delete live slices."""
        super().start(synced)

    def on_resync(self) -> None:
        self.writer.resync()

    def pass_once(self) -> None:
        """One recompute + reconcile."""
        self.writer.reconcile(self.compute())

    def describe_error(self, e: Exception) -> str:
        return str(e) if isinstance(e, SliceWriteError) else _why(e)

    def stop(self, node_leaving: bool = False, timeout: float = 5.0, attempts: int = 3) -> None:
        """Stop the loop; ``node_leaving`` (the agent going for good) deletes our slices."""
        self.stop_loop(timeout)
        if not node_leaving:
            return  # a restart: the slices keep serving and the next agent adopts them
        def failed(state: RetryCallState) -> None:
            e = state.outcome.exception() if state.outcome is not None else None
            last = state.attempt_number >= attempts
            log.warning("removing EndpointSlices on exit failed (%s)%s",
                        _why(e) if isinstance(e, Exception) else e,
                        "; giving up" if last else "; retrying")
            if not last:
                self.writer.resync()  # re-read what is there before the next try

        try:
            for attempt in Retrying(stop=stop_after_attempt(attempts),
                                    wait=wait_fixed(min(1.0, self.interval)),
                                    after=failed):
                with attempt:
                    self.writer.reconcile({})
        except RetryError:
            return
        log.info("node leaving: this node's EndpointSlices removed")

    def status(self) -> dict[str, Any]:
        return {"owned": [f"{ns}/{n}" for ns, n in self.writer.owned],
                "adopted_at_start": self.writer.adopted_count, "writes": self.writer.writes,
                "passes": self.passes, "failures": self.failures, "last_error": self.last_error,
                "refused": dict(self.skipped)}
