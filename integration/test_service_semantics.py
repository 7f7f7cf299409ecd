"""Kubernetes Service semantics on the capture path (#17): what kube-proxy would have done for
a Service, the node Envoy does for a captured pod (docs/service-semantics.md has the table)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from agent.netns.enter import run_in_netns
from agent.testing.kubelet import Pod
from agent.testing.netutil import http_echo_server, http_get_from
from integration.conftest import EnvoyNode, running, until

SVC_IP = "10.96.71.10"


@pytest.fixture
def enode(workdir: str, bridge_name: str) -> Iterator[EnvoyNode]:
    with running(EnvoyNode(workdir, bridge_name)) as n:
        yield n


def _service(node: EnvoyNode, spec: dict[str, Any], name: str = "web", ip: str = SVC_IP,
             app_protocol: str | None = None) -> None:
    port: dict[str, Any] = {"name": "http", "port": 80, "targetPort": 8080}
    if app_protocol is not None:
        port["appProtocol"] = app_protocol
    node.agent.write(f"svc-{name}.yaml", [{
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "app"},
        "spec": {"clusterIP": ip, "clusterIPs": [ip], "selector": {"app": "web"},
                 "ports": [port], **spec}}])


def _backends(node: EnvoyNode, n: int, deps: str = "app/web") -> tuple[list[Pod], Pod, list[Any]]:
    servers = [node.pod(name=f"web-{i}", labels={"app": "web"}) for i in range(n)]
    client = node.pod(name="client", annotations={"aether.io/dependencies": deps})
    for p in (*servers, client):
        node.add(p)
    echo = [http_echo_server(p.netns, "0.0.0.0", 8080, p.name) for p in servers]
    return servers, client, echo


def _who(netns: str, count: int, ip: str = SVC_IP) -> Counter[str]:
    """``count`` GETs on new connections: which pod answered each ("-" for no answer)."""
    got = http_get_from(netns, ip, 80, count=count, timeout=3)
    return Counter(json.loads(body)["pod"] if status == 200 else "-" for status, _h, body in got)


_until = until


def _pod_state(node: EnvoyNode, pod: Pod, *, ready: bool, terminating: bool = False) -> None:
    """Rewrite a local pod's object as the API would report it: its Ready condition, and a
    deletionTimestamp once it is terminating."""
    meta: dict[str, Any] = {"name": pod.name, "namespace": pod.namespace, "uid": pod.uid,
                            "labels": {"app": "web"}}
    if terminating:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    node.agent.write(f"pod-{pod.namespace}-{pod.name}.yaml", [{
        "apiVersion": "v1", "kind": "Pod", "metadata": meta,
        "spec": {"nodeName": "test-node", "serviceAccountName": "default"},
        "status": {"podIP": pod.ip(), "podIPs": [{"ip": pod.ip()}], "phase": "Running",
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}])


@pytest.mark.parametrize("app_protocol", [None, "http"])
def test_client_ip_affinity_keeps_a_pod_on_one_endpoint(enode: EnvoyNode,
                                                        app_protocol: str | None) -> None:
    """sessionAffinity: ClientIP: 100 new connections from one pod all reach one endpoint;
    the same Service without affinity spreads them. On an L4 port (tcp_proxy) and on an
    HTTP one (appProtocol http: balanced per request, the route hashing the caller)."""
    _service(enode, {"sessionAffinity": "ClientIP",
                     "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 600}}},
             app_protocol=app_protocol)
    _service(enode, {}, name="spread", ip="10.96.71.11", app_protocol=app_protocol)
    servers, client, echo = _backends(enode, 3, deps="app/web,app/spread")
    try:
        for ip in (SVC_IP, "10.96.71.11"):
            _until(lambda ip=ip: _who(client.netns, 1, ip).get("-", 0) == 0,
                   "the Service never answered")
        sticky = _who(client.netns, 100)
        assert len(sticky) == 1 and "-" not in sticky, sticky
        spread = _who(client.netns, 100, "10.96.71.11")
        assert len(spread) == 3 and "-" not in spread, spread
    finally:
        for e in echo:
            e.shutdown()


def test_internal_traffic_policy_local_uses_only_this_nodes_endpoints(enode: EnvoyNode) -> None:
    """internalTrafficPolicy: Local: a remote endpoint (an address nothing answers on) is
    never chosen; with no local endpoint left the connection fails, as without the mesh."""
    _service(enode, {"internalTrafficPolicy": "Local"})
    enode.agent.write("pod-remote.yaml", [{
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web-remote", "namespace": "app", "uid": "u-web-remote",
                     "labels": {"app": "web"}},
        "spec": {"nodeName": "other-node"},
        "status": {"podIP": "10.250.9.9", "podIPs": [{"ip": "10.250.9.9"}], "phase": "Running",
                   "conditions": [{"type": "Ready", "status": "True"}]}}])
    servers, client, echo = _backends(enode, 1)
    try:
        _until(lambda: _who(client.netns, 1).get("-", 0) == 0, "the Service never answered")
        assert _who(client.netns, 30) == Counter({"web-0": 30})
        # the local pod stops being ready: nothing local left, the call fails
        _pod_state(enode, servers[0], ready=False)
        _until(lambda: _who(client.netns, 3) == Counter({"-": 3}),
               "a Local Service with no ready local endpoint still answered")
    finally:
        for e in echo:
            e.shutdown()


def test_terminating_endpoints_serve_only_when_no_ready_one_is_left(enode: EnvoyNode) -> None:
    """A terminating pod that still serves gets no traffic while a ready endpoint exists,
    and all of it once none does (kube-proxy's fallback); not serving, it gets none."""
    _service(enode, {})
    servers, client, echo = _backends(enode, 2)
    a, b = servers
    try:
        _until(lambda: set(_who(client.netns, 10)) == {"web-0", "web-1"}, "both never answered")
        _pod_state(enode, b, ready=True, terminating=True)
        _until(lambda: _who(client.netns, 20) == Counter({"web-0": 20}),
               "a terminating endpoint still got traffic beside a ready one")
        _pod_state(enode, a, ready=False)
        _until(lambda: _who(client.netns, 20) == Counter({"web-1": 20}),
               "the serving terminating endpoint did not take over")
        _pod_state(enode, b, ready=False, terminating=True)
        _until(lambda: _who(client.netns, 3) == Counter({"-": 3}),
               "an endpoint neither ready nor serving got traffic")
    finally:
        for e in echo:
            e.shutdown()


def test_publish_not_ready_addresses_makes_not_ready_pods_endpoints(enode: EnvoyNode) -> None:
    _service(enode, {"publishNotReadyAddresses": True})
    servers, client, echo = _backends(enode, 1)
    try:
        _until(lambda: _who(client.netns, 1).get("-", 0) == 0, "the Service never answered")
        _pod_state(enode, servers[0], ready=False)
        time.sleep(2)  # the change has reached Envoy by now, and must not have mattered
        assert _who(client.netns, 10) == Counter({"web-0": 10})
    finally:
        for e in echo:
            e.shutdown()


def test_a_named_target_port_resolves_per_pod_and_each_port_is_its_own(enode: EnvoyNode) -> None:
    """targetPort "web" is 8080 in one pod and 8081 in the other: each pod is reached on
    its own number; the Service's second port (81 → 9000) reaches 9000 on both."""
    enode.agent.write("svc-web.yaml", [{
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "app"},
        "spec": {"clusterIP": SVC_IP, "clusterIPs": [SVC_IP], "selector": {"app": "web"},
                 "ports": [{"name": "http", "port": 80, "targetPort": "web"},
                           {"name": "admin", "port": 81, "targetPort": 9000}]}}])
    servers = [enode.pod(name=f"web-{i}", labels={"app": "web"}) for i in range(2)]
    client = enode.pod(name="client", annotations={"aether.io/dependencies": "app/web"})
    for p in (*servers, client):
        enode.add(p)
    for i, p in enumerate(servers):
        enode.agent.write(f"pod-{p.namespace}-{p.name}.yaml", [{
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": p.name, "namespace": p.namespace, "uid": p.uid,
                         "labels": {"app": "web"}},
            "spec": {"nodeName": "test-node", "containers": [
                {"name": "app", "ports": [{"name": "web", "containerPort": 8080 + i}]}]},
            "status": {"podIP": p.ip(), "podIPs": [{"ip": p.ip()}], "phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True"}]}}])
    # each pod serves on its own named port only (and on 9000, the admin port)
    echo = [http_echo_server(p.netns, "0.0.0.0", 8080 + i, p.name) for i, p in enumerate(servers)]
    echo += [http_echo_server(p.netns, "0.0.0.0", 9000, f"{p.name}-admin") for p in servers]
    try:
        _until(lambda: set(_who(client.netns, 12)) == {"web-0", "web-1"},
               "the named targetPort did not reach both pods on their own numbers")
        got = http_get_from(client.netns, SVC_IP, 81, count=12, timeout=3)
        admin = Counter(json.loads(b)["pod"] if s == 200 else "-" for s, _h, b in got)
        assert set(admin) == {"web-0-admin", "web-1-admin"}, admin
    finally:
        for e in echo:
            e.shutdown()


