"""Clusters and endpoints: a Service port's EDS cluster (resilience, health, priority),
its load assignment, the per-caller-namespace internal clusters and the passthrough."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import (
    address_pb2,
    config_source_pb2,
    health_check_pb2,
    socket_option_pb2,
)
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from google.protobuf import descriptor_pb2, descriptor_pool

from agent.common.config import PASSTHROUGH_MARK
from agent.envoy import mtls
from agent.envoy.names import (
    NETNS_ADDRESS_SELECTOR,
    NETNS_ADDRESS_SELECTOR_TYPE,
    PASSTHROUGH_CLUSTER,
    SO_MARK,
    SOL_SOCKET,
    namespace_listener_name,
    service_cluster_name,
)
from agent.envoy.pieces import (
    duration,
    internal_upstream,
)
from agent.scope.model import Endpoint, ServiceView
from agent.scope.services import TrafficPolicy


@dataclass(frozen=True)
class Resilience:
    """What protects callers from a bad endpoint, per Service port cluster (``aether-agent
    run`` flags). kube-proxy has none of it; these are the defaults a platform team expects
    from a mesh, each one switchable off."""

    # passive outlier detection: this many consecutive failures (5xx, refused or timed-out
    # connects) eject an endpoint for ``ejection_s`` (longer each time); 0: off
    outlier_failures: int = 5
    ejection_s: float = 30.0
    # never eject more than this share of a Service's endpoints at once
    max_ejection_percent: int = 50
    # tcp_proxy: a refused or timed-out connect is tried again on another endpoint, this
    # many attempts in all (1: no retry, as kube-proxy)
    connect_attempts: int = 2
    # connections per Service port cluster; 0: no limit (Envoy's default of 1024 is far
    # too few for a node proxy every pod shares)
    max_connections: int = 0
    # requests (HTTP) or connections (L4) waiting for an upstream connection past that
    # limit, and concurrent HTTP requests; None: the same as ``max_connections``; 0: no limit
    max_pending_requests: int | None = None
    max_requests: int | None = None
    # retries (where a GAMMA route asks for them) may add at most this share of requests
    retry_budget_percent: float = 20.0


def build_service_cluster(view: ServiceView, port: int, connect_timeout_s: float,
                          mark: int = PASSTHROUGH_MARK, tunnel: bool = False,
                          resilience: Resilience = Resilience()) -> cluster_pb2.Cluster:
    """EDS cluster over ADS. Panic mode is off so DRAINING/UNHEALTHY hosts never get
    new connections even when most hosts are out (Kubernetes readiness semantics). It also
    carries the upstream HTTP protocol for when a GAMMA route sends HTTP here (h2c for gRPC
    backends); tcp_proxy ignores it. Upstream sockets are opened in the calling pod's netns
    with the mark, pooled per downstream connection (``upstream_bind_config``).
    ``tunnel`` (mesh identity on): the endpoints are ``mtls-out`` internal addresses instead
    and the pod's netns travels there in filter state (``agent.envoy.mtls``).

    Only the name differs between the Services built with the same settings: each is a copy
    of one template (at 10k Services, building each field by field was a third of a full
    build)."""
    from agent.envoy.http_routes import port_protocol

    name = service_cluster_name(view.namespace, view.name, port)
    sp = next((p for p in view.ports if p.port == port), None)
    cluster = cluster_pb2.Cluster()
    cluster.CopyFrom(_cluster_template(
        connect_timeout_s, mark, tunnel, resilience, view.traffic,
        sp.app_protocol if sp is not None else None,
        (port_protocol(sp) if sp is not None else "detect") if tunnel else None))
    cluster.name = name
    cluster.eds_cluster_config.service_name = name
    return cluster


@functools.lru_cache(maxsize=256)
def _cluster_template(connect_timeout_s: float, mark: int, tunnel: bool, resilience: Resilience,
                      traffic: TrafficPolicy, app_protocol: str | None, hop_protocol: str | None
                      ) -> cluster_pb2.Cluster:
    """A Service cluster without its name, for ``build_service_cluster`` to copy (never
    modified: shared by every caller)."""
    from agent.envoy.http_routes import HTTP_PROTOCOL_OPTIONS_KEY, upstream_http_protocol_options

    cluster = cluster_pb2.Cluster(
        type=cluster_pb2.Cluster.EDS,
        connect_timeout=duration(connect_timeout_s),
        lb_policy=cluster_pb2.Cluster.ROUND_ROBIN,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(
            eds_config=config_source_pb2.ConfigSource(
                ads=config_source_pb2.AggregatedConfigSource(),
                resource_api_version=config_source_pb2.V3,
            ),
        ),
        connection_pool_per_downstream_connection=True,
    )
    apply_resilience(cluster, resilience, traffic)
    if tunnel:
        cluster.transport_socket.CopyFrom(mtls.tunnel_transport_socket())
    else:
        cluster.upstream_bind_config.CopyFrom(upstream_bind_config(mark))
    cluster.common_lb_config.healthy_panic_threshold.value = 0.0
    # host health changes (an outlier ejection, its end) reach the workers' load balancers
    # at once; Envoy's default merge window (1 s) kept sending an ejected endpoint its share
    # for up to a second after it was ejected
    cluster.common_lb_config.update_merge_window.CopyFrom(duration(0.0))
    if traffic.client_ip_affinity:
        # consistent hashing on the caller's address (tcp_proxy / route hash policies);
        # Maglev moves few callers when an endpoint comes or goes
        cluster.lb_policy = cluster_pb2.Cluster.MAGLEV
    if hop_protocol is not None:
        mtls.set_hop_metadata(cluster, hop_protocol)
    cluster.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS_KEY].Pack(
        upstream_http_protocol_options(app_protocol))
    return cluster


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def apply_resilience(cluster: cluster_pb2.Cluster, r: Resilience,
                     traffic: TrafficPolicy | None = None) -> None:
    """Outlier detection, connection limits and the retry budget on a Service cluster (the
    Service's XBackendTrafficPolicy budget, when it has one, over the agent's default)."""
    t = cluster.circuit_breakers.thresholds.add()
    for f, n in (("max_connections", r.max_connections),
                 ("max_pending_requests", _or(r.max_pending_requests, r.max_connections)),
                 ("max_requests", _or(r.max_requests, r.max_connections))):
        getattr(t, f).value = n if n > 0 else mtls.UNLIMITED
    budget = traffic.retry_budget_percent if traffic is not None else None
    floor = traffic.min_retry_concurrency if traffic is not None else None
    t.retry_budget.budget_percent.value = r.retry_budget_percent if budget is None else budget
    t.retry_budget.min_retry_concurrency.value = 3 if floor is None else floor
    if r.outlier_failures > 0:
        od = cluster.outlier_detection
        # a refused or timed-out connect counts as a 5xx (local-origin errors are not split)
        od.consecutive_5xx.value = r.outlier_failures
        od.consecutive_gateway_failure.value = r.outlier_failures
        od.enforcing_consecutive_gateway_failure.value = 100
        od.interval.CopyFrom(duration(5.0))
        od.base_ejection_time.CopyFrom(duration(r.ejection_s))
        od.max_ejection_percent.value = r.max_ejection_percent
        od.enforcing_success_rate.value = 0  # only consecutive failures eject


def endpoint_health(ep: Endpoint) -> int:
    """Ready (or published whatever its state) → HEALTHY; terminating but still serving
    (Ready) → HEALTHY, in the fallback priority (see ``endpoint_priority``); terminating and
    not serving → DRAINING; not ready → UNHEALTHY. Never sent new connections unless
    HEALTHY (panic mode is off)."""
    if ep.always_ready or ep.ready:
        return int(health_check_pb2.HEALTHY)
    return int(health_check_pb2.DRAINING if ep.draining else health_check_pb2.UNHEALTHY)


def endpoint_priority(ep: Endpoint) -> int:
    """Not terminating (or published regardless) before terminating: as kube-proxy does, a
    terminating endpoint that still serves gets traffic only when no ready endpoint is left.
    Within each, the endpoints trafficDistribution prefers (this zone / this node) before
    the others, which take over when no preferred one is left. Compressed to contiguous
    priorities by ``build_load_assignment``."""
    terminating = 0 if ep.always_ready or not ep.draining else 1
    return 2 * terminating + (0 if ep.preferred else 1)


# Envoy spills a priority's load to the next one as its healthy share drops below
# 100/1.4 %; Kubernetes does not spill while any ready endpoint exists. A factor this large
# keeps every request at priority 0 while one of its hosts is healthy.
OVERPROVISIONING_FACTOR = 1_000_000


def _lb_endpoint(ep: Endpoint, tunnel: bool = False) -> endpoint_components_pb2.LbEndpoint:
    """A host: its address and health, nothing else. The node Envoy holds every endpoint of
    the cluster, and per-host metadata is a Struct per host there: naming each host's pod,
    identity and SAN cost the node Envoy ~560 MB at 100k endpoints (bench/README.md, twelfth
    session), for config dumps only: nothing in Envoy read it. The mesh hop's host keeps
    what ``mtls-out`` reads (its SAN and address)."""
    if tunnel:
        return mtls.tunnel_lb_endpoint(ep.ip, ep.port, ep.san, endpoint_health(ep))
    # fields set in place, not built as messages and copied in: one per remote pod at
    # cluster scale, 8.7 -> 3.6 us each (measured)
    lb = endpoint_components_pb2.LbEndpoint(health_status=endpoint_health(ep))
    sa = lb.endpoint.address.socket_address
    sa.address, sa.port_value = ep.ip, ep.port
    return lb


def build_load_assignment(cluster_name: str, endpoints: tuple[Endpoint, ...],
                          tunnel: bool = False) -> endpoint_pb2.ClusterLoadAssignment:
    """Endpoints sorted and de-duplicated by ip:port (Envoy wants unique hosts), one
    priority per tier of ``endpoint_priority`` that has endpoints, contiguous from 0."""
    seen: set[tuple[str, int]] = set()
    lbs = []
    for ep in sorted(endpoints, key=lambda e: (e.ip, e.port, e.draining, not e.ready)):
        if (ep.ip, ep.port) in seen:
            continue
        seen.add((ep.ip, ep.port))
        lbs.append((endpoint_priority(ep), _lb_endpoint(ep, tunnel)))
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster_name)
    for priority in sorted(set(p for p, _ in lbs)):
        cla.endpoints.add(priority=len(cla.endpoints),  # contiguous from 0
                          lb_endpoints=[lb for p, lb in lbs if p == priority])
    if len(cla.endpoints) > 1:
        cla.policy.overprovisioning_factor.value = OVERPROVISIONING_FACTOR
    return cla


def build_namespace_cluster(namespace: str, connect_timeout_s: float,
                            listener: str | None = None) -> cluster_pb2.Cluster:
    """STATIC cluster ``mesh-<ns>`` whose only host is an internal listener: ``listener``
    (the shared ``mesh``), or ``mesh-<ns>`` when None; ``internal_upstream`` passes the pod
    listener's shared filter state along."""
    name = namespace_listener_name(namespace)
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
    cla.endpoints.add().lb_endpoints.add().endpoint.address.envoy_internal_address \
        .server_listener_name = listener or name
    return cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.STATIC,
        connect_timeout=duration(connect_timeout_s),
        load_assignment=cla,
        transport_socket=internal_upstream(),
    )


