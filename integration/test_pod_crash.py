"""A crash of the agent's whole pod (#40): every process of its cgroup killed at once (agent,
keeper, Envoy: an OOM kill, a node-level kill of the container). Meanwhile nothing leaves a
captured pod around the mesh: its table stays and redirects into a capture port nobody
listens on, so connections are refused, never carried direct. The next agent brings every
listener back (bench/takeover.py times it at 110 pods)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from typing import Any

from agent.netns.enter import run_in_netns
from agent.testing.netutil import http_echo_server
from agent.testing.takeover_load import (
    EXT_PORT,
    RAW_IP,
    RAW_PORT,
    WEB_IP,
    Load,
    echo_server,
    envoys_of,
    in_cgroup,
    kill_cgroup,
    new_cgroup,
    pod_socket,
    remove_cgroup,
    services,
    works,
)
from integration.conftest import EnvoyNode, until

BYPASS_PORT = 7201


def _refused(netns: str, ip: str, port: int) -> bool:
    s = pod_socket(netns)
    s.settimeout(2)
    try:
        s.connect((ip, port))
        s.sendall(b"x")
        return s.recv(8) == b""  # accepted by nobody real: closed at once
    except OSError:
        return True
    finally:
        s.close()


def _status(n: EnvoyNode) -> dict[str, Any] | None:
    try:
        return n.agent.status()
    except OSError:
        return None


def test_a_crash_of_the_whole_pod_fails_closed_and_the_next_agent_recovers(
        workdir: str, bridge_name: str) -> None:
    cg = new_cgroup("crash-a")
    cg_next = new_cgroup("crash-b")
    n = EnvoyNode(workdir, bridge_name)
    n.agent.wrapper = in_cgroup(cg)
    nxt: subprocess.Popen[bytes] | None = None
    servers: list[socket.socket] = []
    try:
        n.agent.start()
        n.wait_ready()
        n.agent.write("svcs.yaml", services())
        web = n.pod(name="web-0", labels={"app": "web"})
        raw = n.pod(name="raw-0", labels={"app": "raw"})
        ext = n.pod(namespace="plain", name="ext-0")
        client = n.pod(name="client-0", annotations={"aether.io/dependencies": "app/web,app/raw"})
        for p in (web, raw, ext, client):
            n.add(p)
        http_echo_server(web.netns, "0.0.0.0", 8080, "web-0")
        servers = [echo_server(raw.netns, RAW_PORT), echo_server(ext.netns, EXT_PORT)]
        # a listener of the destination nobody serves: a bypassing connection would queue here
        trap = run_in_netns(ext.netns, lambda: socket.create_server(("0.0.0.0", BYPASS_PORT)))
        trap.setblocking(False)
        servers.append(trap)
        load = Load(client, ext.ip())
        until(lambda: works(load), "the captured client never reached all three destinations")
        envoy = n.envoy_pid()

        kill_cgroup(cg)  # agent, keeper and Envoy at once
        n.agent.proc.wait(10)  # type: ignore[union-attr]
        until(lambda: envoy not in envoys_of(n.agent.run_dir), "the Envoy outlived its pod")
        for _ in range(5):
            for ip, port in ((ext.ip(), BYPASS_PORT), (ext.ip(), EXT_PORT), (RAW_IP, RAW_PORT),
                             (WEB_IP, 80)):
                assert _refused(client.netns, ip, port), f"{ip}:{port} reached without a proxy"
        try:
            trap.accept()
            raise AssertionError("a connection from the captured pod reached its destination "
                                 "directly while no proxy ran")
        except BlockingIOError:
            pass
        listing = subprocess.run(["ip", "netns", "exec", client.netns_name, "nft", "list",
                                  "ruleset"], capture_output=True, text=True, check=True).stdout
        assert "redirect" in listing, listing  # the table stayed: fail closed

        # the runtime starts the container again: the next agent, in a new cgroup
        args = [str(a) for a in n.agent.proc.args]  # type: ignore[union-attr]
        cmd = in_cgroup(cg_next) + args[len(n.agent.wrapper):]
        log = open(os.path.join(workdir, "agent-next.log"), "ab")  # noqa: SIM115
        t0 = time.monotonic()
        nxt = subprocess.Popen(cmd, stdout=log, stderr=log)
        until(lambda: works(load), "the next agent never served the pods again", timeout=60)
        t_works = time.monotonic() - t0
        # its status socket may come a moment after its Envoy serves (the dead agent's is a
        # stale file until then)
        until(lambda: _status(n) is not None, "the next agent's status never answered")
        captured = [p for p in _status(n)["pods"] if p["pod"].startswith("app/")]  # type: ignore[index]
        assert len(captured) == 3 and all(p["listener"] == "live" and p["rules"] == "ok"
                                          for p in captured), captured
        print(f"crash of the whole pod: served again {t_works:.1f} s after the next agent "
              "started")
    finally:
        for s in servers:
            s.close()
        n.cleanup()
        if nxt is not None and nxt.poll() is None:
            nxt.terminate()
            try:
                nxt.wait(30)
            except subprocess.TimeoutExpired:
                nxt.kill()
        n.agent.stop()
        remove_cgroup(cg)
        remove_cgroup(cg_next)
