"""Telling "went through the proxy" from "went around it" now that both leave from the pod's
own address: count new connections after the capture NAT by the socket's cgroup (the proxy's,
or anyone else's), and read Envoy's own per-pod listener counter."""

from __future__ import annotations

import json
import os
from typing import Any

import nftables

from agent.netns.cgroup import cgroup2_mount, nft_name
from agent.netns.enter import run_in_netns
from agent.testing.kubelet import Pod
from integration.conftest import EnvoyNode


class Tap:
    """Counts new TCP connections leaving a pod netns towards ip:port after the capture NAT:
    the proxy's (a socket of the proxy cgroup) and anyone else's. A captured connection is
    redirected to 127.0.0.1:15001 first and never counts; a bypass counts as ``other``."""

    def __init__(self, netns: str, ip: str, port: int, cgroup: str, level: int) -> None:
        self.netns = netns
        fam = "ip6" if ":" in ip else "ip"
        match = f"{fam} daddr {ip} tcp dport {port} ct state new"
        self._nft(f"""table inet aether_tap {{
  chain out {{
    type filter hook output priority 0; policy accept;
    {match} socket cgroupv2 level {level} "{cgroup}" counter accept comment "proxy"
    {match} counter comment "other"
  }}
}}""")

    def _nft(self, script: str) -> str:
        def work() -> str:
            n = nftables.Nftables()
            n.set_json_output(True)
            rc, out, err = n.cmd(script)
            assert rc == 0, err
            return str(out)

        return run_in_netns(self.netns, work)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for item in json.loads(self._nft("list table inet aether_tap"))["nftables"]:
            rule = item.get("rule")
            if rule:
                packets = next(e["counter"]["packets"] for e in rule["expr"] if "counter" in e)
                out[rule["comment"]] = int(packets)
        return out


def integrity(enode: EnvoyNode) -> dict[str, Any]:
    ci: dict[str, Any] = enode.agent.status()["capture_integrity"]
    assert ci["problem"] is None, ci  # this host offers the cgroup v2 match
    return ci


def proxy_cgroup_here(enode: EnvoyNode) -> str:
    """The proxy's cgroup as nft names it from this test's mount namespace, read from Envoy's
    own /proc entry: an agent under `ip netns exec` mounts cgroup2 at /sys/fs/cgroup in its
    private mount namespace, where this hybrid host keeps it at /sys/fs/cgroup/unified."""
    with open(f"/proc/{enode.envoy_pid()}/cgroup") as f:
        path = next(line[3:].strip() for line in f if line.startswith("0::"))
    with open("/proc/self/mountinfo") as f:
        mount = cgroup2_mount(f.read())
    assert mount is not None
    name = nft_name(os.path.join(mount, path.lstrip("/")))
    assert name is not None
    return name


def tap(enode: EnvoyNode, pod: Pod, ip: str, port: int) -> Tap:
    ci = integrity(enode)
    return Tap(pod.netns, ip, port, proxy_cgroup_here(enode), ci["level"])


def carried(enode: EnvoyNode, pod: Pod) -> int:
    """Connections the pod's capture listener accepted (Envoy's own count)."""
    return enode.stat(f"listener.capture-{pod.container_id}.downstream_cx_total")
