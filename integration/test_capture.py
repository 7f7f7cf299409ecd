"""Pod capture end to end: reference CNI plugins + aether-cni + agent + nftables in a real netns."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.netns import nft
from agent.testing.kubelet import CniError
from agent.testing.netutil import capture_listener, dial, host_server, netns_server
from integration.conftest import GW4, GW6, Node

MANAGED = {"aether.io/managed": "true"}


def test_outbound_tcp_is_redirected_with_original_dst(node: Node) -> None:
    pod = node.pod()
    result = node.add(pod)
    assert result["ips"], "prevResult must be printed back"
    cap = capture_listener(pod.netns)
    srv, port = host_server()
    try:
        assert dial(pod.netns, GW4, port) == "captured"
        assert dial(pod.netns, GW6, port) == "captured"
        origs = [o for _, o in cap.seen]
        assert (GW4, port) in origs
        assert (GW6, port) in origs
        assert srv.seen == []
    finally:
        cap.close()
        srv.close()


def test_prev_result_is_returned_unchanged(node: Node) -> None:
    pod = node.pod()
    node.kubelet.create_sandbox(pod)
    bridge = node.kubelet.conflist["plugins"][0]
    conf = dict(bridge, name="aether-test", cniVersion="1.0.0")
    from agent.testing.kubelet import exec_plugin
    prev = exec_plugin(node.kubelet.plugin_dir, "bridge", "ADD", conf, pod.container_id,
                       pod.netns, "eth0", pod.cni_args)
    aconf = dict(node.kubelet.conflist["plugins"][1], name="aether-test", cniVersion="1.0.0",
                 prevResult=prev)
    out = exec_plugin(node.kubelet.plugin_dir, "aether-cni", "ADD", aconf, pod.container_id,
                      pod.netns, "eth0", pod.cni_args)
    assert out == prev
    pod.result = out


_CGROUP_DIAL = """
import ctypes, os, socket, sys
open(os.path.join(sys.argv[1], "cgroup.procs"), "w").write("0")
fd = os.open(sys.argv[2], os.O_RDONLY)
assert ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) == 0
s = socket.socket(socket.AF_INET6 if ":" in sys.argv[3] else socket.AF_INET)
s.setsockopt(socket.SOL_SOCKET, 36, int(sys.argv[5]))
s.settimeout(3)
s.connect((sys.argv[3], int(sys.argv[4])))
print(s.recv(64).decode())
"""


def _dial_from_cgroup(group: str, netns: str, addr: str, port: int, mark: int) -> str:
    """Dial from a process that joined ``group`` (the proxy's cgroup), with ``mark`` set."""
    out = subprocess.run([sys.executable, "-I", "-c", _CGROUP_DIAL, group, netns, addr,
                          str(port), str(mark)], capture_output=True, text=True, timeout=20)
    return out.stdout.strip() or f"error: {out.stderr.strip()[-200:]}"


def test_exclusions_go_direct(node: Node) -> None:
    pod = node.pod(annotations={
        "capture.aether.io/exclude-outbound-ports": "5432",
        "capture.aether.io/exclude-outbound-ip-ranges": "10.214.0.0/24, fd00:a3e2::1",
    })
    node.add(pod)
    bridge = node.kubelet.conflist["plugins"][0]["bridge"]
    extra = [("10.214.0.1/24", "10.214.0.0/24", "10.214.0.1"),
             ("169.254.77.1/16", "169.254.0.0/16", "169.254.77.1"),
             ("fd00:a3e2::1/64", "fd00:a3e2::/64", "fd00:a3e2::1"),
             ("fd00:a3e3::1/64", "fd00:a3e3::/64", "fd00:a3e3::1")]
    for cidr, net, _ in extra:
        subprocess.run(["ip", "addr", "add", cidr, "dev", bridge, "nodad"], check=False)
        via = GW6 if ":" in net else GW4
        subprocess.run(["ip", "netns", "exec", pod.netns_name, "ip", "route", "replace", net,
                        "via", via], check=True)
    cap = capture_listener(pod.netns)
    srv, port = host_server()
    pg, pg_port = host_server(5432) if _free(5432) else host_server()
    try:
        pod_ip4, pod_ip6 = pod.ip(4), pod.ip(6)
        # annotated CIDRs (v4 and v6) go direct; a v6 address outside them is captured
        assert dial(pod.netns, "10.214.0.1", port) == "direct"
        assert dial(pod.netns, "fd00:a3e2::1", port) == "direct"
        assert dial(pod.netns, "fd00:a3e3::1", port) == "captured"
        # link-local always goes direct
        assert dial(pod.netns, "169.254.77.1", port) == "direct"
        # the annotated port goes direct, other ports are captured
        if pg_port == 5432:
            assert dial(pod.netns, GW4, 5432) == "direct"
        # multicast: never reaches the capture listener
        assert not dial(pod.netns, "224.0.0.1", port).startswith("captured")
        # loopback inside the pod: direct
        lo = netns_server(pod.netns, "127.0.0.1", 9099, b"local")
        assert dial(pod.netns, "127.0.0.1", 9099) == "local"
        lo.close()
        # the pod's own IP: direct (local destination)
        own = netns_server(pod.netns, pod_ip4, 9098, b"self")
        assert dial(pod.netns, pod_ip4, 9098) == "self"
        own.close()
        # the proxy's mark goes direct only from the proxy's cgroup, under the mask
        ci = node.agent.status()["capture_integrity"]
        assert ci["problem"] is None and ci["cgroup"]
        group = os.path.join("/sys/fs/cgroup", ci["cgroup"])
        assert _dial_from_cgroup(group, pod.netns, GW4, port, 0xAE) == "direct"
        assert _dial_from_cgroup(group, pod.netns, GW4, port, 0x1200AE) == "direct"
        assert _dial_from_cgroup(group, pod.netns, GW6, port, 0xAE) == "direct"
        assert _dial_from_cgroup(group, pod.netns, GW4, port, 0xAF) == "captured"
        # anyone else setting the mark (this test process is not in that cgroup) is captured
        assert dial(pod.netns, GW4, port, mark=0xAE) == "captured"
        assert dial(pod.netns, GW6, port, mark=0xAE) == "captured"
        peers = {p for p, _ in srv.seen}
        assert pod_ip4 in peers and pod_ip6 in peers
    finally:
        for cidr, _, _ in extra:
            subprocess.run(["ip", "addr", "del", cidr, "dev", bridge], check=False)
        cap.close()
        srv.close()
        pg.close()


def _free(port: int) -> bool:
    import socket
    s = socket.socket()
    try:
        s.bind(("0.0.0.0", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def test_scoped_mode_redirects_only_mesh_port(node: Node) -> None:
    pod = node.pod(annotations={"capture.aether.io/redirect-all": "false"})
    node.add(pod)
    cap = capture_listener(pod.netns)
    srv, port = host_server()
    try:
        assert dial(pod.netns, GW4, port) == "direct"
        assert dial(pod.netns, GW4, 18081) == "captured"
        assert dial(pod.netns, GW6, 18081) == "captured"
    finally:
        cap.close()
        srv.close()


def test_annotation_true_forces_redirect_all_on_a_scoped_node(workdir: str,
                                                             bridge_name: str) -> None:
    n = Node(workdir, bridge_name, redirect_all_default=False)
    n.agent.start()
    try:
        scoped = n.pod()
        forced = n.pod(annotations={"capture.aether.io/redirect-all": "true"})
        n.add(scoped)
        n.add(forced)
        modes = {p["pod"]: p["mode"] for p in n.agent.status()["pods"]}
        assert modes[f"app/{scoped.name}"] == "scoped"
        assert modes[f"app/{forced.name}"] == "redirect-all"
    finally:
        n.cleanup()
        n.agent.stop()


@pytest.mark.parametrize("kind", ["opt-out", "unmanaged", "system"])
def test_not_captured_pods_get_no_rules(node: Node, kind: str) -> None:
    if kind == "opt-out":
        pod = node.pod(labels={"aether.io/managed": "false"})
    elif kind == "unmanaged":
        pod = node.pod(namespace="plain")
    else:
        pod = node.pod(namespace="kube-system", labels=MANAGED)
    node.add(pod)
    assert nft.list_table_text(pod.netns) is None
    assert node.agent.status()["pods"] == []


def test_pod_label_enrolls_pod_in_unmanaged_namespace(node: Node) -> None:
    pod = node.pod(namespace="plain", labels=MANAGED)
    node.add(pod)
    assert nft.list_table_text(pod.netns) is not None


def test_malformed_annotations_apply_what_parsed_and_report_the_rest(node: Node) -> None:
    pod = node.pod(annotations={
        "capture.aether.io/exclude-outbound-ports": "5432,http,70000",
        "capture.aether.io/exclude-outbound-ip-ranges": "10.9.0.0/16,not-a-cidr",
        "capture.aether.io/redirect-all": "maybe",
    })
    node.add(pod)
    table = nft.list_table_text(pod.netns) or ""
    assert "tcp dport 5432 return" in table
    assert "ip daddr 10.9.0.0/16 return" in table
    assert "redirect to :15001" in table
    assert 'comment "aether capture redirect-all policy ' in table  # a first ADD keeps it too
    st = node.agent.status()
    warned = " ".join(w["message"] for w in st["warnings"])
    for bad in ("'http'", "'70000'", "'not-a-cidr'", "'maybe'"):
        assert bad in warned
    assert all(w["reason"] == "CaptureAnnotationInvalid" for w in st["warnings"])
    logged = [r for r in node.agent.log_records() if r.get("level") == "warning"
              and r.get("pod") == pod.name]
    assert logged, "a warning log line names the pod"


def test_del_removes_everything_and_is_idempotent(node: Node) -> None:
    pod = node.pod()
    node.add(pod)
    assert nft.list_table_text(pod.netns) is not None
    node.kubelet.delete_aether_only(pod)
    assert nft.list_table_text(pod.netns) is None
    assert node.agent.status()["pods"] == []
    node.kubelet.delete_aether_only(pod)  # DEL twice
    subprocess.run(["ip", "netns", "del", pod.netns_name], check=True)
    node.kubelet.delete_aether_only(pod)  # DEL with the netns gone
    assert os.listdir(os.path.join(node.agent.run_dir, "pods")) == []


def test_del_with_netns_gone_while_captured(node: Node) -> None:
    pod = node.pod()
    node.add(pod)
    subprocess.run(["ip", "netns", "del", pod.netns_name], check=True)
    node.kubelet.delete_aether_only(pod)
    assert node.agent.status()["pods"] == []


def test_check_passes_then_catches_tampering(node: Node) -> None:
    pod = node.pod()
    node.add(pod)
    node.kubelet.check(pod)
    subprocess.run(["ip", "netns", "exec", pod.netns_name, "nft", "insert", "rule", "inet",
                    "aether", "output", "tcp", "dport", "443", "return"], check=True)
    with pytest.raises(CniError) as err:
        node.kubelet.check(pod)
    assert "differ" in err.value.msg
    assert node.agent.status()["degraded"] is True


def test_check_catches_a_deleted_table(node: Node) -> None:
    pod = node.pod()
    node.add(pod)
    subprocess.run(["ip", "netns", "exec", pod.netns_name, "nft", "delete", "table", "inet",
                    "aether"], check=True)
    with pytest.raises(CniError) as err:
        node.kubelet.check(pod)
    assert "missing" in err.value.msg


def test_re_add_is_idempotent(node: Node) -> None:
    pod = node.pod()
    node.add(pod)
    first = nft.live_fingerprint(pod.netns)
    assert node.kubelet.add_aether_only(pod) == pod.result
    assert nft.live_fingerprint(pod.netns) == first
    node.kubelet.check(pod)


def test_agent_down_fails_add_closed_and_del_succeeds(node: Node) -> None:
    pod = node.pod()
    node.agent.stop()
    with pytest.raises(CniError) as err:
        node.add(pod)
    assert err.value.result["code"] == 100
    assert "not reachable at " + node.agent.socket in err.value.msg
    assert "cannot be captured" in err.value.msg
    assert nft.list_table_text(pod.netns) is None
    node.kubelet.delete(pod)  # DEL with nothing to clean succeeds
    node.pods.remove(pod)


def test_agent_restart_reprograms_drift_and_drops_dead_pods(node: Node) -> None:
    alive, dead = node.pod(), node.pod()
    node.add(alive)
    node.add(dead)
    node.agent.stop()
    subprocess.run(["ip", "netns", "exec", alive.netns_name, "nft", "flush", "chain", "inet",
                    "aether", "output"], check=True)
    subprocess.run(["ip", "netns", "del", dead.netns_name], check=True)
    node.agent.start()
    st = node.agent.status()
    assert [p["pod"] for p in st["pods"]] == [f"app/{alive.name}"]
    assert st["pods"][0]["rules"] == "ok"
    assert any("re-programmed" in m for m in st["reconcile"])
    assert any("gone" in m for m in st["reconcile"])
    node.kubelet.check(alive)


def test_corrupt_state_file_is_reported_and_agent_starts(node: Node) -> None:
    pod = node.pod()
    node.add(pod)
    node.agent.stop()
    records = os.path.join(node.agent.run_dir, "pods")
    (name,) = os.listdir(records)
    with open(os.path.join(records, name), "w") as f:
        f.write('{"version": 1, "pod": {"x": ')
    node.agent.start()
    st = node.agent.status()
    assert any("unreadable" in m for m in st["reconcile"])
    assert st["pods"] == []
    # the pod keeps its rules (nothing torn down on a bad record) and a re-ADD recaptures it
    assert nft.list_table_text(pod.netns) is not None
    node.kubelet.add_aether_only(pod)
    assert [p["pod"] for p in node.agent.status()["pods"]] == [f"app/{pod.name}"]


def test_twenty_concurrent_adds_all_end_captured(node: Node) -> None:
    pods = [node.pod() for _ in range(20)]
    for p in pods:
        node.kubelet.create_sandbox(p)
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(20) as ex:
        list(ex.map(lambda p: node.kubelet.add(p, create=False), pods))
    assert time.monotonic() - t0 < 120
    st = node.agent.status()
    assert len(st["pods"]) == 20
    assert all(p["rules"] == "ok" for p in st["pods"])
    for p in pods:
        assert "redirect to :15001" in (nft.list_table_text(p.netns) or "")


def _tw_reuse(netns: str) -> str:
    return subprocess.run(["nsenter", f"--net={netns}", "cat", "/proc/sys/net/ipv4/tcp_tw_reuse"],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_capture_lets_time_wait_be_reused_unless_the_pod_chose(node: Node) -> None:
    """A captured pod's netns gets tcp_tw_reuse 1 (the kernel's default, 2, is loopback only):
    the proxy's sockets there would otherwise run the port range out (agent/netns/sysctls.py).
    A pod that set the sysctl itself keeps its value; a pod not captured is not touched."""
    host = Path("/proc/sys/net/ipv4/tcp_tw_reuse").read_text()
    pod = node.pod()
    node.add(pod)
    assert _tw_reuse(pod.netns) == "1"
    assert Path("/proc/sys/net/ipv4/tcp_tw_reuse").read_text() == host  # the pod's netns, not ours
    chose = node.pod()
    node.kubelet.create_sandbox(chose)
    subprocess.run(["nsenter", f"--net={chose.netns}", "sysctl", "-qw",
                    "net.ipv4.tcp_tw_reuse=0"], check=True)
    node.kubelet.add(chose, create=False)
    assert nft.list_table_text(chose.netns) is not None  # captured all the same
    assert _tw_reuse(chose.netns) == "0"
    plain = node.pod(labels={"aether.io/managed": "false"})
    node.add(plain)
    assert nft.list_table_text(plain.netns) is None
    assert _tw_reuse(plain.netns) == "2"
