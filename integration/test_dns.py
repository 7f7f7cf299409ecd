"""DNS capture (#42) end to end: the real agent, its pod DNS process and Envoy, pods made by
the reference CNI plugins, and a cluster DNS of our own in a pod of its own.

A captured pod's port-53 traffic is redirected to the pod DNS in its netns: mesh names
(``<svc>.<ns>.aether.internal``) are answered there and the cluster DNS never sees them;
every other query reaches the resolver the pod asked, from the pod's own address, and its
answer comes back byte for byte (NXDOMAIN and truncation included; TCP too)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent.dns import wire
from agent.identity.ca_dir import make_ca
from agent.netns.nft import list_table_text
from agent.testing.dns_double import ClusterDns, addresses, ask
from agent.testing.kubelet import Pod
from agent.testing.netutil import http_echo_server, http_get_from
from integration.conftest import EnvoyNode, running, stop_kept_envoy, until

pytestmark = [pytest.mark.integration]

SVC_IP = "10.96.71.10"
TD = "cluster.local"
MESH_NAME = "echo.app.aether.internal"


@pytest.fixture
def dnode(workdir: str, bridge_name: str) -> Iterator[EnvoyNode]:
    ca = os.path.join(workdir, "ca")
    make_ca(ca, TD)
    with running(EnvoyNode(workdir, bridge_name, extra=[
            "--identity-ca-dir", ca, "--trust-domain", TD])) as n:
        yield n


@pytest.fixture
def cluster_dns(dnode: EnvoyNode) -> Iterator[tuple[ClusterDns, str]]:
    """The cluster DNS: an uncaptured pod (namespace ``plain``) serving port 53."""
    pod = dnode.pod(namespace="plain", name="coredns")
    dnode.add(pod)
    dns = ClusterDns(pod.netns, records={"known.app.svc.cluster.local": ("10.96.99.99",),
                                         "big.app.svc.cluster.local": ("10.96.99.98",)},
                     truncate={"big.app.svc.cluster.local"}).start()
    yield dns, pod.ip()
    dns.close()


def _echo(node: EnvoyNode, client_annotations: dict[str, str] | None = None,
          deps: str | None = "app/echo", server_annotations: dict[str, str] | None = None,
          route: bool = True) -> tuple[Pod, Pod, Any]:
    node.agent.write("svc-echo.yaml", [{
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "echo", "namespace": "app"},
        "spec": {"clusterIP": SVC_IP, "clusterIPs": [SVC_IP], "selector": {"app": "echo"},
                 "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}])
    node.agent.write("route-echo.yaml", [] if not route else [{
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": {"name": "echo-tag", "namespace": "app"},
        "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "echo", "port": 80}],
                 "rules": [{"filters": [{"type": "RequestHeaderModifier",
                                         "requestHeaderModifier": {
                                             "add": [{"name": "x-route", "value": "echo-tag"}]}}],
                            "backendRefs": [{"name": "echo", "port": 80}]}]}}])
    server = node.pod(name="server", labels={"app": "echo"}, service_account="server",
                      annotations=server_annotations)
    client = node.pod(name="client", service_account="client",
                      annotations={**({"aether.io/dependencies": deps} if deps else {}),
                                   **(client_annotations or {})})
    for p in (server, client):
        node.add(p)
    return server, client, http_echo_server(server.netns, "0.0.0.0", 8080, "server")


def _dns_status(node: EnvoyNode) -> dict[str, Any]:
    return dict(node.agent.status().get("dns") or {})


def test_a_mesh_name_is_answered_on_the_node_and_routes_through_the_mesh_with_identity(
        dnode: EnvoyNode, cluster_dns: tuple[ClusterDns, str]) -> None:
    dns, dns_ip = cluster_dns
    _server, client, srv = _echo(dnode)
    try:
        until(lambda: addresses(ask(client.netns, dns_ip, MESH_NAME))[1] == [SVC_IP],
              "the mesh name resolving to the ClusterIP", 20)
        assert addresses(ask(client.netns, dns_ip, MESH_NAME, tcp=True))[1] == [SVC_IP]
        # AAAA of an IPv4-only Service: NOERROR with no records, not asked of the cluster DNS
        assert addresses(ask(client.netns, dns_ip, MESH_NAME, wire.TYPE_AAAA))[:2] == (0, [])
        assert addresses(ask(client.netns, dns_ip, "nope.app.aether.internal"))[0] == \
            wire.RCODE_NXDOMAIN
        assert not [n for n in dns.names_seen() if n.endswith("aether.internal")], \
            "the cluster DNS saw a mesh name"
        # the name is the Service: its route applies and the server sees the caller's identity
        def call() -> tuple[int, dict[str, Any]]:
            code, _h, body = http_get_from(client.netns, SVC_IP, 80,
                                           headers={"Host": MESH_NAME}, timeout=3)[0]
            return code, (json.loads(body) if code == 200 else {})
        code, seen = until(lambda: (got := call())[0] == 200 and got, "a call by mesh name", 20)
        headers = {k.lower(): v for k, v in seen["headers"].items()}
        assert headers.get("x-route") == "echo-tag", headers
        assert f"URI=spiffe://{TD}/ns/app/sa/client" in headers.get("x-forwarded-client-cert", "")
        counts = _dns_status(dnode)["pods"]["app/client"]
        assert counts["mesh"] >= 3 and counts["nxdomain"] >= 1
    finally:
        srv.shutdown()


def test_a_scoped_pod_reaches_the_mesh_name_on_the_mesh_port_through_the_route(
        dnode: EnvoyNode, cluster_dns: tuple[ClusterDns, str]) -> None:
    """Scoped capture (only :18081 redirected): ``<svc>.<ns>.aether.internal:18081`` is the
    Service's HTTP port through the mesh: its route applies, the server sees the caller."""
    _dns, dns_ip = cluster_dns
    _server, client, srv = _echo(dnode, client_annotations={
        "capture.aether.io/redirect-all": "false"})
    try:
        ip = until(lambda: (a := addresses(ask(client.netns, dns_ip, MESH_NAME))[1]) and a[0],
                   "the mesh name resolving", 20)
        assert ip == SVC_IP

        def call() -> tuple[int, dict[str, Any]]:
            code, _h, body = http_get_from(client.netns, ip, 18081,
                                           headers={"Host": f"{MESH_NAME}:18081"}, timeout=3)[0]
            return code, (json.loads(body) if code == 200 else {})
        _code, seen = until(lambda: (got := call())[0] == 200 and got, "a call on :18081", 20)
        headers = {k.lower(): v for k, v in seen["headers"].items()}
        assert headers.get("x-route") == "echo-tag", headers
        assert f"URI=spiffe://{TD}/ns/app/sa/client" in headers.get("x-forwarded-client-cert", "")
        # the Service's real port is not captured for a scoped pod (there is no kube-proxy
        # here, so nothing answers it): the mesh port is the way in
        assert "dport 18081" in (list_table_text(client.netns) or "")
    finally:
        srv.shutdown()


