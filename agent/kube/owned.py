"""Objects this node's agent owns in the API: adopt what exists, send only changes, never crash.

Two kinds of object are written per node: projected EndpointSlices (``agent.slices``) and
MeshPod records (``agent.meshpods``). Both follow one protocol, kept here: the node's objects
are found by label (a restarted agent adopts them instead of duplicating them), the last
state the API returned is kept so an unchanged desired state costs no request, a pass tries
every write and then raises if any failed (the loop retries with backoff), and the objects
are removed only when the node leaves for good (a restart keeps them serving).
``OwnedApi`` is the per-kind edge (which client method writes which resource).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, Protocol

from kubernetes.client.exceptions import ApiException
from tenacity import RetryCallState, RetryError, Retrying, stop_after_attempt, wait_fixed

from agent.kube.client import raw_options
from agent.runtime.loops import DebouncedLoop

log = logging.getLogger("aether.kube.owned")

JSON = dict[str, Any]
ObjKey = tuple[str, str]  # (namespace, name)
Desired = dict[ObjKey, JSON]


class ObjectSource(Protocol):
    """What a writer's desired state is computed from (the mesh's ObjectStore)."""

    def of_kind(self, kind: str) -> list[JSON]: ...


class WriteError(Exception):
    """Some writes failed this pass; the rest went through and the pass is retried."""


class OwnedApi(Protocol):
    """How one kind is listed and written (raw JSON in and out, no model classes)."""

    kind: str

    def list_owned(self, selector: str) -> list[JSON]: ...
    def create(self, ns: str, body: JSON) -> JSON: ...
    def read(self, ns: str, name: str) -> JSON: ...
    def replace(self, ns: str, name: str, body: JSON) -> JSON: ...
    def delete(self, ns: str, name: str, uid: str) -> None:
        """Delete that very object (``uid`` as a precondition: 409 if it is another now)."""
        ...


class RawApi:
    """Base of the ``OwnedApi`` edges: raw JSON (``_preload_content=False``), one timeout."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout

    def opts(self) -> dict[str, Any]:
        return raw_options(self.timeout)

    @staticmethod
    def only(uid: str) -> dict[str, Any]:
        """DeleteOptions that delete only the object with this uid (any, when empty)."""
        return {"preconditions": {"uid": uid}} if uid else {}


def raw_json(resp: Any) -> JSON:
    """The body of a ``_preload_content=False`` answer."""
    data: JSON = json.loads(resp.data) if resp.data else {}
    return data


def _empty(v: Any) -> bool:
    return v is None or v == "" or v == [] or v == {}


def covers(live: Any, want: Any) -> bool:
    """``live`` has everything ``want`` says (server-side additions and defaults ignored)."""
    if isinstance(want, dict):
        if not isinstance(live, dict):
            return not want
        return all(covers(live.get(k), v) if not _empty(v) else _empty(live.get(k))
                   for k, v in want.items())
    if isinstance(want, list):
        live = live or []
        return isinstance(live, list) and len(live) == len(want) and all(
            covers(a, b) for a, b in zip(live, want, strict=True))
    return bool(live == want)


def unchanged(live: JSON, want: JSON, compared: tuple[str, ...]) -> bool:
    """Would writing ``want`` over ``live`` change anything we own (labels, owners and the
    ``compared`` top-level fields)?"""
    lm, wm = live.get("metadata") or {}, want.get("metadata") or {}
    return (covers(lm.get("labels") or {}, wm.get("labels") or {})
            and covers(lm.get("ownerReferences") or [], wm.get("ownerReferences") or [])
            and all(covers(live.get(k), want.get(k)) for k in compared))


def describe(e: BaseException) -> str:
    if isinstance(e, ApiException):
        return f"HTTP {e.status} {e.reason}"
    return f"{type(e).__name__}: {e}"