def _dead_and_alive(node: EnvoyNode) -> tuple[Pod, Any]:
    """Service web over web-0 (serving) and web-1 (a pod with nothing on the port: every
    connect is refused). Returns the client and web-0's server."""
    _service(node, {})
    servers = [node.pod(name=f"web-{i}", labels={"app": "web"}) for i in range(2)]
    client = node.pod(name="client", annotations={"aether.io/dependencies": "app/web"})
    for p in (*servers, client):
        node.add(p)
    return client, http_echo_server(servers[0].netns, "0.0.0.0", 8080, "web-0")


def test_a_refused_connect_is_retried_elsewhere_and_the_endpoint_ejected(enode: EnvoyNode) -> None:
    """The defaults: a connect refused by one endpoint is tried on another (2 attempts),
    and after 5 consecutive failures that endpoint is ejected for 30 s."""
    client, srv = _dead_and_alive(enode)
    try:
        _until(lambda: _who(client.netns, 1).get("-", 0) == 0, "the Service never answered")
        assert _who(client.netns, 40) == Counter({"web-0": 40})
        stat = "cluster.svc|app|web|80.outlier_detection.ejections_active"
        _until(lambda: enode.stat(stat) == 1, "the refusing endpoint was never ejected")
    finally:
        srv.shutdown()


