"""End to end with real Envoy: captured connections to an in-scope Service's ClusterIP are
demuxed by original destination to its EDS cluster; everything else takes the passthrough
(and is reported over the access log service); endpoint health and drain steer new
connections; endpoint changes reach Envoy as EDS only."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.envoy.resources import NodeXdsState, PodListener, service_cluster_name
from agent.scope.model import Endpoint, ServiceView
from agent.scope.services import ServicePort
from integration.conftest_envoy import (
    EnvoyStack,
    HostServer,
    PodNet,
    connect_from_netns,
    envoy_stack,
    free_port,
    pod_netns,
    wait_for,
)

pytestmark = [
    pytest.mark.integration,
]

UID = "mesh-pod-1"
LISTENER = f"capture-{UID}"
CIP4, CIP6, SVC_PORT = "10.96.77.10", "fd00:96::a", 80
CLUSTER = service_cluster_name("mesh", "web", SVC_PORT)
LISTENER_COUNTERS = ("listener_manager.listener_added", "listener_manager.listener_modified",
                     "listener_manager.listener_removed")
CLUSTER_COUNTERS = ("cluster_manager.cluster_added", "cluster_manager.cluster_modified",
                    "cluster_manager.cluster_removed")


class Backends:
    def __init__(self) -> None:
        self.a = HostServer(free_port("0.0.0.0"), reply="backend-a")
        self.b = HostServer(free_port("0.0.0.0"), reply="backend-b")

    def close(self) -> None:
        for s in (self.a, self.b):
            s.shutdown()
            s.server_close()


class Access:
    """Collects on_access callbacks from the ALS stream."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[tuple[str, str, int]] = []

    def __call__(self, listener: str, ip: str, port: int) -> None:
        with self.lock:
            self.seen.append((listener, ip, port))

    def has(self, item: tuple[str, str, int]) -> bool:
        with self.lock:
            return item in self.seen

    def clear(self) -> None:
        with self.lock:
            self.seen.clear()


@pytest.fixture(scope="module")
def backends() -> Iterator[Backends]:
    b = Backends()
    yield b
    b.close()


@pytest.fixture(scope="module")
def pod(backends: Backends) -> Iterator[PodNet]:
    with pod_netns(free_port("0.0.0.0"), extra_ports=(SVC_PORT, backends.a.server_address[1]),
                   default_route=True) as p:
        yield p


@pytest.fixture(scope="module")
def passthrough_server(pod: PodNet) -> Iterator[HostServer]:
    srv = HostServer(pod.port, reply="outside-scope")
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def access() -> Access:
    return Access()