class OwnedWriter:
    """This node's objects of one kind: list once (adoption), then create/replace/delete on
    diff against the desired state."""

    def __init__(self, api: OwnedApi, selector: str, compared: tuple[str, ...]) -> None:
        self.api = api
        self.selector = selector
        self.compared = compared
        self._live: dict[ObjKey, JSON] = {}
        self._adopted = False
        self.writes = 0
        self.adopted_count = 0

    def adopt(self) -> int:
        """List the objects this node already owns (a restart adopts, never duplicates)."""
        items = self.api.list_owned(self.selector)
        self._live = {(str(o["metadata"].get("namespace") or ""), str(o["metadata"]["name"])): o
                      for o in items if isinstance(o, dict) and o.get("metadata")}
        self._adopted = True
        self.adopted_count = len(self._live)
        return len(self._live)

    def resync(self) -> None:
        """Forget the cache: the next pass relists (repairs objects others edited or deleted)."""
        self._adopted = False

    @property
    def owned(self) -> list[ObjKey]:
        return sorted(self._live)

    def reconcile(self, desired: Desired) -> int:
        """Converge our objects on ``desired``; returns the writes sent. Raises WriteError
        (after trying everything) if any failed, so the caller retries with backoff."""
        if not self._adopted:
            self.adopt()
        sent, failed = 0, []
        for key in sorted(desired):
            want, live = desired[key], self._live.get(key)
            if live is not None and unchanged(live, want, self.compared):
                continue
            try:
                sent += 1
                self._write(key, want, live)
            except Exception as e:  # noqa: BLE001 - any failure: keep going, retry the pass
                failed.append(f"{key[0]}/{key[1]}: {describe(e)}")
        for key in sorted(set(self._live) - set(desired)):
            try:
                sent += 1
                self._delete(key)
            except Exception as e:  # noqa: BLE001
                failed.append(f"delete {key[0]}/{key[1]}: {describe(e)}")
        self.writes += sent
        if failed:
            raise WriteError("; ".join(failed))
        return sent

    def _write(self, key: ObjKey, want: JSON, live: JSON | None) -> None:
        ns, name = key
        kind = self.api.kind
        if live is None:
            try:
                self._live[key] = self.api.create(ns, want)
            except ApiException as e:
                if e.status == 409:  # exists but we did not know it: adopt it, replace next pass
                    self._live[key] = self.api.read(ns, name)
                raise
            log.info("%s %s/%s created", kind, ns, name)
            return
        body = dict(want)
        body["metadata"] = {**want["metadata"],
                            "resourceVersion": (live.get("metadata") or {}).get("resourceVersion")}
        try:
            self._live[key] = self.api.replace(ns, name, body)
        except ApiException as e:
            if e.status in (404, 409):  # deleted or changed behind our back: re-learn it
                self._live.pop(key, None)
                if e.status == 409:
                    self._live[key] = self.api.read(ns, name)
            raise
        log.debug("%s %s/%s updated", kind, ns, name)

    def _delete(self, key: ObjKey) -> None:
        """Delete the object we wrote, never a namesake: with its uid as a precondition, a
        409 means the name now holds someone else's object (another node's record for a
        pod that moved there), which is left alone and forgotten."""
        ns, name = key
        uid = str(((self._live.get(key) or {}).get("metadata") or {}).get("uid") or "")
        try:
            self.api.delete(ns, name, uid)
        except ApiException as e:
            if e.status == 409:
                self._live.pop(key, None)
                log.info("%s %s/%s is no longer ours (%s): left alone", self.api.kind, ns, name,
                         describe(e))
                return
            if e.status != 404:
                raise
        self._live.pop(key, None)
        log.info("%s %s/%s deleted", self.api.kind, ns, name)


class OwnedLoop(DebouncedLoop):
    """Background loop: mark_dirty() on model change → one debounced reconcile per burst."""

    objects = "objects"  # what the writer owns, for log lines

    def __init__(self, compute: Callable[[], Desired], writer: OwnedWriter, *,
                 interval: float = 0.5, resync_s: float = 300.0, max_backoff: float = 30.0) -> None:
        super().__init__(interval, resync_s, max_backoff)
        self.compute = compute
        self.writer = writer

    def start(self, synced: Callable[[float], bool] | None = None) -> None:
        """Start the loop; the first pass waits for ``synced`` (the source's initial LIST):
        a half-filled store would look like everything vanished and delete live objects."""
        super().start(synced)

    def on_resync(self) -> None:
        self.writer.resync()

    def pass_once(self) -> None:
        self.writer.reconcile(self.compute())

    def describe_error(self, e: Exception) -> str:
        return str(e) if isinstance(e, WriteError) else describe(e)

    def stop(self, node_leaving: bool = False, timeout: float = 5.0, attempts: int = 3) -> None:
        """Stop the loop; ``node_leaving`` (the agent going for good) deletes our objects."""
        self.stop_loop(timeout)
        if not node_leaving:
            return  # a restart: the objects stay and the next agent adopts them
        kind = self.objects

        def failed(state: RetryCallState) -> None:
            e = state.outcome.exception() if state.outcome is not None else None
            last = state.attempt_number >= attempts
            log.warning("removing %s on exit failed (%s)%s", kind,
                        describe(e) if isinstance(e, BaseException) else e,
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
        log.info("node leaving: this node's %s removed", kind)

    def status(self) -> dict[str, Any]:
        return {"owned": [f"{ns}/{n}" for ns, n in self.writer.owned],
                "adopted_at_start": self.writer.adopted_count, "writes": self.writer.writes,
                "passes": self.passes, "failures": self.failures, "last_error": self.last_error}
