"""End to end: real Envoy driven over ADS binds capture listeners inside a pod netns and
passes redirected traffic through to the original destination with SO_MARK set."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.envoy.resources import NodeXdsState, PodListener, build_listener
from agent.envoy.xds import XdsServer
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

UID = "pod-uid-1"
LISTENER = f"capture-{UID}"


@pytest.fixture(scope="module")
def pod() -> Iterator[PodNet]:
    with pod_netns(free_port("0.0.0.0")) as p:
        yield p


@pytest.fixture(scope="module")
def host_server(pod: PodNet) -> Iterator[HostServer]:
    srv = HostServer(pod.port)
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module", params=[True, False], ids=["delta", "sotw"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[EnvoyStack]:
    tmp: Path = tmp_path_factory.mktemp("envoy")
    with envoy_stack(tmp, delta=request.param) as s:
        yield s


def _state(pod: PodNet) -> NodeXdsState:
    return NodeXdsState(pods=(PodListener(UID, pod.path),))


def _apply(stack: EnvoyStack, state: NodeXdsState) -> None:
    v = stack.xds.set_state(state)
    assert stack.xds.wait_acked(v, 15), stack.xds.status()


def _passes(stack: EnvoyStack, pod: PodNet, srv: HostServer, ip: str) -> None:
    before_srv, before_cx = srv.accepted, stack.stat(f"listener.{LISTENER}.downstream_cx_total")
    assert connect_from_netns(pod.name, ip, pod.port) == "hello-from-host"
    assert srv.accepted == before_srv + 1
    assert wait_for(lambda: stack.stat(f"listener.{LISTENER}.downstream_cx_total")
                    == before_cx + 1, 5)


def _netns_fds(pid: int, ns_path: str) -> list[str]:
    ino = os.stat(ns_path).st_ino
    hits = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == f"net:[{ino}]":
                hits.append(fd)
        except OSError:
            pass
    return hits


def _envoy_sockets_in_ns(ns: str, pid: int) -> list[str]:
    out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-tanp"], capture_output=True,
                         text=True, check=True).stdout
    return [ln for ln in out.splitlines() if f"pid={pid}," in ln]


def test_passthrough_v4_v6_with_mark(stack: EnvoyStack, pod: PodNet,
                                     host_server: HostServer) -> None:
    _apply(stack, _state(pod))
    assert stack.sup.wait_ready(15)
    assert LISTENER in stack.listener_names()
    pid = stack.sup.pid
    assert pid is not None
    listening = [ln for ln in _envoy_sockets_in_ns(pod.name, pid) if "LISTEN" in ln]
    assert any("127.0.0.1:15001" in ln for ln in listening), listening
    assert any("[::1]:15001" in ln for ln in listening), listening

    marks = pod.mark_packets()
    up = stack.stat("cluster.passthrough.upstream_cx_total")
    _passes(stack, pod, host_server, pod.host_v4)
    _passes(stack, pod, host_server, pod.host_v6)
    assert stack.stat("cluster.passthrough.upstream_cx_total") == up + 2
    assert pod.mark_packets() > marks  # upstream sockets carried SO_MARK 0xae


def test_nack_reported_previous_config_keeps_working(stack: EnvoyStack, pod: PodNet,
                                                     host_server: HostServer) -> None:
    _apply(stack, _state(pod))
    nacks = stack.xds.status()["nack_count"]
    bad = build_listener(PodListener("bad", "/var/run/netns/does-not-exist"), 15001)
    v = stack.xds.set_state(_state(pod), extra_listeners=[bad])
    assert not stack.xds.wait_acked(v, 3)
    st = stack.xds.status()
    assert st["nack_count"] == nacks + 1
    assert "does-not-exist" in st["last_nack"]["error_detail"]
    assert st["last_nack"]["version"] == v
    _passes(stack, pod, host_server, pod.host_v4)
    # Recovery: the next good state is ACKed.
    _apply(stack, _state(pod))


def test_kill9_restarts_and_reconnects(stack: EnvoyStack, pod: PodNet,
                                       host_server: HostServer) -> None:
    _apply(stack, _state(pod))
    old = stack.sup.pid
    assert old is not None
    restarts = stack.sup.restarts
    os.kill(old, signal.SIGKILL)
    assert wait_for(lambda: stack.sup.pid not in (None, old), 15)
    assert stack.sup.restarts == restarts + 1
    assert stack.sup.wait_ready(15)
    assert wait_for(lambda: LISTENER in stack.listener_names(), 10)
    _passes(stack, pod, host_server, pod.host_v4)
    _passes(stack, pod, host_server, pod.host_v6)
    st = stack.sup.status()
    assert st["pid"] == stack.sup.pid and st["ready"] and not st["degraded"]
    assert st["rss_bytes"] and st["rss_bytes"] > 0


def test_agent_restart_does_not_disturb_listeners(stack: EnvoyStack, pod: PodNet,
                                                  host_server: HostServer) -> None:
    """A new xDS server (agent restart) re-serving the same state changes nothing in Envoy:
    delta clients declare initial_resource_versions, SotW gets identical resources."""
    _apply(stack, _state(pod))
    counters = ("listener_manager.listener_added", "listener_manager.listener_modified",
                "listener_manager.listener_removed", "cluster_manager.cluster_modified")
    before = {c: stack.stat(c) for c in counters}
    pid = stack.sup.pid
    path = stack.xds.socket_path
    stack.xds.stop(0.1)
    stack.xds = XdsServer(path)
    stack.xds.start()
    _apply(stack, _state(pod))
    assert {c: stack.stat(c) for c in counters} == before
    assert stack.sup.pid == pid
    _passes(stack, pod, host_server, pod.host_v4)


def test_remove_pod_closes_listener_and_netns(stack: EnvoyStack, pod: PodNet,
                                              host_server: HostServer) -> None:
    _apply(stack, _state(pod))
    pid = stack.sup.pid
    assert pid is not None
    _apply(stack, NodeXdsState(pods=()))
    assert wait_for(lambda: LISTENER not in stack.listener_names(), 10)
    assert wait_for(lambda: not _envoy_sockets_in_ns(pod.name, pid), 15), \
        _envoy_sockets_in_ns(pod.name, pid)
    assert _netns_fds(pid, pod.path) == []
    out = connect_from_netns(pod.name, pod.host_v4, pod.port, timeout=2)
    assert out.startswith("ERR")  # redirect still there, nothing listening any more
