"""Per-pod bookkeeping of the node Envoy's sink: the AuthorizationPolicies each pod's
listener enforces, and which pod a listener name belongs to.

Split from ``agent.envoy.sink`` (a mixin of ``EnvoySink``, whose ``__init__`` sets the
state declared here): what the sink records of each pod, apart from publishing it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

from agent.authz.policy import Policy
from agent.cni.state import CapturedPod
from agent.envoy.resources import PodListener


class PodBook:
    """``EnvoySink``'s per-pod records: policies by pod, labels as each ADD read them."""

    # set by EnvoySink.__init__
    authz_for: Callable[[str, dict[str, str]], tuple[Policy, ...]] | None
    _lock: threading.Lock
    _pods: dict[str, PodListener]
    _authz: dict[str, tuple[Policy, ...]]
    _pod_keys: dict[str, str]
    _pod_labels: dict[str, dict[str, str]]

    def _current_authz(self, cid: str, lis: PodListener) -> PodListener:
        """``lis`` with the policies as they are now (a policy may have changed since its
        ADD resolved them): from the labels the ADD read, when it read them."""
        labels, resolve = self._pod_labels.get(cid), self.authz_for
        if labels is None or resolve is None:
            return lis
        want = resolve(lis.namespace, labels)
        return lis if want == lis.authz else replace(lis, authz=want)

    def _policies_of(self, pod: CapturedPod) -> tuple[Policy, ...]:
        """The policies selecting ``pod`` at its ADD: from its labels when the ADD read them,
        else as the mesh last published them."""
        resolve = self.authz_for
        if pod.labels is not None and resolve is not None:
            return resolve(pod.namespace, pod.labels)
        with self._lock:
            return self._authz.get(pod.key, ())

    def set_authz(self, by_pod: dict[str, tuple[Policy, ...]],
                  known: frozenset[str] | None = None) -> int:
        """The policies selecting each local pod (pod key → policies; absent: none), applied
        at the next publish (``set_services`` follows). ``known``: the pods the mesh model
        holds (None: all); one it does not hold yet keeps what its ADD resolved. Returns how
        many pods changed."""
        changed = 0
        with self._lock:
            self._authz = by_pod
            for cid, lis in list(self._pods.items()):
                key = self._pod_keys.get(cid, "")
                if known is not None and key not in known:
                    continue
                want = by_pod.get(key, ())
                if lis.authz != want:
                    self._pods[cid] = replace(lis, authz=want)
                    changed += 1
        return changed

    def authz_of(self, container_id: str) -> tuple[Policy, ...]:
        """What the pod's inbound listener enforces now (status)."""
        with self._lock:
            lis = self._pods.get(container_id)
            return lis.authz if lis is not None else ()

    def _identity_of_listener(self, listener: str) -> str | None:
        """``inbound-<cid>`` → its pod's identity (for the inbound access log; a gRPC
        thread, so one dict read and no lock)."""
        from agent.envoy.mtls import INBOUND_LISTENER_PREFIX
        if not listener.startswith(INBOUND_LISTENER_PREFIX):
            return None
        pod = self._pods.get(listener[len(INBOUND_LISTENER_PREFIX):])
        return pod.identity if pod is not None else None