@pytest.mark.parametrize("by", ["mesh name", "standard name"])
def test_the_first_call_to_a_service_never_called_is_a_mesh_call(
        dnode: EnvoyNode, cluster_dns: tuple[ClusterDns, str], by: str) -> None:
    """Demand scope, a client that declares nothing, a STRICT server (plaintext refused):
    the name's answer waits until the node's proxy serves the Service, so the very first
    request goes over the mesh hop with the caller's identity."""
    dns, dns_ip = cluster_dns
    name = MESH_NAME if by == "mesh name" else "echo.app.svc.cluster.local"
    dns.records[name] = (SVC_IP,)  # the cluster DNS knows the standard name
    _server, client, srv = _echo(dnode, deps=None, route=False, server_annotations={
        "security.aether.io/peer-authentication": "strict"})
    try:
        # the Service is known to the agent (its model), not served: nobody asked for it
        until(lambda: (dnode.agent.status()["mesh"]["objects_by_kind"]).get("Service"),
              "the Service in the agent's model", 20)
        time.sleep(0.5)  # its endpoints (the server pod) settled too
        served = dnode.agent.status()["mesh"]["dependency_set"].get("app/echo", [])
        assert not served or all(r.startswith("not served") for r in served), served
        assert addresses(ask(client.netns, dns_ip, name, timeout=5))[1] == [SVC_IP]
        code, _h, body = http_get_from(client.netns, SVC_IP, 80, headers={"Host": name},
                                       timeout=5)[0]
        assert code == 200, body
        xfcc = {k.lower(): v for k, v in json.loads(body)["headers"].items()}.get(
            "x-forwarded-client-cert", "")
        assert f"URI=spiffe://{TD}/ns/app/sa/client" in xfcc
        mesh = dnode.agent.status()["mesh"]
        assert mesh["first_calls_held"] >= 1 and mesh["first_call_hold_timeouts"] == 0
    finally:
        srv.shutdown()


