"""Listener-state tracking of the node Envoy's sink: what Envoy made of each pod's
listener (a NACK withdraws it, a DEL's removal waits for an ACK) and what its admin
says it holds.

Split from ``agent.envoy.sink`` (a mixin of ``EnvoySink``, whose ``__init__`` sets the
state declared here): the agent's view of Envoy's listeners, apart from publishing them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from agent.envoy.judge import JUDGE_LISTENER_PREFIX
from agent.envoy.listener_view import (
    REJECTED,
    ListenerProbe,
    ListenerState,
    listener_state,
    nack_names,
)
from agent.envoy.resources import LISTENER_TYPE, PodListener
from agent.envoy.xds import XdsServer

log = logging.getLogger("aether.envoy")


class ListenerTracking:
    """``EnvoySink``'s view of the listeners Envoy holds, rejected and removed."""

    # set by EnvoySink.__init__
    xds: XdsServer
    listener_probe: ListenerProbe
    _lock: threading.Lock
    _pods: dict[str, PodListener]
    _rejected: dict[str, str]
    _removals: dict[str, str]
    # from the other parts of EnvoySink
    _publish: Callable[[], str]
    check_envoy_netns: Callable[[str], bool]
    if TYPE_CHECKING:
        @property
        def pid(self) -> int | None: ...

    def _on_nack(self, type_url: str, detail: str) -> None:
        """Envoy rejected a config. Pod listeners it names are withdrawn: left in, every Envoy
        (re)start would be asked for them again and NACK again, and a failed bind can strand
        Envoy in the pod's netns, so a pod that holds its own capture port (it can bind it
        while Envoy restarts) would keep the node's Envoy in a restart loop. The pod fails
        closed instead (redirect rules stay, nothing listens) and status names the reason."""
        if type_url == LISTENER_TYPE:
            with self._lock:
                named = [cid for cid in self._pods if any(
                    nack_names(f"{prefix}{cid}", detail)
                    for prefix in ("capture-", "inbound-", "inbound-detect-",
                                   JUDGE_LISTENER_PREFIX))]
                for cid in named:
                    del self._pods[cid]
                    self._rejected[cid] = detail.strip()
                if named:
                    log.error("envoy rejected the listener of %d pod(s); withdrawn, their "
                              "traffic is refused until they are re-added: %s", len(named),
                              detail.strip())
                    self._publish()
        self.check_envoy_netns("after a NACK")

    def listener_states(self, container_ids: list[str]) -> dict[str, ListenerState]:
        """Each pod's listener as Envoy holds it (its admin's view plus our last NACK), not
        as the agent intends it. One cached, time-bounded admin probe for all pods."""
        x = self.xds.status()
        view = self.listener_probe.view(key=(self.pid, x.get("version"), str(x.get("acked")),
                                             x.get("nack_count")))
        with self._lock:
            rejected = {cid: self._rejected[cid] for cid in container_ids
                        if cid in self._rejected and cid not in self._pods}
        return {cid: (ListenerState(REJECTED, rejected[cid]) if cid in rejected
                      else listener_state(f"capture-{cid}", view, x.get("last_nack")))
                for cid in container_ids}

    def _acked(self, version: str) -> bool:
        try:
            return self.xds.wait_acked(version, 0)
        except ValueError:  # so old the server forgot it: superseded long ago
            return True

    def pending_removals(self) -> list[str]:
        """Listeners withdrawn (DEL) whose removal Envoy has not ACKed yet."""
        with self._lock:
            pending = dict(self._removals)
        done = [cid for cid, v in pending.items() if self._acked(v)]
        with self._lock:
            for cid in done:
                if self._removals.get(cid) == pending[cid]:
                    del self._removals[cid]
            return sorted(f"capture-{cid}" for cid in self._removals)
