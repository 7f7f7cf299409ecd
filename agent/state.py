"""The agent's record of captured pods, persisted atomically under the run dir.

A restart reads it back to know what it captured (netns paths, policies, rule fingerprints)
so it can re-verify tables and re-serve listeners without asking kubelet.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from agent.capture.policy import AnnotationProblem, CapturePolicy

log = logging.getLogger("aether.state")
STATE_VERSION = 1


@dataclass
class CapturedPod:
    container_id: str
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

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["policy"] = self.policy.to_json()
        d["problems"] = [asdict(p) for p in self.problems]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CapturedPod:
        d = dict(d)
        d["policy"] = CapturePolicy.from_json(d["policy"])
        d["problems"] = [AnnotationProblem(**p) for p in d.get("problems") or []]
        return cls(**d)


class StateStore:
    """Thread-safe map container_id → CapturedPod, one file per pod under `directory`.

    One small file a pod keeps each ADD/DEL O(1) (a single-file store rewrote and fsynced
    every pod on every ADD); each write is temp file + fsync + rename, so a crash leaves the
    old record or the new one, never a torn one.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self.pods: dict[str, CapturedPod] = {}
        self.load_problem: str | None = None

    def _path(self, container_id: str) -> str:
        return os.path.join(self.directory, f"{container_id}.json")

    def load(self) -> None:
        pods: dict[str, CapturedPod] = {}
        problems: list[str] = []
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return
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
        if problems:
            self.load_problem = (f"state records unreadable ({'; '.join(problems)}); moved aside "
                                 "as *.corrupt, rebuilding from the live netns")
            log.error(self.load_problem)
        with self._lock:
            self.pods = pods

    def _write(self, pod: CapturedPod) -> None:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        data = {"version": STATE_VERSION, "pod": pod.to_json()}
        fd, tmp = tempfile.mkstemp(prefix=".pod.", dir=self.directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, self._path(pod.container_id))
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

    def remove(self, container_id: str) -> CapturedPod | None:
        with self._lock:
            pod = self.pods.pop(container_id, None)
        try:
            os.unlink(self._path(container_id))
        except FileNotFoundError:
            pass
        return pod

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
        for pod in self.all():
            if pod.container_id == exclude:
                continue
            try:  # pod.netns, not kubelet_netns: a /proc/<pid> path may name a reused pid
                if pod.netns and identity(pod.netns) == target:
                    return pod
            except OSError:
                continue
        return None
