"""The delay before restarting an endless loop that failed: a watch stream, the Envoy child.

Not tenacity: these are not retries of one call (tenacity's job, used for those: the API
reads in agent.source.kube, the taint patch, the EndpointSlice cleanup) but supervision loops
that run for the agent's life, count their recent failures, and reset the count on
success; tenacity's wait strategies take a per-call retry state they do not have. One
shape for all: exponential from ``base``, capped, jittered between half and the full step
so a fleet of nodes that lost the API together does not come back in step."""

from __future__ import annotations

import random


def backoff_delay(failures: int, base: float = 0.2, cap: float = 5.0) -> float:
    """Seconds to wait after ``failures`` consecutive failures (1 for the first)."""
    step = min(cap, base * (2 ** max(0, failures - 1)))
    return random.uniform(step / 2, step)
