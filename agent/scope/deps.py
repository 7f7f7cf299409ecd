"""The node dependency set: which Services this node's proxy must know (demand scope).

A node serves only what its managed pods need: Services they declare
(``aether.io/dependencies``: ``svc`` in the pod's namespace, ``ns/svc``, ``ns/*``), in-mesh
Services they were seen dialling (learned from the passthrough access log, kept for a TTL
refreshed on use — the first connection passes through, later ones are meshed), and,
transitively, the backendRefs of every route target in the set. ``scope_all`` switches the
limiter off. Every entry can say why it is in (``explain``), because "why is X (not) in my
proxy" is the first question an operator asks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

DEPENDENCIES_ANNOTATION = "aether.io/dependencies"
DEFAULT_LEARN_TTL = 600.0


@dataclass(frozen=True)
class DepPattern:
    """``ns/name`` or ``ns/*``."""

    namespace: str
    name: str  # "*" for the whole namespace

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def parse_dependencies(value: str, pod_namespace: str) -> tuple[set[DepPattern], list[str]]:
    """The annotation → patterns; malformed entries are returned as problems, never raised."""
    patterns: set[DepPattern] = set()
    problems: list[str] = []
    for raw in value.replace("\n", ",").split(","):
        entry = raw.strip()
        if not entry:
            continue
        parts = entry.split("/")
        if len(parts) == 1:
            ns, name = pod_namespace, parts[0]
        elif len(parts) == 2:
            ns, name = parts
        else:
            problems.append(f"{entry!r}: expected svc, ns/svc or ns/*")
            continue
        ns, name = ns.strip(), name.strip()
        if not ns or not name or (name == "*" and len(parts) == 1) or "*" in ns:
            problems.append(f"{entry!r}: expected svc, ns/svc or ns/*")
            continue
        patterns.add(DepPattern(ns, name))
    return patterns, problems


class DependencySet:
    """Declared + learned entries and their closure over route targets' backends."""

    def __init__(
        self,
        *,
        ttl: float = DEFAULT_LEARN_TTL,
        clock: Callable[[], float] = time.monotonic,
        scope_all: bool = False,
    ) -> None:
        self.ttl = ttl
        self.clock = clock
        self.scope_all = scope_all
        self._declared: dict[str, set[DepPattern]] = {}  # pod key → its patterns
        self.problems: dict[str, list[str]] = {}
        self._learned: dict[str, float] = {}  # service key → expiry (clock time)

    # ---- declared --------------------------------------------------------------------------

    def set_declared(self, pod_key: str, annotation: str | None, pod_namespace: str) -> bool:
        """Replace one pod's declarations; True if they changed (only this pod is touched)."""
        patterns, problems = parse_dependencies(annotation or "", pod_namespace)
        if problems:
            self.problems[pod_key] = problems
        else:
            self.problems.pop(pod_key, None)
        old = self._declared.get(pod_key, set())
        if patterns:
            self._declared[pod_key] = patterns
        else:
            self._declared.pop(pod_key, None)
        return old != patterns

    def remove_pod(self, pod_key: str) -> bool:
        self.problems.pop(pod_key, None)
        return self._declared.pop(pod_key, None) is not None

    def declared_patterns(self) -> dict[DepPattern, set[str]]:
        out: dict[DepPattern, set[str]] = {}
        for pod, patterns in self._declared.items():
            for p in patterns:
                out.setdefault(p, set()).add(pod)
        return out

    # ---- learned ---------------------------------------------------------------------------

    def learn(self, svc_key: str) -> bool:
        """A local pod dialled this in-mesh Service: (re)start its TTL. True if newly added."""
        now = self.clock()
        expiry = self._learned.get(svc_key)
        new = expiry is None or expiry <= now
        self._learned[svc_key] = now + self.ttl
        return new

    def expire(self) -> set[str]:
        """Drop learned entries past their TTL; returns them."""
        now = self.clock()
        gone = {k for k, exp in self._learned.items() if exp <= now}
        for k in gone:
            del self._learned[k]
        return gone

    def learned(self) -> dict[str, float]:
        """Live learned entries → seconds left."""
        now = self.clock()
        return {k: exp - now for k, exp in self._learned.items() if exp > now}

    def next_expiry(self) -> float | None:
        """Seconds until the next learned entry lapses (for the caller's timer)."""
        left = self.learned().values()
        return min(left) if left else None

    # ---- the set ---------------------------------------------------------------------------

    def roots(self, services_in_ns: Callable[[str], Iterable[str]]) -> dict[str, list[str]]:
        """Entries before closure → reasons."""
        why: dict[str, list[str]] = {}
        for pattern, pods in sorted(self.declared_patterns().items(), key=lambda i: str(i[0])):
            keys = (
                list(services_in_ns(pattern.namespace)) if pattern.name == "*" else [str(pattern)]
            )
            for k in keys:
                why.setdefault(k, []).append(
                    f"declared by {', '.join(sorted(pods))}"
                    + (f" ({pattern})" if pattern.name == "*" else "")
                )
        for k, left in sorted(self.learned().items()):
            why.setdefault(k, []).append(f"learned from traffic, expires in {left:.0f}s")
        return why

    def explain(
        self,
        services_in_ns: Callable[[str], Iterable[str]],
        backends_of: Callable[[str], Iterable[str]],
        all_services: Callable[[], Iterable[str]] | None = None,
    ) -> dict[str, list[str]]:
        """Every Service in the set → why (declared-by pods, learned + expiry, via target X)."""
        if self.scope_all:
            why = {k: ["--scope all"] for k in (all_services() if all_services else ())}
        else:
            why = self.roots(services_in_ns)
        queue = sorted(why)
        seen = set(queue)
        while queue:
            target = queue.pop(0)
            for b in sorted(backends_of(target)):
                if b == target:
                    continue
                if f"backend of route target {target}" not in why.setdefault(b, []):
                    why[b].append(f"backend of route target {target}")
                if b not in seen:
                    seen.add(b)
                    queue.append(b)
        return why

    def compute(
        self,
        services_in_ns: Callable[[str], Iterable[str]],
        backends_of: Callable[[str], Iterable[str]],
        all_services: Callable[[], Iterable[str]] | None = None,
    ) -> set[str]:
        return set(self.explain(services_in_ns, backends_of, all_services))
