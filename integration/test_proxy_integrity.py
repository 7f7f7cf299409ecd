"""The proxy path's integrity on a real node (reference bridge plugin + aether-cni + agent +
Envoy): the proxy's upstream sockets live in the pod's netns (the destination sees the pod),
only the proxy's cgroup can use the passthrough mark (a pod process that sets it is still
captured), a pod without IPv6 is captured on IPv4, and a failed listener bind never leaves the
node Envoy inside a pod's netns."""

from __future__ import annotations

import http.client
import http.server
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from agent.netns.enter import run_in_netns
from agent.testing.kubelet import Kubelet, Pod
from agent.testing.netutil import ClosingHTTPServer, dial, host_server
from integration.conftest import GW4, GW6, SUBNET4, EnvoyNode, running
from integration.taps import carried as _carried
from integration.taps import integrity as _integrity
from integration.taps import proxy_cgroup_here as _proxy_cgroup_here
from integration.taps import tap as _tap

pytestmark = [pytest.mark.integration]

MARK = 0xAE
SERVICE_IP = "10.96.212.10"


def _netns_id(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


# A process with nothing but CAP_NET_RAW (containerd/Docker's default set has it), as an
# unprivileged uid: it sets the proxy's mark on its socket and dials out.
_FORGER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, 36, int(sys.argv[3]))
print("mark-set", flush=True)
s.settimeout(3)
s.connect((sys.argv[1], int(sys.argv[2])))
print(s.recv(64).decode(), flush=True)
"""


@pytest.fixture(params=["host", "ip-netns-exec"])
def anode(request: pytest.FixtureRequest, workdir: str, bridge_name: str) -> Iterator[EnvoyNode]:
    """The agent as a DaemonSet runs it, and under `ip netns exec` in the node's netns: that
    remounts /sys in a mount namespace of its own, without the cgroup mounts, so the agent
    finds no cgroup2 and must mount the hierarchy itself to keep the unforgeable RETURN."""
    n = EnvoyNode(workdir, bridge_name)
    name = f"aether-host-{os.getpid()}"
    if request.param == "ip-netns-exec":
        subprocess.run(["ip", "netns", "attach", name, str(os.getpid())], check=True)
        n.agent.wrapper = ["ip", "netns", "exec", name]
    try:
        with running(n):
            yield n
    finally:
        if n.agent.wrapper:
            subprocess.run(["ip", "netns", "delete", name], check=False)
    if n.agent.wrapper:
        assert "mounted the cgroup2 hierarchy at /sys/fs/cgroup" in n.agent.logs()


def test_cap_net_raw_process_setting_the_mark_is_still_captured(anode: EnvoyNode) -> None:
    enode = anode
    pod = enode.pod()
    enode.add(pod)
    srv, port = host_server()
    tap = _tap(enode, pod, GW4, port)
    try:
        before = _carried(enode, pod)
        out = subprocess.run(
            ["ip", "netns", "exec", pod.netns_name, "setpriv", "--reuid=65534", "--regid=65534",
             "--clear-groups", "--inh-caps=-all,+net_raw", "--ambient-caps=-all,+net_raw",
             "--bounding-set=-all,+net_raw", "python3", "-I", "-c", _FORGER, GW4, str(port),
             str(MARK)], capture_output=True, text=True, timeout=30)
        assert out.stdout.split() == ["mark-set", "direct"], out.stderr
        # it went through the pod's capture listener and out as the proxy's connection
        assert _carried(enode, pod) == before + 1
        assert tap.counts() == {"proxy": 1, "other": 0}
        assert [p for p, _ in srv.seen] == [pod.ip(4)]
    finally:
        srv.close()


def test_passthrough_keeps_the_pod_address_and_needs_envoy(enode: EnvoyNode) -> None:
    pod = enode.pod()
    enode.add(pod)
    srv, port = host_server()
    tap = _tap(enode, pod, GW4, port)
    try:
        assert dial(pod.netns, GW4, port) == "direct"
        assert dial(pod.netns, GW6, port) == "direct"
        # the destination sees the pod's own addresses; the v4 one left as the proxy's
        assert sorted(p for p, _ in srv.seen) == sorted([pod.ip(4), pod.ip(6)])
        assert tap.counts() == {"proxy": 1, "other": 0}
        pid = enode.envoy_pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            frozen = dial(pod.netns, GW4, port, timeout=1.5)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert frozen.startswith("error:"), frozen  # nobody answers for a frozen proxy
        assert len(srv.seen) == 2  # and nothing slipped past it
        assert tap.counts()["other"] == 0
    finally:
        srv.close()


def _write(enode: EnvoyNode, name: str, objs: list[dict[str, Any]]) -> None:
    with open(os.path.join(enode.agent.manifests, name), "w") as f:
        yaml.safe_dump_all(objs, f)


class _Peers(http.server.BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive backend answering each request with the address it came from."""

    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, str]] = []

    def do_GET(self) -> None:  # noqa: N802
        _Peers.seen.append((self.headers.get("x-caller", ""), self.client_address[0]))
        body = self.client_address[0].encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return


