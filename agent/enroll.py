"""Live enrollment and release: capture follows a running pod's labels and annotations.

Labelling a namespace `aether.io/managed=true` must capture the pods already running there,
and removing the label must release them, without restarting anything. `plan` is the pure
part (records, remembered uncaptured pods and the source's view in, steps out); the loop runs
it whenever a Pod or Namespace changes (and every `resync_s` as a safety net) and hands each
step to the CNI handler, which applies it with ADD's own checks and fail-closed order.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from agent.capture.policy import CapturePolicy, decide
from agent.config import NodeConfig
from agent.source.base import WatchEvent
from agent.source.model import NamespaceMeta, PodMeta, namespace_from_object, pod_from_object
from agent.state import CapturedPod, SeenPod

log = logging.getLogger("aether.enroll")

Lookup = Callable[[str, str], tuple[PodMeta | None, NamespaceMeta | None]]


@dataclass(frozen=True)
class Step:
    action: Literal["capture", "release", "reapply"]
    container_id: str
    key: str
    why: str
    policy: CapturePolicy | None = None


def plan(records: list[CapturedPod], seen: list[SeenPod], lookup: Lookup,
         node: NodeConfig) -> list[Step]:
    """What to change so capture matches policy for every running pod the agent knows.

    Unknown is not "no": a pod or namespace the source does not hold (yet), or holds as
    another pod (uid differs: replaced under the same name), is left as it is."""
    steps: list[Step] = []
    for rec in records:
        pod, ns = lookup(rec.namespace, rec.name)
        if pod is None or ns is None or (pod.uid and rec.uid and pod.uid != rec.uid):
            continue
        d = decide(pod, ns, node, rec.redirect_all_default)
        if not d.captured or d.policy is None:
            steps.append(Step("release", rec.container_id, rec.key, d.reason))
        elif d.policy != rec.policy:
            steps.append(Step("reapply", rec.container_id, rec.key, d.reason, d.policy))
    captured = {r.container_id for r in records}
    for s in seen:
        if s.container_id in captured:
            continue
        pod, ns = lookup(s.namespace, s.name)
        if pod is None or ns is None or (pod.uid and s.uid and pod.uid != s.uid):
            continue
        d = decide(pod, ns, node, s.redirect_all_default)
        if d.captured and d.policy is not None:
            steps.append(Step("capture", s.container_id, s.key, d.reason))
    return steps


class EnrollmentLoop:
    """Runs `plan` after Pod/Namespace changes (debounced) and every `resync_s`."""

    def __init__(self, handler: Any, objects: Any, node: NodeConfig,
                 debounce_s: float = 0.2, resync_s: float = 30.0) -> None:
        self.handler = handler
        self.objects = objects
        self.node = node
        self.debounce_s = debounce_s
        self.resync_s = resync_s
        self.passes = 0
        self.last_steps: list[Step] = []
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._unsubscribe: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._run, name="enroll", daemon=True)

    def start(self) -> None:
        self._unsubscribe = self.objects.on_event(self._on_event, replay=False)
        self._dirty.set()  # one pass at start: changes made while the agent was down
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._dirty.set()
        if self._unsubscribe is not None:
            self._unsubscribe()
        self._thread.join(timeout=5)

    def _on_event(self, event: WatchEvent) -> None:
        if event.kind in ("Pod", "Namespace"):
            self._dirty.set()

    def lookup(self, namespace: str, name: str) -> tuple[PodMeta | None, NamespaceMeta | None]:
        cached = getattr(self.handler.source, "cached", None)
        if callable(cached):  # the very view ADD answers from (CachedSource)
            found: tuple[PodMeta | None, NamespaceMeta | None] = cached(namespace, name)
            return found
        pod = self.objects.get("Pod", namespace, name)
        ns = self.objects.get("Namespace", "", namespace)
        return (pod_from_object(pod) if pod is not None else None,
                namespace_from_object(ns) if ns is not None else None)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._dirty.wait(self.resync_s)
            if self._stop.is_set():
                return
            self._stop.wait(self.debounce_s)  # let a burst of changes settle
            self._dirty.clear()
            try:
                self.run_once()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad pass
                log.exception("live enrollment pass failed")

    def run_once(self) -> list[Step]:
        store = self.handler.store
        steps = plan(store.all(), store.all_seen(), self.lookup, self.node)
        self.passes += 1
        self.last_steps = steps
        for step in steps:
            if self._stop.is_set():
                break
            if step.action == "capture":
                self.handler.enroll(step.container_id)
            elif step.action == "release":
                self.handler.release(step.container_id, step.why)
            else:
                self.handler.reapply(step.container_id, step.policy, step.why)
        return steps
