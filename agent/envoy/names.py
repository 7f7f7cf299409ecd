"""Names of the node Envoy's resources and the filter-state keys and tags they share
(listener, cluster and log names, Service cluster names): what every builder agrees on."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"
CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
PASSTHROUGH_CLUSTER = "passthrough"
LISTENER_PREFIX = "capture-"
# The STATIC cluster per caller namespace, and the internal listener it reaches: ``mesh``,
# shared by every namespace whose callers see the same chains, or ``mesh-<ns>`` for a
# namespace with consumer routes of its own.
NAMESPACE_LISTENER_PREFIX = "mesh-"
SHARED_MESH_LISTENER = "mesh"
# The caller "namespace" of the shared listener: no real one (not a DNS label), so no
# consumer route applies to it and its table is the one every other namespace sees.
SHARED_CALLERS = "*"
DEFAULT_NAMESPACE = "default"
SERVICE_CLUSTER_PREFIX = "svc|"
ALS_LOG_NAME = "aether-passthrough"
# Access-log records (--access-log, agent.envoy.traffic): every connection a namespace
# listener closes, and every request an HTTP chain answers, reported to the agent.
TRAFFIC_LOG_NAME = "aether-traffic"
REQUEST_LOG_NAME = "aether-requests"
TRAFFIC_TAGS = {"chain": "%FILTER_CHAIN_NAME%", "flags": "%RESPONSE_FLAGS%"}
# Custom tags on every ALS entry: the pod listener that accepted the connection (from filter
# state) and the internal listener that logged it.
ALS_LISTENER_TAG = "listener"
ALS_MESH_LISTENER_TAG = "mesh_listener"

# Filter state handed from a pod listener to its namespace's internal listener (the restored
# addresses: ORIGINAL_DST_LOCAL_STATE, ORIGINAL_DST_REMOTE_STATE, agent.envoy.pieces).
CAPTURE_LISTENER_STATE = "aether.capture_listener"
CAPTURE_LISTENER_FORMAT = f"%FILTER_STATE({CAPTURE_LISTENER_STATE}:PLAIN)%"
# The clusters' local address selector opens the upstream socket in the netns named by
# UPSTREAM_NETNS_STATE, which the pod listener shares TRANSITIVE (it crosses the internal
# listener).
NETNS_ADDRESS_SELECTOR = "envoy.upstream.local_address_selector.filter_state_override"
NETNS_ADDRESS_SELECTOR_TYPE = ("type.googleapis.com/envoy.extensions.local_address_selectors."
                               "filter_state_override.v3.Config")

SOL_SOCKET = 1
SO_MARK = 36

# HTTP (GAMMA HCM) chains log failed requests only: a 5xx or any response flag (UH no healthy
# upstream, UF connect failure, UC upstream reset, NC no cluster, ...). A healthy request
# costs nothing; a failure names its flags, details, route, cluster and x-request-id.
HTTP_FAILURE_LOG_TAG = "http-failure"
HTTP_FAILURE_LOG_FORMAT = (
    f"[%START_TIME%] {HTTP_FAILURE_LOG_TAG} listener={CAPTURE_LISTENER_FORMAT} "
    "mesh=%LISTENER_NAME% %REQ(:METHOD)% %REQ(:AUTHORITY)%%REQ(:PATH)% -> "
    "%DOWNSTREAM_LOCAL_ADDRESS% status=%RESPONSE_CODE% flags=%RESPONSE_FLAGS% "
    "details=%RESPONSE_CODE_DETAILS% route=%ROUTE_NAME% cluster=%UPSTREAM_CLUSTER% "
    "upstream=%UPSTREAM_HOST% request_id=%REQ(X-REQUEST-ID)% dur=%DURATION%ms "
    "failure=%UPSTREAM_TRANSPORT_FAILURE_REASON%\n"
)


def astuple_shallow(obj: Any) -> tuple[Any, ...]:
    """A dataclass's field values in order, as its generated ``__eq__``/``__hash__`` see
    them (``dataclasses.astuple`` would deep-copy)."""
    return tuple(getattr(obj, f.name) for f in fields(obj))


def namespace_listener_name(namespace: str) -> str:
    """``mesh-<ns>``: the cluster for callers in ``namespace`` (and the internal listener it
    reaches when their chains are their own); ``mesh`` for ``SHARED_CALLERS``."""
    if namespace == SHARED_CALLERS:
        return SHARED_MESH_LISTENER
    return f"{NAMESPACE_LISTENER_PREFIX}{namespace or DEFAULT_NAMESPACE}"


def service_cluster_name(namespace: str, name: str, port: int) -> str:
    """``svc|<ns>|<name>|<port>``: namespace-aware, unambiguous (no '|' in k8s names)."""
    return f"{SERVICE_CLUSTER_PREFIX}{namespace}|{name}|{port}"


POD_CLUSTER_PREFIX = "pod|"


def pod_cluster_name(namespace: str, service: str, ip: str, port: int) -> str:
    """``pod|<ns>|<service>|<ip>|<port>``: one endpoint of a headless Service, dialled by
    its address."""
    return f"{POD_CLUSTER_PREFIX}{namespace}|{service}|{ip}|{port}"


def parse_service_cluster_name(cluster: str) -> tuple[str, str, int] | None:
    """Inverse of ``service_cluster_name`` (stats and status read cluster names back)."""
    parts = cluster.split("|")
    if len(parts) != 4 or parts[0] + "|" != SERVICE_CLUSTER_PREFIX or not parts[3].isdigit():
        return None
    return parts[1], parts[2], int(parts[3])
