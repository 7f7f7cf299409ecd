"""The held first call (#42): a pod's DNS question for an in-mesh Service this node does not
serve yet brings the Service into scope, and the answer waits (bounded) until the proxy has
it, so the connection that follows is a mesh call from its first request."""

from __future__ import annotations

import threading
import time
from typing import Any

from agent.common.config import NodeConfig
from agent.runtime.mesh import MeshRuntime
from agent.source.base import WatchEvent

SVC = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "echo", "namespace": "app"},
       "spec": {"clusterIP": "10.96.0.7", "clusterIPs": ["10.96.0.7"],
                "selector": {"app": "echo"}, "ports": [{"port": 80, "targetPort": 8080}]}}


class _Sink:
    """Records publishes; ACKs a version ``ack_delay`` s after it is published."""

    def __init__(self, ack_delay: float = 0.0, acks: bool = True) -> None:
        self.published: list[set[str]] = []
        self.ack_delay, self.acks = ack_delay, acks
        self.waited: list[str] = []

    def set_services(self, views: Any, gamma: Any = None, learnable: Any = None) -> str:
        self.published.append({v.key for v in views})
        return str(len(self.published))

    def wait_acked(self, version: str, timeout: float) -> bool:
        self.waited.append(version)
        time.sleep(min(self.ack_delay, timeout))
        return self.acks and self.ack_delay <= timeout


def _runtime(sink: _Sink) -> MeshRuntime:
    rt = MeshRuntime(NodeConfig(node_name="n1", run_dir="/tmp/unused"), debounce_s=0.01)
    rt.follow_objects()
    rt.sink = sink
    rt.model.register_local("u1", "app", "server", "server", ["10.1.0.5"],
                            labels={"app": "echo"}, ready=True)  # the Service is in mesh
    rt.objects.apply(WatchEvent("ADDED", "Service", SVC))
    return rt


def _publisher(rt: MeshRuntime) -> threading.Thread:
    t = threading.Thread(target=rt._publisher, daemon=True)
    t.start()
    return t


def test_a_mesh_name_answer_waits_until_the_proxy_has_its_service() -> None:
    sink = _Sink(ack_delay=0.05)
    rt = _runtime(sink)
    rt.publish_now()
    assert "app/echo" not in sink.published[-1]  # demand scope: nobody declared it
    _publisher(rt)
    try:
        started = time.monotonic()
        assert rt.name_lookup("service", "app", "echo") == ("10.96.0.7",)
        took = time.monotonic() - started
        assert "app/echo" in sink.published[-1] and sink.waited, "answered before the push"
        assert took >= 0.05 and rt.held_total == 1 and rt.held_timeouts == 0
        # served now: the next question is answered at once, nothing held
        started = time.monotonic()
        assert rt.name_lookup("service", "app", "echo") == ("10.96.0.7",)
        assert time.monotonic() - started < 0.05 and rt.held_total == 1
    finally:
        rt._stop.set()
        rt._dirty.set()


def test_the_standard_name_readies_the_service_and_is_still_forwarded() -> None:
    sink = _Sink()
    rt = _runtime(sink)
    _publisher(rt)
    try:
        assert rt.name_lookup("hold", "app", "echo") is None  # forwarded by the pod DNS
        assert "app/echo" in sink.published[-1]
    finally:
        rt._stop.set()
        rt._dirty.set()


def test_the_hold_is_bounded_and_counted() -> None:
    sink = _Sink(ack_delay=5.0)  # never within the hold
    rt = _runtime(sink)
    _publisher(rt)
    try:
        started = time.monotonic()
        assert not rt.bring_into_scope("app/echo", hold_s=0.2)
        assert 0.15 < time.monotonic() - started < 1.0 and rt.held_timeouts == 1
    finally:
        rt._stop.set()
        rt._dirty.set()


def test_names_out_of_the_mesh_are_not_held() -> None:
    rt = _runtime(_Sink())
    assert rt.name_lookup("service", "app", "nope") is None
    assert not rt.bring_into_scope("app/nope") and rt.held_total == 0


def test_without_a_proxy_nothing_is_held() -> None:
    rt = _runtime(_Sink())
    rt.sink = None  # --no-envoy: the mesh model publishes to nobody
    started = time.monotonic()
    assert rt.name_lookup("service", "app", "echo") == ("10.96.0.7",)
    assert time.monotonic() - started < 0.5 and rt.held_total == 0