def test_other_names_reach_the_resolver_the_pod_asked_from_the_pod_unchanged(
        dnode: EnvoyNode, cluster_dns: tuple[ClusterDns, str]) -> None:
    dns, dns_ip = cluster_dns
    client = dnode.pod(name="asker", service_account="asker")
    dnode.add(client)
    for tcp in (False, True):
        got = ask(client.netns, dns_ip, "known.app.svc.cluster.local", tcp=tcp)
        assert addresses(got)[:2] == (0, ["10.96.99.99"]) and got == dns.sent[-1]
        assert dns.seen[-1].transport == ("tcp" if tcp else "udp")
        assert dns.seen[-1].peer == client.ip(), "the resolver must see the pod, not the node"
        # NXDOMAIN relayed as the resolver wrote it
        nx = ask(client.netns, dns_ip, "nope.app.svc.cluster.local", tcp=tcp)
        assert addresses(nx)[0] == wire.RCODE_NXDOMAIN and nx == dns.sent[-1]
    # truncation: TC over UDP, relayed as is; the retry over TCP gets the records
    udp = ask(client.netns, dns_ip, "big.app.svc.cluster.local")
    assert addresses(udp)[2] and udp == dns.sent[-1]
    tcp_answer = ask(client.netns, dns_ip, "big.app.svc.cluster.local", tcp=True)
    assert addresses(tcp_answer)[1] == ["10.96.99.98"]
    counts = _dns_status(dnode)["pods"]["app/asker"]
    assert counts["forwarded"] >= 6
    # the table sends DNS to the pod DNS, after the proxy's own RETURN
    table = list_table_text(client.netns) or ""
    assert "15053" in table


def test_an_opted_out_pod_asks_the_cluster_dns_itself(
        dnode: EnvoyNode, cluster_dns: tuple[ClusterDns, str]) -> None:
    dns, dns_ip = cluster_dns
    pod = dnode.pod(name="optout", annotations={"capture.aether.io/dns": "false"})
    dnode.add(pod)
    got = ask(pod.netns, dns_ip, MESH_NAME)
    assert addresses(got)[0] == wire.RCODE_NXDOMAIN and MESH_NAME in dns.names_seen()
    assert "15053" not in (list_table_text(pod.netns) or "")
    assert "app/optout" not in (_dns_status(dnode).get("pods") or {})


def test_a_pod_cannot_forge_its_way_past_the_dns_capture(
        dnode: EnvoyNode, cluster_dns: tuple[ClusterDns, str]) -> None:
    """A pod process with CAP_NET_RAW sets the proxy's mark on its own socket: the RETURN
    also wants the proxy's cgroup, so the query is still captured."""
    dns, dns_ip = cluster_dns
    pod = dnode.pod(name="forger")
    dnode.add(pod)
    for tcp in (False, True):
        before = len(dns.seen)
        got = ask(pod.netns, dns_ip, "nope.app.aether.internal", tcp=tcp, mark=0xAE)
        assert addresses(got)[0] == wire.RCODE_NXDOMAIN
        assert len(dns.seen) == before, "a marked query left uncaptured"


