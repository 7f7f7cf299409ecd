"""Gateway API policies on Services: XBackendTrafficPolicy (retry budget, session
persistence) and BackendLBPolicy (session persistence) folded into a Service's traffic fields.

Split out of ``agent.scope.model``, which keeps the policy objects by key; which policy wins
for which field is here. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from agent.scope.services import (
    Service,
    TrafficPolicy,
    policy_targets,
    retry_constraint,
    session_persistence,
)
from agent.source.objects import BackendTrafficPolicyObject

#: Gateway API policies on Services: XBackendTrafficPolicy (retry budget, session
#: persistence) and its predecessor BackendLBPolicy (session persistence), one pool: on
#: conflict the oldest of either kind wins.
BACKEND_POLICY_KINDS = ("XBackendTrafficPolicy", "BackendLBPolicy")


def policy_traffic(svc: Service, policies: Mapping[str, BackendTrafficPolicyObject]) -> TrafficPolicy:
    """The Service's own traffic fields, with the retry budget of the oldest
    XBackendTrafficPolicy targeting it and the session persistence of the oldest policy
    (XBackendTrafficPolicy or BackendLBPolicy) that sets one (Gateway API: on conflict,
    the oldest policy by creation time, then by namespace/name, wins), each field on its
    own. ``policies``: every policy object by its model key."""
    ordered = sorted(
        ((str((p.get("metadata") or {}).get("creationTimestamp") or ""), k, p)
         for k, p in policies.items() if svc.key in policy_targets(p)),
        key=lambda t: (t[0], t[1]))
    traffic = svc.traffic
    retry = session = False
    for _created, _key, p in ordered:
        percent, floor = retry_constraint(p)
        if percent is not None and not retry:
            traffic = replace(traffic, retry_budget_percent=percent,
                              min_retry_concurrency=floor)
            retry = True
        persistence = session_persistence(p)
        if persistence is not None and not session:
            traffic = replace(traffic, session=persistence)
            session = True
    return traffic