def _serve_in(netns: str, port: int) -> ClosingHTTPServer:
    srv = run_in_netns(netns, lambda: ClosingHTTPServer(("0.0.0.0", port), _Peers))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture
def mesh(enode: EnvoyNode) -> Iterator[tuple[EnvoyNode, Pod, Pod, Pod]]:
    """A backend pod behind Service `peers` (HTTP, with an HTTPRoute so Envoy pools upstream
    HTTP connections) and two client pods that declare it."""
    _write(enode, "peers.yaml", [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "peers", "namespace": "app"},
         "spec": {"clusterIP": SERVICE_IP, "clusterIPs": [SERVICE_IP],
                  "selector": {"app": "peers"},
                  "ports": [{"name": "http", "port": 80, "targetPort": 8080,
                             "appProtocol": "http"}]}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
         "metadata": {"name": "peers", "namespace": "app",
                      "creationTimestamp": "2026-01-01T00:00:00Z"},
         "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "peers", "port": 80}],
                  "rules": [{"backendRefs": [{"name": "peers", "port": 80}]}]}},
    ])
    backend = enode.pod(name="peers-0", labels={"app": "peers"})
    a = enode.pod(name="client-a", annotations={"aether.io/dependencies": "peers"})
    b = enode.pod(name="client-b", annotations={"aether.io/dependencies": "peers"})
    for p in (backend, a, b):
        enode.add(p)
    srv = _serve_in(backend.netns, 8080)
    _Peers.seen.clear()
    deadline = time.monotonic() + 20
    while "svc|app|peers|80::" not in enode.admin("/clusters") \
            or SERVICE_IP not in enode.admin("/config_dump?resource=dynamic_listeners"):
        assert time.monotonic() < deadline, "the Service never reached Envoy"
        time.sleep(0.2)
    yield enode, backend, a, b
    srv.shutdown()


def _keepalive_gets(netns: str, caller: str, n: int) -> list[tuple[int, str]]:
    """n GETs over ONE client connection to the Service (HTTP keep-alive)."""

    def work() -> list[tuple[int, str]]:
        conn = http.client.HTTPConnection(SERVICE_IP, 80, timeout=5)
        out = []
        try:
            for _ in range(n):
                conn.request("GET", "/", headers={"x-caller": caller})
                r = conn.getresponse()
                out.append((r.status, r.read().decode()))
        finally:
            conn.close()
        return out

    return run_in_netns(netns, work, timeout=60)


