"""A directory of Kubernetes YAML as the metadata source, for standalone/systemd use and the demo.

Files are re-read when anything in the directory changes (checked by mtime on each lookup),
so editing a manifest takes effect on the next pod ADD without restarting the agent. Events
cannot go to an API server here: they are logged and kept for `aether-agent status`.

A file that cannot be read is not an empty file (`ManifestDir`). Each file is parsed on its
own, all or nothing, and a file that fails — a YAML error, bytes that are not UTF-8, a
document that is not a mapping, a `kind: List` whose items are not a list of mappings —
keeps the objects of its *last good version* (none if it never parsed), named in the logs
and in the source's `problems` (shown by `aether-agent status`); the other files are not
affected. A document without kind/metadata.name is skipped and reported, the rest of its
file is used.

In-place rewrites (`open(…, "w")` truncates, then writes) pass through states that parse:
 - an empty file (whitespace only) that had objects keeps its last good version until it
   has stayed empty for ``IN_PLACE_GRACE_S`` (by its mtime); an empty file older than that
   is taken as emptied on purpose and its objects go;
 - a non-empty .yaml/.yml file not ending in a newline and younger than the grace period is
   taken as half-written (every YAML writer ends with one) and waits the same way.
Deleting a file removes its objects at once. What cannot be detected: a truncation that
happens to stop at a document or line boundary. Write-then-rename is the safe way to edit.
Pods and namespaces that are not known (yet) are CNI try-again for the handler, never "not
managed", so a pod missing during a rewrite waits; kubelet retries.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml

from agent.source.base import PodEvent, SourceError, WatchEvent
from agent.source.model import NamespaceMeta, PodMeta, namespace_from_object, pod_from_object

log = logging.getLogger("aether.source.manifests")

ObjKey = tuple[str, str, str]  # kind, namespace, name
FileStamp = tuple[int, int, int]  # mtime_ns, size, inode

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")
#: How long an in-place rewrite may look empty or half-written before it is taken as is.
IN_PLACE_GRACE_S = 2.0


class ManifestError(ValueError):
    """A file's content is not a usable manifest (the whole file is refused)."""


