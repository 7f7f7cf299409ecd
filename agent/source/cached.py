"""Point lookups served from the watch cache first, the API second.

The CNI path must keep working when the API server is slow, failing or restarting: pods
and namespaces the watcher already holds are answered from memory; only a miss (a pod so
new the watch has not delivered it yet) goes to the API, with its retries. A miss the API
answers with 404 is None here, and None is never "not managed": the CNI handler answers
try-again (kubelet retries) until the pod and its namespace are known.
"""

from __future__ import annotations

from agent.source.base import MetadataSource, PodEvent
from agent.source.events import ObjectStore
from agent.source.model import NamespaceMeta, PodMeta, namespace_from_object, pod_from_object


class CachedSource:
    def __init__(self, inner: MetadataSource, objects: ObjectStore) -> None:
        self.inner = inner
        self.objects = objects
        self.hits = 0
        self.misses = 0

    def get_pod(self, namespace: str, name: str) -> PodMeta | None:
        obj = self.objects.get("Pod", namespace, name)
        if obj is not None:
            self.hits += 1
            return pod_from_object(obj)
        self.misses += 1
        return self.inner.get_pod(namespace, name)

    def get_namespace(self, name: str) -> NamespaceMeta | None:
        obj = self.objects.get("Namespace", "", name)
        if obj is not None:
            self.hits += 1
            return namespace_from_object(obj)
        self.misses += 1
        return self.inner.get_namespace(name)

    def record_event(self, event: PodEvent) -> None:
        self.inner.record_event(event)

    def describe(self) -> str:
        return f"{self.inner.describe()} (watch cache)"