def test_ejection_alone_steers_connections_off_a_refusing_endpoint(workdir: str,
                                                                   bridge_name: str) -> None:
    """`--connect-attempts 1` (no retry on another endpoint): the refusing endpoint's
    connections fail until it has failed 5 times in a row, then none reaches it: the
    ejection reaches the load balancer at once (no update merge window)."""
    with running(EnvoyNode(workdir, bridge_name, extra=["--connect-attempts", "1"])) as node:
        client, srv = _dead_and_alive(node)
        try:
            _until(lambda: _who(client.netns, 1).get("web-0", 0) > 0, "the Service never answered")
            first = _who(client.netns, 30)
            assert first["-"] <= 5, first  # at most the 5 that eject it
            stat = "cluster.svc|app|web|80.outlier_detection.ejections_active"
            assert node.stat(stat) == 1
            assert _who(client.netns, 30) == Counter({"web-0": 30})
        finally:
            srv.shutdown()


def test_without_retries_and_ejection_the_dead_endpoint_shows(workdir: str, bridge_name: str) -> None:
    """`--connect-attempts 1 --outlier-consecutive-failures 0` is kube-proxy's behaviour:
    about half the connections reach the dead endpoint and fail."""
    with running(EnvoyNode(workdir, bridge_name, extra=[
            "--connect-attempts", "1", "--outlier-consecutive-failures", "0"])) as node:
        client, srv = _dead_and_alive(node)
        try:
            _until(lambda: _who(client.netns, 4).get("web-0", 0) > 0, "the Service never answered")
            got = _who(client.netns, 40)
            assert got["-"] >= 5 and got["web-0"] >= 5, got
        finally:
            srv.shutdown()


def _two_zones(node: EnvoyNode) -> None:
    """This node (test-node) in zone-a, far-node in zone-b."""
    node.agent.write("nodes.yaml", [
        {"apiVersion": "v1", "kind": "Node",
         "metadata": {"name": n, "labels": {"topology.kubernetes.io/zone": z}}}
        for n, z in (("test-node", "zone-a"), ("far-node", "zone-b"))])


def _far_pod(node: EnvoyNode) -> None:
    """web-far: a ready web pod of far-node, at the node's bridge address (the test serves
    it from the host netns)."""
    from integration.conftest import GW4
    node.agent.write("pod-far.yaml", [{
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web-far", "namespace": "app", "uid": "u-web-far",
                     "labels": {"app": "web"}},
        "spec": {"nodeName": "far-node"},
        "status": {"podIP": GW4, "podIPs": [{"ip": GW4}], "phase": "Running",
                   "conditions": [{"type": "Ready", "status": "True"}]}}])


@pytest.mark.parametrize("prefer", ["PreferSameZone", "PreferClose", "PreferSameNode"])
def test_traffic_distribution_prefers_this_zone_and_falls_back(workdir: str, bridge_name: str,
                                                               prefer: str) -> None:
    """trafficDistribution PreferSameZone (and PreferClose, its older name), PreferSameNode:
    with this node in zone-a, the endpoint in zone-a (a pod here, so on this node too) takes
    every connection and the one in zone-b (a pod of far-node, served from the node's bridge
    address) none; once it is not ready, zone-b takes over. Without trafficDistribution
    both are used."""
    from integration.conftest import GW4
    with running(EnvoyNode(workdir, bridge_name)) as node:
        _two_zones(node)
        _service(node, {"trafficDistribution": prefer})
        _service(node, {}, name="flat", ip="10.96.71.11")
        _far_pod(node)
        servers, client, echo = _backends(node, 1, deps="app/web,app/flat")
        far = http_echo_server(f"/proc/{os.getpid()}/ns/net", GW4, 8080, "web-far")
        try:
            _until(lambda: set(_who(client.netns, 12, "10.96.71.11")) == {"web-0", "web-far"},
                   "the Service without trafficDistribution did not use both zones")
            _until(lambda: _who(client.netns, 20) == Counter({"web-0": 20}),
                   f"{prefer} still sent connections to the other zone")
            _pod_state(node, servers[0], ready=False)
            _until(lambda: _who(client.netns, 10) == Counter({"web-far": 10}),
                   "no fallback to the other zone when this one had no ready endpoint")
        finally:
            far.shutdown()
            for e in echo:
                e.shutdown()