@pytest.fixture(scope="module", params=[True, False], ids=["delta", "sotw"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          access: Access) -> Iterator[EnvoyStack]:
    tmp: Path = tmp_path_factory.mktemp("envoy-mesh")
    with envoy_stack(tmp, delta=request.param, on_access=access) as s:
        yield s


def _ep(pod: PodNet, srv: HostServer, *, ready: bool = True, draining: bool = False
        ) -> Endpoint:
    return Endpoint(pod.host_v4, srv.server_address[1], "mesh/web-sa", ready, draining,
                    "spiffe://cluster.local/ns/mesh/sa/web-sa", f"mesh/web-{srv.reply.decode()}")


def _view(*eps: Endpoint) -> ServiceView:
    return ServiceView(
        key="mesh/web", namespace="mesh", name="web", cluster_ips=(CIP4, CIP6),
        ports=(ServicePort(SVC_PORT, "tcp", target_port=8080),),
        names=("web.mesh.svc.cluster.local", "web.mesh.aether.internal"),
        endpoints={SVC_PORT: eps},
    )


def _apply(stack: EnvoyStack, pod: PodNet, *views: ServiceView) -> None:
    v = stack.xds.set_state(NodeXdsState(pods=(PodListener(UID, pod.path),), services=views))
    assert stack.xds.wait_acked(v, 15), stack.xds.status()


def _counters(stack: EnvoyStack) -> dict[str, int]:
    return {c: stack.stat(c) for c in LISTENER_COUNTERS + CLUSTER_COUNTERS}


def _replies(pod: PodNet, ip: str, n: int) -> list[str]:
    return [connect_from_netns(pod.name, ip, SVC_PORT) for _ in range(n)]


def _healthy(stack: EnvoyStack, n: int) -> bool:
    return stack.stat(f"cluster.{CLUSTER}.membership_healthy") == n


def test_cluster_ip_reaches_backend_v4_v6(stack: EnvoyStack, pod: PodNet, backends: Backends,
                                          passthrough_server: HostServer) -> None:
    _apply(stack, pod, _view(_ep(pod, backends.a)))
    assert stack.sup.wait_ready(15)
    assert wait_for(lambda: _healthy(stack, 1), 10)
    before, up = backends.a.accepted, stack.stat(f"cluster.{CLUSTER}.upstream_cx_total")
    pt = stack.stat("cluster.passthrough.upstream_cx_total")
    assert connect_from_netns(pod.name, CIP4, SVC_PORT) == "backend-a"
    assert connect_from_netns(pod.name, CIP6, SVC_PORT) == "backend-a"
    assert backends.a.accepted == before + 2
    assert stack.stat(f"cluster.{CLUSTER}.upstream_cx_total") == up + 2
    assert stack.stat("cluster.passthrough.upstream_cx_total") == pt


def test_pod_ip_and_out_of_scope_take_passthrough_and_are_logged(
        stack: EnvoyStack, pod: PodNet, backends: Backends, passthrough_server: HostServer,
        access: Access) -> None:
    _apply(stack, pod, _view(_ep(pod, backends.a)))
    access.clear()
    pt = stack.stat("cluster.passthrough.upstream_cx_total")
    up = stack.stat(f"cluster.{CLUSTER}.upstream_cx_total")
    # Out of scope: the host server on its own port.
    assert connect_from_netns(pod.name, pod.host_v4, pod.port) == "outside-scope"
    # The Service's endpoint dialled directly (a pod IP, not a ClusterIP): not a Service.
    a_port = backends.a.server_address[1]
    assert connect_from_netns(pod.name, pod.host_v4, a_port) == "backend-a"
    assert stack.stat("cluster.passthrough.upstream_cx_total") == pt + 2
    assert stack.stat(f"cluster.{CLUSTER}.upstream_cx_total") == up
    # ALS: both passthrough connections reported with their original destination.
    assert wait_for(lambda: access.has((LISTENER, pod.host_v4, pod.port)), 10), access.seen
    assert wait_for(lambda: access.has((LISTENER, pod.host_v4, a_port)), 10), access.seen
    assert not any(ip in (CIP4, CIP6) for _, ip, _ in access.seen)


def test_draining_endpoint_gets_no_new_connections_and_push_is_eds_only(
        stack: EnvoyStack, pod: PodNet, backends: Backends) -> None:
    _apply(stack, pod, _view(_ep(pod, backends.a), _ep(pod, backends.b)))
    assert wait_for(lambda: _healthy(stack, 2), 10)
    assert set(_replies(pod, CIP4, 8)) == {"backend-a", "backend-b"}

    before = _counters(stack)
    eds_updates = stack.stat(f"cluster.{CLUSTER}.update_success")
    # terminating but still serving: in the fallback priority, used only without a ready one
    _apply(stack, pod, _view(_ep(pod, backends.a), _ep(pod, backends.b, draining=True)))
    assert wait_for(lambda: stack.stat(f"cluster.{CLUSTER}.update_success") > eds_updates, 10)
    assert set(_replies(pod, CIP4, 8)) == {"backend-a"}
    assert set(_replies(pod, CIP6, 4)) == {"backend-a"}

    # not ready -> UNHEALTHY also stops traffic; back to ready restores it
    _apply(stack, pod, _view(_ep(pod, backends.a, ready=False), _ep(pod, backends.b)))
    assert wait_for(lambda: _healthy(stack, 1), 10)
    assert set(_replies(pod, CIP4, 6)) == {"backend-b"}
    _apply(stack, pod, _view(_ep(pod, backends.a), _ep(pod, backends.b)))
    assert wait_for(lambda: _healthy(stack, 2), 10)

    # Three endpoint changes, no listener or cluster touched; each arrived as an EDS update.
    assert _counters(stack) == before
    assert stack.stat(f"cluster.{CLUSTER}.update_success") >= eds_updates + 3


def test_service_removed_falls_back_to_passthrough(stack: EnvoyStack, pod: PodNet,
                                                   backends: Backends, access: Access) -> None:
    _apply(stack, pod, _view(_ep(pod, backends.a)))
    _apply(stack, pod)
    assert wait_for(lambda: stack.stat(f"cluster.{CLUSTER}.membership_total") == 0, 10)
    # ClusterIP no longer a Service: passthrough to 10.96.77.10:80, which nothing serves.
    assert connect_from_netns(pod.name, CIP4, SVC_PORT, timeout=2) != "backend-a"
    assert wait_for(lambda: access.has((LISTENER, CIP4, SVC_PORT)), 10), access.seen
    _apply(stack, pod, _view(_ep(pod, backends.a)))
    assert wait_for(lambda: _healthy(stack, 1), 10)
    assert connect_from_netns(pod.name, CIP4, SVC_PORT) == "backend-a"
