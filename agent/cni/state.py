"""The agent's record of captured pods, persisted atomically under the run dir.

A restart reads it back to know what it captured (netns paths, policies, rule fingerprints)
so it can re-verify tables and re-serve listeners without asking kubelet.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from agent.capture.policy import AnnotationProblem, CapturePolicy
from agent.common.ids import ContainerId, PodKey, pod_key

log = logging.getLogger("aether.state")
STATE_VERSION = 1


@dataclass
class CapturedPod:
    container_id: ContainerId
    uid: str
    namespace: str
    name: str
    service_account: str
    netns: str  # the path the agent uses (pinned copy when kubelet gave /proc/…)
    kubelet_netns: str
    ifname: str
    ips: list[str]
    policy: CapturePolicy
    fingerprint: str
    reason: str
    problems: list[AnnotationProblem] = field(default_factory=list)
    pinned: bool = False
    captured_at: float = 0.0
    net_admin: bool = False
    redirect_all_default: bool = False  # the netconf's, so a live re-decision matches ADD's
    enrolled_live: bool = False  # captured by a label/annotation change, not by its ADD
    workload: str = ""  # the pod's owner (its Deployment, StatefulSet...): the metrics' source
    # (127.0.0.1 binds, ::1 binds) in the netns, read by the ADD's own visit there; not
    # recorded (a restarted agent reads it again)
    loopback: tuple[bool, bool] | None = field(default=None, compare=False)
    # its labels as the ADD read them (what selects its AuthorizationPolicies before the mesh
    # model has the pod); not recorded: a restarted agent has them from the mesh source
    labels: dict[str, str] | None = field(default=None, compare=False)

    @property
    def key(self) -> PodKey:
        return pod_key(self.namespace, self.name)

    def to_json(self) -> dict[str, Any]:
        """As ``asdict`` gives it, without its recursive deep copy (the policy was converted
        twice): every ADD writes one of these."""
        d = {name: getattr(self, name) for name in _RECORD_FIELDS}
        d["ips"] = list(self.ips)
        d["policy"] = self.policy.to_json()
        d["problems"] = [asdict(p) for p in self.problems]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CapturedPod:
        d = dict(d)
        d["policy"] = CapturePolicy.from_json(d["policy"])
        d["problems"] = [AnnotationProblem(**p) for p in d.get("problems") or []]
        return cls(**d)


_RECORD_FIELDS = tuple(f.name for f in fields(CapturedPod) if f.name not in ("loopback", "labels"))


@dataclass
class AddIntent:
    """An ADD under way: the netns it works in (the pin when it pins) before any record."""

    container_id: str
    kubelet_netns: str
    netns: str
    pinned: bool


@dataclass
class SeenPod:
    """A pod that went through ADD uncaptured (not managed then), remembered with its netns so
    a label or annotation change can capture it live (agent/runtime/enroll.py), and a pod released
    live, remembered so it can be captured again. DEL forgets it."""

    container_id: str
    uid: str
    namespace: str
    name: str
    kubelet_netns: str
    ifname: str
    ips: list[str]
    netns_id: list[int]  # (st_dev, st_ino) when seen: a reused /proc/<pid> path is not it
    redirect_all_default: bool = False  # the netconf's capture_redirect_all_default
    seen_at: float = 0.0

    @property
    def key(self) -> PodKey:
        return pod_key(self.namespace, self.name)


TEMP_PREFIX = ".pod."
INTENT_SUFFIX = ".adding"


class StateStore:
    """Thread-safe map container_id → CapturedPod, one file per pod under `directory`.

    One small file a pod keeps each ADD/DEL O(1) (a single-file store rewrote and fsynced
    every pod on every ADD); each write is temp file + rename, so a crash of the agent leaves
    the old record or the new one, never a torn one (the page cache outlives the process).
    Records are not fsynced: they describe pod network namespaces and pins, which a node
    crash or reboot takes with it (and the run dir is tmpfs on most nodes), so no record
    is worth more after a reboot than none; reconcile drops what a reboot left behind, and
    ``load`` reports a file it cannot read rather than failing. An fsync cost every ADD
    ~1.4 ms of waiting on a disk-backed run dir for nothing.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self.pods: dict[str, CapturedPod] = {}
        self.load_problem: str | None = None
        self.swept: list[str] = []  # temp files of interrupted writes removed by load()
        self.seen: dict[str, SeenPod] = {}  # uncaptured pods with a netns (live enrollment)
        # container id -> its record's netns identity, as netns_owner last read it;
        # identity -> those container ids; the records not read yet (a put re-reads one)
        self._idents: dict[str, tuple[int, int]] = {}
        self._by_ident: dict[tuple[int, int], set[str]] = {}
        self._unread: set[str] = set()

    def _path(self, container_id: str) -> str:
        return os.path.join(self.directory, f"{container_id}.json")

    def load(self) -> None:
        pods: dict[str, CapturedPod] = {}
        problems: list[str] = []
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return
        self.swept = self._sweep_temp(names)
        for name in names:
            if not name.endswith(".json") or name.startswith("."):
                continue
            path = os.path.join(self.directory, name)
            try:
                with open(path, encoding="utf-8") as f:
                    raw = json.load(f)
                if raw.get("version") != STATE_VERSION:
                    raise ValueError(f"unknown state version {raw.get('version')!r}")
                pod = CapturedPod.from_json(raw["pod"])
                pods[pod.container_id] = pod
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                problems.append(f"{name}: {e}")
                os.replace(path, path + ".corrupt")
        seen = self._load_seen()
        if problems:
            self.load_problem = (f"state records unreadable ({'; '.join(problems)}); moved aside "
                                 "as *.corrupt, rebuilding from the live netns")
            log.error(self.load_problem)
        with self._lock:
            self.pods = pods
            self.seen = seen
            self._idents, self._by_ident, self._unread = {}, {}, set(pods)

    # -- uncaptured pods (live enrollment) ----------------------------------------------
    @property
    def seen_dir(self) -> str:
        return os.path.join(self.directory, "seen")

    def _load_seen(self) -> dict[str, SeenPod]:
        out: dict[str, SeenPod] = {}
        try:
            names = sorted(os.listdir(self.seen_dir))
        except FileNotFoundError:
            return out
        for name in names:
            path = os.path.join(self.seen_dir, name)
            if name.startswith(TEMP_PREFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                continue
            if not name.endswith(".json"):
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    seen = SeenPod(**json.load(f))
                out[seen.container_id] = seen
            except (OSError, ValueError, TypeError) as e:
                log.error("uncaptured-pod record %s unreadable (%s): dropped; that pod is "
                          "enrolled live only after its next ADD", name, e)
                with contextlib.suppress(OSError):
                    os.unlink(path)
        return out

    def put_seen(self, seen: SeenPod) -> None:
        self._write_file(os.path.join(self.seen_dir, f"{seen.container_id}.json"),
                         asdict(seen), sync=False, directory=self.seen_dir)
        with self._lock:
            self.seen[seen.container_id] = seen

    def remove_seen(self, container_id: str) -> SeenPod | None:
        with self._lock:
            seen = self.seen.pop(container_id, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.seen_dir, f"{container_id}.json"))
        return seen

    def get_seen(self, container_id: str) -> SeenPod | None:
        with self._lock:
            return self.seen.get(container_id)

    def all_seen(self) -> list[SeenPod]:
        with self._lock:
            return list(self.seen.values())

    def _sweep_temp(self, names: list[str]) -> list[str]:
        """Remove the temp files of writes a crash (SIGKILL) interrupted: a temp file is
        renamed into place or unlinked by its writer, so at load none is still in use."""
        swept = []
        for name in names:
            if name.startswith(TEMP_PREFIX):
                try:
                    os.unlink(os.path.join(self.directory, name))
                    swept.append(name)
                except FileNotFoundError:
                    pass
        if swept:
            log.info("removed %d temp files of interrupted state writes: %s", len(swept),
                     ", ".join(swept[:10]))
        return swept

    def _write(self, pod: CapturedPod) -> None:
        data = {"version": STATE_VERSION, "pod": pod.to_json()}
        self._write_file(self._path(pod.container_id), data, sync=False)  # see the class doc

    def _write_file(self, path: str, data: dict[str, Any], sync: bool,
                    directory: str = "") -> None:
        """Write ``data`` as JSON to ``path`` atomically (a temp file renamed into place).
        Every ADD writes twice, so this is a handful of syscalls: the temp name is this
        thread's own (no random name, no O_EXCL retry loop), created 0600 (no chmod), and
        the directory is made only when it is missing."""
        directory = directory or self.directory
        tmp = os.path.join(directory, f"{TEMP_PREFIX}{threading.get_ident()}-"
                                      f"{os.path.basename(path)}")
        # dumps, not dump: dump streams through the pure-Python encoder in chunks
        body = json.dumps(data, sort_keys=True).encode()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileNotFoundError:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            fd = os.open(tmp, flags, 0o600)
        try:
            try:
                view = memoryview(body)
                while view:
                    view = view[os.write(fd, view):]
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    def put(self, pod: CapturedPod) -> None:
        self._write(pod)
        with self._lock:
            self.pods[pod.container_id] = pod
            # a new record may pin a new namespace on the same path
            self._forget_ident(pod.container_id)
            self._unread.add(pod.container_id)

    def remove(self, container_id: str) -> CapturedPod | None:
        with self._lock:
            pod = self.pods.pop(container_id, None)
            self._forget_ident(container_id)
        try:
            os.unlink(self._path(container_id))
        except FileNotFoundError:
            pass
        return pod

    # -- ADD intents: what an ADD in progress may have done before its record exists ------
    def _intent_path(self, container_id: str) -> str:
        return os.path.join(self.directory, f"{container_id}{INTENT_SUFFIX}")

    def begin_add(self, intent: AddIntent) -> None:
        """Written before an ADD's first step (pin, rules): a restarted agent that finds it
        without a record undoes what that ADD did (agent/runtime/recovery.py). Not fsynced: it must
        survive a crash of the agent, not of the node (a reboot takes every netns and pin)."""
        self._write_file(self._intent_path(intent.container_id), asdict(intent), sync=False)

    def end_add(self, container_id: str) -> None:
        """The ADD is recorded (its record supersedes the intent) or undone."""
        try:
            os.unlink(self._intent_path(container_id))
        except FileNotFoundError:
            pass

    def intents(self) -> list[AddIntent]:
        """Intents left by ADDs that never finished (only a crash leaves one behind)."""
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            if not name.endswith(INTENT_SUFFIX) or name.startswith("."):
                continue
            cid = name[:-len(INTENT_SUFFIX)]
            try:
                with open(os.path.join(self.directory, name), encoding="utf-8") as f:
                    raw = json.load(f)
                out.append(AddIntent(container_id=cid, kubelet_netns=str(raw["kubelet_netns"]),
                                     netns=str(raw["netns"]), pinned=bool(raw["pinned"])))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                log.error("ADD intent %s unreadable (%s): only its pin can be undone", name, e)
                out.append(AddIntent(container_id=cid, kubelet_netns="", netns="", pinned=False))
        return out

    def get(self, container_id: str) -> CapturedPod | None:
        with self._lock:
            return self.pods.get(container_id)

    def all(self) -> list[CapturedPod]:
        with self._lock:
            return list(self.pods.values())

    def netns_owner(
        self,
        target: tuple[int, int],
        identity: Callable[[str], tuple[int, int]],
        exclude: str = "",
    ) -> CapturedPod | None:
        """The record (other than container `exclude`) whose netns is `target`.

        Paths differ (a pin under <run-dir>/netns, /var/run/netns/<name>, /proc/<pid>/ns/net),
        so namespaces are compared by identity (`identity(path)` → (st_dev, st_ino), e.g.
        agent.netns.enter.netns_identity); a record whose netns is gone owns nothing.
        """
        # Every ADD asks this, so it must neither stat nor visit every record: with 16 ADDs
        # at once, N short syscalls each handing the GIL back made it the ADD path's
        # bottleneck, and a Python loop over every record is most of a millisecond at a few
        # hundred pods. Identities are read once per record (and its path) into an index
        # by identity; only a match is stat'ed again (a namespace that is gone can leave its
        # inode to a new one). pod.netns, not kubelet_netns: a /proc/<pid> path may name a
        # reused pid.
        with self._lock:
            todo = [(cid, pod.netns) for cid in self._unread
                    if (pod := self.pods.get(cid)) is not None and pod.netns]
            self._unread.intersection_update(c for c, _p in todo)
        for cid, path in todo:
            try:
                ident = identity(path)
            except OSError:
                continue  # gone (owns nothing) or unreadable now: asked again next time
            with self._lock:
                pod = self.pods.get(cid)
                if pod is None or pod.netns != path or cid not in self._unread:
                    continue
                self._unread.discard(cid)
                self._idents[cid] = ident
                self._by_ident.setdefault(ident, set()).add(cid)
        with self._lock:
            candidates = [(cid, pod) for cid in self._by_ident.get(target, ())
                          if cid != exclude and (pod := self.pods.get(cid)) is not None]
        for cid, pod in candidates:
            try:
                if identity(pod.netns) == target:
                    return pod
            except OSError:
                pass
            with self._lock:  # no longer that namespace: read it afresh next time
                if self.pods.get(cid) is pod:
                    self._forget_ident(cid)
                    self._unread.add(cid)
        return None

    def _forget_ident(self, cid: str) -> None:
        """Drop a record from the identity index (caller holds the lock)."""
        self._unread.discard(cid)
        ident = self._idents.pop(cid, None)
        if ident is not None:
            owners = self._by_ident.get(ident)
            if owners is not None:
                owners.discard(cid)
                if not owners:
                    del self._by_ident[ident]