def _hinted_slice(node: EnvoyNode, hints: dict[str, dict[str, list[str]]]) -> None:
    """Service web's EndpointSlice as the controller writes it, with these hints per address."""
    node.agent.write("slice-web.yaml", [{
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "web-h1", "namespace": "app",
                     "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4", "ports": [{"name": "http", "port": 8080}],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": True},
                       "hints": {k: [{"name": n} for n in v] for k, v in h.items()}}
                      for ip, h in hints.items()]}])


def test_endpoint_slice_hints_steer_as_kube_proxy_reads_them(workdir: str,
                                                             bridge_name: str) -> None:
    """EndpointSlice hints decide, as they do for kube-proxy: hinted forZones zone-a (ours),
    the endpoint in zone-b takes every connection and the one here none; forNodes naming
    this node turns it round; once the hinted endpoint is not ready, the other takes over."""
    from integration.conftest import GW4
    with running(EnvoyNode(workdir, bridge_name)) as node:
        _two_zones(node)
        _service(node, {})
        _far_pod(node)
        servers, client, echo = _backends(node, 1)
        far = http_echo_server(f"/proc/{os.getpid()}/ns/net", GW4, 8080, "web-far")
        here = servers[0].ip()
        try:
            _until(lambda: set(_who(client.netns, 12)) == {"web-0", "web-far"},
                   "without hints both endpoints were not used")
            _hinted_slice(node, {here: {"forZones": ["zone-b"]},
                                 GW4: {"forZones": ["zone-a"]}})
            _until(lambda: _who(client.netns, 20) == Counter({"web-far": 20}),
                   "the zone hints did not send every connection to the hinted endpoint")
            _hinted_slice(node, {here: {"forZones": ["zone-a"], "forNodes": ["test-node"]},
                                 GW4: {"forZones": ["zone-b"], "forNodes": ["far-node"]}})
            _until(lambda: _who(client.netns, 20) == Counter({"web-0": 20}),
                   "the node hints did not send every connection to this node's endpoint")
            _pod_state(node, servers[0], ready=False)
            _until(lambda: _who(client.netns, 10) == Counter({"web-far": 10}),
                   "no fallback when the hinted endpoint was not ready")
        finally:
            far.shutdown()
            for e in echo:
                e.shutdown()


def _cluster_thresholds(node: EnvoyNode, name: str) -> dict[str, Any] | None:
    dump = json.loads(node.admin("/config_dump?resource=dynamic_active_clusters"))
    for c in dump.get("configs", []):
        cluster = c.get("cluster", {})
        if cluster.get("name") == name:
            return dict(cluster.get("circuit_breakers", {}).get("thresholds", [{}])[0])
    return None


def test_a_backend_traffic_policy_sets_the_services_retry_budget(enode: EnvoyNode) -> None:
    """XBackendTrafficPolicy (Gateway API, experimental) on Service web: its retry budget
    replaces the agent's default on the Service's cluster in Envoy, and goes with the
    policy."""
    _service(enode, {})
    servers, client, echo = _backends(enode, 1)
    name = "svc|app|web|80"
    try:
        _until(lambda: (_cluster_thresholds(enode, name) or {}).get("retry_budget"),
               "the Service cluster never reached Envoy")
        assert _cluster_thresholds(enode, name)["retry_budget"]["budget_percent"]["value"] == 20
        enode.agent.write("btp.yaml", [{
            "apiVersion": "gateway.networking.x-k8s.io/v1alpha1", "kind": "XBackendTrafficPolicy",
            "metadata": {"name": "web-budget", "namespace": "app"},
            "spec": {"targetRefs": [{"group": "", "kind": "Service", "name": "web"}],
                     "retryConstraint": {"budget": {"percent": 5, "interval": "10s"},
                                         "minRetryRate": {"count": 2, "interval": "1s"}}}}])
        got = _until(lambda: (t := _cluster_thresholds(enode, name) or {}).get("retry_budget", {})
                     .get("budget_percent", {}).get("value") == 5 and t,
                     "the policy's budget never reached Envoy")
        assert got["retry_budget"]["min_retry_concurrency"] == 2
        os.unlink(os.path.join(enode.agent.manifests, "btp.yaml"))
        _until(lambda: _cluster_thresholds(enode, name)["retry_budget"]["budget_percent"]
               ["value"] == 20, "the budget stayed after the policy went")
        assert _who(client.netns, 3) == Counter({"web-0": 3})
    finally:
        for e in echo:
            e.shutdown()


