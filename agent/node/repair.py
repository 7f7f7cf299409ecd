"""Pods on this node that should be captured but were not (the gap the taint cannot close).

A pod that tolerates every taint, or one that started while the plugin was missing, runs
uncaptured. The agent finds them at startup and on each pod event; by default it reports
(`CaptureMissing` Event + status), with `--repair=delete` it evicts them so their controller
recreates them, this time through the plugin.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from agent.capture.policy import decide
from agent.common.config import NodeConfig
from agent.kube import done
from agent.kube.rest import CoreV1
from agent.source.base import PodEvent
from agent.source.model import NamespaceMeta, PodMeta, namespace_from_object, pod_from_object

log = logging.getLogger("aether.repair")

REASON = "CaptureMissing"
MODES = ("report", "delete")


@dataclass(frozen=True)
class NodePod:
    meta: PodMeta
    phase: str
    deleting: bool = False


def node_pod_from_object(obj: dict[str, Any]) -> NodePod:
    return NodePod(pod_from_object(obj), str((obj.get("status") or {}).get("phase") or ""),
                   bool((obj.get("metadata") or {}).get("deletionTimestamp")))


@dataclass(frozen=True)
class Uncaptured:
    pod: PodMeta
    why_managed: str


def find_uncaptured(pods: Iterable[NodePod], namespaces: dict[str, NamespaceMeta],
                    captured_uids: set[str], node: NodeConfig) -> list[Uncaptured]:
    """Running, not terminating, on this node, managed by policy, and not in our state.

    Pending pods are skipped: their CNI ADD may still be in flight.
    """
    out = []
    for p in pods:
        if p.phase != "Running" or p.deleting or p.meta.uid in captured_uids:
            continue
        if node.node_name and p.meta.node_name != node.node_name:
            continue
        decision = decide(p.meta, namespaces.get(p.meta.namespace), node, False)
        if decision.captured:
            out.append(Uncaptured(p.meta, decision.reason))
    return out


class RepairLoop:
    """Scan at start, then act on pod events (watch) with a periodic full resync."""

    def __init__(self, api: client.ApiClient, node: NodeConfig,
                 captured_uids: Callable[[], set[str]],
                 record_event: Callable[[PodEvent], None], mode: str = "report",
                 resync: float = 60.0, timeout: float = 5.0) -> None:
        if mode not in MODES:
            raise ValueError(f"--repair must be one of {', '.join(MODES)}, not {mode!r}")
        self.core = CoreV1(api)
        self.node = node
        self.captured_uids = captured_uids
        self.record_event = record_event
        self.mode = mode
        self.resync = resync
        self.timeout = timeout
        self.found: dict[str, dict[str, Any]] = {}  # uid → status entry
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rv = ""

    # ---- API ------------------------------------------------------------------------------

    def _get(self, call: Callable[..., Any], *args: Any, **kw: Any) -> dict[str, Any]:
        resp = call(*args, _preload_content=False,
                    _request_timeout=(self.timeout, self.timeout), **kw)
        obj: dict[str, Any] = json.loads(resp.data)
        return obj

    def _namespace(self, name: str) -> NamespaceMeta | None:
        try:
            return namespace_from_object(self._get(self.core.read_namespace, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def _list_pods(self) -> list[dict[str, Any]]:
        lst = self._get(self.core.list_pod_for_all_namespaces,
                        field_selector=f"spec.nodeName={self.node.node_name}")
        self._rv = str((lst.get("metadata") or {}).get("resourceVersion") or "")
        return list(lst.get("items") or [])

    # ---- detection and action -------------------------------------------------------------

    def scan(self) -> list[Uncaptured]:
        """Full pass over this node's pods (startup and resync)."""
        objs = self._list_pods()
        pods = [node_pod_from_object(o) for o in objs]
        namespaces: dict[str, NamespaceMeta] = {}
        for ns in {p.meta.namespace for p in pods}:
            meta = self._namespace(ns)
            if meta is not None:
                namespaces[ns] = meta
        found = find_uncaptured(pods, namespaces, self.captured_uids(), self.node)
        live = {p.meta.uid for p in pods if not p.deleting}
        with self._lock:
            for uid in [u for u in self.found if u not in live]:
                del self.found[uid]
        for u in found:
            self._act(u)
        return found

    def handle_pod(self, obj: dict[str, Any], event_type: str = "MODIFIED") -> None:
        """One pod event: forget deleted pods, act on a newly uncaptured one."""
        p = node_pod_from_object(obj)
        if event_type == "DELETED" or p.deleting:
            with self._lock:
                self.found.pop(p.meta.uid, None)
            return
        if p.phase != "Running" or p.meta.uid in self.captured_uids():
            return
        ns = self._namespace(p.meta.namespace)
        for u in find_uncaptured([p], {ns.name: ns} if ns else {}, self.captured_uids(),
                                 self.node):
            self._act(u)

    def _act(self, u: Uncaptured) -> None:
        with self._lock:
            seen = self.found.get(u.pod.uid)
            if seen is not None and (self.mode == "report" or seen["action"] == "evicted"):
                return
        action = "reported"
        msg = (f"pod runs without aether capture although it is managed ({u.why_managed}): it "
               "started before the CNI plugin was installed or while the agent was down")
        if self.mode == "delete":
            action = self._evict(u.pod)
            msg += f"; {action}" + (" so its controller recreates it captured"
                                    if action == "evicted" else "")
        else:
            msg += "; delete the pod (or run the agent with --repair=delete) to capture it"
        log.warning("%s: %s", u.pod.key, msg, extra={"pod": u.pod.key, "uid": u.pod.uid})
        with self._lock:
            self.found[u.pod.uid] = {"pod": u.pod.key, "uid": u.pod.uid, "reason": REASON,
                                     "action": action, "since": time.time()}
        self.record_event(PodEvent(u.pod.namespace, u.pod.name, u.pod.uid, REASON, msg))

    def _evict(self, pod: PodMeta) -> str:
        """Eviction API (honours PodDisruptionBudgets); plain DELETE where it is missing."""
        body = {"apiVersion": "policy/v1", "kind": "Eviction",
                "metadata": {"name": pod.name, "namespace": pod.namespace},
                "deleteOptions": {"preconditions": {"uid": pod.uid}}}
        try:
            resp: Any = self.core.create_namespaced_pod_eviction(
                pod.name, pod.namespace, body,
                _preload_content=False, _request_timeout=(self.timeout, self.timeout))
            done(resp)
            return "evicted"
        except ApiException as e:
            if e.status == 429:
                return "eviction blocked by a PodDisruptionBudget (will retry)"
            if e.status not in (404, 405):
                return f"eviction failed: HTTP {e.status}"
        try:
            resp = self.core.delete_namespaced_pod(
                pod.name, pod.namespace,
                body={"preconditions": {"uid": pod.uid}},
                _preload_content=False, _request_timeout=(self.timeout, self.timeout))
            done(resp)
        except ApiException as e:
            return "already gone" if e.status == 404 else f"delete failed: HTTP {e.status}"
        return "evicted"

    # ---- loop -----------------------------------------------------------------------------

    def _run(self) -> None:
        next_scan = 0.0
        while not self._stop.is_set():
            try:
                if time.monotonic() >= next_scan or not self._rv:
                    self.scan()
                    next_scan = time.monotonic() + self.resync
                w = watch.Watch()
                for ev in w.stream(self.core.list_pod_for_all_namespaces,
                                   field_selector=f"spec.nodeName={self.node.node_name}",
                                   resource_version=self._rv, timeout_seconds=2,
                                   allow_watch_bookmarks=True):
                    if self._stop.is_set():
                        w.stop()
                        break
                    raw = ev.get("raw_object") or {}
                    rv = (raw.get("metadata") or {}).get("resourceVersion")
                    if rv:
                        self._rv = str(rv)
                    if ev.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        self.handle_pod(raw, str(ev["type"]))
            except Exception as e:  # noqa: BLE001 - API trouble: back off, rescan
                log.debug("repair watch: %s: %s", type(e).__name__, e)
                self._rv = ""
                self._stop.wait(1.0)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="capture-repair", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def status(self) -> list[dict[str, Any]]:
        with self._lock:
            return sorted(self.found.values(), key=lambda x: str(x["pod"]))
