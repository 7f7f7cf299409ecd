"""The agent on the Kubernetes API (the project's test API server, the real client):
Events on pods, and ADD that keeps working while the API drops watches, answers 410/500s,
is slow, or restarts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent.netns import nft
from agent.testing.apiserver import FakeApiServer
from agent.testing.kubelet import Kubelet, Pod
from integration.conftest import SUBNET4, SUBNET6, AgentProc


def ns_obj(name: str, managed: bool) -> dict[str, Any]:
    labels = {"aether.io/managed": "true"} if managed else {}
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}


def pod_obj(pod: Pod, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod.name, "namespace": pod.namespace, "uid": pod.uid,
                         "annotations": annotations or {}},
            "spec": {"nodeName": "test-node", "serviceAccountName": "sa1",
                     "containers": [{"name": "c", "image": "x"}]}}


class KubeAgent(AgentProc):
    def __init__(self, workdir: str, kubeconfig: str, extra: list[str] | None = None) -> None:
        super().__init__(workdir, extra=extra)
        self.kubeconfig = kubeconfig

    def start(self, env: dict[str, str] | None = None) -> AgentProc:
        cmd = [sys.executable, "-m", "agent.cli", "run", "--kubeconfig", self.kubeconfig,
               "--node-name", "test-node", "--run-dir", self.run_dir, "--log-format", "json",
               "--no-envoy", "--daemonset-name", "", "--metrics-port", "0", *self.extra]
        log = open(self.log_path, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                self.status()
                return self
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(self.logs()[-3000:]) from None
                time.sleep(0.05)
        raise RuntimeError("agent did not come up")


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    srv = FakeApiServer().start()
    srv.put_object(ns_obj("app", True))
    srv.put_object(ns_obj("plain", False))
    srv.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "test-node"},
                    "spec": {"taints": [{"key": "aether.io/agent-not-ready",
                                         "effect": "NoSchedule"}]}})
    yield srv
    srv.stop()


@pytest.fixture
def kagent(api: FakeApiServer, workdir: str, bridge_name: str) -> Iterator[tuple[KubeAgent, Kubelet]]:
    kc = api.kubeconfig(os.path.join(workdir, "kubeconfig"))
    agent = KubeAgent(workdir, kc)
    agent.start()
    kubelet = Kubelet(workdir, bridge_name, SUBNET4, SUBNET6,
                      {"agent_socket": agent.socket, "capture_redirect_all_default": True})
    made: list[Pod] = []
    yield agent, kubelet
    for p in kubelet_pods(kubelet):
        made.append(p)
    agent.stop()


_PODS: dict[int, list[Pod]] = {}


def kubelet_pods(k: Kubelet) -> list[Pod]:
    return _PODS.get(id(k), [])


def new_pod(api: FakeApiServer, k: Kubelet, annotations: dict[str, str] | None = None) -> Pod:
    pod = k.new_pod("app", f"web-{len(_PODS.get(id(k), []))}-{time.monotonic_ns() % 10000}")
    api.put_object(pod_obj(pod, annotations))
    _PODS.setdefault(id(k), []).append(pod)
    return pod


@pytest.fixture(autouse=True)
def _cleanup_pods() -> Iterator[None]:
    yield
    for pods in _PODS.values():
        for p in pods:
            subprocess.run(["ip", "netns", "del", p.netns_name], check=False, capture_output=True)
    _PODS.clear()


def wait_for(pred: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError("condition not reached")


def test_invalid_annotation_becomes_a_pod_event(api: FakeApiServer,
                                                kagent: tuple[KubeAgent, Kubelet]) -> None:
    agent, k = kagent
    pod = new_pod(api, k, {"capture.aether.io/exclude-outbound-ports": "80,http"})
    k.add(pod)
    assert "tcp dport 80 return" in (nft.list_table_text(pod.netns) or "")
    wait_for(lambda: api.events_for("app", pod.name))  # sent off the ADD path
    events = api.events_for("app", pod.name)
    assert [e["reason"] for e in events] == ["CaptureAnnotationInvalid"]
    assert "'http'" in events[0]["message"]
    assert events[0]["involvedObject"]["uid"] == pod.uid


def test_add_never_waits_on_the_api_server_for_its_event(
        api: FakeApiServer, kagent: tuple[KubeAgent, Kubelet]) -> None:
    """An ADD with a malformed annotation while the API server answers in 3 s: the Event
    goes out from the agent's queue later; the ADD does not wait for it."""
    agent, k = kagent
    pod = new_pod(api, k, {"capture.aether.io/exclude-outbound-ports": "80,http"})
    wait_for(lambda: pods_cached(agent) >= 1)
    api.delay(3.0)
    try:
        t0 = time.monotonic()
        k.add(pod)
        assert time.monotonic() - t0 < 2.0
    finally:
        api.clear_faults()
    wait_for(lambda: api.events_for("app", pod.name), 15)
    assert [e["reason"] for e in api.events_for("app", pod.name)] == ["CaptureAnnotationInvalid"]


