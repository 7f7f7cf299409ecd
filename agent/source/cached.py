"""Point lookups served from the watch cache first, the API second.

The CNI path must keep working when the API server is slow, failing or restarting: pods
and namespaces the watcher already holds are answered from memory; only a miss (a pod so
new the watch has not delivered it yet) goes to the API, with its retries. A miss the API
answers with 404 is None here, and None is never "not managed": the CNI handler answers
try-again (kubelet retries) until the pod and its namespace are known.

With ``--manifests`` the inner source is the manifest directory, whose loader's snapshot is
what the watcher feeds the store from — never older than the store, which can lag it by the
seconds a 50k-object file takes to apply. Lookups read that snapshot (``peek``) instead of
the store; a miss asks the source, which waits a bounded time for a scan of the directory
and never parses a file on the caller's thread (``agent.source.manifests``).
"""

from __future__ import annotations

from typing import Any

from agent.source.base import MetadataSource, PodEvent
from agent.source.events import ObjectStore
from agent.source.model import NamespaceMeta, PodMeta, namespace_from_object, pod_from_object


class CachedSource:
    def __init__(self, inner: MetadataSource, objects: ObjectStore) -> None:
        self.inner = inner
        self.objects = objects
        self.hits = 0
        self.misses = 0
        self.stale = 0  # cached under the name, but another pod (uid differs)

    def get_pod(self, namespace: str, name: str, uid: str = "") -> PodMeta | None:
        """A cached Pod whose uid is not kubelet's is another pod of the same name (a
        StatefulSet pod recreated while the watch lagged): ask the inner source instead."""
        obj = self._cached("Pod", namespace, name)
        if obj is not None:
            pod = pod_from_object(obj)
            if not uid or not pod.uid or pod.uid == uid:
                self.hits += 1
                return pod
            self.stale += 1
        self.misses += 1
        return self.inner.get_pod(namespace, name, uid)

    def _cached(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The watch cache's object; for a source with a fresher snapshot of its own (the
        manifest directory's ``peek``), that snapshot."""
        peek = getattr(self.inner, "peek", None)
        if callable(peek):
            found: dict[str, Any] | None = peek(kind, namespace, name)
            return found
        return self.objects.get(kind, namespace, name)

    def get_namespace(self, name: str) -> NamespaceMeta | None:
        obj = self._cached("Namespace", "", name)
        if obj is not None:
            self.hits += 1
            return namespace_from_object(obj)
        self.misses += 1
        return self.inner.get_namespace(name)

    def cached(self, namespace: str, name: str) -> tuple[PodMeta | None, NamespaceMeta | None]:
        """The pod and its namespace as ADD would see them from memory, never asking the
        inner source: the live-enrollment loop decides on exactly the view ADD uses."""
        pod = self._cached("Pod", namespace, name)
        ns = self._cached("Namespace", "", namespace)
        return (pod_from_object(pod) if pod is not None else None,
                namespace_from_object(ns) if ns is not None else None)

    def record_event(self, event: PodEvent) -> None:
        self.inner.record_event(event)

    def describe(self) -> str:
        return f"{self.inner.describe()} (watch cache)"
