"""Helpers for the Envoy integration tests: a throwaway pod netns wired to the host by a
veth pair, the capture redirect inside it, a host TCP server, and an Envoy + xDS stack."""

from __future__ import annotations

import contextlib
import os
import random
import re
import socket
import socketserver
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from agent.common.config import CAPTURE_PORT, PASSTHROUGH_MARK
from agent.envoy.bootstrap import build_bootstrap, write_bootstrap
from agent.envoy.supervisor import EnvoySupervisor, admin_request
from agent.envoy.xds import XdsServer


def sh(cmd: str, stdin: str | None = None, check: bool = True) -> str:
    out = subprocess.run(cmd, shell=True, input=stdin, capture_output=True, text=True,
                         timeout=60)
    if check and out.returncode != 0:
        raise RuntimeError(f"{cmd!r} failed: {out.stderr.strip()}")
    return out.stdout


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class PodNet:
    name: str
    path: str
    host_v4: str
    host_v6: str
    port: int
    mark_table: str

    def mark_packets(self) -> int:
        """Packets leaving the pod netns (Envoy's upstream sockets live there) towards the test
        server that carry the passthrough mark."""
        out = sh(f"ip netns exec {self.name} nft list table inet {self.mark_table}")
        return sum(int(n) for n in re.findall(r"counter packets (\d+)", out))


@contextlib.contextmanager
def pod_netns(port: int, extra_ports: tuple[int, ...] = (), default_route: bool = False
              ) -> Iterator[PodNet]:
    """``extra_ports`` are redirected too; ``default_route`` sends everything (e.g. to
    ClusterIPs nothing routes) via the host side, as a pod's default route would."""
    tag = f"{os.getpid() % 10000}{random.randint(100, 999)}"
    ns, hv, pv = f"aet{tag}", f"aeh{tag}", f"aep{tag}"
    a, b = random.randint(0, 255), random.randint(1, 254)
    h4, p4 = f"10.{a}.{b}.1", f"10.{a}.{b}.2"
    h6, p6 = f"fd00:ae:{a:x}{b:02x}::1", f"fd00:ae:{a:x}{b:02x}::2"
    mark_table = f"aemark{tag}"
    sh(f"ip netns add {ns}")
    try:
        sh(f"ip link add {hv} type veth peer name {pv}")
        sh(f"ip link set {pv} netns {ns}")
        sh(f"ip addr add {h4}/24 dev {hv}; ip -6 addr add {h6}/64 dev {hv} nodad; "
           f"ip link set {hv} up")
        x = f"ip netns exec {ns}"
        sh(f"{x} ip link set lo up; {x} ip addr add {p4}/24 dev {pv}; "
           f"{x} ip -6 addr add {p6}/64 dev {pv} nodad; {x} ip link set {pv} up")
        if default_route:
            sh(f"{x} ip route add default via {h4}; {x} ip -6 route add default via {h6}")
        mark = PASSTHROUGH_MARK
        dports = "{ " + ", ".join(str(p) for p in sorted({port, *extra_ports})) + " }"
        sh(f"{x} nft -f -", stdin=f"""
table inet aether_test {{
  chain out {{
    type nat hook output priority -100;
    meta mark & 0xff == {mark:#x} return
    ip daddr != 127.0.0.0/8 tcp dport {dports} redirect to :{CAPTURE_PORT}
    ip6 daddr != ::1 tcp dport {dports} redirect to :{CAPTURE_PORT}
  }}
}}
""")
        sh(f"{x} nft -f -", stdin=f"""
table inet {mark_table} {{
  chain out {{
    type filter hook output priority 0;
    ip daddr {h4} tcp dport {port} meta mark & 0xff == {mark:#x} counter
    ip6 daddr {h6} tcp dport {port} meta mark & 0xff == {mark:#x} counter
  }}
}}
""")
        yield PodNet(ns, f"/var/run/netns/{ns}", h4, h6, port, mark_table)
    finally:
        sh(f"ip link del {hv}", check=False)
        sh(f"ip netns del {ns}", check=False)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        srv = self.server
        assert isinstance(srv, HostServer)
        with srv.lock:
            srv.accepted += 1
        self.request.sendall(srv.reply + b"\n")


class HostServer(socketserver.ThreadingTCPServer):
    """Dual-stack TCP server on the host side; counts accepted connections."""

    address_family = socket.AF_INET6
    allow_reuse_address = True
    daemon_threads = True

    def __init__(self, port: int, reply: str = "hello-from-host") -> None:
        self.lock = threading.Lock()
        self.accepted = 0
        self.reply = reply.encode()
        super().__init__(("::", port), _Handler, bind_and_activate=False)
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        self.server_bind()
        self.server_activate()
        threading.Thread(target=self.serve_forever, daemon=True).start()


def connect_from_netns(ns: str, ip: str, port: int, timeout: float = 3.0) -> str:
    """Open a TCP connection from inside ``ns``; returns what the server sent."""
    code = ("import socket,sys;"
            f"s=socket.create_connection(({ip!r},{port}),timeout={timeout});"
            "print(s.recv(100).decode().strip())")
    out = subprocess.run(["ip", "netns", "exec", ns, "python3", "-c", code],
                         capture_output=True, text=True, timeout=timeout + 10)
    return out.stdout.strip() if out.returncode == 0 else f"ERR {out.stderr.strip()[-200:]}"


@dataclass
class EnvoyStack:
    xds: XdsServer
    sup: EnvoySupervisor
    admin: str
    tmp: Path
    extra: dict[str, object] = field(default_factory=dict)

    def admin_get(self, path: str) -> str:
        code, body = admin_request(self.admin, "GET", path, timeout=3)
        if code != 200:
            raise OSError(f"envoy admin GET {path}: HTTP {code}: {body[:300]}")
        return body

    def stat(self, name: str) -> int:
        text = self.admin_get("/stats?filter=" + urllib.parse.quote(f"^{re.escape(name)}$"))
        m = re.search(rf"^{re.escape(name)}: (\d+)", text, re.M)
        return int(m.group(1)) if m else 0

    def listener_names(self) -> list[str]:
        return [ln.split("::")[0] for ln in self.admin_get("/listeners").splitlines() if ln]


@contextlib.contextmanager
def envoy_stack(tmp: Path, delta: bool = True,
                on_access: Callable[[str, str, int], None] | None = None
                ) -> Iterator[EnvoyStack]:
    sock = str(tmp / "xds.sock")
    xds = XdsServer(sock, on_access=on_access)
    xds.start()
    boot = tmp / "envoy.json"
    admin = str(tmp / "admin.sock")  # a unix socket (0600), as the agent runs it
    write_bootstrap(str(boot), build_bootstrap("test-node", sock, admin, delta=delta))
    sup = EnvoySupervisor(None, str(boot), admin, base_id=random.randint(1000, 60000))
    sup.start()
    stack = EnvoyStack(xds, sup, admin, tmp)
    try:
        yield stack
    finally:
        sup.stop(timeout=5)
        stack.xds.stop(0.2)


def wait_for(pred: Callable[[], object], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return False
