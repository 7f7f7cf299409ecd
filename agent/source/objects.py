"""The raw Kubernetes and Gateway API objects the mesh model parses, as TypedDicts: the
fields the agent reads, named as the API spells them (pure).

Every key is optional (``total=False``): objects come from the API or a manifest file, and
the parsers (``agent.scope.services``, ``routes``, ``registry``, ``agent.source.model``)
treat a missing or mistyped field as absent rather than trusting the declared shape. What a
TypedDict here says is which fields the agent depends on — a field not listed is not read.
The store hands objects around as plain dicts; the parse functions take these types, and an
object is ``cast`` where it leaves the store for one of them (``MeshModel._apply``, the
watcher's slim transforms).
"""

from __future__ import annotations

from typing import Any, TypedDict


class OwnerReference(TypedDict, total=False):
    apiVersion: str
    kind: str
    name: str
    uid: str
    controller: bool


class ObjectMeta(TypedDict, total=False):
    name: str
    namespace: str
    uid: str
    labels: dict[str, str]
    annotations: dict[str, str]
    ownerReferences: list[OwnerReference]
    creationTimestamp: str
    deletionTimestamp: str
    resourceVersion: str
    generation: int


# -- core/v1 ---------------------------------------------------------------------------------


class ContainerPort(TypedDict, total=False):
    name: str
    containerPort: int
    protocol: str


class Container(TypedDict, total=False):
    name: str
    ports: list[ContainerPort]
    securityContext: dict[str, Any]


class PodSpec(TypedDict, total=False):
    nodeName: str
    serviceAccountName: str
    serviceAccount: str
    hostNetwork: bool
    containers: list[Container]
    initContainers: list[Container]


class PodIP(TypedDict, total=False):
    ip: str


class PodCondition(TypedDict, total=False):
    type: str
    status: str


class PodStatus(TypedDict, total=False):
    phase: str
    podIP: str
    podIPs: list[PodIP]
    conditions: list[PodCondition]


class PodObject(TypedDict, total=False):
    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: PodSpec
    status: PodStatus


class NodeObject(TypedDict, total=False):
    apiVersion: str
    kind: str
    metadata: ObjectMeta  # the zone is a label: topology.kubernetes.io/zone


class ServicePortSpec(TypedDict, total=False):
    name: str
    port: int
    targetPort: int | str
    protocol: str
    appProtocol: str


class ClientIPConfig(TypedDict, total=False):
    timeoutSeconds: int


class SessionAffinityConfig(TypedDict, total=False):
    clientIP: ClientIPConfig


class ServiceSpec(TypedDict, total=False):
    type: str
    clusterIP: str
    clusterIPs: list[str]
    selector: dict[str, str]
    ports: list[ServicePortSpec]
    sessionAffinity: str
    sessionAffinityConfig: SessionAffinityConfig
    internalTrafficPolicy: str
    trafficDistribution: str
    publishNotReadyAddresses: bool
    externalName: str


class ServiceObject(TypedDict, total=False):
    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: ServiceSpec


# -- discovery.k8s.io/v1 ---------------------------------------------------------------------


class EndpointConditions(TypedDict, total=False):
    ready: bool
    serving: bool
    terminating: bool


class HintTarget(TypedDict, total=False):
    name: str  # a zone (forZones) or a node (forNodes)


class EndpointHints(TypedDict, total=False):
    forZones: list[HintTarget]
    forNodes: list[HintTarget]


class ObjectReference(TypedDict, total=False):
    kind: str
    name: str
    namespace: str
    uid: str


class Endpoint(TypedDict, total=False):
    addresses: list[str]
    conditions: EndpointConditions
    nodeName: str
    zone: str
    hints: EndpointHints
    targetRef: ObjectReference


class EndpointPort(TypedDict, total=False):
    name: str
    port: int
    protocol: str
    appProtocol: str


class EndpointSliceObject(TypedDict, total=False):
    apiVersion: str
    kind: str
    metadata: ObjectMeta
    addressType: str
    endpoints: list[Endpoint]
    ports: list[EndpointPort]


# -- gateway.networking.k8s.io ---------------------------------------------------------------


class ParentReference(TypedDict, total=False):
    group: str
    kind: str
    namespace: str
    name: str
    port: int
    sectionName: str


class BackendRef(TypedDict, total=False):
    group: str
    kind: str
    namespace: str
    name: str
    port: int
    weight: int
    filters: list[dict[str, Any]]


class RouteRule(TypedDict, total=False):
    name: str
    matches: list[dict[str, Any]]  # HTTPRouteMatch / GRPCRouteMatch: parsed field by field
    filters: list[dict[str, Any]]
    backendRefs: list[BackendRef]
    timeouts: dict[str, str]
    retry: dict[str, Any]


class RouteSpec(TypedDict, total=False):
    parentRefs: list[ParentReference]
    hostnames: list[str]
    rules: list[RouteRule]


class RouteObject(TypedDict, total=False):
    """An HTTPRoute or a GRPCRoute (the same shape as far as the mesh reads it)."""

    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: RouteSpec


class BackendTrafficPolicySpec(TypedDict, total=False):
    targetRefs: list[dict[str, str]]
    retryConstraint: dict[str, Any]
    sessionPersistence: dict[str, Any]


class BackendTrafficPolicyObject(TypedDict, total=False):
    """gateway.networking.x-k8s.io XBackendTrafficPolicy, and gateway.networking.k8s.io
    BackendLBPolicy (the same targetRefs and sessionPersistence, no retryConstraint)."""

    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: BackendTrafficPolicySpec
