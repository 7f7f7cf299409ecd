"""Fixtures for root-only integration tests: a node's CNI runtime and a running agent."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from agent.cni import protocol
from agent.envoy.supervisor import admin_request
from agent.netns.pin import release_pin_dir
from agent.testing.kubelet import Kubelet, Pod

assert os.geteuid() == 0, "integration tests need root (real netns, nftables, Envoy)"

# one /24 per test process, so concurrent runs (a developer's and CI's) never share a gateway
_NET = os.getpid() % 250
SUBNET4 = f"10.213.{_NET}.0/24"
SUBNET6 = f"fd00:a3e1:{_NET:x}::/64"
GW4 = f"10.213.{_NET}.1"
GW6 = f"fd00:a3e1:{_NET:x}::1"


class AgentProc:
    """`aether-agent run` as users start it, in a subprocess, with a manifest directory."""

    def __init__(self, workdir: str, envoy: bool = False, extra: list[str] | None = None) -> None:
        self.workdir = workdir
        self.run_dir = os.path.join(workdir, "run")
        self.manifests = os.path.join(workdir, "manifests")
        os.makedirs(self.manifests, exist_ok=True)
        self.envoy = envoy
        self.extra = extra or []
        self.proc: subprocess.Popen[bytes] | None = None
        # a command the agent runs under, e.g. ["unshare", "--mount", "--propagation",
        # "unchanged"] for an agent in a mount namespace of its own (a restarted container)
        self.wrapper: list[str] = []
        self.log_path = os.path.join(workdir, "agent.log")
        self.write("namespaces.yaml", [
            {"apiVersion": "v1", "kind": "Namespace",
             "metadata": {"name": "app", "labels": {"aether.io/managed": "true"}}},
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "plain"}},
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kube-system"}},
        ])

    @property
    def socket(self) -> str:
        return os.path.join(self.run_dir, "cni.sock")

    def write(self, name: str, objects: list[dict[str, Any]]) -> None:
        with open(os.path.join(self.manifests, name), "w") as f:
            yaml.safe_dump_all(objects, f)

    def add_pod(self, pod: Pod, labels: dict[str, str] | None = None,
                annotations: dict[str, str] | None = None,
                service_account: str = "default") -> None:
        self.write(f"pod-{pod.namespace}-{pod.name}.yaml", [{
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod.name, "namespace": pod.namespace, "uid": pod.uid,
                         "labels": labels or {}, "annotations": annotations or {}},
            "spec": {"nodeName": "test-node", "serviceAccountName": service_account},
        }])

    def start(self, env: dict[str, str] | None = None) -> AgentProc:
        cmd = [sys.executable, "-m", "agent.cli", "run", "--manifests", self.manifests,
               "--node-name", "test-node", "--run-dir", self.run_dir, "--log-format", "json",
               "--log-level", "debug"]
        if not self.envoy:
            cmd.append("--no-envoy")
        self.metrics_port = free_port()
        cmd += ["--metrics-port", str(self.metrics_port), "--metrics-host", "127.0.0.1"]
        cmd += self.extra
        cmd = [*self.wrapper, *cmd]
        log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if os.path.exists(os.path.join(self.run_dir, "status.sock")):
                try:
                    self.status()
                    return self
                except OSError:
                    pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited {self.proc.returncode}: {self.logs()[-3000:]}")
            time.sleep(0.05)
        raise RuntimeError(f"agent did not come up: {self.logs()[-3000:]}")

    def stop(self, sig: int = 15) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def http(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}{path}",
                                        timeout=5) as r:
                return int(r.status), r.read().decode()
        except urllib.error.HTTPError as e:
            return int(e.code), e.read().decode()

    def status(self) -> dict[str, Any]:
        answer = protocol.call(os.path.join(self.run_dir, "status.sock"), {"command": "status"}, 10)
        st: dict[str, Any] = answer["status"]
        return st

    def logs(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def log_records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.logs().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out


# Test ClusterIPs live here. Nothing routes them on this machine: a passthrough connection to
# one (before the mesh config arrives, or out of scope) must fail here, never leave the host.
CLUSTER_IP_RANGES = (("-4", "10.96.0.0/12"), ("-6", "fd00:96::/32"))


@pytest.fixture(scope="session", autouse=True)
def blackhole_cluster_ips() -> Iterator[None]:
    added = []
    for fam, net in CLUSTER_IP_RANGES:
        r = subprocess.run(["ip", fam, "route", "add", "blackhole", net], capture_output=True,
                           check=False)
        if r.returncode == 0:
            added.append((fam, net))
    yield
    for fam, net in added:
        subprocess.run(["ip", fam, "route", "del", "blackhole", net], capture_output=True,
                       check=False)


def _pod_netns() -> set[str]:
    try:
        return {n for n in os.listdir("/var/run/netns") if n.startswith("aet-")}
    except FileNotFoundError:
        return set()


def _test_envoys() -> dict[int, str]:
    """Envoys (and their keepers) started for a test workdir's agent."""
    import psutil
    out = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = proc.info["cmdline"] or []
        if any(a.startswith(tempfile.gettempdir() + "/aether-it-") and a.endswith("bootstrap.json")
               for a in cmd):
            out[proc.info["pid"]] = " ".join(cmd)[:160]
    return out


