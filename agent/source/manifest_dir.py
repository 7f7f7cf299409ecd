"""The files of a manifest directory and the last good version of each (``ManifestFiles``).

What ``agent.source.manifests`` builds on: which files there are (``dir_stamp``), reading one
safely (``_read_file``), and per file the objects of its last good version, kept through a
failing parse or an in-place rewrite (the rules are in that module's docstring). Its own
module so that the scanning state is apart from the loader's threads and the source; it
never imports ``agent.source.manifests`` (which re-exports its names).
"""

from __future__ import annotations

import os
import stat as statmod
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.source.manifest_parse import ManifestError, ObjKey, parse_manifest

FileStamp = tuple[int, int, int]  # mtime_ns, size, inode
Parser = Callable[[str, bytes], tuple[dict[ObjKey, dict[str, Any]], list[str]]]

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")
#: How long an in-place rewrite may look empty or half-written before it is taken as is.
IN_PLACE_GRACE_S = 2.0
#: A manifest file larger than this is refused unread (its last good version is kept).
MAX_FILE_BYTES = 16 * 1024 * 1024


@dataclass
class _FileState:
    stamp: FileStamp
    objects: dict[ObjKey, dict[str, Any]]  # the last good version's
    good: bool  # some version of the file ever parsed
    problem: str = ""  # why the current content is not used ("" when it is)
    warnings: list[str] = field(default_factory=list)  # skipped documents of a good version
    settled: bool = True  # False: look again even if the file does not change


@dataclass(frozen=True)
class ParseJob:
    """A big file handed to the background parser, as it was when the scan saw it."""

    path: str
    st: os.stat_result
    stamp: FileStamp
    prev: _FileState | None