def test_add_keeps_working_through_api_trouble(api: FakeApiServer,
                                               kagent: tuple[KubeAgent, Kubelet]) -> None:
    agent, k = kagent
    first = new_pod(api, k)
    k.add(first)
    # the watch cache knows the pod: ADD must not need the API at all
    known = new_pod(api, k)
    wait_for(lambda: pods_cached(agent) >= 2)
    api.fail_next(1000, 500)
    api.delay(3.0)
    t0 = time.monotonic()
    k.add(known)
    assert time.monotonic() - t0 < 3.0
    assert nft.list_table_text(known.netns) is not None
    api.clear_faults()
    # watches cut and history compacted: the watcher relists (410) and converges
    api.compact()
    api.drop_watches(abrupt=True)
    later = new_pod(api, k)
    wait_for(lambda: pods_cached(agent) >= 3, 20)
    api.fail_next(1000, 500)
    k.add(later)
    api.clear_faults()
    assert len(agent.status()["pods"]) == 3
    assert agent.proc is not None and agent.proc.poll() is None


def pods_cached(agent: KubeAgent) -> int:
    return int(agent.status()["mesh"]["objects_by_kind"].get("Pod", 0))


def test_api_server_restart(api: FakeApiServer, kagent: tuple[KubeAgent, Kubelet]) -> None:
    agent, k = kagent
    api.stop()
    time.sleep(1.0)
    api.start()
    pod = new_pod(api, k)
    wait_for(lambda: pods_cached(agent) >= 1, 20)
    k.add(pod)
    assert nft.list_table_text(pod.netns) is not None


def test_unknown_pod_and_api_down_fails_closed(api: FakeApiServer,
                                               kagent: tuple[KubeAgent, Kubelet]) -> None:
    agent, k = kagent
    pod = k.new_pod("app", "never-listed")
    _PODS.setdefault(id(k), []).append(pod)
    api.fail_next(1000, 503)
    from agent.testing.kubelet import CniError
    with pytest.raises(CniError) as err:
        k.add(pod)
    assert err.value.result["code"] == 11
    assert "cannot read pod app/never-listed" in err.value.msg
    api.clear_faults()


def _taints(api: FakeApiServer) -> list[str]:
    node = api.get_object("Node", "test-node") or {}
    return [t["key"] for t in (node.get("spec") or {}).get("taints") or []]


def test_readiness_taint_follows_install_and_shutdown(api: FakeApiServer, workdir: str) -> None:
    """Taint off once the plugin is installed and the socket served; back on a final stop."""
    conf, cbin = os.path.join(workdir, "net.d"), os.path.join(workdir, "bin")
    os.makedirs(conf)
    with open(os.path.join(conf, "10-bridge.conflist"), "w") as f:
        f.write('{"cniVersion": "1.0.0", "name": "k8s", "plugins": [{"type": "bridge"}]}')
    kc = api.kubeconfig(os.path.join(workdir, "kubeconfig"))
    agent = KubeAgent(workdir, kc, ["--cni-conf-dir", conf, "--cni-bin-dir", cbin])
    agent.start()
    try:
        time.sleep(2.0)
        assert "aether.io/agent-not-ready" in _taints(api)  # plugin not installed yet
        subprocess.run([sys.executable, "-m", "agent.install.cli", "--cni-conf-dir", conf,
                        "--cni-bin-dir", cbin, "--python-runtime", "host",
                        "--agent-socket", agent.socket], check=True, capture_output=True)
        wait_for(lambda: "aether.io/agent-not-ready" not in _taints(api), 15)
        ci = agent.status()["cni_install"]
        assert ci["conflist"] == os.path.join(conf, "10-bridge.conflist")
        assert ci["entry_present"] is True and ci["plugin_present"] is True
    finally:
        agent.stop()
    assert "aether.io/agent-not-ready" in _taints(api)  # no DaemonSet: a stop for good


