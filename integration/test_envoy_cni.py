"""The node Envoy behind real CNI capture: reference plugins + aether-cni + agent + Envoy."""

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

import psutil
import pytest

from agent.netns import nft
from agent.netns.enter import run_in_netns
from agent.testing.netutil import dial, host_server
from integration.conftest import GW4, GW6, EnvoyNode, stop_kept_envoy
from integration.taps import carried, tap


class _Hello(http.server.BaseHTTPRequestHandler):
    peers: list[str] = []

    def do_GET(self) -> None:  # noqa: N802
        _Hello.peers.append(self.client_address[0])
        body = b"x" * 1024
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return


class _V6Server(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        super().server_bind()


def http_server() -> tuple[int, list[http.server.ThreadingHTTPServer]]:
    s4 = http.server.ThreadingHTTPServer(("0.0.0.0", 0), _Hello)
    port = s4.server_address[1]
    s6 = _V6Server(("::", port), _Hello)
    for s in (s4, s6):
        threading.Thread(target=s.serve_forever, daemon=True).start()
    return port, [s4, s6]


def http_get(netns: str, host: str, port: int) -> int:
    def work() -> int:
        conn = http.client.HTTPConnection(host, port, timeout=5)
        conn.request("GET", "/")
        r = conn.getresponse()
        r.read()
        conn.close()
        return r.status

    return run_in_netns(netns, work)


def test_http_and_tcp_pass_through_envoy(enode: EnvoyNode) -> None:
    pod = enode.pod()
    enode.add(pod)
    assert f"capture-{pod.container_id}" in enode.listeners()
    port, servers = http_server()
    tcp, tport = host_server()
    try:
        before = enode.stat("cluster.passthrough.upstream_cx_total")
        _Hello.peers.clear()
        assert http_get(pod.netns, GW4, port) == 200
        assert http_get(pod.netns, GW6, port) == 200
        assert dial(pod.netns, GW4, tport) == "direct"  # raw TCP reaches the real server
        assert dial(pod.netns, GW6, tport) == "direct"
        assert enode.stat("cluster.passthrough.upstream_cx_total") >= before + 4
        # Envoy's upstream sockets live in the pod's netns: the servers see the pod's address
        assert set(_Hello.peers) == {pod.ip(4), pod.ip(6)}
        assert {p for p, _ in tcp.seen} == {pod.ip(4), pod.ip(6)}
    finally:
        for s in servers:
            s.shutdown()
        tcp.close()


def _access_records(logs: str) -> list[dict[str, object]]:
    out = []
    for line in logs.splitlines():
        if '"agent.access"' in line:
            out.append(json.loads(line))
    return out


def test_access_log_flag_logs_each_connection_as_a_json_record(workdir: str, bridge_name: str
                                                               ) -> None:
    """`--access-log`: one JSON record per captured connection in the agent's log, naming the
    calling pod, its listener, the original destination, the endpoint Envoy dialled, flags,
    bytes and duration (off by default; see the unit test of the passthrough chain)."""
    n = EnvoyNode(workdir, bridge_name, extra=["--access-log"])
    n.agent.start()
    n.wait_ready()
    tcp, tport = host_server()
    try:
        pod = n.pod()
        n.add(pod)
        assert dial(pod.netns, GW4, tport) == "direct"
        deadline = time.monotonic() + 10  # the access-log stream flushes about every second
        mine: list[dict[str, object]] = []
        while not mine:
            assert time.monotonic() < deadline, "no access record reached the agent log"
            time.sleep(0.2)
            mine = [r for r in _access_records(n.agent.logs())
                    if r.get("listener") == f"capture-{pod.container_id}"]
        (rec,) = mine
        assert rec["kind"] == "connection" and rec["cluster"] == "passthrough"
        assert rec["dst"] == f"{GW4}:{tport}" and rec["endpoint"] == f"{GW4}:{tport}"
        assert (rec["src_namespace"], rec["src_pod"]) == (pod.namespace, pod.name)
        assert isinstance(rec["duration_ms"], float) and rec["bytes_sent"] == len(b"direct")
    finally:
        tcp.close()
        n.cleanup()
        n.agent.stop()


def test_excluded_destinations_do_not_touch_envoy(enode: EnvoyNode) -> None:
    pod = enode.pod(annotations={"capture.aether.io/exclude-outbound-ip-ranges": GW4})
    enode.add(pod)
    tcp, tport = host_server()
    try:
        before = enode.stat("cluster.passthrough.upstream_cx_total")
        assert dial(pod.netns, GW4, tport) == "direct"
        assert pod.ip(4) in {p for p, _ in tcp.seen}
        assert enode.stat("cluster.passthrough.upstream_cx_total") == before
    finally:
        tcp.close()


def test_passthrough_upstream_is_not_recaptured(enode: EnvoyNode) -> None:
    """Envoy's upstream leaves from the pod's netns, marked, from the proxy cgroup: the pod's
    rules RETURN it, so one connection is exactly one pass through the capture listener.
    Without that RETURN the upstream would be redirected into the same listener again (a
    loop): the listener's own counter would then exceed one."""
    pod = enode.pod()
    enode.add(pod)
    tcp, tport = host_server()
    try:
        stat = f"listener.capture-{pod.container_id}.downstream_cx_total"
        before_cx = enode.stat(stat)
        assert dial(pod.netns, GW4, tport) == "direct"
        time.sleep(0.2)
        assert enode.stat(stat) - before_cx == 1
        assert len(tcp.seen) == 1
    finally:
        tcp.close()


def test_envoy_kill_refuses_then_recovers(enode: EnvoyNode) -> None:
    pod = enode.pod()
    enode.add(pod)
    tcp, tport = host_server()
    around = tap(enode, pod, GW4, tport)
    try:
        assert dial(pod.netns, GW4, tport) == "direct"
        old = enode.envoy_pid()
        os.kill(old, signal.SIGKILL)
        outcomes = []
        deadline = time.monotonic() + 30
        recovered = False
        while time.monotonic() < deadline:
            r = dial(pod.netns, GW4, tport, timeout=1)
            outcomes.append(r)
            if r == "direct":
                recovered = True
                break
            time.sleep(0.05)
        assert recovered, outcomes[-5:]
        assert any(o.startswith("error:ConnectionRefusedError") for o in outcomes), outcomes[:5]
        # nothing reached the server around Envoy: every success came through Envoy
        assert around.counts()["other"] == 0 and around.counts()["proxy"] == len(tcp.seen)
        assert enode.envoy_pid() != old
        assert enode.agent.status()["envoy"]["restarts"] >= 1
    finally:
        tcp.close()


def _envoy_netns_fds(pid: int, netns_path: str) -> int:
    ino = os.stat(netns_path).st_ino
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == f"net:[{ino}]":
                n += 1
        except OSError:
            continue
    return n


def _envoy_socket_inodes_in(netns: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", netns, "ss", "-ltnp"], capture_output=True,
                         text=True, check=True).stdout
    return sum(1 for line in out.splitlines() if "envoy" in line)


def test_del_removes_listener_and_netns_references(enode: EnvoyNode) -> None:
    pod = enode.pod()
    enode.add(pod)
    pid = enode.envoy_pid()
    assert _envoy_socket_inodes_in(pod.netns_name) >= 2
    enode.kubelet.delete_aether_only(pod)
    deadline = time.monotonic() + 10
    while f"capture-{pod.container_id}" in enode.listeners() \
            or _envoy_netns_fds(pid, pod.netns) or _envoy_socket_inodes_in(pod.netns_name):
        assert time.monotonic() < deadline, "envoy still holds the pod netns"
        time.sleep(0.1)


def test_del_with_envoy_frozen_returns_at_once_and_settles_later(enode: EnvoyNode) -> None:
    """DEL never waits on the proxy: with Envoy stopped (SIGSTOP) it succeeds at once, status
    lists the removal as pending, and Envoy's next ACK settles it."""
    pod = enode.pod()
    enode.add(pod)
    pid = enode.envoy_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        enode.kubelet.delete_aether_only(pod)
        assert time.monotonic() - started < 5
        st = enode.agent.status()
        assert st["pods"] == []
        assert st["envoy"]["pending_removals"] == [f"capture-{pod.container_id}"]
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while enode.agent.status()["envoy"]["pending_removals"] \
            or f"capture-{pod.container_id}" in enode.listeners():
        assert time.monotonic() < deadline, "the removal never settled"
        time.sleep(0.2)


def test_fifty_pods_add_del_loop_leaves_nothing(enode: EnvoyNode) -> None:
    pid = enode.envoy_pid()
    fds_before = len(os.listdir(f"/proc/{pid}/fd"))
    for i in range(50):
        pod = enode.pod(name=f"loop-{i}")
        enode.add(pod)
        enode.kubelet.delete(pod)
        enode.pods.remove(pod)
    time.sleep(1)
    assert [n for n in enode.listeners() if n.startswith("capture-")] == []
    assert enode.agent.status()["pods"] == []
    assert not os.listdir(os.path.join(enode.agent.run_dir, "netns")) if os.path.isdir(
        os.path.join(enode.agent.run_dir, "netns")) else True
    fds_after = len(os.listdir(f"/proc/{pid}/fd"))
    assert fds_after <= fds_before + 5
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            assert not os.readlink(f"/proc/{pid}/fd/{fd}").startswith("net:[")
        except FileNotFoundError:
            continue


def test_agent_restart_keeps_envoy_serving(enode: EnvoyNode) -> None:
    pod = enode.pod()
    enode.add(pod)
    tcp, tport = host_server()
    around = tap(enode, pod, GW4, tport)
    try:
        pid = enode.envoy_pid()
        adds = enode.stat("listener_manager.listener_added")
        assert enode.agent.proc is not None
        enode.agent.proc.kill()  # the agent dies hard
        enode.agent.proc.wait()
        assert psutil.pid_exists(pid)
        assert dial(pod.netns, GW4, tport) == "direct"  # Envoy keeps serving meanwhile
        enode.agent.start()
        assert enode.envoy_pid() == pid  # adopted, not replaced
        assert dial(pod.netns, GW4, tport) == "direct"
        assert enode.stat("listener_manager.listener_added") == adds  # live listeners untouched
        newpod = enode.pod()
        enode.add(newpod)
        assert f"capture-{newpod.container_id}" in enode.listeners()
        assert dial(newpod.netns, GW4, tport) == "direct"
        assert around.counts() == {"proxy": 2, "other": 0}  # both through the adopted Envoy
        assert carried(enode, newpod) == 1
    finally:
        tcp.close()


def test_add_fails_closed_when_envoy_cannot_confirm(enode: EnvoyNode) -> None:
    """Envoy stopped (SIGSTOP): ADD cannot be confirmed and fails with a clear error."""
    pid = enode.envoy_pid()
    pod = enode.pod()
    os.kill(pid, signal.SIGSTOP)
    try:
        from agent.testing.kubelet import CniError
        with pytest.raises(CniError) as err:
            enode.add(pod)
        assert "did not ACK" in err.value.msg or "proxy did not confirm" in err.value.msg
    finally:
        os.kill(pid, signal.SIGCONT)
    assert nft.list_table_text(pod.netns) is not None  # rules stay: refused, never bypassed


def test_metrics_count_real_adds_and_readyz_follows_envoy(enode: EnvoyNode) -> None:
    a = enode.agent
    assert a.http("/healthz")[0] == 200
    assert a.http("/readyz") == (200, "ready") or a.http("/readyz")[0] == 200
    pods = [enode.pod(), enode.pod(namespace="plain")]
    for p in pods:
        enode.add(p)
    _, text = a.http("/metrics")
    assert 'aether_cni_requests_total{command="ADD",outcome="ok"} 1.0' in text
    assert 'aether_cni_requests_total{command="ADD",outcome="skipped"} 1.0' in text
    assert "aether_pods_captured 1.0" in text
    assert "aether_envoy_ready 1.0" in text
    assert 'aether_cni_request_duration_seconds_count{command="ADD"} 2.0' in text
    pid = enode.envoy_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while a.http("/readyz")[0] != 503:
            assert time.monotonic() < deadline, "readyz did not flip with Envoy down"
            time.sleep(0.2)
        assert "envoy" in a.http("/readyz")[1]
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while a.http("/readyz")[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_graceful_agent_restart_keeps_envoy_serving(workdir: str, bridge_name: str) -> None:
    """An upgrade-style stop (SIGTERM, --envoy-on-exit keep; 'auto' does this on Kubernetes
    while our DaemonSet exists): Envoy serves on untouched, the next agent adopts it."""
    n = EnvoyNode(workdir, bridge_name, extra=["--envoy-on-exit", "keep"])
    n.agent.start()
    n.wait_ready()
    tcp, tport = host_server()
    keeper = 0
    try:
        pod = n.pod()
        n.add(pod)
        around = tap(n, pod, GW4, tport)
        pid = n.envoy_pid()
        with open(os.path.join(n.agent.run_dir, "envoy", "envoy.pid")) as f:
            keeper = int(f.read())
        adds = n.stat("listener_manager.listener_added")
        n.agent.stop()  # SIGTERM
        assert psutil.pid_exists(pid)
        assert dial(pod.netns, GW4, tport) == "direct"
        n.agent.start()
        assert n.envoy_pid() == pid
        assert n.stat("listener_manager.listener_added") == adds
        assert dial(pod.netns, GW4, tport) == "direct"
        assert around.counts() == {"proxy": 2, "other": 0}
    finally:
        tcp.close()
        stop_kept_envoy(n, keeper)
