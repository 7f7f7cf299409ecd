"""The Service catalog: Kubernetes Services as plain records, indexed by key and ClusterIP.

A Service is both the thing a client dials (ClusterIP:port, the names of proposal 020) and a
selector of backend pods. Parsing keeps exactly what capture and xDS need: both ClusterIP
families (dual-stack), every port with its targetPort left unresolved (a named targetPort
means something different in each pod), and appProtocol for L7 detection.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Any

from agent.common.ids import ServiceKey, service_key
from agent.scope import durations
from agent.source.objects import (
    BackendTrafficPolicyObject,
    ServiceObject,
    ServicePortSpec,
    ServiceSpec,
)

CLUSTER_DOMAIN = "svc.cluster.local"
DEFAULT_MESH_DOMAIN = "aether.internal"


_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
#: Dotted-quad IPv4 in its one spelling (no leading zeros): already canonical. Pod and
#: endpoint addresses nearly always are, and ipaddress costs ~20 µs a parse.
_PLAIN_IPV4 = re.compile(rf"{_OCTET}(\.{_OCTET}){{3}}")


def canonical_ip(ip: str) -> str | None:
    """One spelling per address (IPv6 has many), None if it is not an IP at all."""
    if _PLAIN_IPV4.fullmatch(ip):
        return ip
    try:
        canon = str(ipaddress.ip_address(ip.strip()))
    except ValueError:
        return None
    return ip if canon == ip else canon  # the caller's string when it already is canonical


@dataclass(frozen=True)
class ServicePort:
    """One Service port; target_port is an int or a container port name."""

    port: int
    name: str = ""
    protocol: str = "TCP"
    target_port: int | str = 0
    app_protocol: str | None = None

    def __post_init__(self) -> None:
        if self.target_port in (0, ""):
            object.__setattr__(self, "target_port", self.port)  # the Kubernetes default


@dataclass(frozen=True)
class TrafficPolicy:
    """The Service fields that change which endpoint a client reaches."""

    # sessionAffinity: ClientIP (the same client pod keeps its endpoint; its timeoutSeconds
    # has nothing to expire here: docs/service-semantics.md)
    client_ip_affinity: bool = False
    # internalTrafficPolicy: Local (only this node's endpoints; none: the connection fails)
    local_only: bool = False
    # publishNotReadyAddresses: not-ready pods are endpoints too
    publish_not_ready: bool = False
    # trafficDistribution: "zone" (PreferClose, PreferSameZone) or "node" (PreferSameNode)
    # endpoints first, the rest only when none of those is left; "" none
    prefer: str = ""
    # XBackendTrafficPolicy retryConstraint on this Service: the retry budget (percent of
    # active requests) and its floor (concurrent retries always allowed); None: the
    # agent's default (--retry-budget-percent)
    retry_budget_percent: float | None = None
    min_retry_concurrency: int | None = None
    # XBackendTrafficPolicy sessionPersistence: requests carrying the session go to the
    # endpoint that answered the first (HTTP chains only); None: none
    session: SessionPersistence | None = None


SESSION_COOKIE_DEFAULT = "aether-session"


@dataclass(frozen=True)
class SessionPersistence:
    """Gateway API session persistence as Envoy's stateful-session filter does it: a cookie
    (``ttl_s`` None: a session cookie) or a header naming the endpoint."""

    kind: str = "Cookie"  # "Cookie" | "Header"
    name: str = SESSION_COOKIE_DEFAULT
    ttl_s: float | None = None
    path: str = "/"  # the cookie's Path: a route rule's path match, "/" for a policy's


def traffic_policy_from_spec(spec: ServiceSpec) -> TrafficPolicy:
    """The Service spec's traffic fields; anything malformed keeps Kubernetes' default.
    One object per combination (immutable): most of a cluster's Services share the default,
    and an object each was ~1.5 MB at 10k Services."""
    key = (spec.get("sessionAffinity") == "ClientIP",
           spec.get("internalTrafficPolicy") == "Local",
           spec.get("publishNotReadyAddresses") is True,
           PREFER.get(str(spec.get("trafficDistribution") or ""), ""))
    got = _POLICIES.get(key)
    if got is None:
        got = _POLICIES[key] = TrafficPolicy(client_ip_affinity=key[0], local_only=key[1],
                                             publish_not_ready=key[2], prefer=key[3])
    return got


_POLICIES: dict[tuple[bool, bool, bool, str], TrafficPolicy] = {}  # 24 at most


#: trafficDistribution values and what they prefer (unknown values: no preference, as
#: kube-proxy ignores them)
PREFER = {"PreferClose": "zone", "PreferSameZone": "zone", "PreferSameNode": "node"}
ZONE_LABEL = "topology.kubernetes.io/zone"


@dataclass(frozen=True)
class Service:
    """A Kubernetes Service as the mesh sees it."""

    namespace: str
    name: str
    cluster_ips: tuple[str, ...] = ()
    ports: tuple[ServicePort, ...] = ()
    selector: dict[str, str] | None = None  # None: selectorless, endpoints from slices
    type: str = "ClusterIP"
    headless: bool = False
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    # kube-proxy semantics the capture path keeps (docs/service-semantics.md)
    traffic: TrafficPolicy = field(default_factory=TrafficPolicy)

    @property
    def key(self) -> ServiceKey:
        return service_key(self.namespace, self.name)


    @property
    def ipv4(self) -> tuple[str, ...]:
        return tuple(ip for ip in self.cluster_ips if ":" not in ip)

    @property
    def ipv6(self) -> tuple[str, ...]:
        return tuple(ip for ip in self.cluster_ips if ":" in ip)

    def names(self, mesh_domain: str = DEFAULT_MESH_DOMAIN) -> tuple[str, str]:
        """The standard name first, then the mesh name (both route, proposal 020)."""
        return (
            f"{self.name}.{self.namespace}.{CLUSTER_DOMAIN}",
            f"{self.name}.{self.namespace}.{mesh_domain}",
        )

    def port(self, number: int) -> ServicePort | None:
        for p in self.ports:
            if p.port == number:
                return p
        return None

    def selects(self, labels: dict[str, str]) -> bool:
        """Kubernetes semantics: an empty selector selects nothing (and None means slices)."""
        if not self.selector:
            return False
        return all(labels.get(k) == v for k, v in self.selector.items())


_NO_MAP: dict[str, str] = {}  # shared: Services' maps are never changed in place


def _str_map(value: Any) -> dict[str, str]:
    """A string map as the Service holds it: the object's own when it is one already (as
    decoded JSON is: the store and the model then hold one map, not two per Service)."""
    if not isinstance(value, dict) or not value:
        return _NO_MAP
    if all(type(k) is str and type(v) is str for k, v in value.items()):
        return value
    return {str(k): "" if v is None else str(v) for k, v in value.items()}


def _port(raw: ServicePortSpec) -> ServicePort | None:
    try:
        number = int(raw.get("port") or 0)
    except (TypeError, ValueError):
        return None
    if not 1 <= number <= 65535:
        return None
    tp_raw = raw.get("targetPort")
    target: int | str
    if isinstance(tp_raw, int):
        target = tp_raw
    elif isinstance(tp_raw, str) and tp_raw.strip():
        target = int(tp_raw) if tp_raw.strip().isdigit() else tp_raw.strip()
    else:
        target = number
    app = raw.get("appProtocol")
    return ServicePort(
        port=number,
        name=str(raw.get("name") or ""),
        protocol=str(raw.get("protocol") or "TCP"),
        target_port=target,
        app_protocol=str(app) if app else None,
    )


def service_from_object(obj: ServiceObject) -> Service:
    """Service JSON → Service. Headless/ExternalName services get no ClusterIPs (nothing to
    capture) but keep their ports and selector, so they can still be backends."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    svc_type = str(spec.get("type") or "ClusterIP")
    raw_ips = spec.get("clusterIPs") or ([spec["clusterIP"]] if spec.get("clusterIP") else [])
    headless = any(str(ip) == "None" for ip in raw_ips)
    ips: list[str] = []
    if not headless and svc_type != "ExternalName":
        for ip in raw_ips:
            c = canonical_ip(str(ip))
            if c and c not in ips:
                ips.append(c)
    ports = tuple(p for p in (_port(r) for r in spec.get("ports") or [] if isinstance(r, dict))
                  if p is not None)
    selector = spec.get("selector")
    return Service(
        namespace=str(meta.get("namespace") or "default"),
        name=str(meta.get("name") or ""),
        cluster_ips=tuple(ips),
        ports=ports,
        selector=_str_map(selector) if isinstance(selector, dict) and selector else None,
        type=svc_type,
        headless=headless,
        labels=_str_map(meta.get("labels")),
        annotations=_str_map(meta.get("annotations")),
        traffic=traffic_policy_from_spec(spec),
    )


