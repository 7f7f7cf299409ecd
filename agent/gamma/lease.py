"""Leader election over a coordination.k8s.io Lease: one agent in the cluster writes status.

Every node runs an agent and every agent computes the same route status; if all wrote, the
API server would see N writers fighting over resourceVersions. The client-go algorithm,
reduced: expiry is judged by *local* time since the record last changed (no clock-skew
trust), writes use resourceVersion (optimistic concurrency), a leader that cannot renew
within ``renew_deadline`` (< lease duration) stops calling itself leader before anyone else
may take over, and a clean stop releases the lease so the successor need not wait.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from agent.kube.client import done, raw_options
from agent.kube.rest import CoordinationV1

log = logging.getLogger("aether.gamma.lease")

DEFAULT_NAMESPACE = "aether-system"
DEFAULT_NAME = "aether-gamma-status"


def micro_time(now: datetime | None = None) -> str:
    """metav1.MicroTime as the API server writes it."""
    return (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElector:
    """Acquire/renew one Lease in a background thread; ``is_leader()`` is the gate."""

    def __init__(
        self,
        api: client.ApiClient,
        identity: str,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        name: str = DEFAULT_NAME,
        lease_duration: float = 15.0,
        renew_interval: float = 5.0,
        retry_interval: float = 2.0,
        renew_deadline: float | None = None,
        timeout: float = 5.0,
        on_change: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.coord = CoordinationV1(api)
        self.identity = identity
        self.namespace, self.name = namespace, name
        self.lease_seconds = max(1, math.ceil(lease_duration))  # the API field is an int
        self.renew_interval = renew_interval
        self.retry_interval = retry_interval
        self.renew_deadline = renew_deadline if renew_deadline is not None else lease_duration * 2 / 3
        self.timeout = timeout
        self.on_change = on_change
        self.clock = clock
        self._lock = threading.Lock()
        self._observed: tuple[Any, ...] | None = None  # (holder, renewTime, duration) last seen
        self._observed_at = 0.0
        self._renewed_at: float | None = None  # local time of our last successful write
        self._live: dict[str, Any] | None = None
        self._was_leader = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.transitions = 0
        self.last_error: str | None = None

    # -- API -------------------------------------------------------------------------------
    def _opts(self) -> dict[str, Any]:
        return raw_options(self.timeout)

    def _read(self) -> dict[str, Any] | None:
        try:
            resp = self.coord.read_namespaced_lease(self.name, self.namespace, **self._opts())
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        data: dict[str, Any] = json.loads(resp.data)
        return data

    def _spec(self, acquire: str, transitions: int) -> dict[str, Any]:
        return {"holderIdentity": self.identity, "leaseDurationSeconds": self.lease_seconds,
                "acquireTime": acquire, "renewTime": micro_time(), "leaseTransitions": transitions}

    # -- one step --------------------------------------------------------------------------
    def try_acquire_or_renew(self) -> bool:
        """One election round: create, renew, or take over an expired lease. True if leader."""
        try:
            ok = self._round()
            self.last_error = None
        except ApiException as e:
            self.last_error = f"HTTP {e.status} {e.reason}"
            ok = False
        except Exception as e:  # noqa: BLE001 - network errors must not end the loop
            self.last_error = f"{type(e).__name__}: {e}"
            ok = False
        if not ok and self.last_error:
            log.debug("lease %s/%s: %s", self.namespace, self.name, self.last_error)
        self._notify()
        return self.is_leader()

    def _round(self) -> bool:
        now = self.clock()
        live = self._read()
        if live is None:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": self._spec(micro_time(), 0)}
            try:
                resp = self.coord.create_namespaced_lease(self.namespace, body, **self._opts())
            except ApiException as e:
                if e.status == 409:  # another agent created it first
                    return False
                raise
            return self._won(json.loads(resp.data), now)
        spec = live.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = (holder, spec.get("renewTime"), spec.get("leaseDurationSeconds"))
        if record != self._observed:
            self._observed, self._observed_at = record, now
        duration = float(spec.get("leaseDurationSeconds") or self.lease_seconds)
        if holder and holder != self.identity and now < self._observed_at + duration:
            with self._lock:
                self._renewed_at = None  # someone else holds a live lease
            return False
        transitions = int(spec.get("leaseTransitions") or 0)
        if holder == self.identity:
            new_spec = self._spec(spec.get("acquireTime") or micro_time(), transitions)
        else:
            new_spec = self._spec(micro_time(), transitions + 1)  # a change of holder, as client-go counts
        body = dict(live)
        body["spec"] = new_spec  # live metadata carries the resourceVersion: a stale write 409s
        try:
            resp = self.coord.replace_namespaced_lease(self.name, self.namespace, body, **self._opts())
        except ApiException as e:
            if e.status == 409:
                return False
            raise
        if holder != self.identity:
            log.info("lease %s/%s acquired by %s (was %s)", self.namespace, self.name,
                     self.identity, holder or "free")
        return self._won(json.loads(resp.data), now)

    def _won(self, obj: dict[str, Any], now: float) -> bool:
        spec = obj.get("spec") or {}
        with self._lock:
            self._live = obj
            self._renewed_at = now
            self._observed = (spec.get("holderIdentity") or "", spec.get("renewTime"),
                              spec.get("leaseDurationSeconds"))
            self._observed_at = now
        return True

    def is_leader(self) -> bool:
        """Held by us and renewed recently enough that nobody else can have taken over."""
        with self._lock:
            return self._renewed_at is not None and self.clock() - self._renewed_at < self.renew_deadline

    def holder(self) -> str:
        """The holder we last saw ("" if free or unknown)."""
        with self._lock:
            return str(self._observed[0]) if self._observed else ""

    def _notify(self) -> None:
        leader = self.is_leader()
        if leader == self._was_leader:
            return
        self._was_leader = leader
        if leader:
            self.transitions += 1
        log.info("%s %s leadership of lease %s/%s", self.identity,
                 "gained" if leader else "lost", self.namespace, self.name)
        if self.on_change is not None:
            try:
                self.on_change(leader)
            except Exception:  # noqa: BLE001 - a callback must not stop the election
                log.exception("leadership callback failed")

    # -- loop ------------------------------------------------------------------------------
    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gamma-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            leader = self.try_acquire_or_renew()
            if self._stop.wait(self.renew_interval if leader else self.retry_interval):
                return

    def stop(self, release: bool = True) -> None:
        """Stop the loop; with ``release`` a held lease is handed back (successor: no wait)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout + 1)
            self._thread = None
        was_leader = self.is_leader()
        with self._lock:
            self._renewed_at = None
            live = self._live
        if release and was_leader and live is not None:
            self._release(live)
        self._notify()

    def _release(self, live: dict[str, Any]) -> None:
        body = dict(live)
        spec = dict(live.get("spec") or {})
        spec.update({"holderIdentity": None, "renewTime": micro_time()})
        body["spec"] = {k: v for k, v in spec.items() if v is not None}
        try:
            done(self.coord.replace_namespaced_lease(self.name, self.namespace, body, **self._opts()))
            log.info("lease %s/%s released by %s", self.namespace, self.name, self.identity)
        except Exception as e:  # noqa: BLE001 - the lease then simply expires
            log.warning("lease %s/%s not released (%s): it expires in %ss", self.namespace,
                        self.name, e, self.lease_seconds)
