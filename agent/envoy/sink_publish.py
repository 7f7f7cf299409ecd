"""The shared publish of the node Envoy's sink: the node state handed to the xDS server,
concurrent ADDs sharing one publish, and the wait for Envoy's ACK of it.

Split from ``agent.envoy.sink`` (a mixin of ``EnvoySink``, whose ``__init__`` sets the
state declared here) so the publish path, the one every ADD, DEL and mesh change takes,
reads on its own, apart from the Envoy process and the per-pod bookkeeping.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agent.common.config import NodeConfig
from agent.envoy.resources import NodeXdsState, PodListener, Resilience
from agent.envoy.xds import XdsServer
from agent.identity.manager import IdentityManager
from agent.scope.route_tables import GammaResult

log = logging.getLogger("aether.envoy")

# How long a shared listener publish holds the next one while it waits for Envoy's answer
PIPELINE_WAIT_S = 1.0


class ListenerNotConfirmed(Exception):
    pass


class SharedPublish:
    """``EnvoySink``'s publishes: ``_publish`` builds and pushes, ``_publish_shared`` lets
    concurrent ADDs ride one push, ``_confirm`` waits for the ACK."""

    # set by EnvoySink.__init__
    node: NodeConfig
    xds: XdsServer
    ack_timeout: float
    access_log: bool
    traffic_metrics: bool
    resilience: Resilience
    identity: IdentityManager | None
    metrics: Any
    shared_publishes: int
    _lock: threading.Lock
    _stopping: threading.Event
    _pods: dict[str, PodListener]
    _scoped: set[str]  # the scoped pods (EnvoySink)
    _rejected: dict[str, str]
    _services: tuple[Any, ...]
    _gamma: GammaResult | None
    _learnable: tuple[tuple[str, int], ...] | None
    _batch: threading.Condition
    _ticket: int
    _covered: int
    _covered_version: str
    _covered_at: float
    _batch_busy: bool
    _incoming: dict[str, PodListener]
    # from the other parts of EnvoySink
    _current_authz: Callable[[str, PodListener], PodListener]
    if TYPE_CHECKING:
        @property
        def pid(self) -> int | None: ...

    def _renewer(self) -> None:
        """Renew SVIDs at half life (and retry failed ones); each change is pushed over SDS.
        Envoy uses a rotated certificate for new handshakes; open connections keep going."""
        assert self.identity is not None
        while not self._stopping.wait(min(5.0, max(0.05, self.identity.next_due()))):
            try:
                if self.identity.renew_due():
                    with self._lock:
                        self._publish()
            except Exception:  # noqa: BLE001 - the renewer must outlive one bad round
                log.exception("SVID renewal failed")

    def _publish(self) -> str:
        state = NodeXdsState(pods=tuple(self._pods.values()),
                             capture_port=self.node.capture_port,
                             passthrough_mark=self.node.passthrough_mark,
                             services=self._services, gamma=self._gamma,
                             connection_log=self.access_log, learn_targets=self._learnable,
                             mesh_tls=self.identity.mesh_tls() if self.identity else None,
                             resilience=self.resilience,
                             traffic_metrics=self.traffic_metrics,
                             mesh_port=self.node.mesh_port if self._scoped else None)
        return self.xds.set_state(state)

    def _publish_shared(self, container_id: str, listener: PodListener,
                        deadline: float | None = None) -> tuple[str, float]:
        """Add ``listener`` and publish; returns a version that includes it and when that
        version was pushed (monotonic). Concurrent ADDs
        share publishes: while one builds and pushes, the listeners of the others gather in
        ``_incoming`` (no wait on the publish lock), and the next publish carries them all.
        So 16 pods starting at once cost Envoy a few LDS updates, each binding several
        listeners, instead of 16 in a row with every ADD waiting on the ACKs of all before
        it. Nothing waits for a batch to fill: a lone ADD publishes at once. ``deadline``
        (monotonic): the ADD's own; no wait here outlasts it."""
        with self._batch:
            self._incoming[container_id] = listener
            self._ticket += 1
            mine = self._ticket
            while True:
                if self._covered >= mine:
                    self.shared_publishes += 1
                    return self._covered_version, self._covered_at
                if not self._batch_busy:
                    self._batch_busy = True
                    incoming, self._incoming = self._incoming, {}
                    covers = self._ticket
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self._incoming.pop(container_id, None)
                    raise ListenerNotConfirmed(
                        f"the listener of container {container_id} was not pushed to Envoy "
                        f"within {self.ack_timeout:.0f}s (a push before it got no answer)")
                self._batch.wait(left)
        version, pushed = "", 0.0
        try:
            with self._lock:
                for cid, lis in incoming.items():
                    self._rejected.pop(cid, None)
                    self._pods[cid] = self._current_authz(cid, lis)
                version = self._publish()
            pushed = time.monotonic()
            self._await_envoy(version, deadline)
        finally:
            with self._batch:
                self._batch_busy = False
                if version:  # on failure the listeners stay in _pods; a waiter publishes
                    self._covered, self._covered_version = covers, version
                    self._covered_at = pushed
                self._batch.notify_all()
        return version, pushed

    def _await_envoy(self, version: str, until: float | None = None) -> None:
        """Hold the next shared publish until Envoy answered this one (ACK or NACK), for at
        most ``PIPELINE_WAIT_S``: the ADDs arriving meanwhile gather into one push instead of
        each pushing its own. Envoy applies LDS updates one after another anyway, so under 16
        concurrent ADDs this is fewer builds, pushes and ACKs for the same wait, and a lone
        ADD loses nothing (it waits for this very ACK in ``_confirm``). A slow or NACKing
        Envoy holds the batch no longer than the cap (nor than ``until``, the leading
        ADD's own deadline), and with no Envoy connected there is nothing to wait for; nor
        while the xDS server is held (a take-over restoring its pods into an Envoy that gets
        nothing before the Services: at 110 pods the wait cost a minute, 1 s a pod)."""
        deadline = time.monotonic() + PIPELINE_WAIT_S
        if until is not None:
            deadline = min(deadline, until)
        if self.xds.held or not self.xds.status().get("connected_streams"):
            return
        while time.monotonic() < deadline:
            if self.xds.wait_acked(version, min(0.05, max(0.0, deadline - time.monotonic()))):
                return
            nack = self.xds.status().get("last_nack")
            if nack and int(str(nack.get("version") or -1)) >= int(version):
                return

    def _confirm(self, version: str, what: str, pod_id: str | None = None,
                 started: float | None = None, pushed: float | None = None) -> None:
        """Wait for Envoy's ACK of ``version``, ``ack_timeout`` from ``started`` (now by
        default; an ADD counts from its own start, its wait in a shared publish included);
        ``pushed``: when that version went out (the push-to-ACK histogram's start).
        With ``pod_id``: a later version may be ACKed only because that pod's listener was
        withdrawn after a NACK (``_on_nack``); that is a rejection, never a confirmation."""
        now = time.monotonic()
        published = now if pushed is None else pushed
        deadline = (now if started is None else started) + self.ack_timeout
        while True:
            acked = self.xds.wait_acked(version, min(0.2, max(0.0, deadline - time.monotonic())))
            if pod_id is not None:
                with self._lock:
                    reason = self._rejected.get(pod_id)
                if reason is not None:
                    raise ListenerNotConfirmed(f"Envoy rejected {what}: {reason}")
            if acked:
                if self.metrics is not None:
                    self.metrics.observe_xds_push(time.monotonic() - published)
                return
            nack = self.xds.status().get("last_nack")
            if nack and str(nack.get("version")) == version:
                raise ListenerNotConfirmed(f"Envoy rejected {what}: {nack.get('error_detail')}")
            if time.monotonic() >= deadline:
                raise ListenerNotConfirmed(
                    f"Envoy did not ACK {what} within {self.ack_timeout:.0f}s "
                    f"(envoy pid {self.pid or 'none'}, xDS streams "
                    f"{self.xds.status().get('connected_streams')})")

    def wait_acked(self, version: str, timeout: float) -> bool:
        """True once Envoy has ACKed ``version`` (a publish's), within ``timeout`` s."""
        return bool(self.xds.wait_acked(version, timeout))

    def set_services(self, views: list[Any], gamma: GammaResult | None = None,
                     learnable: tuple[tuple[str, int], ...] | None = None) -> str:
        """The in-scope Services or their GAMMA tables changed: rebuild chains, clusters, EDS.
        ``learnable``: the (ClusterIP, port) pairs whose passthrough connections Envoy reports
        for dependency learning (None: all of them).
        Not awaited: a pod's ADD waits for its own listener, not for the mesh config."""
        with self._lock:
            self._services = tuple(views)  # the builder compares views by identity
            self._gamma = gamma
            self._learnable = learnable
            version = self._publish()
        self.xds.release()  # a no-op unless an adopted Envoy is still held
        return version
