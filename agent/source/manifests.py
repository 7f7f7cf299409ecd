"""A directory of Kubernetes YAML as the metadata source, for standalone/systemd use and the demo.

Files are re-read when anything in the directory changes, so editing a manifest takes effect
on the next pod ADD without restarting the agent. Events cannot go to an API server here:
they are logged and kept for `aether-agent status`.

A file that cannot be read is not an empty file (`ManifestDir`). Each file is parsed on its
own, all or nothing, and a file that fails — a YAML error, bytes that are not UTF-8, a
document that is not a mapping, a `kind: List` whose items are not a list of mappings, a
file over ``MAX_FILE_BYTES``, a document past the alias or nesting bounds of
``agent.source.yamlsafe``, something that is not a regular file — keeps the objects of its
*last good version* (none if it never parsed), named in the logs and in the source's
`problems` (shown by `aether-agent status`); the other files are not affected. A document
without kind/metadata.name is skipped and reported, the rest of its file is used.

Parsing never happens on the CNI ADD path (`ManifestLoader`). One loader per directory is
shared by the source and the mesh watcher, so each file is parsed once per change, and only
the files that changed. A scan (stat every file, parse the small ones that changed) runs on
the watcher's thread or on the loader's own scan thread; a file over
``BACKGROUND_PARSE_BYTES`` is parsed in the background — in a child process
(``agent.source.parse_worker``: no GIL shared with the CNI threads, memory and time limits,
a crash refuses the file) driven by a thread of the loader — while the scan publishes
everything else, its previous version (if any) still served. A lookup asks for a
scan and waits at most ``LOOKUP_WAIT_S`` for it; past that it answers from the last
published snapshot — a pod it does not hold yet is "not known", which the CNI handler turns
into try-again (code 11). No lock a lookup takes is held while a file is parsed.

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

The files and their last good versions are ``agent.source.manifest_dir``'s (this module's
``ManifestDir`` is its ``ManifestFiles``); here are the loader's threads and the source.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from agent.source.base import PodEvent, SourceError, WatchEvent
from agent.source.manifest_dir import (
    IN_PLACE_GRACE_S,
    MANIFEST_SUFFIXES,
    MAX_FILE_BYTES,
    FileStamp,
    ManifestFiles,
    ParseJob,
    Parser,
    dir_stamp,
)
from agent.source.manifest_dir import _read_file as _read_file
from agent.source.manifest_parse import ManifestError, ObjKey, _one_line, parse_manifest
from agent.source.model import NamespaceMeta, PodMeta, namespace_from_object, pod_from_object

__all__ = [  # where they were before the splits
    "IN_PLACE_GRACE_S", "MANIFEST_SUFFIXES", "MAX_FILE_BYTES", "FileStamp", "ManifestError",
    "ManifestFiles", "ObjKey", "ParseJob", "Parser", "dir_stamp", "parse_manifest",
]

log = logging.getLogger("aether.source.manifests")

#: Files larger than this are parsed on a background thread, never holding up a scan.
BACKGROUND_PARSE_BYTES = 256 * 1024
#: How long a lookup waits for a scan of the directory before it answers from the snapshot.
LOOKUP_WAIT_S = 0.5
#: A loader's scan or parse thread with nothing to do exits after this long.
_IDLE_S = 5.0


class ManifestDir(ManifestFiles):
    """The objects of a manifest directory, parsed per file with last-good retention (all of
    it in ``agent.source.manifest_dir.ManifestFiles``); a file is parsed with this module's
    ``parse_manifest``, looked up when the file is parsed."""

    def _parse(self, path: str, data: bytes) -> tuple[dict[ObjKey, dict[str, Any]], list[str]]:
        return parse_manifest(path, data)


def load_objects(directory: str) -> tuple[dict[ObjKey, dict[str, Any]], list[str]]:
    """Every object in *.yaml/*.yml/*.json under directory as it is now (one-shot: no last
    good versions, no grace); unusable files and skipped documents reported."""
    return ManifestDir(directory, grace=0.0).read()




@dataclass(frozen=True)
class Snapshot:
    """One published view of the directory; never mutated once published."""

    objects: Mapping[ObjKey, dict[str, Any]]
    problems: tuple[str, ...] = ()
    loading: tuple[str, ...] = ()  # big files being parsed in the background
    generation: int = 0  # bumped on every re-read
    complete: bool = False  # read at least once, and no file waits for the background parser


class ManifestLoader:
    """A manifest directory parsed off the lookup path, published as immutable ``Snapshot``s.

    ``scan()`` brings the snapshot up to date (call it from a thread that may take time: the
    watcher's, or the loader's own scan thread, which ``request()`` starts on demand);
    changed files over ``background_over`` bytes go to a parse thread of their own. A lookup
    calls ``request()`` and ``wait_scanned(asked, timeout)``, then reads ``snapshot``: one
    attribute read, never a lock held by a parse. Both threads exit when idle.
    """

    def __init__(self, directory: str, grace: float = IN_PLACE_GRACE_S,
                 clock: Callable[[], float] = time.time, *,
                 background_over: int | None = BACKGROUND_PARSE_BYTES,
                 max_bytes: int = MAX_FILE_BYTES, isolate: bool = True) -> None:
        self.directory = directory
        self.isolate = isolate  # big files parse in a child process (parse_worker)
        self._dir = ManifestDir(directory, grace, clock, background_over=background_over,
                                max_bytes=max_bytes)
        self._snapshot = Snapshot({})
        self._stamp: tuple[tuple[str, float, int], ...] | None = None
        self._scan_lock = threading.Lock()  # one scan at a time; never taken by a lookup
        self._cond = threading.Condition()  # guards everything below
        self._scanned_from = -1.0  # start (monotonic) of the newest completed scan
        self.scans = 0  # completed scans
        self.scan_error = ""  # why the newest scan failed ("" when it did not)
        self._want_scan = False
        self._scanner: threading.Thread | None = None
        self._jobs: list[ParseJob] = []
        self._parser: threading.Thread | None = None
        self._logged: set[str] = set()
        self._history: deque[tuple[int, frozenset[ObjKey]]] = deque(maxlen=256)
        self.background_parses = 0

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    # ---- scanning (never on a lookup's thread) ---------------------------------------------

    def scan(self) -> Snapshot:
        """Re-read the directory if it changed; SourceError if it cannot be read."""
        with self._scan_lock:
            started = time.monotonic()
            error = ""
            try:
                self._scan_locked()
            except Exception as e:  # noqa: BLE001 - reported to the lookups that wait
                error = str(e) if isinstance(e, SourceError) else \
                    f"manifest directory {self.directory}: {e}"
                raise SourceError(error) from e
            finally:
                with self._cond:
                    self.scan_error = error
                    self._scanned_from = max(self._scanned_from, started)
                    self.scans += 1
                    self._cond.notify_all()
        return self._snapshot

    def _scan_locked(self) -> None:
        if not os.path.isdir(self.directory):
            raise SourceError(f"manifest directory {self.directory} does not exist")
        stats: dict[str, os.stat_result] = {}
        stamp = dir_stamp(self.directory, stats)
        old = self._snapshot
        if stamp == self._stamp and old.generation and not self._dir.pending \
                and not self._dir.results_ready:
            if not old.complete and not old.loading and not self._parsing():
                self._snapshot = replace(old, complete=True)  # the last parse was dropped
            return
        read_started = time.monotonic()
        objects, problems = self._dir.read(stats)
        jobs = self._dir.take_jobs()
        took = time.monotonic() - read_started
        if took > 0.1:
            log.debug("manifest scan: read %d objects in %.2fs", len(objects), took)
        loading = tuple(self._dir.loading)
        busy = bool(jobs) or self._parsing()
        self._log_changes(problems, loading)
        generation = old.generation + 1
        self._history.append((generation, frozenset(self._dir.changed)))
        self._snapshot = Snapshot(objects, tuple(problems), loading, generation,
                                  complete=not (loading or busy))
        self._stamp = stamp
        if jobs:
            self._queue(jobs)

    def changed_between(self, old: int, new: int) -> frozenset[ObjKey] | None:
        """Keys whose objects may differ between snapshots ``old`` and ``new``; None when
        that is no longer known (compare everything)."""
        if old == new:
            return frozenset()
        wanted = [keys for g, keys in list(self._history) if old < g <= new]
        if old < 0 or len(wanted) != new - old:
            return None
        return frozenset().union(*wanted)

    def _parsing(self) -> bool:
        with self._cond:
            return bool(self._jobs or self._parser is not None)

    def _log_changes(self, problems: list[str], loading: tuple[str, ...]) -> None:
        now = set(problems) | set(loading)
        for p in problems:
            if p not in self._logged:
                log.warning("manifest problem: %s", p)
        for p in loading:
            if p not in self._logged:
                log.info("manifest %s", p)
        self._logged = now

    # ---- the scan thread: scans asked for by lookups ------------------------------------

    def request(self) -> float:
        """Ask for a scan soon (on the scan thread); returns the time asked, for
        ``wait_scanned``."""
        asked = time.monotonic()
        with self._cond:
            self._want_scan = True
            if self._scanner is None:
                self._scanner = threading.Thread(target=self._scan_loop, name="manifest-scan",
                                                 daemon=True)
                self._scanner.start()
            else:
                self._cond.notify_all()
        return asked

    def wait_scanned(self, asked: float, timeout: float) -> bool:
        """True once a scan that started at or after ``asked`` completed (within timeout)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._scanned_from < asked:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def _scan_loop(self) -> None:
        while True:
            with self._cond:
                if not self._want_scan:
                    self._cond.wait(_IDLE_S)
                if not self._want_scan:
                    self._scanner = None
                    return
                self._want_scan = False
            try:
                self.scan()
            except SourceError as e:
                log.debug("manifest scan failed: %s", e)
            except Exception:  # never let the thread die with a request outstanding
                log.exception("manifest scan failed")

    # ---- the parse thread: big files ------------------------------------------------------

    def _queue(self, jobs: list[ParseJob]) -> None:
        with self._cond:
            self._jobs += jobs
            if self._parser is None:
                self._parser = threading.Thread(target=self._parse_loop, name="manifest-parse",
                                                daemon=True)
                self._parser.start()

    def _parse_loop(self) -> None:
        while True:
            with self._cond:
                if not self._jobs:
                    self._parser = None
                    break
                job = self._jobs.pop(0)
            try:
                self._parse_one(job)
            except Exception as e:  # noqa: BLE001 - a bug here must not leave it "being parsed"
                log.exception("background parse of %s failed", job.path)
                self._dir.finish(job, self._dir.refuse(job, f"parse failed: {_one_line(e)}"))
        self.request()  # publish the results (and "complete")

    def _parse_one(self, job: ParseJob) -> None:
        try:
            st = os.stat(job.path)
        except OSError:
            return  # gone: the next scan drops it
        if (st.st_mtime_ns, st.st_size, st.st_ino) != job.stamp:
            return  # changed again: the next scan queues the new version
        started = time.monotonic()
        state = self._dir.load(job, self._parse_in_child if self.isolate else None)
        self._dir.finish(job, state)
        self.background_parses += 1
        log.info("parsed %s (%d bytes, %s) in %.2fs in the background", job.path,
                 job.st.st_size, "refused" if state is None or state.problem
                 else f"{len(state.objects)} objects", time.monotonic() - started)
        self.request()


    @staticmethod
    def _parse_in_child(path: str, data: bytes) -> tuple[dict[ObjKey, dict[str, Any]], list[str]]:
        from agent.source.parse_worker import ChildFailed, parse_in_child
        try:
            return parse_in_child(path, data)
        except ChildFailed as e:
            log.warning("%s; parsing %s in the agent's process instead", e, path)
            return parse_manifest(path, data)


_SHARED: weakref.WeakValueDictionary[tuple[Any, ...], ManifestLoader] = \
    weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


def shared_loader(directory: str, grace: float = IN_PLACE_GRACE_S,
                  clock: Callable[[], float] = time.time) -> ManifestLoader:
    """The process's one loader for ``directory`` (the source and the watcher share it, so
    every file is parsed once per change)."""
    key = (os.path.realpath(directory), grace, clock)
    with _SHARED_LOCK:
        loader = _SHARED.get(key)
        if loader is None:
            loader = ManifestLoader(directory, grace, clock)
            _SHARED[key] = loader
        return loader


class ManifestSource:
    """MetadataSource over a manifest directory: lookups read the loader's snapshot."""

    def __init__(self, directory: str, grace: float = IN_PLACE_GRACE_S,
                 clock: Callable[[], float] = time.time, *,
                 lookup_wait: float = LOOKUP_WAIT_S, loader: ManifestLoader | None = None) -> None:
        if not os.path.isdir(directory):
            raise SourceError(f"manifest directory {directory} does not exist")
        self.directory = directory
        self.loader = loader or shared_loader(directory, grace, clock)
        self.lookup_wait = lookup_wait
        self.events: deque[PodEvent] = deque(maxlen=500)
        self._late_at = -1  # loader.scans when a lookup last gave up waiting
        self.loader.request()

    @property
    def problems(self) -> list[str]:
        snap = self.loader.snapshot
        return [*snap.problems, *snap.loading]

    def current(self) -> Snapshot:
        """The snapshot after a scan that started after this call, or — when that takes
        longer than ``lookup_wait`` — the one published last. Never parses on this thread.
        SourceError when the directory cannot be read."""
        asked = self.loader.request()
        late = self._late_at
        # a lookup already gave up on the scan still running: do not wait for it again
        if late < 0 or late != self.loader.scans:
            if self.loader.wait_scanned(asked, self.lookup_wait):
                self._late_at = -1
                if self.loader.scan_error:
                    raise SourceError(self.loader.scan_error)
            else:
                self._late_at = self.loader.scans
                log.info("manifest lookup: no scan within %.2fs; answering from the last "
                         "snapshot", self.lookup_wait)
        waited = time.monotonic() - asked
        if waited > 0.1:
            log.debug("manifest lookup waited %.2fs for a scan", waited)
        snap = self.loader.snapshot
        if not snap.generation and self.loader.scan_error:
            raise SourceError(self.loader.scan_error)
        return snap

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.current().objects.get((kind, namespace, name))

    def peek(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object in the last published snapshot: no scan, no wait (what the watch cache
        reads; ``get`` is the lookup that waits for a scan)."""
        return self.loader.snapshot.objects.get((kind, namespace, name))

    def get_pod(self, namespace: str, name: str, uid: str = "") -> PodMeta | None:
        obj = self.get("Pod", namespace, name)
        return None if obj is None else pod_from_object(obj)

    def get_namespace(self, name: str) -> NamespaceMeta | None:
        obj = self.get("Namespace", "", name)
        return None if obj is None else namespace_from_object(obj)

    def snapshot(self) -> list[WatchEvent]:
        """Every object as an ADDED event: the same shape a Kubernetes list produces."""
        objects = self.loader.scan().objects
        return [WatchEvent("ADDED", k[0], o) for k, o in sorted(objects.items())]

    def record_event(self, event: PodEvent) -> None:
        self.events.append(event)
        log.warning(
            "%s event %s: %s",
            event.kind.lower(),
            event.reason,
            event.message,
            extra={"pod": event.pod, "namespace": event.namespace, "reason": event.reason},
        )

    def describe(self) -> str:
        return f"manifest directory {self.directory}"
