"""Envoy's RBAC counters → ``aether_authz_decisions_total`` (#41). Pure.

The inbound filters (``agent.authz.rbac``) name their stats by the pod's listener uid, the
action and a tag (the policy's index among the pod's, or ``any`` for the ALLOW set):

* network (L4 chains, the judging listener): ``aether_authz.<uid>.<action>.<tag>.rbac.<r>``
* HTTP, one filter (a pod's own detection listener: ``http.inbound-detect-<uid>.…``):
  ``http.inbound-<uid>-http.rbac.aether_authz.http.allowed`` (allowed: no DENY matched,
  an ALLOW did) and Envoy's per-rule ``….aether_authz.http.policy.<ns>/<name>[<rule>].
  denied`` (a DENY policy), ``….http.policy.~no_allow.denied`` (no ALLOW admitted it),
  ``….aether_authz.audit.all.policy.<ns>/<name>[<rule>].shadow_allowed`` (audited)

A decision is counted where it was taken: a DENY policy's ``denied`` (``deny`` under that
policy), the ALLOW set's ``allowed``/``denied`` (under ``*``: Envoy does not say which ALLOW
matched), an AUDIT policy's ``shadow_allowed`` (``audit``). Pods are summed into their
workload, so the series are bounded by workloads × the policies that select them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from agent.authz.policy import Policy
from agent.authz.rbac import ANY_ALLOW, NO_ALLOW

_NET = re.compile(r"^aether_authz\.(?P<uid>[^.]+)\.(?P<action>deny|allow|audit)\."
                  r"(?P<tag>[^.]+)\.rbac\.(?P<result>[a-z_]+)$")
# the HCM of a pod's declared HTTP chain (``inbound-<uid>-http``) or of its own detection
# listener (``inbound-detect-<uid>``); its one RBAC filter (``rbac.http_rbac_filters``)
_HCM = r"^http\.inbound-(?:detect-(?P<detected>[^.]+)|(?P<uid>[^.]+)-http)\.rbac\.aether_authz\."
_HTTP = re.compile(_HCM + r"(?P<tag>http)\.(?P<result>allowed)$")
# Envoy's per-rule stats name the policy (``<ns>/<name>[<rule>]``; an unreadable one without
# the rule; ``~no_allow``: what no ALLOW policy admitted)
_HTTP_RULE = re.compile(_HCM + r"(?:http|(?P<audit>audit)\.all)\.policy\."
                        r"(?P<policy>[^/.]+/[^\[.]+|~no_allow)(?:\[\d+\])?\."
                        r"(?P<result>[a-z_]+)$")
STATS_FILTER = r"aether_authz\."


class Decisions(NamedTuple):
    dst_namespace: str
    dst_workload: str
    policy: str
    action: str
    decision: str


_COUNTED = {("deny", "denied"): "deny", ("allow", "allowed"): "allow",
            ("allow", "denied"): "deny", ("audit", "shadow_allowed"): "audit"}


def decisions(stats: Iterable[tuple[str, int]],
              pods: Mapping[str, tuple[str, str, Sequence[Policy]]]) -> dict[Decisions, int]:
    """``stats``: (name, value) of Envoy's counters; ``pods``: listener uid → (namespace,
    workload, the policies its filters were rendered from). A pod gone since (its stats
    outlive it until Envoy drops them) is not counted."""
    out: dict[Decisions, int] = {}
    for name, value in stats:
        m = _NET.match(name)
        if m is not None:
            action, result, tag = m["action"], m["result"], m["tag"]
        else:
            m = _HTTP.match(name) or _HTTP_RULE.match(name)
            if m is None:
                continue
            groups = m.groupdict()
            result, policy_name = m["result"], groups.get("policy")
            if policy_name is None:  # the filter's allowed: no DENY, some ALLOW matched
                action, tag = "allow", ANY_ALLOW
            elif groups.get("audit"):
                action, tag = "audit", None
            elif policy_name == NO_ALLOW:
                action, tag = "allow", ANY_ALLOW
            else:
                action, tag = "deny", None
        uid = m.groupdict().get("detected") or m["uid"]
        decision = _COUNTED.get((action, result))
        pod = pods.get(uid)
        if decision is None or pod is None:
            continue
        ns, workload, policies = pod
        if tag is None:  # a per-rule stat: the policy by name
            policy = m["policy"]
        elif tag == ANY_ALLOW:
            if not any(p.action == "ALLOW" for p in policies):
                continue  # allowed with no ALLOW policy selecting it: not an ALLOW decision
            policy = "*"
        else:
            try:
                policy = policies[int(tag)].key
            except (ValueError, IndexError):
                continue
        key = Decisions(ns, workload, policy, action.upper(), decision)
        out[key] = out.get(key, 0) + value
    # every policy that selects a pod is there from the start, at zero
    for ns, workload, policies in pods.values():
        for p in policies:
            action = p.action.lower()
            for (a, _r), decision in _COUNTED.items():
                if a == action:
                    out.setdefault(Decisions(ns, workload, "*" if a == "allow" else p.key,
                                             p.action, decision), 0)
    return out