def _read_file(path: str, max_bytes: int) -> bytes:
    """A regular file's bytes, at most ``max_bytes``; never blocks on a FIFO or a device."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        if not statmod.S_ISREG(os.fstat(fd).st_mode):
            raise ManifestError("not a regular file")
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise ManifestError(f"larger than the {max_bytes}-byte limit for one file")
    finally:
        os.close(fd)


class ManifestFiles:
    """The objects of a manifest directory, parsed per file with last-good retention.

    ``read()`` re-parses only files whose (mtime, size, inode) changed; see the docstring of
    ``agent.source.manifests`` for what a failing or half-rewritten file does. ``pending`` is True while a
    file waits out the in-place grace period: callers must read again even if the directory
    stamp has not changed.

    With ``background_over`` set, ``read()`` does not parse a changed file larger than that:
    it keeps the file's previous state, notes it in ``loading`` and queues a ``ParseJob``
    (``take_jobs()``) for another thread, which runs ``load(job)`` and hands the result
    back with ``finish(job, state)``; the next ``read()`` installs it if the file has not
    changed since. Only ``finish`` may be called from another thread than ``read``'s.
    """

    def __init__(self, directory: str, grace: float = IN_PLACE_GRACE_S,
                 clock: Callable[[], float] = time.time, *,
                 background_over: int | None = None, max_bytes: int = MAX_FILE_BYTES) -> None:
        self.directory = directory
        self.grace = grace
        self.clock = clock
        self.background_over = background_over
        self.max_bytes = max_bytes
        self.pending = False
        self.loading: list[str] = []
        self.changed: set[ObjKey] = set()  # keys whose file's objects changed in the last read
        self._files: dict[str, _FileState] = {}
        self._queued: dict[str, FileStamp] = {}
        self._jobs: list[ParseJob] = []
        self._done: dict[str, tuple[FileStamp, _FileState | None]] = {}
        self._done_lock = threading.Lock()

    def _paths(self) -> list[str]:
        paths = []
        for root, _dirs, files in os.walk(self.directory):
            paths += [os.path.join(root, f) for f in files if f.endswith(MANIFEST_SUFFIXES)]
        return sorted(paths)

    @property
    def results_ready(self) -> bool:
        """A background parse finished: ``read()`` again to install it."""
        with self._done_lock:
            return bool(self._done)

    def take_jobs(self) -> list[ParseJob]:
        jobs, self._jobs = self._jobs, []
        return jobs

    def load(self, job: ParseJob, parse: Parser | None = None) -> _FileState | None:
        """Parse a queued file (any thread: touches no shared state), with ``parse`` in place
        of ``parse_manifest`` if given."""
        return self._load(job.path, job.st, job.stamp, job.prev, parse)

    def refuse(self, job: ParseJob, why: str) -> _FileState:
        """The state of a queued file that could not be parsed: its last good version kept."""
        return self._keep(job.prev, job.stamp, job.path, why)

    def finish(self, job: ParseJob, state: _FileState | None) -> None:
        with self._done_lock:
            self._done[job.path] = (job.stamp, state)

    def read(self, stats: Mapping[str, os.stat_result] | None = None
             ) -> tuple[dict[ObjKey, dict[str, Any]], list[str]]:
        """(every object, problems): later files win on a duplicate key. ``stats``: the
        manifest files and their stat results, as ``dir_stamp`` just found them (saves a
        second stat of every file)."""
        with self._done_lock:
            done, self._done = self._done, {}
        files: dict[str, _FileState] = {}
        loading: list[str] = []
        seen: set[str] = set()
        for path in sorted(stats) if stats is not None else self._paths():
            try:
                st = stats[path] if stats is not None else os.stat(path)
            except FileNotFoundError:
                continue  # deleted: its objects go
            except OSError as e:
                prev = self._files.get(path)
                if prev is not None:
                    files[path] = self._keep(prev, prev.stamp, path, f"cannot stat: {e.strerror}")
                continue
            seen.add(path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            prev = self._files.get(path)
            if prev is not None and prev.stamp == stamp and prev.settled:
                files[path] = prev
                continue
            if not statmod.S_ISREG(st.st_mode):
                files[path] = self._keep(prev, stamp, path, "not a regular file")
                continue
            if st.st_size > self.max_bytes:
                files[path] = self._keep(prev, stamp, path, f"{st.st_size} bytes, over the "
                                         f"{self.max_bytes}-byte limit for one file")
                continue
            if self.background_over is not None and st.st_size > self.background_over:
                finished = done.get(path)
                if finished is not None and finished[0] == stamp:
                    self._queued.pop(path, None)
                    if finished[1] is not None:
                        files[path] = finished[1]
                    continue
                if self._queued.get(path) != stamp:
                    self._queued[path] = stamp
                    self._jobs.append(ParseJob(path, st, stamp, prev))
                if prev is not None:
                    files[path] = prev  # served until the new version is parsed
                meanwhile = (f"its last good version ({len(prev.objects)} objects) is served "
                             "meanwhile" if prev is not None and prev.good
                             else "its objects are not known until then")
                loading.append(f"{path}: {st.st_size} bytes, being parsed in the background; "
                               f"{meanwhile}")
                continue
            state = self._load(path, st, stamp, prev)
            if state is not None:
                files[path] = state
        changed: set[ObjKey] = set()
        for path in self._files.keys() | files.keys():
            before, after = self._files.get(path), files.get(path)
            if before is None or after is None or before.objects is not after.objects:
                changed.update(before.objects if before is not None else ())
                changed.update(after.objects if after is not None else ())
        self.changed = changed
        self._files = files
        self._queued = {p: s for p, s in self._queued.items() if p in seen}
        self.loading = loading
        self.pending = any(not f.settled for f in files.values())
        objects: dict[ObjKey, dict[str, Any]] = {}
        problems: list[str] = []
        for state in files.values():
            objects.update(state.objects)
            if state.problem:
                problems.append(state.problem)
            problems += state.warnings
        return objects, problems

    def _parse(self, path: str, data: bytes) -> tuple[dict[ObjKey, dict[str, Any]], list[str]]:
        """One file's objects: ``parse_manifest`` (``agent.source.manifests.ManifestDir`` looks
        it up in its own module instead, where tests replace it)."""
        return parse_manifest(path, data)

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
              prev: _FileState | None, parse: Parser | None = None) -> _FileState | None:
        try:
            data = _read_file(path, self.max_bytes)
        except FileNotFoundError:
            return None
        except ManifestError as e:
            return self._keep(prev, stamp, path, str(e))
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
            objects, warnings = (parse or self._parse)(path, data)
        except ManifestError as e:
            return self._keep(prev, stamp, path, str(e))
        return _FileState(stamp, objects, True, "", warnings)


def dir_stamp(directory: str, stats: dict[str, os.stat_result] | None = None
              ) -> tuple[tuple[str, float, int], ...]:
    """(path, mtime, size) of the directory tree: changes when any manifest does. The stat
    results of the manifest files go into ``stats`` if given."""
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
            if stats is not None and f.endswith(MANIFEST_SUFFIXES):
                stats[p] = st
    return tuple(sorted(stamp))