def test_mesh_hop_keeps_the_pod_address_and_pools_never_mix_pods(
        mesh: tuple[EnvoyNode, Pod, Pod, Pod]) -> None:
    enode, backend, a, b = mesh
    # interleave two callers' keep-alive streams through the same Service, several rounds
    for _ in range(3):
        for caller in (a, b):
            got = _keepalive_gets(caller.netns, caller.name, 5)
            assert got == [(200, caller.ip(4))] * 5, got
    assert len(_Peers.seen) == 30
    # every request reached the backend from its own caller's address, never the other's
    assert {(c, ip) for c, ip in _Peers.seen} == {("client-a", a.ip(4)), ("client-b", b.ip(4))}
    assert enode.stat("cluster.svc|app|peers|80.upstream_rq_total") >= 30
    tap = _tap(enode, a, backend.ip(4), 8080)
    pid = enode.envoy_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        frozen = dial(a.netns, SERVICE_IP, 80, timeout=1.5)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert frozen.startswith("error:"), frozen
    assert tap.counts()["other"] == 0


def _v4_only(enode: EnvoyNode) -> Kubelet:
    """The node's kubelet, IPv4 only (the same bridge, subnet and IPAM store)."""
    k = Kubelet(enode.kubelet.workdir, enode.kubelet.conflist["plugins"][0]["bridge"], SUBNET4,
                "", {"agent_socket": enode.agent.socket, "capture_redirect_all_default": True})
    ipam = k.conflist["plugins"][0]["ipam"]
    ipam["ranges"] = [[{"subnet": SUBNET4}]]
    ipam["routes"] = [{"dst": "0.0.0.0/0"}]
    return k


def test_pod_without_ipv6_is_captured_on_ipv4_and_envoy_stays_home(enode: EnvoyNode) -> None:
    kubelet = _v4_only(enode)
    pod = enode.pod()
    kubelet.create_sandbox(pod)
    subprocess.run(["ip", "netns", "exec", pod.netns_name, "sysctl", "-qw",
                    "net.ipv6.conf.all.disable_ipv6=1"], check=True)
    kubelet.add(pod, create=False)
    try:
        lis = json.loads(enode.admin("/listeners?format=json"))
        mine = [x for x in lis["listener_statuses"] if x["name"] == f"capture-{pod.container_id}"]
        assert len(mine) == 1
        addrs = [mine[0]["local_address"]] + [a["address"] for a in
                                              mine[0].get("additional_local_addresses", [])]
        assert [a["socket_address"]["address"] for a in addrs] == ["127.0.0.1"]
        assert _netns_id(f"/proc/{enode.envoy_pid()}/ns/net") == _netns_id("/proc/self/ns/net")
        srv, port = host_server()
        try:
            assert dial(pod.netns, GW4, port) == "direct"
            assert [p for p, _ in srv.seen] == [pod.ip(4)]
            assert _carried(enode, pod) == 1
        finally:
            srv.close()
    finally:
        kubelet.delete(pod)
        enode.pods.remove(pod)


def test_a_failed_listener_bind_never_leaves_envoy_in_a_pod_netns(enode: EnvoyNode) -> None:
    """Something inside the pod already holds 127.0.0.1:15001: Envoy's bind fails there and
    it NACKs. Envoy can stay in the pod's netns after such a failure
    (docs/envoy-netns-leak.md); the agent checks after every NACK and restarts it."""
    good = enode.pod()
    enode.add(good)
    pod = enode.pod()
    enode.kubelet.create_sandbox(pod)
    squatter = run_in_netns(pod.netns, lambda: socket.create_server(("127.0.0.1", 15001)))
    try:
        with pytest.raises(Exception, match="(?s)proxy did not confirm"):
            enode.kubelet.add(pod, create=False)
        node = _netns_id("/proc/self/ns/net")
        deadline = time.monotonic() + 20
        while True:
            try:
                if _netns_id(f"/proc/{enode.envoy_pid()}/ns/net") == node:
                    enode.wait_ready()
                    break
            except (OSError, AssertionError):
                pass
            assert time.monotonic() < deadline, "envoy never came back to the node netns"
            time.sleep(0.2)
        srv, port = host_server()
        try:  # the other pod is still served
            deadline = time.monotonic() + 20
            while dial(good.netns, GW4, port, timeout=1) != "direct":
                assert time.monotonic() < deadline
                time.sleep(0.2)
            assert srv.seen and {p for p, _ in srv.seen} == {good.ip(4)}
        finally:
            srv.close()
    finally:
        squatter.close()