class _PodTcpServer:
    """A TCP server in a pod's netns, a thread per connection running ``serve`` (which
    closes it); ``conns`` keeps every accepted one so the test can close them all."""

    def __init__(self, netns: str, port: int = 8080) -> None:
        import socket
        import threading

        def listen() -> socket.socket:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", port))
            s.listen(16)
            return s
        self.sock = run_in_netns(netns, listen)
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve_and_close, args=(conn,), daemon=True).start()

    def _serve_and_close(self, conn: Any) -> None:
        try:
            self.serve(conn)
        except OSError:
            pass
        finally:
            conn.close()

    def serve(self, conn: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


class _HoldingEcho(_PodTcpServer):
    """Echoes on every connection until the peer closes (so connections through the proxy
    stay open as long as the test holds them)."""

    def serve(self, conn: Any) -> None:
        while data := conn.recv(4096):
            conn.sendall(data)


def _connect(netns: str, ip: str = SVC_IP) -> Any:
    import socket
    return run_in_netns(netns, lambda: socket.create_connection((ip, 80), timeout=3))


def _echoes(sock: Any, timeout: float = 3.0) -> bytes:
    """What one b"ping" brings back: b"ping", b"" (closed), or b"-" (nothing yet)."""
    sock.settimeout(timeout)
    try:
        sock.sendall(b"ping")
        return bytes(sock.recv(4))
    except TimeoutError:
        return b"-"
    except OSError:
        return b""


def test_connection_limit_per_service_closes_what_is_past_it(workdir: str,
                                                              bridge_name: str) -> None:
    """`--max-connections-per-service 2` on an L4 Service: two connections are relayed, a
    third is closed at once (Envoy's TCP pool does not queue past the connection limit),
    and once one of the two closes a new one is relayed again."""
    with running(EnvoyNode(workdir, bridge_name, extra=[
            "--max-connections-per-service", "2"])) as node:
        _service(node, {})
        web = node.pod(name="web-0", labels={"app": "web"})
        client = node.pod(name="client", annotations={"aether.io/dependencies": "app/web"})
        for p in (web, client):
            node.add(p)
        srv = _HoldingEcho(web.netns)
        held: list[Any] = []
        name = "cluster.svc|app|web|80"
        try:
            def one_answers() -> bool:
                s = _connect(client.netns)
                try:
                    return _echoes(s) == b"ping"
                finally:
                    s.close()
            _until(one_answers, "the Service never answered")
            _until(lambda: node.stat(f"{name}.upstream_cx_active") == 0,
                   "the probe connections never closed")
            a, b = _connect(client.netns), _connect(client.netns)
            held += [a, b]
            assert (_echoes(a), _echoes(b)) == (b"ping", b"ping")
            over = _connect(client.netns)  # the pod's capture listener accepts it …
            held.append(over)
            assert _echoes(over) == b""  # … and it is closed: no third upstream connection
            assert node.stat(f"{name}.upstream_cx_overflow") >= 1
            a.close()
            _until(lambda: node.stat(f"{name}.upstream_cx_active") == 1, "a's slot never freed")
            again = _connect(client.netns)
            held.append(again)
            assert (_echoes(again), _echoes(b)) == (b"ping", b"ping")
        finally:
            for s in held:
                s.close()
            srv.close()


def test_concurrent_request_limit_per_service(workdir: str, bridge_name: str) -> None:
    """`--max-requests-per-service 1` on an HTTP Service (appProtocol http): while one slow
    request is in flight, a second gets 503 at once (flag UO, Envoy's overflow); once the
    slow one is answered, requests pass again. (On HTTP chains this is the Service-wide
    bound: their upstream pools are per downstream connection, see docs/service-semantics.md.)"""
    with running(EnvoyNode(workdir, bridge_name, extra=["--max-requests-per-service", "1"])) as node:
        _service(node, {}, app_protocol="http")
        servers, client, echo = _backends(node, 1)
        try:
            _until(lambda: _who(client.netns, 1).get("-", 0) == 0, "the Service never answered")
            got: dict[str, tuple[int, dict[str, str], float]] = {}

            def get(key: str, path: str) -> None:
                t0 = time.monotonic()
                (status, headers, _b), = http_get_from(client.netns, SVC_IP, 80, path,
                                                       timeout=10)
                got[key] = (status, headers, time.monotonic() - t0)
            slow = threading.Thread(target=get, args=("slow", "/delay/3000"))
            slow.start()
            time.sleep(0.7)
            get("over", "/")
            slow.join(15)
            get("after", "/")
            assert got["over"][0] == 503 and got["over"][2] < 1.5, got
            assert (got["slow"][0], got["after"][0]) == (200, 200), got
            assert node.stat("cluster.svc|app|web|80.upstream_rq_active_overflow") >= 1
        finally:
            for e in echo:
                e.shutdown()


_SYN_DROP = """table inet blackhole {
  chain input { type filter hook input priority -10; tcp dport 8080 ct state new drop; }
}
"""


def _answer_after(netns: str, payload: bytes) -> tuple[bytes, float]:
    """Connect to the Service, send ``payload``, and return the first bytes back (b"" when
    closed) and how long they took."""
    s = _connect(netns)
    t0 = time.monotonic()
    try:
        s.settimeout(15)
        s.sendall(payload)
        return bytes(s.recv(64)), time.monotonic() - t0
    except OSError:
        return b"", time.monotonic() - t0
    finally:
        s.close()


@pytest.mark.parametrize("app_protocol,pending", [(None, 1), ("http", 1), (None, 2), ("http", 2)])
def test_pending_request_limit_per_service(workdir: str, bridge_name: str,
                                           app_protocol: str | None, pending: int) -> None:
    """`--max-pending-requests-per-service` bounds what waits on an upstream connect: the one
    endpoint stops answering SYNs, so a first caller waits out the 5 s connect timeout. With
    a limit of 1 a second caller fails at once (L4: closed; HTTP: 503, Envoy's pending
    overflow); with 2 it waits as the first does."""
    extra = ["--max-connections-per-service", "100", "--max-pending-requests-per-service",
             str(pending), "--connect-attempts", "1", "--outlier-consecutive-failures", "0"]
    with running(EnvoyNode(workdir, bridge_name, extra=extra)) as node:
        _service(node, {}, app_protocol=app_protocol)
        servers, client, echo = _backends(node, 1)
        try:
            _until(lambda: _who(client.netns, 1).get("-", 0) == 0, "the Service never answered")
            subprocess.run(["nsenter", f"--net={servers[0].netns}", "nft", "-f", "-"],
                           input=_SYN_DROP, text=True, check=True)
            request = b"GET / HTTP/1.1\r\nHost: web\r\n\r\n"
            got: dict[str, tuple[bytes, float]] = {}

            def first() -> None:
                got["first"] = _answer_after(client.netns, request)
            waiting = threading.Thread(target=first)
            waiting.start()
            time.sleep(0.5)
            got["second"] = _answer_after(client.netns, request)
            waiting.join(20)
            overflow = node.stat("cluster.svc|app|web|80.upstream_rq_pending_overflow")
            assert got["first"][1] >= 4.0, got       # waited out the connect timeout
            if pending == 1:
                answer, took = got["second"]
                # L4: closed without a byte; HTTP: Envoy's 503
                assert (answer.startswith(b"HTTP/1.1 503") if app_protocol == "http"
                        else answer == b""), got
                assert took < 1.0, got
                assert overflow >= 1, overflow
            else:
                assert got["second"][1] >= 4.0, got
                assert overflow == 0, overflow
        finally:
            for e in echo:
                e.shutdown()


def test_an_endpoint_answering_5xx_is_ejected(enode: EnvoyNode) -> None:
    """Passive outlier detection on an HTTP Service (appProtocol http, no route): web-1
    answers every request 503; after 5 consecutive 5xx it is ejected (30 s), and the
    requests that follow all reach web-0. kube-proxy would keep sending it half."""
    _service(enode, {}, app_protocol="http")
    servers = [enode.pod(name=f"web-{i}", labels={"app": "web"}) for i in range(2)]
    client = enode.pod(name="client", annotations={"aether.io/dependencies": "app/web"})
    for p in (*servers, client):
        enode.add(p)
    good = http_echo_server(servers[0].netns, "0.0.0.0", 8080, "web-0")
    bad = http_echo_server(servers[1].netns, "0.0.0.0", 8080, "web-1", status=503)
    try:
        _until(lambda: _who(client.netns, 1).get("-", 0) == 0, "the Service never answered")
        stat = "cluster.svc|app|web|80.outlier_detection.ejections_active"
        first = _who(client.netns, 30)
        assert 1 <= first["-"] <= 10, first  # web-1 503s reached the client until ejected
        _until(lambda: enode.stat(stat) == 1, "the 5xx endpoint was never ejected")
        assert enode.stat("cluster.svc|app|web|80.outlier_detection.ejections_enforced_total") == 1
        assert _who(client.netns, 20) == Counter({"web-0": 20})
    finally:
        good.shutdown()
        bad.shutdown()


class _UpgradeEcho(_PodTcpServer):
    """A WebSocket-style server: answers an ``Upgrade: websocket`` request with 101
    Switching Protocols, then echoes the raw bytes that follow until the peer closes (what a
    WebSocket frame stream needs of the proxy: bytes both ways)."""

    def __init__(self, netns: str, port: int = 8080) -> None:
        self.requests: list[bytes] = []
        super().__init__(netns, port)

    def serve(self, conn: Any) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = conn.recv(4096)
            if not chunk:
                return
            head += chunk
        self.requests.append(head)
        _request, _, rest = head.partition(b"\r\n\r\n")
        conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                     b"Connection: Upgrade\r\n\r\n")
        if rest:
            conn.sendall(rest)
        while data := conn.recv(4096):
            conn.sendall(data)


