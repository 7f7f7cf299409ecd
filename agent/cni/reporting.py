"""What the CNI handler reports besides its answers: the counters of its outcomes, and the
invalid capture annotations of a pod (log line, recent problem for `status`, Kubernetes Event
through the bounded event queue). Apart from the lifecycle so its steps read as steps."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from agent.capture.policy import CaptureDecision
from agent.source.base import PodEvent
from agent.source.event_queue import EventQueue
from agent.source.model import PodMeta

log = logging.getLogger("aether.cni")

REASON_INVALID_ANNOTATION = "CaptureAnnotationInvalid"


@dataclass
class Counters:
    add_ok: int = 0
    add_failed: int = 0
    add_skipped: int = 0
    del_ok: int = 0
    check_ok: int = 0
    check_failed: int = 0
    annotation_errors: int = 0
    enrolled: int = 0  # captured live on a label/annotation change
    released: int = 0  # released live
    reapplied: int = 0  # exclusions changed in place


def report_problems(pod: PodMeta, decision: CaptureDecision, counters: Counters,
                    recent_problems: deque[dict[str, Any]], events: EventQueue) -> None:
    """The pod's invalid capture annotations: counted, logged, kept for `status`, sent as an
    Event (the valid entries are applied all the same)."""
    counters.annotation_errors += len(decision.problems)
    message = "; ".join(str(x) for x in decision.problems)
    message += " — the valid entries are applied"
    log.warning("pod %s: invalid capture annotations: %s", pod.key, message,
                extra={"pod": pod.name, "namespace": pod.namespace})
    recent_problems.append({"pod": pod.key, "reason": REASON_INVALID_ANNOTATION,
                            "message": message, "time": time.time()})
    events.put(PodEvent(pod.namespace, pod.name, pod.uid,
                        REASON_INVALID_ANNOTATION, message))