def _running(pid: int) -> bool:
    import psutil
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


@pytest.fixture(autouse=True)
def no_leaked_pod_netns() -> Iterator[None]:
    """Every test removes the pod sandboxes it made: a leaked one holds an address a later
    test's pod may get too (each test's IPAM starts over), which is no pod's real state.
    Autouse, so it is set up before (and torn down after) the node fixtures."""
    before = _pod_netns()
    yield
    leaked = sorted(_pod_netns() - before)
    for name in leaked:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
    assert not leaked, f"the test left pod network namespaces behind: {leaked}"


@pytest.fixture(scope="session", autouse=True)
def no_leaked_envoys() -> Iterator[None]:
    """The whole session stops every Envoy it started (module-scoped harnesses keep theirs
    across tests, so this is checked once, at the end): a leaked one keeps binding."""
    import psutil
    before = _test_envoys()
    yield
    deadline = time.monotonic() + 5  # an Envoy told to stop may take a moment to go
    while True:
        stray = {pid: cmd for pid, cmd in _test_envoys().items()
                 if pid not in before and _running(pid)}
        if not stray or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in stray:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    assert not stray, f"the test session left Envoy processes running: {list(stray.values())}"


@pytest.fixture(scope="session")
def bridge_name() -> Iterator[str]:
    name = f"aetbr{uuid.uuid4().hex[:6]}"
    yield name
    subprocess.run(["ip", "link", "del", name], check=False, capture_output=True)


@pytest.fixture
def workdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="aether-it-")
    yield d
    if not os.environ.get("AETHER_KEEP_WORKDIR"):
        # the agent makes <run-dir>/netns a shared bind mount of itself (and pins in it)
        release_pin_dir(os.path.join(d, "run", "netns"))
        shutil.rmtree(d, ignore_errors=True)


