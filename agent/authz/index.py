"""The AuthorizationPolicies the agent knows, and which of them select a pod (#41).

Plain data: the object store's events go in (upsert/remove), a pod's namespace and labels
come out as the policies that select it, in a stable order (by key), so the same set always
renders the same filters and a pod whose set did not change keeps its listener untouched.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from agent.authz.policy import DEFAULT_ROOT_NAMESPACE, Policy, parse_policy, selects


class PolicyIndex:
    def __init__(self, root_namespace: str = DEFAULT_ROOT_NAMESPACE) -> None:
        self.root_namespace = root_namespace
        self._by_key: dict[str, Policy] = {}
        self._lock = threading.Lock()

    def upsert(self, obj: Mapping[str, Any]) -> Policy | None:
        """Parse and hold ``obj``; returns the policy when it changed (None: the same)."""
        policy = parse_policy(obj)
        with self._lock:
            if self._by_key.get(policy.key) == policy:
                return None
            self._by_key[policy.key] = policy
        return policy

    def remove(self, namespace: str, name: str) -> bool:
        with self._lock:
            return self._by_key.pop(f"{namespace}/{name}", None) is not None

    def all(self) -> list[Policy]:
        with self._lock:
            return sorted(self._by_key.values(), key=lambda p: p.key)

    def for_pod(self, namespace: str, labels: Mapping[str, str]) -> tuple[Policy, ...]:
        """The policies that select a pod of ``namespace`` with ``labels``, by key."""
        return tuple(p for p in self.all()
                     if selects(p, namespace, labels, self.root_namespace))

    def problems(self) -> list[tuple[str, str]]:
        """(policy key, why it cannot be read) of each policy enforced fail closed."""
        return [(p.key, p.error) for p in self.all() if p.error is not None]

    def __len__(self) -> int:
        return len(self._by_key)
