"""The mesh model in the running agent: a /proc netns path pinned for the pod's life, a
Service learned from traffic (passthrough first, meshed after), and namespace-aware keys."""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

import yaml

from agent.testing.netutil import http_echo_server, http_get_from
from integration.conftest import GW4, EnvoyNode
from integration.taps import carried


def test_proc_netns_path_is_pinned_and_released(enode: EnvoyNode) -> None:
    from agent.testing.netutil import dial, host_server
    pod = enode.pod()
    enode.kubelet.create_sandbox(pod)
    sleeper = subprocess.Popen(["ip", "netns", "exec", pod.netns_name, "sleep", "600"])
    try:
        time.sleep(0.3)
        pod.netns_override = f"/proc/{sleeper.pid}/ns/net"
        enode.kubelet.add(pod, create=False)
        pin = os.path.join(enode.agent.run_dir, "netns", pod.container_id)
        assert os.path.ismount(pin)
        assert os.stat(pin).st_ino == os.stat(f"/var/run/netns/{pod.netns_name}").st_ino
        srv, port = host_server()
        try:
            assert dial(f"/var/run/netns/{pod.netns_name}", GW4, port) == "direct"
            assert carried(enode, pod) == 1  # through Envoy
        finally:
            srv.close()
        enode.kubelet.delete_aether_only(pod)
        assert not os.path.exists(pin)
    finally:
        sleeper.kill()
        sleeper.wait()


def _write(enode: EnvoyNode, name: str, objs: list[dict[str, Any]]) -> None:
    with open(os.path.join(enode.agent.manifests, name), "w") as f:
        yaml.safe_dump_all(objs, f)


def _svc(ns: str, name: str, ip: str, app: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
            "spec": {"clusterIP": ip, "clusterIPs": [ip], "selector": {"app": app},
                     "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}


def test_service_learned_from_traffic_then_meshed(enode: EnvoyNode) -> None:
    _write(enode, "ns-b.yaml", [{"apiVersion": "v1", "kind": "Namespace",
                                 "metadata": {"name": "b", "labels": {"aether.io/managed": "true"}}}])
    _write(enode, "svcs.yaml", [_svc("app", "learn", "10.96.60.10", "learn"),
                                _svc("b", "learn", "10.96.60.11", "learn")])
    backend_a = enode.pod(name="learn-a", labels={"app": "learn"})
    backend_b = enode.pod(namespace="b", name="learn-b", labels={"app": "learn"})
    client = enode.pod(name="client")  # declares nothing
    servers = []
    for p in (backend_a, backend_b, client):
        enode.add(p)
    for p in (backend_a, backend_b):
        servers.append(http_echo_server(p.netns, "0.0.0.0", 8080, p.name))
    try:
        st = enode.agent.status()["mesh"]["dependency_set"]
        assert "app/learn" not in st  # not declared, not yet used
        # first use passes through (nothing routes the ClusterIP here: it fails), and teaches
        first = http_get_from(client.netns, "10.96.60.10", 80, count=1, timeout=2)
        assert first[0][0] != 200
        deadline = time.monotonic() + 15
        while True:
            got = http_get_from(client.netns, "10.96.60.10", 80, count=1, timeout=2)
            if got[0][0] == 200:
                break
            assert time.monotonic() < deadline, "the learned Service was never meshed"
            time.sleep(0.3)
        assert got[0][1]["x-pod"] == "learn-a"
        why = enode.agent.status()["mesh"]["dependency_set"]["app/learn"]
        assert any("learned" in w for w in why)
        # b/learn is another Service with the same name and ServiceAccount: its own cluster
        http_get_from(client.netns, "10.96.60.11", 80, count=1, timeout=2)
        deadline = time.monotonic() + 15
        while http_get_from(client.netns, "10.96.60.11", 80, count=1, timeout=2)[0][1].get(
                "x-pod") != "learn-b":
            assert time.monotonic() < deadline
            time.sleep(0.3)
        clusters = enode.admin("/clusters")
        assert "svc|app|learn|80::" in clusters and "svc|b|learn|80::" in clusters
    finally:
        for s in servers:
            s.shutdown()


def test_restart_repins_a_lost_pin_and_drops_a_dead_sandbox(enode: EnvoyNode) -> None:
    alive, dead = enode.pod(), enode.pod()
    sleepers = {}
    for p in (alive, dead):
        enode.kubelet.create_sandbox(p)
        sleepers[p.name] = subprocess.Popen(["ip", "netns", "exec", p.netns_name, "sleep", "600"])
    try:
        time.sleep(0.3)
        for p in (alive, dead):
            p.netns_override = f"/proc/{sleepers[p.name].pid}/ns/net"
            enode.kubelet.add(p, create=False)
        enode.agent.stop()
        pin_alive = os.path.join(enode.agent.run_dir, "netns", alive.container_id)
        pin_dead = os.path.join(enode.agent.run_dir, "netns", dead.container_id)
        subprocess.run(["umount", pin_alive], check=True)  # the agent's mounts were lost
        sleepers[dead.name].kill()
        sleepers[dead.name].wait()
        subprocess.run(["ip", "netns", "del", dead.netns_name], check=True)  # sandbox gone
        enode.agent.start()
        enode.wait_ready()
        st = enode.agent.status()
        assert [p["pod"] for p in st["pods"]] == [f"app/{alive.name}"]
        assert st["pods"][0]["rules"] == "ok"
        assert any("re-pinned" in m for m in st["reconcile"])
        assert any("gone" in m for m in st["reconcile"])
        assert os.path.ismount(pin_alive) and not os.path.exists(pin_dead)
        enode.kubelet.delete_aether_only(alive)
        assert not os.path.exists(pin_alive)
    finally:
        for s in sleepers.values():
            s.kill()
            s.wait()
        enode.pods.remove(dead)