@dataclass
class _FileState:
    stamp: FileStamp
    objects: dict[ObjKey, dict[str, Any]]  # the last good version's
    good: bool  # some version of the file ever parsed
    problem: str = ""  # why the current content is not used ("" when it is)
    warnings: list[str] = field(default_factory=list)  # skipped documents of a good version
    settled: bool = True  # False: look again even if the file does not change


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def parse_manifest(path: str, data: bytes) -> tuple[dict[ObjKey, dict[str, Any]], list[str]]:
    """One file's objects and its skipped-document warnings; ManifestError if unusable."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ManifestError(f"not UTF-8 ({_one_line(e)})") from e
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as e:
        raise ManifestError(f"YAML error: {_one_line(e)}") from e
    objects: dict[ObjKey, dict[str, Any]] = {}
    warnings: list[str] = []
    for i, doc in enumerate(docs, 1):
        for obj in _flatten(doc, i):
            kind = obj.get("kind")
            meta = obj.get("metadata")
            if not isinstance(kind, str) or not isinstance(meta, dict) or not meta.get("name"):
                warnings.append(f"{path}: document without kind/metadata.name skipped")
                continue
            ns = "" if kind == "Namespace" else str(meta.get("namespace") or "default")
            objects[(kind, ns, str(meta["name"]))] = obj
    return objects, warnings


class ManifestDir:
    """The objects of a manifest directory, parsed per file with last-good retention.

    ``read()`` re-parses only files whose (mtime, size, inode) changed; see the module
    docstring for what a failing or half-rewritten file does. ``pending`` is True while a
    file waits out the in-place grace period: callers must read again even if the directory
    stamp has not changed.
    """

    def __init__(self, directory: str, grace: float = IN_PLACE_GRACE_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.directory = directory
        self.grace = grace
        self.clock = clock
        self.pending = False
        self._files: dict[str, _FileState] = {}

    def _paths(self) -> list[str]:
        paths = []
        for root, _dirs, files in os.walk(self.directory):
            paths += [os.path.join(root, f) for f in files if f.endswith(MANIFEST_SUFFIXES)]
        return sorted(paths)

    def read(self) -> tuple[dict[ObjKey, dict[str, Any]], list[str]]:
        """(every object, problems): later files win on a duplicate key."""
        files: dict[str, _FileState] = {}
        for path in self._paths():
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue  # deleted: its objects go
            except OSError as e:
                prev = self._files.get(path)
                if prev is not None:
                    files[path] = self._keep(prev, prev.stamp, path, f"cannot stat: {e.strerror}")
                continue
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            prev = self._files.get(path)
            if prev is not None and prev.stamp == stamp and prev.settled:
                files[path] = prev
                continue
            state = self._load(path, st, stamp, prev)
            if state is not None:
                files[path] = state
        self._files = files
        self.pending = any(not f.settled for f in files.values())
        objects: dict[ObjKey, dict[str, Any]] = {}
        problems: list[str] = []
        for state in files.values():
            objects.update(state.objects)
            if state.problem:
                problems.append(state.problem)
            problems += state.warnings
        return objects, problems

    def _keep(self, prev: _FileState | None, stamp: FileStamp, path: str, why: str,
              settled: bool = True) -> _FileState:
        if prev is not None and prev.good:
            kept = f"keeping its last good version ({len(prev.objects)} objects)"
            objects, good, warnings = prev.objects, True, prev.warnings
        else:
            kept = "not loaded (no good version yet)"
            objects, good, warnings = {}, False, []
        return _FileState(stamp, objects, good, f"{path}: {why}: {kept}", warnings, settled)

    def _load(self, path: str, st: os.stat_result, stamp: FileStamp,
              prev: _FileState | None) -> _FileState | None:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            return self._keep(prev, stamp, path, f"cannot read: {e.strerror}")
        young = self.clock() - st.st_mtime < self.grace
        if young and not data.strip() and prev is not None and prev.objects:
            return self._keep(prev, stamp, path, "emptied, probably being rewritten in place",
                              settled=False)
        if young and data.strip() and path.endswith((".yaml", ".yml")) \
                and not data.endswith(b"\n"):
            return self._keep(prev, stamp, path, "no final newline, probably being written",
                              settled=False)
        try:
            objects, warnings = parse_manifest(path, data)
        except ManifestError as e:
            return self._keep(prev, stamp, path, str(e))
        return _FileState(stamp, objects, True, "", warnings)


def load_objects(directory: str) -> tuple[dict[ObjKey, dict[str, Any]], list[str]]:
    """Every object in *.yaml/*.yml/*.json under directory as it is now (one-shot: no last
    good versions, no grace); unusable files and skipped documents reported."""
    return ManifestDir(directory, grace=0.0).read()


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


def _flatten(doc: Any, index: int = 0) -> list[dict[str, Any]]:
    """A document's objects (a List's items); ManifestError when it is not a mapping."""
    if doc is None:
        return []  # an empty document (`---` with nothing after it)
    if not isinstance(doc, dict):
        raise ManifestError(f"document {index} is a {type(doc).__name__}, not a mapping")
    if doc.get("kind") == "List" or (
        isinstance(doc.get("kind"), str) and str(doc["kind"]).endswith("List") and "items" in doc
    ):
        items = doc.get("items")
        if items is None:
            return []
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise ManifestError(f"document {index} is a {doc['kind']} whose items are not "
                                "a list of mappings")
        return items
    return [doc]


class ManifestSource:
    """MetadataSource over a manifest directory."""

    def __init__(self, directory: str, grace: float = IN_PLACE_GRACE_S,
                 clock: Callable[[], float] = time.time) -> None:
        if not os.path.isdir(directory):
            raise SourceError(f"manifest directory {directory} does not exist")
        self.directory = directory
        self._dir = ManifestDir(directory, grace, clock)
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
        if stamp == self._stamp and not self._dir.pending:
            return
        objects, problems = self._dir.read()
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
