"""A pod's workload: what traffic metrics name a caller by (its owner, not the pod)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any


def workload_of(pod_name: str, obj: Mapping[str, Any] | None) -> str:
    """The controlling owner's name; a ReplicaSet's Deployment (the ReplicaSet name less
    its ``-<pod-template-hash>``); the pod itself when it has no owner."""
    meta = (obj or {}).get("metadata") or {}
    owners = [o for o in meta.get("ownerReferences") or [] if isinstance(o, dict)]
    owner = next((o for o in owners if o.get("controller")), owners[0] if owners else None)
    if owner is None or not owner.get("name"):
        return pod_name
    name = str(owner["name"])
    if owner.get("kind") == "ReplicaSet":
        pth = str((meta.get("labels") or {}).get("pod-template-hash") or "")
        if pth and name.endswith(f"-{pth}"):
            name = name[: -len(pth) - 1]
    return sys.intern(name)  # one string for a workload's pods
