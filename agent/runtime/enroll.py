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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from agent.capture.policy import CapturePolicy, decide
from agent.cni.state import CapturedPod, SeenPod
from agent.common.config import NodeConfig
from agent.source.base import WatchEvent
from agent.source.model import NamespaceMeta, PodMeta, namespace_from_object, pod_from_object

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


DISCOVERED_PREFIX = "discovered-"
RESCAN_S = 10.0  # pods still not found by IP are looked for again at most this often


def to_discover(pods: list[PodMeta], namespaces: dict[str, NamespaceMeta],
                records: list[CapturedPod], seen: list[SeenPod], node: NodeConfig,
                redirect_all_default: bool) -> list[PodMeta]:
    """Running pods of this node that are to be captured but that no ADD of ours ever saw
    (older than aether here): their netns must be found by their IP."""
    known = {r.uid for r in records} | {s.uid for s in seen}
    out = []
    for pod in pods:
        if pod.node_name != node.node_name or pod.host_network or not pod.ips or not pod.uid:
            continue
        if pod.phase not in ("Running", "") or pod.uid in known:
            continue
        ns = namespaces.get(pod.namespace)
        if ns is None:
            continue
        d = decide(pod, ns, node, redirect_all_default)
        if d.captured and d.policy is not None:
            out.append(pod)
    return out


class EnrollmentLoop:
    """Runs `plan` after Pod/Namespace changes (debounced) and every `resync_s`."""

    def __init__(self, handler: Any, objects: Any, node: NodeConfig,
                 debounce_s: float = 0.2, resync_s: float = 30.0,
                 redirect_all_default: bool = False) -> None:
        self.handler = handler
        self.objects = objects
        self.node = node
        self.debounce_s = debounce_s
        self.resync_s = resync_s
        self.passes = 0
        self.redirect_all_default = redirect_all_default  # for pods no ADD told us about
        self.discovered = 0
        self.not_found: dict[str, str] = {}  # uid → pod key: to capture, netns not found
        self.last_steps: list[Step] = []
        self._dirty = threading.Event()
        self._stop = threading.Event()
        # this node's Pods as the source holds them (kept from the events, so a pass never
        # scans a cluster's worth of objects): what discovery by IP looks at
        self._local: dict[tuple[str, str], dict[str, Any]] = {}
        self._local_lock = threading.Lock()
        self._last_scan: tuple[frozenset[str], float] = (frozenset(), 0.0)
        self._unsubscribe: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._run, name="enroll", daemon=True)

    def start(self) -> None:
        self._unsubscribe = self.objects.on_event(self._on_event, replay=True)
        self._dirty.set()  # one pass at start: changes made while the agent was down
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._dirty.set()
        if self._unsubscribe is not None:
            self._unsubscribe()
        self._thread.join(timeout=5)

    def _on_event(self, event: WatchEvent) -> None:
        if event.kind == "Pod":
            meta = event.obj.get("metadata") or {}
            spec = event.obj.get("spec") or {}
            key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
            with self._local_lock:
                if event.type != "DELETED" and isinstance(spec, dict) \
                        and spec.get("nodeName") == self.node.node_name:
                    self._local[key] = event.obj
                else:
                    self._local.pop(key, None)
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
        node = (self.handler.strict_node() if hasattr(self.handler, "strict_node")
                else self.node)  # the node's current addresses, as STRICT ADDs saw them
        steps = plan(store.all(), store.all_seen(), self.lookup, node)
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
        if not self._stop.is_set():
            self._discover()
        return steps

    def _discover(self) -> None:
        """Pods older than the agent: found by IP among the node's namespaces, then captured
        under a synthetic container id (their kubelet DEL is matched by netns)."""
        from agent.netns.discover import find_by_ips
        store = self.handler.store
        with self._local_lock:
            local = list(self._local.values())
        pods = [pod_from_object(o) for o in local]
        namespaces: dict[str, NamespaceMeta] = {}
        for name in {p.namespace for p in pods}:
            obj = self.objects.get("Namespace", "", name)
            if obj is not None:
                namespaces[name] = namespace_from_object(obj)
        last = getattr(self.handler, "last_redirect_all_default", None)
        default = self.redirect_all_default if last is None else bool(last)
        todo = to_discover(pods, namespaces, store.all(), store.all_seen(), self.node, default)
        if not todo:
            self.not_found = {}
            return
        wanted = frozenset(p.uid for p in todo)
        now = time.monotonic()
        if wanted == self._last_scan[0] and now - self._last_scan[1] < RESCAN_S:
            return  # the same pods were just looked for: not every pass rescans the node
        self._last_scan = (wanted, now)
        found = find_by_ips({ip: p.uid for p in todo for ip in p.ips})
        self.not_found = {p.uid: p.key for p in todo if p.uid not in found}
        for pod in todo:
            path = found.get(pod.uid)
            if path is not None and self.handler.enroll_discovered(
                    pod, path, DISCOVERED_PREFIX + pod.uid, default):
                self.discovered += 1