def test_kubernetes_ws_app_protocol_carries_a_websocket_upgrade(enode: EnvoyNode) -> None:
    """appProtocol kubernetes.io/ws (the HTTP chain, no route): the Upgrade reaches the pod,
    its 101 reaches the client, and after it bytes flow both ways on the same connection,
    as they would without the mesh."""
    _service(enode, {}, app_protocol="kubernetes.io/ws")
    web = enode.pod(name="web-0", labels={"app": "web"})
    client = enode.pod(name="client", annotations={"aether.io/dependencies": "app/web"})
    for p in (web, client):
        enode.add(p)
    srv = _UpgradeEcho(web.netns)
    upgrade = (b"GET /chat HTTP/1.1\r\nHost: web.app\r\nUpgrade: websocket\r\n"
               b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
               b"Sec-WebSocket-Version: 13\r\n\r\n")

    def exchange() -> tuple[bytes, bytes]:
        s = _connect(client.netns)
        try:
            s.settimeout(3)
            s.sendall(upgrade)
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = s.recv(4096)
                if not chunk:
                    return head, b""
                head += chunk
            frame = b"\x81\x05hello"  # a text frame's bytes: the proxy must not touch them
            s.sendall(frame)
            got = b""
            while len(got) < len(frame):
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
            return head, got
        except OSError:
            return b"", b""
        finally:
            s.close()
    try:
        got = _until(lambda: (r := exchange())[0].startswith(b"HTTP/1.1 101") and r,
                     "the upgrade never came back")
        head, echoed = got
        assert echoed == b"\x81\x05hello"
        assert b"upgrade: websocket" in head.lower()
        seen = srv.requests[-1].lower()
        assert b"upgrade: websocket" in seen and b"get /chat http/1.1" in seen
        # it went through the HTTP chain (counted per request), not the L4 relay
        assert enode.stat("cluster.svc|app|web|80.upstream_rq_101") >= 1
    finally:
        srv.close()