class ServiceCatalog:
    """Services by key, by namespace and by ClusterIP. Not thread-safe: the model serialises."""

    def __init__(self) -> None:
        self._by_key: dict[str, Service] = {}
        self._by_ns: dict[str, set[str]] = {}
        self._by_ip: dict[str, str] = {}

    def upsert(self, svc: Service) -> Service | None:
        """Insert or replace; returns the previous record (None if new)."""
        old = self._by_key.get(svc.key)
        if old is not None:
            self._unindex(old)
        self._by_key[svc.key] = svc
        self._by_ns.setdefault(svc.namespace, set()).add(svc.key)
        for ip in svc.cluster_ips:
            self._by_ip[ip] = svc.key
        return old

    def remove(self, key: str) -> Service | None:
        old = self._by_key.pop(key, None)
        if old is not None:
            self._unindex(old)
        return old

    def _unindex(self, svc: Service) -> None:
        keys = self._by_ns.get(svc.namespace)
        if keys is not None:
            keys.discard(svc.key)
            if not keys:
                del self._by_ns[svc.namespace]
        for ip in svc.cluster_ips:
            if self._by_ip.get(ip) == svc.key:
                del self._by_ip[ip]

    def get(self, key: str) -> Service | None:
        return self._by_key.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def keys(self) -> list[str]:
        return sorted(self._by_key)

    def in_namespace(self, namespace: str) -> list[str]:
        return sorted(self._by_ns.get(namespace, ()))

    def by_cluster_ip(self, ip: str, port: int | None = None) -> str | None:
        """The Service owning ClusterIP ``ip`` (and serving ``port``, if given)."""
        c = canonical_ip(ip)
        key = self._by_ip.get(c) if c else None
        if key is None:
            return None
        if port is not None and self._by_key[key].port(port) is None:
            return None
        return key