def test_the_pod_dns_survives_its_process_dying_and_goes_with_the_pod(
        dnode: EnvoyNode, cluster_dns: tuple[ClusterDns, str]) -> None:
    dns, dns_ip = cluster_dns
    pod = dnode.pod(name="lasting")
    dnode.add(pod)
    assert addresses(ask(pod.netns, dns_ip, "known.app.svc.cluster.local"))[1] == ["10.96.99.99"]
    pid = _dns_status(dnode)["pid"]
    os.kill(pid, signal.SIGKILL)
    until(lambda: (st := _dns_status(dnode)).get("up") and st.get("pid") != pid
          and "app/lasting" in (st.get("pods") or {}), "the pod DNS started again", 15)
    assert addresses(ask(pod.netns, dns_ip, "known.app.svc.cluster.local"))[1] == ["10.96.99.99"]
    # DEL: its sockets go with it (the cluster DNS pod is not captured: none of its own)
    dnode.kubelet.delete(pod)
    dnode.pods.remove(pod)
    deadline = time.monotonic() + 10
    while "app/lasting" in (_dns_status(dnode).get("pods") or {}):
        assert time.monotonic() < deadline, _dns_status(dnode)
        time.sleep(0.1)
    assert _dns_status(dnode)["served"] == 0


def test_a_restart_hands_the_pod_dns_over_without_a_lost_query(
        workdir: str, bridge_name: str) -> None:
    """An upgrade-style stop (SIGTERM, Envoy kept): the DNS process outlives the agent and
    forwards on; the next agent's binds beside it (SO_REUSEPORT) and stops it once every
    restored pod is served. A pod asking all along loses no query."""
    import threading

    import psutil
    n = EnvoyNode(workdir, bridge_name, extra=["--envoy-on-exit", "keep"])
    n.agent.start()
    n.wait_ready()
    keeper = 0
    dns: ClusterDns | None = None
    try:
        dns_pod = n.pod(namespace="plain", name="coredns")
        n.add(dns_pod)
        dns = ClusterDns(dns_pod.netns, records={"known.app.svc.cluster.local": ("10.96.99.99",)}
                         ).start()
        client = n.pod(name="steady")
        n.add(client)
        with open(os.path.join(n.agent.run_dir, "envoy", "envoy.pid")) as f:
            keeper = int(f.read())
        assert addresses(ask(client.netns, dns_pod.ip(), "known.app.svc.cluster.local"))[1]
        old = _dns_status(n)["pid"]
        answered, lost, stop = [0], [0], threading.Event()

        def steady() -> None:
            while not stop.is_set():
                got = ask(client.netns, dns_pod.ip(), "known.app.svc.cluster.local", timeout=2)
                if got and addresses(got)[1] == ["10.96.99.99"]:
                    answered[0] += 1
                else:
                    lost[0] += 1
                time.sleep(0.01)
        t = threading.Thread(target=steady, daemon=True)
        t.start()
        n.agent.stop()  # SIGTERM
        assert psutil.pid_exists(old), "the DNS process went with the agent"
        during = answered[0]
        time.sleep(1.0)
        assert answered[0] > during, "no answer while the agent was down"
        # a mesh name needs the agent: SERVFAIL meanwhile (the pod's resolver retries)
        assert addresses(ask(client.netns, dns_pod.ip(), "x.app.aether.internal"))[0] == \
            wire.RCODE_SERVFAIL
        n.agent.start()
        until(lambda: not psutil.pid_exists(old) or psutil.Process(old).status() == "zombie",
              "the previous DNS process still runs", 20)
        time.sleep(1.0)
        stop.set()
        t.join(10)
        assert _dns_status(n)["pid"] != old and "app/steady" in _dns_status(n)["pods"]
        assert lost[0] == 0 and answered[0] > 50, (lost[0], answered[0])
        assert addresses(ask(client.netns, dns_pod.ip(), "x.app.aether.internal"))[0] == \
            wire.RCODE_NXDOMAIN
    finally:
        if dns is not None:
            dns.close()
        stop_kept_envoy(n, keeper)