def _register_selector_config() -> None:
    """xds-protos does not ship the (empty) selector config message; register it in the
    default pool so JSON views of our clusters (bootstrap validation, config dumps) resolve
    its ``@type``. The wire form needs nothing: an Any with the type URL and no bytes."""
    name = NETNS_ADDRESS_SELECTOR_TYPE.rsplit("/", 1)[1]
    pool = descriptor_pool.Default()
    try:
        pool.FindMessageTypeByName(name)
        return
    except KeyError:
        pass
    package, _, message = name.rpartition(".")
    fdp = descriptor_pb2.FileDescriptorProto(
        name=package.replace(".", "/") + "/config.proto", package=package, syntax="proto3")
    fdp.message_type.add(name=message)
    pool.Add(fdp)


_register_selector_config()


def upstream_bind_config(mark: int) -> address_pb2.BindConfig:
    """Upstream sockets of captured traffic: opened in the pod's netns, stamped with the mark.

    The ``filter_state_override`` local address selector moves the bind address into the netns
    named by the ``UPSTREAM_NETNS_STATE`` filter state (set by the pod listener, shared
    transitively); it only overrides an address that exists, hence the wildcard source
    addresses (IPv4, and IPv6 as an extra address picked for IPv6 endpoints). Port 0 and the
    wildcard IP leave the source to the kernel in that netns, as for the pod's own sockets, so
    the destination sees the pod's address and the pod's routes and policies apply. SO_MARK
    is set before bind; the pod's rules RETURN the mark only for the proxy's cgroup.
    Connections without that filter state (none today) would leave from Envoy's own netns.
    """
    opt = socket_option_pb2.SocketOption(
        description="SO_MARK passthrough",
        level=SOL_SOCKET,
        name=SO_MARK,
        int_value=mark,
        state=socket_option_pb2.SocketOption.STATE_PREBIND,
    )
    bind = address_pb2.BindConfig(
        source_address=address_pb2.SocketAddress(address="0.0.0.0", port_value=0),
        socket_options=[opt],
    )
    bind.extra_source_addresses.add().address.CopyFrom(
        address_pb2.SocketAddress(address="::", port_value=0))
    bind.local_address_selector.name = NETNS_ADDRESS_SELECTOR
    bind.local_address_selector.typed_config.type_url = NETNS_ADDRESS_SELECTOR_TYPE
    return bind


def build_passthrough_cluster(mark: int, connect_timeout_s: float) -> cluster_pb2.Cluster:
    """ORIGINAL_DST cluster: the restored original destination, reached from the pod's netns.

    Used from the internal listeners, where the destination is the one ``original_dst``
    restored from filter state. One connection pool per downstream connection: a pooled
    upstream connection was opened in one pod's netns and must never carry another's bytes.
    """
    return cluster_pb2.Cluster(
        name=PASSTHROUGH_CLUSTER,
        type=cluster_pb2.Cluster.ORIGINAL_DST,
        lb_policy=cluster_pb2.Cluster.CLUSTER_PROVIDED,
        connect_timeout=duration(connect_timeout_s),
        upstream_bind_config=upstream_bind_config(mark),
        connection_pool_per_downstream_connection=True,
    )