def test_route_status_written_by_the_agent(api: FakeApiServer, workdir: str) -> None:
    """The agent (leader via its Lease) writes Accepted/ResolvedRefs for a valid and a broken
    route, with our controllerName and observedGeneration; other controllers' entries stay."""
    def svc(name: str, ip: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "app"},
                "spec": {"clusterIP": ip, "clusterIPs": [ip], "selector": {"app": name},
                         "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}

    api.put_object(svc("echo", "10.96.50.10"))
    api.put_object(svc("echo-v1", "10.96.50.11"))
    other = {"parentRef": {"group": "", "kind": "Service", "name": "echo"},
             "controllerName": "other.example/mesh",
             "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted",
                             "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}

    def route(name: str, backend: str) -> dict[str, Any]:
        return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
                "metadata": {"name": name, "namespace": "app", "generation": 3},
                "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "echo",
                                         "port": 80}],
                         "rules": [{"backendRefs": [{"name": backend, "port": 80}]}]},
                "status": {"parents": [other]}}

    api.put_object(route("good", "echo-v1"))
    api.put_object(route("broken", "does-not-exist"))
    kc = api.kubeconfig(os.path.join(workdir, "kubeconfig"))
    agent = KubeAgent(workdir, kc)
    agent.start()
    try:
        def ours(name: str) -> dict[str, Any] | None:
            obj = api.get_object("HTTPRoute", name, "app", "gateway.networking.k8s.io/v1") or {}
            for p in (obj.get("status") or {}).get("parents") or []:
                if p.get("controllerName") == "aether.io/mesh":
                    return dict(p)
            return None

        wait_for(lambda: ours("good") is not None and ours("broken") is not None, 30)
        good, broken = ours("good"), ours("broken")
        assert good is not None and broken is not None
        conds = {c["type"]: c for c in good["conditions"]}
        assert conds["Accepted"]["status"] == "True"
        assert conds["ResolvedRefs"]["status"] == "True"
        assert conds["Accepted"]["observedGeneration"] == 3
        bconds = {c["type"]: c for c in broken["conditions"]}
        assert bconds["ResolvedRefs"]["status"] == "False"
        assert bconds["ResolvedRefs"]["reason"] == "BackendNotFound"
        obj = api.get_object("HTTPRoute", "good", "app", "gateway.networking.k8s.io/v1") or {}
        ctrls = [p["controllerName"] for p in obj["status"]["parents"]]
        assert "other.example/mesh" in ctrls  # left untouched
        assert agent.status()["route_status"]
    finally:
        agent.stop()


def _served(agent: KubeAgent, key: str) -> bool:
    reasons = (agent.status().get("mesh") or {}).get("dependency_set", {}).get(key, [])
    return bool(reasons) and not any(r.startswith("not served") for r in reasons)


def test_pods_of_other_nodes_come_from_their_records_and_ours_are_published(
        api: FakeApiServer, workdir: str, bridge_name: str) -> None:
    """The agent watches only this node's Pods; another node's pod is an endpoint through
    the MeshPod record its agent published (its full Pod is in the API but never listed),
    and a pod captured here is published for the other nodes, until it is deleted."""
    from agent.meshpods import record
    from agent.source.model import slim_pod

    remote = {"apiVersion": "v1", "kind": "Pod",
              "metadata": {"name": "echo-far", "namespace": "app", "uid": "u-far",
                           "labels": {"app": "echo"}},
              "spec": {"nodeName": "other-node", "serviceAccountName": "echo",
                       "containers": [{"name": "c", "image": "x"}]},
              "status": {"podIP": "10.250.3.3", "podIPs": [{"ip": "10.250.3.3"}],
                         "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
    api.put_object({"apiVersion": "v1", "kind": "Service",
                    "metadata": {"name": "echo", "namespace": "app"},
                    "spec": {"clusterIP": "10.96.50.1", "selector": {"app": "echo"},
                             "ports": [{"port": 80, "targetPort": 8080}]}})
    api.put_object(remote)
    kc = api.kubeconfig(os.path.join(workdir, "kubeconfig"))
    agent = KubeAgent(workdir, kc, extra=["--scope", "all"])
    agent.start()
    k = Kubelet(workdir, bridge_name, SUBNET4, SUBNET6,
                {"agent_socket": agent.socket, "capture_redirect_all_default": True})
    try:
        time.sleep(1.0)
        assert not _served(agent, "app/echo")  # the Pod alone is not read: no endpoint
        api.put_object(record.record_of(slim_pod(remote), "other-node"))
        wait_for(lambda: _served(agent, "app/echo"))
        pod = new_pod(api, k)
        k.add(pod)

        def published() -> dict[str, Any] | None:
            return api.get_object(record.KIND, pod.name, "app", api_version=record.API_VERSION)

        wait_for(lambda: published() is not None)
        rec = published()
        assert rec is not None
        assert rec["metadata"]["labels"] == {"aether.io/node": "test-node"}
        assert rec["metadata"]["ownerReferences"][0]["uid"] == pod.uid
        assert rec["spec"]["pod"]["spec"]["serviceAccountName"] == "sa1"
        st = agent.status()
        assert st["mesh"]["objects_by_kind"].get("Pod") == 1  # this node's only
        assert st["meshpods"]["owned"] == [f"app/{pod.name}"]
        assert st["meshpods"]["remote_pods"] == "meshpods"
        api.delete_object(record.KIND, "echo-far", "app", api_version=record.API_VERSION)
        wait_for(lambda: not _served(agent, "app/echo"))
        k.delete(pod)
        api.delete_object("Pod", pod.name, "app")
        wait_for(lambda: published() is None)
    finally:
        agent.stop()