def retry_constraint(policy: BackendTrafficPolicyObject) -> tuple[float | None, int | None]:
    """An XBackendTrafficPolicy's retryConstraint → (budget percent, minimum concurrent
    retries). Gateway API defaults: 20 percent; minRetryRate's count is the floor (Envoy
    budgets concurrent retries, not a rate over an interval)."""
    rc = (policy.get("spec") or {}).get("retryConstraint")
    if not isinstance(rc, dict):
        return None, None
    budget = rc.get("budget")
    pct = budget.get("percent", 20) if isinstance(budget, dict) else 20
    percent = float(pct) if isinstance(pct, int | float) and 0 <= pct <= 100 else 20.0
    rate = rc.get("minRetryRate")
    count = rate.get("count") if isinstance(rate, dict) else None
    return percent, (int(count) if isinstance(count, int) and count >= 0 else None)


def session_persistence(policy: BackendTrafficPolicyObject) -> SessionPersistence | None:
    """An XBackendTrafficPolicy's or BackendLBPolicy's sessionPersistence (see
    ``parse_session_persistence``); None when absent or malformed (a type we do not
    implement is no persistence, not a guess)."""
    try:
        return parse_session_persistence((policy.get("spec") or {}).get("sessionPersistence"))
    except ValueError:
        return None


def parse_session_persistence(sp: Any) -> SessionPersistence | None:
    """Gateway API's SessionPersistence → ``SessionPersistence``; None when absent, and
    ValueError when it asks for what we do not do (a type other than Cookie or Header, or a
    Permanent cookie without the absoluteTimeout Gateway API requires). ``cookieConfig.
    lifetimeType: Permanent`` gives the cookie ``absoluteTimeout`` as its lifetime; Session
    (the default) a session cookie. ``idleTimeout`` has no Envoy counterpart and is not
    applied."""
    if sp is None:
        return None
    if not isinstance(sp, dict):
        raise ValueError("sessionPersistence is not an object")
    kind = sp.get("type") or "Cookie"
    if kind not in ("Cookie", "Header"):
        raise ValueError(f"sessionPersistence type {kind!r} is not supported")
    name = sp.get("sessionName")
    if not isinstance(name, str) or not name or len(name) > 128:
        name = SESSION_COOKIE_DEFAULT
    ttl: float | None = None
    lifetime = ((sp.get("cookieConfig") or {}) if isinstance(sp.get("cookieConfig"), dict)
                else {}).get("lifetimeType") or "Session"
    if kind == "Cookie" and lifetime == "Permanent":
        ttl = durations.seconds(sp.get("absoluteTimeout"))
        if not ttl:
            raise ValueError("a Permanent session cookie needs absoluteTimeout")
    return SessionPersistence(kind=kind, name=name, ttl_s=ttl)


def policy_targets(policy: BackendTrafficPolicyObject) -> list[str]:
    """The Service keys (``<ns>/<name>``) a namespaced Gateway API policy targets."""
    meta = policy.get("metadata") or {}
    ns = str(meta.get("namespace") or "default")
    out = []
    for ref in (policy.get("spec") or {}).get("targetRefs") or []:
        if isinstance(ref, dict) and (ref.get("group") or "") == "" \
                and ref.get("kind") == "Service" and ref.get("name"):
            out.append(f"{ns}/{ref['name']}")
    return out