def test_session_persistence_keeps_a_session_on_one_endpoint(enode: EnvoyNode) -> None:
    """XBackendTrafficPolicy sessionPersistence (Cookie) on an HTTP Service with three
    endpoints: the first answer sets the cookie; every request sending it back, each on a
    new connection, reaches the endpoint that answered first; requests without it are
    spread. Header-based sessions likewise. The policy gone, the cookie means nothing."""
    _service(enode, {}, app_protocol="http")
    servers, client, echo = _backends(enode, 3)

    def policy(session: dict[str, Any]) -> None:
        enode.agent.write("btp.yaml", [{
            "apiVersion": "gateway.networking.x-k8s.io/v1alpha1", "kind": "XBackendTrafficPolicy",
            "metadata": {"name": "web-sticky", "namespace": "app"},
            "spec": {"targetRefs": [{"group": "", "kind": "Service", "name": "web"}],
                     "sessionPersistence": session}}])

    def pods(count: int, headers: dict[str, str] | None = None) -> Counter[str]:
        got = http_get_from(client.netns, SVC_IP, 80, headers=headers, count=count, timeout=3)
        return Counter(json.loads(b)["pod"] if s == 200 else "-" for s, _h, b in got)

    try:
        _until(lambda: len(pods(9)) == 3, "the Service never spread over its endpoints")
        policy({"sessionName": "shop", "type": "Cookie"})

        def first() -> tuple[str, str] | None:
            ((status, headers, body),) = http_get_from(client.netns, SVC_IP, 80, timeout=3)
            cookie = headers.get("set-cookie", "")
            return (cookie.split(";")[0], json.loads(body)["pod"]) \
                if status == 200 and cookie.startswith("shop=") else None
        cookie, pod = _until(first, "no session cookie was ever set")
        assert pods(12, {"cookie": cookie}) == Counter({pod: 12})
        assert len(pods(12)) > 1  # no cookie: still spread

        policy({"sessionName": "x-shop-session", "type": "Header"})

        def first_header() -> tuple[str, str] | None:
            ((status, headers, body),) = http_get_from(client.netns, SVC_IP, 80, timeout=3)
            value = headers.get("x-shop-session")
            return (value, json.loads(body)["pod"]) if status == 200 and value else None
        value, pod = _until(first_header, "no session header was ever set")
        assert pods(12, {"x-shop-session": value}) == Counter({pod: 12})

        os.unlink(os.path.join(enode.agent.manifests, "btp.yaml"))
        _until(lambda: len(pods(12, {"x-shop-session": value})) > 1,
               "the session stayed after the policy went")
    finally:
        for e in echo:
            e.shutdown()