def wait_no_tentative(dev: str, timeout: float = 10.0) -> None:
    """The bridge's IPv6 gateway address is usable only once DAD is done."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["ip", "-6", "addr", "show", "dev", dev, "tentative"],
                             capture_output=True, text=True, check=False).stdout
        if not out.strip():
            return
        time.sleep(0.05)


class Node:
    """A kubelet and an agent sharing one workdir; cleans every pod it made."""

    def __init__(self, workdir: str, bridge: str, envoy: bool = False,
                 redirect_all_default: bool = True, agent_extra: list[str] | None = None) -> None:
        self.agent = AgentProc(workdir, envoy=envoy, extra=agent_extra)
        self.kubelet = Kubelet(workdir, bridge, SUBNET4, SUBNET6, {
            "agent_socket": self.agent.socket,
            "capture_redirect_all_default": redirect_all_default,
        })
        self.pods: list[Pod] = []

    def pod(self, namespace: str = "app", name: str | None = None,
            labels: dict[str, str] | None = None,
            annotations: dict[str, str] | None = None,
            service_account: str = "default") -> Pod:
        pod = self.kubelet.new_pod(namespace, name or f"p-{uuid.uuid4().hex[:6]}")
        self.agent.add_pod(pod, labels, annotations, service_account)
        self.pods.append(pod)
        return pod

    def add(self, pod: Pod) -> dict[str, Any]:
        result = self.kubelet.add(pod)
        wait_no_tentative(self.kubelet.conflist["plugins"][0]["bridge"])
        return result

    def cleanup(self) -> None:
        for pod in self.pods:
            try:
                self.kubelet.delete(pod)
            except Exception:  # noqa: BLE001 - best effort teardown
                subprocess.run(["ip", "netns", "del", pod.netns_name], check=False,
                               capture_output=True)


@pytest.fixture
def node(workdir: str, bridge_name: str) -> Iterator[Node]:
    n = Node(workdir, bridge_name)
    n.agent.start()
    yield n
    n.cleanup()
    n.agent.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EnvoyNode(Node):
    """The agent with its Envoy, whose admin is the default root-only unix socket."""

    def __init__(self, workdir: str, bridge: str, extra: list[str] | None = None) -> None:
        super().__init__(workdir, bridge, envoy=True,
                         agent_extra=["--listener-timeout", "15", *(extra or [])])

    @property
    def admin_socket(self) -> str:
        return os.path.join(self.agent.run_dir, "envoy", "admin.sock")

    def admin(self, path: str, method: str = "GET", timeout: float = 5) -> str:
        code, body = admin_request(self.admin_socket, method, path, timeout=timeout)
        if code != 200:
            raise OSError(f"envoy admin {method} {path}: HTTP {code}: {body[:300]}")
        return body

    def stat(self, name: str) -> int:
        for line in self.admin(f"/stats?filter=^{re.escape(name)}$").splitlines():
            key, _, value = line.partition(": ")
            if key == name:
                return int(value)
        return 0

    def listeners(self) -> list[str]:
        return [ln.split("::")[0] for ln in self.admin("/listeners").splitlines() if ln]

    def listener_withdrawn(self, container_id: str, timeout: float = 10.0) -> None:
        """Wait for a DEL'd pod's listener to leave Envoy. DEL returns before Envoy's ACK (it
        never waits on the proxy), so the withdrawal settles with the next ACK."""
        name = f"capture-{container_id}"
        until(lambda: name not in self.listeners(), f"{name} still in Envoy {timeout} s after "
              "DEL", timeout)

    def envoy_pid(self) -> int:
        pid = self.agent.status()["envoy"]["pid"]
        assert pid
        return int(pid)

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.admin("/ready").strip() == "LIVE":
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError("envoy not ready")


@contextlib.contextmanager
def running(n: EnvoyNode) -> Iterator[EnvoyNode]:
    """The node's agent started with its Envoy ready; afterwards every pod cleaned, the agent
    stopped, and its log free of tracebacks."""
    n.agent.start()
    try:
        n.wait_ready()
        yield n
    finally:
        n.cleanup()
        n.agent.stop()
    assert "Traceback" not in n.agent.logs()


@pytest.fixture
def enode(workdir: str, bridge_name: str) -> Iterator[EnvoyNode]:
    with running(EnvoyNode(workdir, bridge_name)) as n:
        yield n




def stop_kept_envoy(node: EnvoyNode, keeper: int) -> None:
    """The end of a test whose agent stops with ``--envoy-on-exit keep``: pods cleaned, the
    agent stopped, then the Envoy it kept (its keeper ``keeper``, 0 if never read)."""
    import psutil
    node.cleanup()
    node.agent.stop()
    if keeper and psutil.pid_exists(keeper):
        os.kill(keeper, signal.SIGTERM)
        psutil.Process(keeper).wait(10)


def until(pred: Any, what: str, timeout: float = 20.0) -> Any:
    """Poll ``pred`` until it returns something truthy (returned); fail with ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, what
        time.sleep(0.3)