def test_status_names_the_unforgeable_return(anode: EnvoyNode) -> None:
    enode = anode
    ci = _integrity(enode)
    assert ci["proxy_match"].startswith("mark + socket cgroupv2 level ")
    with open(f"/proc/{enode.envoy_pid()}/cgroup") as f:
        own = next(line[3:].strip() for line in f if line.startswith("0::"))
    assert own.endswith("/aether-proxy")
    # the agent names it from its own mount namespace; here it is the same cgroup
    assert ("/" + ci["cgroup"]).endswith(own), (ci["cgroup"], own)
    assert os.path.isdir(os.path.join("/sys/fs/cgroup", _proxy_cgroup_here(enode)))
    out = subprocess.run(["aether-agent", "status", "--run-dir", enode.agent.run_dir],
                         capture_output=True, text=True, timeout=30)
    assert "capture integrity: proxy RETURN by mark + socket cgroupv2" in out.stdout
    assert "DEGRADED" not in out.stdout


def test_a_pod_holding_its_capture_port_across_an_envoy_restart_cannot_loop_the_proxy(
        enode: EnvoyNode) -> None:
    """A pod process can bind 127.0.0.1:15001 in its own netns while the node Envoy restarts
    (any uid: the port is above 1024). The new Envoy's bind of that pod's listener then fails
    — and can strand Envoy in the pod's netns. The agent withdraws the listener Envoy named in
    its NACK: the node's Envoy settles, every other pod is served, the squatting pod fails
    closed (its connections reach only its own squatter) and status says why."""
    good, bad = enode.pod(), enode.pod()
    enode.add(good)
    enode.add(bad)
    srv, port = host_server()
    around = _tap(enode, bad, GW4, port)
    old = enode.envoy_pid()
    os.kill(old, signal.SIGKILL)
    squatter = None
    deadline = time.monotonic() + 5
    while squatter is None:
        try:
            squatter = run_in_netns(bad.netns,
                                    lambda: socket.create_server(("127.0.0.1", 15001)))
        except OSError:
            assert time.monotonic() < deadline, "the dead Envoy's socket never went away"
            time.sleep(0.01)
    try:
        node = _netns_id("/proc/self/ns/net")
        deadline = time.monotonic() + 30
        while True:  # a new Envoy, at home, serving the good pod
            try:
                pid = enode.envoy_pid()
                if pid != old and _netns_id(f"/proc/{pid}/ns/net") == node \
                        and dial(good.netns, GW4, port, timeout=1) == "direct":
                    break
            except (OSError, AssertionError):
                pass
            assert time.monotonic() < deadline, "the node Envoy never settled"
            time.sleep(0.2)
        time.sleep(5)  # no restart loop: the same Envoy, still at home, still serving
        assert enode.envoy_pid() == pid
        assert _netns_id(f"/proc/{pid}/ns/net") == node
        assert dial(good.netns, GW4, port) == "direct"
        st = {p["pod"]: p for p in enode.agent.status()["pods"]}
        assert st[f"app/{bad.name}"]["listener"] == "rejected"
        assert "cannot bind '127.0.0.1:15001'" in st[f"app/{bad.name}"]["listener_detail"]
        assert st[f"app/{good.name}"]["listener"] == "live"
        # the squatting pod's own traffic still never leaves around the proxy
        assert not dial(bad.netns, GW4, port, timeout=1).startswith("direct")
        assert around.counts()["other"] == 0
    finally:
        squatter.close()
        srv.close()