def test_route_rule_and_backend_lb_policy_sessions(enode: EnvoyNode) -> None:
    """An HTTPRoute rule's sessionPersistence keeps a session on one endpoint for that rule
    only (its cookie's Path is the rule's path; another rule neither sets nor honours it);
    a BackendLBPolicy on the Service gives the rules without their own a session too, and
    the rule's own still wins on its path."""
    _service(enode, {}, app_protocol="http")
    enode.agent.write("route-web.yaml", [{
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": {"name": "web", "namespace": "app",
                     "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "web", "port": 80}],
                 "rules": [
                     {"matches": [{"path": {"type": "PathPrefix", "value": "/cart"}}],
                      "backendRefs": [{"name": "web", "port": 80}],
                      "sessionPersistence": {"sessionName": "cart", "type": "Cookie"}},
                     {"backendRefs": [{"name": "web", "port": 80}]}]}}])
    servers, client, echo = _backends(enode, 3)

    def get(path: str, headers: dict[str, str] | None = None, count: int = 1
            ) -> list[tuple[str, dict[str, str]]]:
        got = http_get_from(client.netns, SVC_IP, 80, path, headers=headers, count=count,
                            timeout=3)
        return [(json.loads(b)["pod"] if s == 200 else "-", h) for s, h, b in got]

    def cookie_of(path: str) -> tuple[str, str, str] | None:
        ((pod, headers),) = get(path)
        cookie = headers.get("set-cookie", "")
        return (cookie.split(";")[0], cookie, pod) if cookie.startswith("cart=") else None

    try:
        cookie, full, pod = _until(lambda: cookie_of("/cart/items"),
                                   "the rule's session cookie was never set")
        assert "path=/cart" in full.lower()
        assert Counter(p for p, _h in get("/cart/x", {"cookie": cookie}, 12)) == Counter({pod: 12})
        other = get("/", {"cookie": cookie}, 12)
        assert len({p for p, _h in other}) > 1  # the other rule ignores the cart session
        assert not any("set-cookie" in h for _p, h in other)

        enode.agent.write("lb.yaml", [{
            "apiVersion": "gateway.networking.k8s.io/v1alpha2", "kind": "BackendLBPolicy",
            "metadata": {"name": "web", "namespace": "app"},
            "spec": {"targetRefs": [{"group": "", "kind": "Service", "name": "web"}],
                     "sessionPersistence": {"sessionName": "x-web-session", "type": "Header"}}}])

        def header_session() -> tuple[str, str] | None:
            ((p, headers),) = get("/")
            value = headers.get("x-web-session")
            return (value, p) if value else None
        value, pod = _until(header_session, "the BackendLBPolicy session never showed")
        assert Counter(p for p, _h in get("/", {"x-web-session": value}, 12)) == Counter({pod: 12})
        ((_p, h),) = get("/cart/y")
        assert "x-web-session" not in h and h.get("set-cookie", "").startswith("cart=")
    finally:
        for e in echo:
            e.shutdown()


def test_a_forged_session_cookie_reaches_no_address_outside_the_service(
        enode: EnvoyNode) -> None:
    """A pod that rewrites its session cookie to name another address (here the node's
    bridge address, where a server listens on the Service's target port) is not sent there:
    Envoy honours a session only for a host of the Service's cluster, and the load balancer
    picks one of its endpoints instead."""
    import base64

    from integration.conftest import GW4
    _service(enode, {}, app_protocol="http")
    enode.agent.write("btp.yaml", [{
        "apiVersion": "gateway.networking.x-k8s.io/v1alpha1", "kind": "XBackendTrafficPolicy",
        "metadata": {"name": "web-sticky", "namespace": "app"},
        "spec": {"targetRefs": [{"group": "", "kind": "Service", "name": "web"}],
                 "sessionPersistence": {"sessionName": "shop", "type": "Cookie"}}}])
    servers, client, echo = _backends(enode, 2)
    intruder = http_echo_server(f"/proc/{os.getpid()}/ns/net", GW4, 8080, "intruder")

    def cookie() -> str | None:
        ((status, headers, _b),) = http_get_from(client.netns, SVC_IP, 80, timeout=3)
        value = headers.get("set-cookie", "").split(";")[0]
        return value if status == 200 and value.startswith("shop=") else None

    try:
        real = _until(cookie, "no session cookie was ever set")
        raw = base64.b64decode(real[len("shop="):] + "==").decode()
        here = next(s.ip() for s in servers if f"{s.ip()}:8080" in raw)
        forged = base64.b64encode(raw.replace(f"{here}:8080", f"{GW4}:8080").encode()).decode()
        assert forged != real[len("shop="):]
        got = http_get_from(client.netns, SVC_IP, 80, headers={"cookie": f"shop={forged}"},
                            count=12, timeout=3)
        pods = Counter(json.loads(b)["pod"] if s == 200 else "-" for s, _h, b in got)
        assert set(pods) <= {"web-0", "web-1"} and sum(pods.values()) == 12, pods
    finally:
        intruder.shutdown()
        for e in echo:
            e.shutdown()
