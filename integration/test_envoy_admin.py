"""Envoy's admin is root-only (issue #12, item 8).

Whoever reaches the admin can ``POST /drain_listeners`` and stop every captured pod's traffic.
By default it is a unix socket ``<run-dir>/envoy/admin.sock`` (0600, in a 0700 directory),
and Envoy listens on no TCP port of the node; a TCP admin port exists only when
``--envoy-admin-port`` asks for it."""

from __future__ import annotations

import os
import stat
import subprocess
import time

import psutil

from agent.testing.netutil import dial, host_server
from integration.conftest import GW4, EnvoyNode, free_port

NOBODY = 65534
# /usr/bin/python3: the test's own interpreter may live where nobody cannot go (/root).
ATTACK = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
    s.sendall(b"POST /drain_listeners HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    print("REACHED", s.recv(200).decode(errors="replace").splitlines()[0])
except OSError as e:
    print("DENIED", type(e).__name__, e.errno)
"""


def as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                           *argv], capture_output=True, text=True, timeout=30, check=False)


def tcp_listen_inodes() -> dict[int, str]:
    """Listening TCP sockets of this (the node's) netns: inode → local address."""
    out: dict[int, str] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    out[int(fields[9])] = fields[1]
    return out


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def envoy_tcp_listeners(pid: int) -> dict[int, str]:
    """TCP ports Envoy listens on in the node's netns (its pod listeners live in pod netns
    and so are not in this netns's table)."""
    listening = tcp_listen_inodes()
    return {i: listening[i] for i in socket_inodes(pid) if i in listening}


def test_admin_is_root_only_and_not_on_tcp(enode: EnvoyNode) -> None:
    pods = [enode.pod(), enode.pod()]
    for p in pods:
        enode.add(p)
    sock = enode.admin_socket
    assert enode.agent.status()["envoy"]["admin"] == sock
    st, dst = os.stat(sock), os.stat(os.path.dirname(sock))
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
    assert stat.S_IMODE(dst.st_mode) == 0o700 and dst.st_uid == 0

    # an unprivileged local user cannot reach it: not even the directory lets it in
    r = as_nobody("/usr/bin/python3", "-c", ATTACK, sock)
    assert r.stdout.startswith("DENIED PermissionError 13"), r.stdout + r.stderr
    # nor the socket itself, were the directory open (Pipe.mode 0600)
    os.chmod(os.path.dirname(sock), 0o711)
    try:
        r = as_nobody("/usr/bin/python3", "-c", ATTACK, sock)
    finally:
        os.chmod(os.path.dirname(sock), 0o700)
    assert r.stdout.startswith("DENIED PermissionError 13"), r.stdout + r.stderr

    # no TCP admin (nor anything else) on the node: the old 127.0.0.1:15000 hole is closed
    pid = enode.envoy_pid()
    assert envoy_tcp_listeners(pid) == {}
    assert enode.stat("listener_manager.listener_stopped") == 0

    # every pod listener is still there, status agrees, and traffic flows through Envoy
    names = set(enode.listeners())
    assert {f"capture-{p.container_id}" for p in pods} <= names
    doc = enode.agent.status()
    assert doc["degraded"] is False and {p["listener"] for p in doc["pods"]} == {"live"}
    tcp, tport = host_server()
    try:
        for p in pods:
            accepted = enode.stat(f"listener.capture-{p.container_id}.downstream_cx_total")
            assert dial(p.netns, GW4, tport) == "direct"
            deadline = time.monotonic() + 5  # carried by the pod's own Envoy listener
            while enode.stat(f"listener.capture-{p.container_id}.downstream_cx_total") <= accepted:
                assert time.monotonic() < deadline, "the connection did not go through Envoy"
                time.sleep(0.05)
        assert len(tcp.seen) == len(pods)
    finally:
        tcp.close()


def test_tcp_admin_only_by_explicit_flag(workdir: str, bridge_name: str) -> None:
    """``--envoy-admin-port`` (the contract flag) still serves a TCP admin on 127.0.0.1 —
    reachable by any local user, which is why it is not the default — and the agent uses it."""
    port = free_port()
    n = EnvoyNode(workdir, bridge_name, extra=["--envoy-admin-port", str(port)])
    n.agent.start()
    try:
        deadline = time.monotonic() + 30
        while not n.agent.status().get("envoy", {}).get("ready"):
            assert time.monotonic() < deadline, "envoy not ready"
            time.sleep(0.2)
        assert n.agent.status()["envoy"]["admin"] == f"127.0.0.1:{port}"
        assert not os.path.exists(n.admin_socket)
        listening = envoy_tcp_listeners(n.envoy_pid())
        assert list(listening.values()) == [f"0100007F:{port:04X}"]
        r = as_nobody("/usr/bin/python3", "-c",
                      f"import urllib.request;print(urllib.request.urlopen("
                      f"'http://127.0.0.1:{port}/ready',timeout=5).read().decode())")
        assert r.stdout.strip() == "LIVE", r.stdout + r.stderr
        assert psutil.Process(n.envoy_pid()).is_running()
    finally:
        n.cleanup()
        n.agent.stop()
