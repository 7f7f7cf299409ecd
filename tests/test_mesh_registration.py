"""CNI registrations never wait on a busy mesh model: queued in order, applied after."""

from __future__ import annotations

import threading
import time

from agent.capture.policy import CapturePolicy
from agent.cni.state import CapturedPod
from agent.common.config import NodeConfig
from agent.runtime.mesh import REGISTER_WAIT_S, MeshRuntime


def _pod(name: str) -> CapturedPod:
    return CapturedPod(container_id=f"c-{name}", uid=f"u-{name}", namespace="app", name=name,
                       service_account="sa", netns="/n", kubelet_netns="/n", ifname="eth0",
                       ips=["10.1.0.5"],
                       policy=CapturePolicy(True, 15001, 18081, 0xAE, 0xFF),
                       fingerprint="f", reason="test")


def _registered(mesh: MeshRuntime, name: str) -> bool:
    return f"app/{name}" in mesh.model.registry._cni


def test_a_busy_model_defers_registration_in_order() -> None:
    mesh = MeshRuntime(NodeConfig(node_name="n"))
    held, release = threading.Event(), threading.Event()

    def busy() -> None:  # a big re-evaluation holding the model
        with mesh.model._lock:
            held.set()
            release.wait(5)

    t = threading.Thread(target=busy)
    t.start()
    held.wait(5)
    started = time.monotonic()
    mesh.pod_captured(_pod("a"), {}, {})
    mesh.pod_released(_pod("a"))
    mesh.pod_captured(_pod("b"), {}, {})
    took = time.monotonic() - started
    assert took < 3 * REGISTER_WAIT_S + 0.2, took  # the CNI path did not wait for the model
    assert mesh.registrations_deferred == 3
    assert not _registered(mesh, "b")
    release.set()
    t.join(5)
    deadline = time.monotonic() + 5
    while mesh._reg_queue:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert _registered(mesh, "b") and not _registered(mesh, "a")  # order kept: a added, removed


def test_a_free_model_registers_at_once() -> None:
    mesh = MeshRuntime(NodeConfig(node_name="n"))
    mesh.pod_captured(_pod("c"), {}, {})
    assert _registered(mesh, "c") and mesh.registrations_deferred == 0
