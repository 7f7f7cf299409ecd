"""Which pods are captured and how: a pure function of pod, namespace and node defaults.

Names and precedence follow proposal 022 (seeds/003): managed pods only; redirect-all from
the node default unless the pod annotation overrides it either way; exclusions are carved out
ahead of the redirect; a malformed entry never stops the rest and is always reported.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, replace
from typing import Any

from agent.common.config import NodeConfig
from agent.source.model import NamespaceMeta, PodMeta

MANAGED_LABEL = "aether.io/managed"
ANN_REDIRECT_ALL = "capture.aether.io/redirect-all"
ANN_EXCLUDE_PORTS = "capture.aether.io/exclude-outbound-ports"
ANN_EXCLUDE_RANGES = "capture.aether.io/exclude-outbound-ip-ranges"
# DNS capture (#42): on where the node has it, unless the pod says "false"
ANN_DNS = "capture.aether.io/dns"
# Peer authentication (#16): on the pod, else on its namespace, else permissive.
ANN_PEER_AUTH = "security.aether.io/peer-authentication"
PEER_AUTH_MODES = ("permissive", "strict")

#: Always returned before the redirect: loopback, link-local (cloud metadata), multicast.
BUILTIN_EXCLUDED_V4 = ("127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4")
BUILTIN_EXCLUDED_V6 = ("::1/128", "fe80::/10", "ff00::/8")

MAX_ENTRIES = 1024


@dataclass(frozen=True)
class AnnotationProblem:
    """One rejected annotation entry; becomes a warning log and a pod Event."""

    annotation: str
    entry: str
    reason: str

    def __str__(self) -> str:
        return f"{self.annotation}: {self.entry!r} rejected ({self.reason})"


@dataclass(frozen=True)
class CapturePolicy:
    """Everything the rule renderer needs for one pod; stored in the state file."""

    redirect_all: bool
    capture_port: int
    mesh_port: int
    mark: int
    mark_mask: int
    exclude_ports: tuple[tuple[int, int], ...] = ()
    exclude_v4: tuple[str, ...] = ()
    exclude_v6: tuple[str, ...] = ()
    # The proxy's cgroup (v2) as nft names it (relative to /sys/fs/cgroup) and its level in
    # the hierarchy: the mark RETURN holds only for sockets of that cgroup. None: this host
    # offers no unforgeable match and the RETURN is by mark alone (reported as degraded).
    proxy_cgroup: str | None = None
    proxy_cgroup_level: int = 0
    # The other agent's proxy cgroup while two agents overlap (a take-over): its upstream
    # sockets RETURN too, until it has exited. None outside a take-over.
    peer_cgroup: str | None = None
    peer_cgroup_level: int = 0
    # STRICT peer authentication: new inbound TCP connections are refused unless they come
    # to the inbound (mTLS) port, over the pod's loopback (the proxy delivering), or from the
    # node's own addresses (kubelet probes).
    strict: bool = False
    inbound_port: int = 15008
    # Judged (#41): an AuthorizationPolicy selects the pod and it is not STRICT. New inbound
    # TCP connections go to the proxy's plaintext listener on ``judge_port``, which applies
    # the policies (a plaintext caller has no identity: only ipBlocks can match it) and
    # delivers what they allow; the same exemptions as STRICT.
    judged: bool = False
    judge_port: int = 15006
    node_sources_v4: tuple[str, ...] = ()
    node_sources_v6: tuple[str, ...] = ()
    # DNS capture: UDP and TCP to port 53 (but to the pod's own addresses) go to the pod's
    # DNS on ``dns_port`` of its loopback (agent/dns/)
    dns_capture: bool = False
    dns_port: int = 15053

    @property
    def mode(self) -> str:
        return "redirect-all" if self.redirect_all else "scoped"

    def to_json(self) -> dict[str, object]:
        return {
            "redirect_all": self.redirect_all,
            "capture_port": self.capture_port,
            "mesh_port": self.mesh_port,
            "mark": self.mark,
            "mark_mask": self.mark_mask,
            "exclude_ports": [list(r) for r in self.exclude_ports],
            "exclude_v4": list(self.exclude_v4),
            "exclude_v6": list(self.exclude_v6),
            "proxy_cgroup": self.proxy_cgroup,
            "proxy_cgroup_level": self.proxy_cgroup_level,
            # only during a take-over, so the policies of every other moment keep their hash
            **({"peer_cgroup": self.peer_cgroup, "peer_cgroup_level": self.peer_cgroup_level}
               if self.peer_cgroup else {}),
            # only for STRICT: a permissive policy keeps the hash (and table comment) it had
            **({"strict": True, "inbound_port": self.inbound_port} if self.strict else {}),
            **({"judged": True, "judge_port": self.judge_port, "inbound_port": self.inbound_port}
               if self.judged else {}),
            **({"node_sources_v4": list(self.node_sources_v4),
                "node_sources_v6": list(self.node_sources_v6)}
               if self.strict or self.judged else {}),
            # only when on: a policy without it keeps the hash it had before DNS capture
            **({"dns_capture": True, "dns_port": self.dns_port} if self.dns_capture else {}),
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> CapturePolicy:
        ports = data.get("exclude_ports") or []
        assert isinstance(ports, list)
        return cls(
            redirect_all=bool(data["redirect_all"]),
            capture_port=int(str(data["capture_port"])),
            mesh_port=int(str(data["mesh_port"])),
            mark=int(str(data["mark"])),
            mark_mask=int(str(data["mark_mask"])),
            exclude_ports=tuple((int(a), int(b)) for a, b in ports),
            exclude_v4=tuple(str(x) for x in data.get("exclude_v4") or []),  # type: ignore[attr-defined]
            exclude_v6=tuple(str(x) for x in data.get("exclude_v6") or []),  # type: ignore[attr-defined]
            proxy_cgroup=(None if data.get("proxy_cgroup") is None
                          else str(data.get("proxy_cgroup"))),
            proxy_cgroup_level=int(str(data.get("proxy_cgroup_level") or 0)),
            peer_cgroup=(None if data.get("peer_cgroup") is None
                         else str(data.get("peer_cgroup"))),
            peer_cgroup_level=int(str(data.get("peer_cgroup_level") or 0)),
            strict=bool(data.get("strict", False)),
            inbound_port=int(str(data.get("inbound_port") or 15008)),
            judged=bool(data.get("judged", False)),
            judge_port=int(str(data.get("judge_port") or 15006)),
            node_sources_v4=tuple(str(x) for x in data.get("node_sources_v4") or []),  # type: ignore[attr-defined]
            node_sources_v6=tuple(str(x) for x in data.get("node_sources_v6") or []),  # type: ignore[attr-defined]
            dns_capture=bool(data.get("dns_capture", False)),
            dns_port=int(str(data.get("dns_port") or 15053)),
        )


@dataclass(frozen=True)
class CaptureDecision:
    captured: bool
    reason: str
    policy: CapturePolicy | None = None
    problems: tuple[AnnotationProblem, ...] = field(default_factory=tuple)


def _split(value: str) -> list[str]:
    return [p.strip() for p in value.replace("\n", ",").split(",") if p.strip()]


def parse_ports(value: str) -> tuple[tuple[tuple[int, int], ...], list[AnnotationProblem]]:
    """'5432, 8000-8010' → merged inclusive ranges; bad entries reported, never raised."""
    ranges: list[tuple[int, int]] = []
    problems: list[AnnotationProblem] = []
    entries = _split(value)
    for i, entry in enumerate(entries):
        if i >= MAX_ENTRIES:
            problems.append(
                AnnotationProblem(ANN_EXCLUDE_PORTS, entry, f"more than {MAX_ENTRIES} entries")
            )
            continue
        lo_s, sep, hi_s = entry.partition("-")
        try:
            lo = int(lo_s.strip(), 10)
            hi = int(hi_s.strip(), 10) if sep else lo
        except ValueError:
            problems.append(AnnotationProblem(ANN_EXCLUDE_PORTS, entry, "not a port number"))
            continue
        if not (1 <= lo <= 65535 and 1 <= hi <= 65535):
            problems.append(AnnotationProblem(ANN_EXCLUDE_PORTS, entry, "port out of 1-65535"))
            continue
        if hi < lo:
            problems.append(AnnotationProblem(ANN_EXCLUDE_PORTS, entry, "range end before start"))
            continue
        ranges.append((lo, hi))
    return _merge_ranges(ranges), problems


def _merge_ranges(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def parse_cidrs(
    value: str,
) -> tuple[tuple[str, ...], tuple[str, ...], list[AnnotationProblem]]:
    """Comma-separated CIDRs → collapsed v4 and v6 networks; a bare address is a host route."""
    v4: list[ipaddress.IPv4Network] = []
    v6: list[ipaddress.IPv6Network] = []
    problems: list[AnnotationProblem] = []
    for i, entry in enumerate(_split(value)):
        if i >= MAX_ENTRIES:
            problems.append(
                AnnotationProblem(ANN_EXCLUDE_RANGES, entry, f"more than {MAX_ENTRIES} entries")
            )
            continue
        try:
            net = ipaddress.ip_network(entry, strict=False)
        except ValueError:
            problems.append(AnnotationProblem(ANN_EXCLUDE_RANGES, entry, "not an IP address or CIDR"))
            continue
        if isinstance(net, ipaddress.IPv4Network):
            v4.append(net)
        else:
            v6.append(net)
    return (
        tuple(str(n) for n in ipaddress.collapse_addresses(v4)),
        tuple(str(n) for n in ipaddress.collapse_addresses(v6)),
        problems,
    )


def parse_bool(value: str) -> bool | None:
    v = value.strip().lower()
    if v == "true":
        return True
    if v == "false":
        return False
    return None


def _is_agent_pod(pod: PodMeta, node: NodeConfig) -> bool:
    if pod.namespace != node.agent_namespace:
        return False
    return all(pod.labels.get(k) == v for k, v in node.agent_labels.items())


def managed(pod: PodMeta, namespace: NamespaceMeta | None, node: NodeConfig
            ) -> tuple[bool, str]:
    """Whether the mesh captures the pod, and why: the first half of ``decide``, all the
    registry needs for every pod of the cluster (the annotations only shape *how* a pod is
    captured, never *whether*)."""
    if pod.namespace in node.system_namespaces:
        return False, f"system namespace {pod.namespace}"
    if _is_agent_pod(pod, node):
        return False, "the agent's own pod"
    if pod.host_network:
        return False, "hostNetwork pod"
    pod_label = pod.labels.get(MANAGED_LABEL, "").strip().lower()
    ns_label = (namespace.labels if namespace else {}).get(MANAGED_LABEL, "").strip().lower()
    if pod_label == "false":
        return False, f"pod label {MANAGED_LABEL}=false (opt-out)"
    if pod_label == "true":
        return True, f"pod label {MANAGED_LABEL}=true"
    if ns_label == "true":
        return True, f"namespace label {MANAGED_LABEL}=true"
    return False, "not managed (no aether.io/managed=true on pod or namespace)"


def decide(
    pod: PodMeta,
    namespace: NamespaceMeta | None,
    node: NodeConfig,
    redirect_all_default: bool,
) -> CaptureDecision:
    """The capture decision for one pod. Never raises; problems are returned, not dropped."""
    captured, why = managed(pod, namespace, node)
    if not captured:
        return CaptureDecision(False, why)

    problems: list[AnnotationProblem] = []
    ann = pod.annotations
    redirect_all = redirect_all_default
    if ANN_REDIRECT_ALL in ann:
        parsed = parse_bool(ann[ANN_REDIRECT_ALL])
        if parsed is None:
            problems.append(
                AnnotationProblem(
                    ANN_REDIRECT_ALL,
                    ann[ANN_REDIRECT_ALL],
                    f"expected \"true\" or \"false\"; node default "
                    f"({'on' if redirect_all_default else 'off'}) applies",
                )
            )
        else:
            redirect_all = parsed
    strict, auth_problems = peer_authentication(ann, namespace.annotations if namespace else {})
    problems += auth_problems
    judged = not strict and node.authz.selects(pod.namespace, pod.labels)
    exempt = strict or judged  # the node's addresses pass (kubelet probes)
    ports, port_problems = parse_ports(ann.get(ANN_EXCLUDE_PORTS, ""))
    v4, v6, cidr_problems = parse_cidrs(ann.get(ANN_EXCLUDE_RANGES, ""))
    problems += port_problems + cidr_problems
    dns = node.dns_capture
    if node.dns_capture and ANN_DNS in ann:
        parsed_dns = parse_bool(ann[ANN_DNS])
        if parsed_dns is None:
            problems.append(AnnotationProblem(
                ANN_DNS, ann[ANN_DNS], "expected \"true\" or \"false\"; DNS stays captured"))
        else:
            dns = parsed_dns
    policy = CapturePolicy(
        redirect_all=redirect_all,
        capture_port=node.capture_port,
        mesh_port=node.mesh_port,
        mark=node.passthrough_mark,
        mark_mask=node.passthrough_mark_mask,
        exclude_ports=ports,
        exclude_v4=v4,
        exclude_v6=v6,
        proxy_cgroup=node.proxy_cgroup,
        proxy_cgroup_level=node.proxy_cgroup_level,
        **_peer_fields(node),
        strict=strict,
        inbound_port=node.inbound_port if exempt else CapturePolicy.inbound_port,
        judged=judged,
        judge_port=node.judge_port if judged else CapturePolicy.judge_port,
        node_sources_v4=tuple(a for a in node.node_addresses if ":" not in a) if exempt else (),
        node_sources_v6=tuple(a for a in node.node_addresses if ":" in a) if exempt else (),
        dns_capture=dns,
        dns_port=node.dns_port if dns else CapturePolicy.dns_port,
    )
    return CaptureDecision(True, why, policy, tuple(problems))


def peer_authentication(pod_annotations: dict[str, str], ns_annotations: dict[str, str]
                        ) -> tuple[bool, list[AnnotationProblem]]:
    """STRICT or not: the pod's annotation, else its namespace's, else permissive. A value
    that is neither mode fails closed (strict) and is reported: guessing permissive would let
    plaintext in where the owner asked for it to be refused."""
    for source, ann in (("pod", pod_annotations), ("namespace", ns_annotations)):
        if ANN_PEER_AUTH not in ann:
            continue
        raw = ann[ANN_PEER_AUTH]
        value = raw.strip().lower()
        if value in PEER_AUTH_MODES:
            return value == "strict", []
        return True, [AnnotationProblem(
            ANN_PEER_AUTH, raw, f"{source} annotation: expected \"permissive\" or \"strict\"; "
            "strict applies until it is fixed")]
    return False, []


def with_judged(policy: CapturePolicy, judged: bool, node: NodeConfig) -> CapturePolicy:
    """``policy`` with its plaintext inbound judged or not (an AuthorizationPolicy came to
    select the pod, or stopped): what ``decide`` gives for the same pod (STRICT wins, the
    node's current addresses exempt)."""
    judged = judged and not policy.strict
    exempt = policy.strict or judged
    return replace(
        policy, judged=judged,
        judge_port=node.judge_port if judged else CapturePolicy.judge_port,
        inbound_port=node.inbound_port if exempt else CapturePolicy.inbound_port,
        node_sources_v4=tuple(a for a in node.node_addresses if ":" not in a) if exempt else (),
        node_sources_v6=tuple(a for a in node.node_addresses if ":" in a) if exempt else ())


def _peer_fields(node: NodeConfig) -> dict[str, Any]:
    peer = node.peer_proxy.get() if node.proxy_cgroup else None
    return {"peer_cgroup": peer[0], "peer_cgroup_level": peer[1]} if peer else {}


def with_node_proxies(policy: CapturePolicy, node: NodeConfig) -> CapturePolicy:
    """A recorded policy with this agent's proxy cgroup (and a take-over peer's) in place of
    the one it was recorded with: a recorded policy names the cgroup of the agent that wrote
    it, which after an upgrade is not the Envoy now serving."""
    fields: dict[str, Any] = {"proxy_cgroup": node.proxy_cgroup,
                              "proxy_cgroup_level": node.proxy_cgroup_level,
                              "peer_cgroup": None, "peer_cgroup_level": 0}
    return replace(policy, **{**fields, **_peer_fields(node)})
