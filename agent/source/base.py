"""The metadata-source contract shared by the Kubernetes API and the manifest directory.

The CNI handler only needs point lookups (pod, namespace) and a way to report a problem on a
pod (a Kubernetes Event, or a log line + status entry in standalone mode). Later issues grow
sources into list/watch; the event type below is the shape both backends will emit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from agent.source.model import NamespaceMeta, PodMeta

EventType = Literal["ADDED", "MODIFIED", "DELETED"]


@dataclass(frozen=True)
class WatchEvent:
    """One change to one object, identical whichever backend produced it."""

    type: EventType
    kind: str
    obj: dict[str, Any]


@dataclass(frozen=True)
class PodEvent:
    """A Kubernetes Event to record against a pod (or, with ``kind``/``api_version``,
    another namespaced object of ours: an AuthorizationPolicy that cannot be read)."""

    namespace: str
    pod: str  # the object's name
    uid: str
    reason: str
    message: str
    type: Literal["Normal", "Warning"] = "Warning"
    kind: str = "Pod"
    api_version: str = "v1"


class SourceError(Exception):
    """The source could not answer (API down after retries, unreadable directory)."""


class MetadataSource(Protocol):
    def get_pod(self, namespace: str, name: str, uid: str = "") -> PodMeta | None:
        """The pod, None if it does not exist; SourceError if the source cannot answer.

        The CNI handler treats None (and a None namespace) as "not known yet" — try-again,
        never "not managed". ``uid`` (kubelet's K8S_POD_UID): a cache holding another pod of
        that name (a StatefulSet pod recreated) must look again rather than answer with it."""
        ...

    def get_namespace(self, name: str) -> NamespaceMeta | None:
        ...

    def record_event(self, event: PodEvent) -> None:
        """Best effort: a failure to record is logged, never raised."""
        ...

    def describe(self) -> str:
        """One line for logs and status: which source this is."""
        ...
