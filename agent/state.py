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
    """Thread-safe map container_id → CapturedPod, saved on every change."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.pods: dict[str, CapturedPod] = {}
        self.load_problem: str | None = None

    def load(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as f:
                raw = json.load(f)
            if raw.get("version") != STATE_VERSION:
                raise ValueError(f"unknown state version {raw.get('version')!r}")
            pods = {cid: CapturedPod.from_json(p) for cid, p in raw["pods"].items()}
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            self.load_problem = f"state file {self.path} unreadable ({e}); rebuilding"
            log.error(self.load_problem)
            return
        with self._lock:
            self.pods = pods

    def _save_locked(self) -> None:
        data = {
            "version": STATE_VERSION,
            "pods": {cid: p.to_json() for cid, p in sorted(self.pods.items())},
        }
        directory = os.path.dirname(self.path) or "."
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".state.", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    def put(self, pod: CapturedPod) -> None:
        with self._lock:
            self.pods[pod.container_id] = pod
            self._save_locked()

    def remove(self, container_id: str) -> CapturedPod | None:
        with self._lock:
            pod = self.pods.pop(container_id, None)
            if pod is not None:
                self._save_locked()
            return pod

    def get(self, container_id: str) -> CapturedPod | None:
        with self._lock:
            return self.pods.get(container_id)

    def all(self) -> list[CapturedPod]:
        with self._lock:
            return list(self.pods.values())
