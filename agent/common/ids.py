"""The agent's identifiers as distinct types (``NewType``): all strings at run time, but a
Service key can no longer be handed where a pod key or a container id is meant (pure).

- ``ContainerId``: ``CNI_CONTAINERID``, the sandbox's id: a capture record's key.
- ``PodKey``: ``<namespace>/<name>`` of a Pod (the registry's key, a record's ``key``).
- ``ServiceKey``: ``<namespace>/<name>`` of a Service (the catalog's key, a view's key).
- ``IdentityKey``: ``<namespace>/<serviceaccount>``: a workload identity (proposal 023's
  registry key), whose SVID is ``spiffe://<td>/ns/<ns>/sa/<sa>``.
"""

from __future__ import annotations

import sys
from typing import NewType

ContainerId = NewType("ContainerId", str)
PodKey = NewType("PodKey", str)
ServiceKey = NewType("ServiceKey", str)
IdentityKey = NewType("IdentityKey", str)


# Keys are interned: each is held by many maps, sets and endpoints, once as one object.
def pod_key(namespace: str, name: str) -> PodKey:
    return PodKey(sys.intern(f"{namespace}/{name}"))


def service_key(namespace: str, name: str) -> ServiceKey:
    return ServiceKey(sys.intern(f"{namespace}/{name}"))
