"""A directory of Kubernetes YAML as the metadata source, for standalone/systemd use and the demo.

Files are re-read when anything in the directory changes (checked by mtime on each lookup),
so editing a manifest takes effect on the next pod ADD without restarting the agent. Events
cannot go to an API server here: they are logged and kept for `aether-agent status`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Any

import yaml

from agent.source.base import PodEvent, SourceError, WatchEvent
from agent.source.model import NamespaceMeta, PodMeta, namespace_from_object, pod_from_object

log = logging.getLogger("aether.source.manifests")

ObjKey = tuple[str, str, str]  # kind, namespace, name


def load_objects(directory: str) -> tuple[dict[ObjKey, dict[str, Any]], list[str]]:
    """Every object in *.yaml/*.yml/*.json under directory; unreadable documents reported."""
    objects: dict[ObjKey, dict[str, Any]] = {}
    problems: list[str] = []
    for root, _dirs, files in os.walk(directory):
        for fname in sorted(files):
            if not fname.endswith((".yaml", ".yml", ".json")):
                continue
            path = os.path.join(root, fname)
            try:
                with open(path, encoding="utf-8") as f:
                    docs = list(yaml.safe_load_all(f))
            except (OSError, yaml.YAMLError) as e:
                problems.append(f"{path}: {e}")
                continue
            for doc in docs:
                for obj in _flatten(doc):
                    kind = obj.get("kind")
                    meta = obj.get("metadata")
                    if not isinstance(kind, str) or not isinstance(meta, dict) or not meta.get("name"):
                        problems.append(f"{path}: document without kind/metadata.name skipped")
                        continue
                    ns = "" if kind == "Namespace" else str(meta.get("namespace") or "default")
                    objects[(kind, ns, str(meta["name"]))] = obj
    return objects, problems


def dir_stamp(directory: str) -> tuple[tuple[str, float, int], ...]:
    """(path, mtime, size) of the directory tree: changes when any manifest does."""
    stamp: list[tuple[str, float, int]] = []
    for root, _dirs, files in os.walk(directory):
        stamp.append((root, os.stat(root).st_mtime, 0))
        for f in files:
            p = os.path.join(root, f)
            try:
                st = os.stat(p)
            except FileNotFoundError:
                continue
            stamp.append((p, st.st_mtime, st.st_size))
    return tuple(sorted(stamp))


def _flatten(doc: Any) -> list[dict[str, Any]]:
    if not isinstance(doc, dict):
        return []
    if doc.get("kind") == "List" or (
        isinstance(doc.get("kind"), str) and str(doc["kind"]).endswith("List") and "items" in doc
    ):
        return [i for i in doc.get("items") or [] if isinstance(i, dict)]
    return [doc]


class ManifestSource:
    """MetadataSource over a manifest directory."""

    def __init__(self, directory: str) -> None:
        if not os.path.isdir(directory):
            raise SourceError(f"manifest directory {directory} does not exist")
        self.directory = directory
        self._lock = threading.Lock()
        self._stamp: tuple[tuple[str, float, int], ...] | None = None
        self._objects: dict[ObjKey, dict[str, Any]] = {}
        self._scanned_at = -1.0
        self.events: deque[PodEvent] = deque(maxlen=500)
        self.problems: list[str] = []

    def _refresh(self) -> None:
        try:
            stamp = dir_stamp(self.directory)
        except OSError as e:
            raise SourceError(f"manifest directory {self.directory}: {e}") from e
        if stamp == self._stamp:
            return
        objects, problems = load_objects(self.directory)
        for p in problems:
            if p not in self.problems:
                log.warning("manifest problem: %s", p)
        self._objects, self.problems, self._stamp = objects, problems, stamp

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        asked = time.monotonic()
        with self._lock:
            # A refresh that started after this lookup began already saw every change made
            # before it: concurrent ADDs share one directory scan instead of queueing N.
            if self._scanned_at < asked:
                self._scanned_at = time.monotonic()
                self._refresh()
            return self._objects.get((kind, namespace, name))

    def get_pod(self, namespace: str, name: str) -> PodMeta | None:
        obj = self.get("Pod", namespace, name)
        return None if obj is None else pod_from_object(obj)

    def get_namespace(self, name: str) -> NamespaceMeta | None:
        obj = self.get("Namespace", "", name)
        return None if obj is None else namespace_from_object(obj)

    def snapshot(self) -> list[WatchEvent]:
        """Every object as an ADDED event: the same shape a Kubernetes list produces."""
        with self._lock:
            self._scanned_at = time.monotonic()
            self._refresh()
            return [WatchEvent("ADDED", k[0], o) for k, o in sorted(self._objects.items())]

    def record_event(self, event: PodEvent) -> None:
        self.events.append(event)
        log.warning(
            "pod event %s: %s",
            event.reason,
            event.message,
            extra={"pod": event.pod, "namespace": event.namespace, "reason": event.reason},
        )

    def describe(self) -> str:
        return f"manifest directory {self.directory}"
