"""The mesh hop with identity (#16): a captured client calling a Service reaches the backend
pod's inbound listener as mTLS (the port in SNI), presenting its own SVID and accepting
only the backend's SAN; the backend application sees the caller's SPIFFE ID."""

from __future__ import annotations

import datetime
import http.client
import json
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent.common.config import CAPTURE_PORT, DNS_PORT
from agent.envoy import mtls
from agent.identity.ca_dir import CaDirProvider, make_ca
from agent.netns.enter import run_in_netns
from agent.testing.kubelet import Pod
from agent.testing.netutil import host_get, http_echo_server, http_get_from, read_first
from integration.conftest import EnvoyNode, running
from integration.wire import Sniffer

SVC_IP = "10.96.70.10"
TD = "cluster.local"


@pytest.fixture
def svid_ttl() -> float:
    return 3600.0


@pytest.fixture
def mnode(workdir: str, bridge_name: str, svid_ttl: float) -> Iterator[EnvoyNode]:
    ca = os.path.join(workdir, "ca")
    make_ca(ca, TD)
    with running(EnvoyNode(workdir, bridge_name, extra=[
            "--identity-ca-dir", ca, "--trust-domain", TD, "--svid-ttl", str(svid_ttl),
            "--access-log"])) as n:
        yield n


def _service(node: EnvoyNode, name: str = "echo", ip: str = SVC_IP, app: str = "echo",
             port: int = 80, target: int = 8080, app_protocol: str | None = None) -> None:
    sp: dict[str, Any] = {"name": "p", "port": port, "targetPort": target}
    if app_protocol:
        sp["appProtocol"] = app_protocol
    node.agent.write(f"svc-{name}.yaml", [{
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "app"},
        "spec": {"clusterIP": ip, "clusterIPs": [ip], "selector": {"app": app},
                 "ports": [sp]}}])


def _echo_pair(node: EnvoyNode, *others: Pod, deps: str = "app/echo",
               server_annotations: dict[str, str] | None = None) -> tuple[Pod, Pod, Any]:
    """Service echo, its backend pod (SA server, an HTTP echo on 8080) and a client pod (SA
    client) that declares ``deps``, all added (then ``others``); returns (server, client,
    the echo server to shut down)."""
    _service(node)
    server = node.pod(name="server", labels={"app": "echo"}, service_account="server",
                      annotations=server_annotations)
    client = node.pod(name="client", service_account="client",
                      annotations={"aether.io/dependencies": deps})
    for p in (server, client, *others):
        node.add(p)
    return server, client, http_echo_server(server.netns, "0.0.0.0", 8080, "server")


def _get_ok(netns: str, ip: str, deadline_s: float = 20.0) -> tuple[int, dict[str, str], bytes]:
    deadline = time.monotonic() + deadline_s
    while True:
        got = http_get_from(netns, ip, 80, count=1, timeout=3)[0]
        if got[0] == 200 or time.monotonic() > deadline:
            return got
        time.sleep(0.3)


def test_service_call_is_mtls_and_the_backend_sees_the_caller(mnode: EnvoyNode) -> None:
    server, client, srv = _echo_pair(mnode)
    try:
        first_ok = _get_ok(client.netns, SVC_IP)
        assert first_ok[0] == 200
        with Sniffer(server.netns) as wire:
            status, _headers, body = http_get_from(
                client.netns, SVC_IP, 80, headers={"x-forwarded-client-cert": "URI=forged"})[0]
        assert status == 200, body
        seen: dict[str, Any] = json.loads(body)
        xfcc = seen["headers"].get("x-forwarded-client-cert", "")
        # the caller's identity, set by the server side's proxy; the client's forged value gone
        assert f"URI=spiffe://{TD}/ns/app/sa/client" in xfcc, xfcc
        assert f"By=spiffe://{TD}/ns/app/sa/server" in xfcc, xfcc
        assert "forged" not in xfcc
        hop = wire.between(client.ip(), server.ip())
        data = [s for s in hop if s.payload]
        assert data, "no segment between the pods was seen"
        # everything went to the inbound port; the first client payload is a TLS handshake
        assert {s.dport for s in data if s.src == client.ip()} == {15008}
        first = next(s for s in data if s.src == client.ip())
        assert first.payload[:1] == b"\x16" and first.payload[5:6] == b"\x01"  # ClientHello
        assert not any(b"GET /" in s.payload or b"forged" in s.payload for s in hop)
    finally:
        srv.shutdown()
    # the server side's access log names the caller (--access-log)
    deadline = time.monotonic() + 10
    while f"peer=spiffe://{TD}/ns/app/sa/client" not in mnode.agent.logs():
        assert time.monotonic() < deadline, "no inbound access log line naming the caller"
        time.sleep(0.2)
    ids = {r["identity"]: r for r in mnode.agent.status()["envoy"]["identity"]["svids"]}
    assert set(ids) == {"app/client", "app/server"}
    assert ids["app/client"]["spiffe_id"] == f"spiffe://{TD}/ns/app/sa/client"
    assert ids["app/client"]["pods"] == ["app/client"]
    # what an operator sees: the SVIDs, their expiry and pods; the expiry as a metric
    human = subprocess.run([sys.executable, "-m", "agent.cli", "status", "--run-dir",
                            mnode.agent.run_dir], capture_output=True, text=True, check=True).stdout
    assert "mesh identity: ca-dir" in human and f"spiffe://{TD}/ns/app/sa/server" in human
    assert re.search(r"app/client\s+spiffe://\S+/sa/client\s+(59|60)m\s+app/client", human), human
    # and who called whom: the server's pods accepted the client's connections (the access
    # log stream is flushed each second)
    deadline = time.monotonic() + 10
    while not re.search(rf"app/server\s+spiffe://{TD}/ns/app/sa/client\s+\d+", human):
        assert time.monotonic() < deadline, human
        time.sleep(0.3)
        human = subprocess.run([sys.executable, "-m", "agent.cli", "status", "--run-dir",
                                mnode.agent.run_dir], capture_output=True, text=True,
                               check=True).stdout
    code, metrics = mnode.agent.http("/metrics")
    left = re.search(r'aether_svid_expiry_seconds\{identity="app/server"\} (\S+)', metrics)
    assert code == 200 and left and 3500 < float(left.group(1)) <= 3600
    # DEL: the pod's inbound listener goes, and with the identity's last pod its SVID
    mnode.kubelet.delete(server)
    mnode.pods.remove(server)
    deadline = time.monotonic() + 10
    # capture- and inbound-<container id>
    while any(n.endswith(server.container_id) for n in mnode.listeners()):
        assert time.monotonic() < deadline, "a listener of the pod left after DEL"
        time.sleep(0.1)
    held = {r["identity"] for r in mnode.agent.status()["envoy"]["identity"]["svids"]}
    assert held == {"app/client"}


class TlsImposter:
    """A TLS server on :15008 in a pod netns presenting an SVID of ``spiffe_id`` (signed by
    the mesh CA): what a pod of another ServiceAccount could present for a backend's address.
    Records each handshake's outcome and whether any bytes followed it."""

    def __init__(self, netns: str, ca_dir: str, spiffe_id: str) -> None:
        svid = CaDirProvider(ca_dir).issue(spiffe_id, time.time())
        d = os.path.join(ca_dir, spiffe_id.rsplit("/", 1)[1])
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "crt.pem"), "w") as f:
            f.write(svid.cert_chain_pem)
        with open(os.path.join(d, "key.pem"), "w") as f:
            f.write(svid.key_pem)
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(os.path.join(d, "crt.pem"), os.path.join(d, "key.pem"))
        self.ctx.set_alpn_protocols(["h2"])
        self.outcomes: list[str] = []

        def listen() -> socket.socket:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", 15008))
            s.listen(16)
            s.settimeout(0.2)
            return s

        self.sock = run_in_netns(netns, listen)
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            conn.settimeout(2)
            try:
                tls = self.ctx.wrap_socket(conn, server_side=True)
                data = tls.recv(64)
                self.outcomes.append("data" if data else "handshake-then-close")
                tls.close()
            except (ssl.SSLError, OSError) as e:
                self.outcomes.append(f"refused: {type(e).__name__}")
                conn.close()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def _remote_backend(node: EnvoyNode, ip: str, sa: str) -> None:
    """A backend pod of Service echo on another node, as the API reports it: its address is
    ``ip`` and its ServiceAccount ``sa``."""
    node.agent.write("pod-remote-server.yaml", [{
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "remote-server", "namespace": "app", "uid": "u-remote",
                     "labels": {"app": "echo"}},
        "spec": {"nodeName": "other-node", "serviceAccountName": sa},
        "status": {"podIP": ip, "podIPs": [{"ip": ip}], "phase": "Running",
                   "conditions": [{"type": "Ready", "status": "True"}]}}])


@pytest.mark.parametrize("presented,accepted", [("evil", False), ("server", True)])
def test_a_pod_of_another_service_account_cannot_pose_as_the_backend(
        mnode: EnvoyNode, presented: str, accepted: bool) -> None:
    _service(mnode)
    client = mnode.pod(name="client", service_account="client",
                       annotations={"aether.io/dependencies": "app/echo"})
    imposter = mnode.pod(namespace="plain", name="imposter")  # not in the mesh: no listener
    mnode.add(client)
    mnode.add(imposter)
    _remote_backend(mnode, imposter.ip(), "server")
    server = TlsImposter(imposter.netns, os.path.join(mnode.agent.workdir, "ca"),
                         f"spiffe://{TD}/ns/app/sa/{presented}")
    try:
        deadline = time.monotonic() + 20
        while not server.outcomes and time.monotonic() < deadline:
            http_get_from(client.netns, SVC_IP, 80, count=1, timeout=2)
            time.sleep(0.2)
        assert server.outcomes, "the client never reached the backend address"
        if accepted:  # same CA, the backend's SAN: the tunnel opens (HTTP/2 preface follows)
            assert "data" in server.outcomes, server.outcomes
        else:  # same CA, another SAN: refused in the handshake, not one byte of the request
            assert all(o != "data" for o in server.outcomes), server.outcomes
            assert mnode.stat("cluster.mtls|app|client.ssl.fail_verify_san") >= 1
    finally:
        server.close()


_host_get = host_get


@pytest.mark.parametrize("mode", ["strict", "permissive"])
def test_peer_authentication_strict_refuses_plaintext_from_outside_the_mesh(
        mnode: EnvoyNode, mode: str) -> None:
    outsider = mnode.pod(namespace="plain", name="outsider")  # not in the mesh
    server, client, srv = _echo_pair(
        mnode, outsider, server_annotations={"security.aether.io/peer-authentication": mode})
    try:
        # a meshed client gets through either way, over mTLS, and is named
        status, _h, body = _get_ok(client.netns, SVC_IP)
        assert status == 200, body
        assert "sa/client" in json.loads(body)["headers"]["x-forwarded-client-cert"]
        # the node (kubelet's probes) in plaintext, either way
        assert _host_get(server.ip(), 8080) == 200
        # a pod outside the mesh, straight to the pod's port
        direct = http_get_from(outsider.netns, server.ip(), 8080, count=1, timeout=3)[0]
        if mode == "strict":
            # steered to the proxy, which speaks only mesh mTLS: closed, no answer, and
            # counted as an unauthenticated caller of the pod
            assert direct[0] == 0 and direct[1]["error"], direct
            deadline = time.monotonic() + 10
            pat = (r'aether_mesh_inbound_connections_total'
                   r'\{caller="unauthenticated",identity="app/server"\} (\S+)')
            while not re.search(pat, mnode.agent.http("/metrics")[1]):
                assert time.monotonic() < deadline, "the refused connection was not counted"
                time.sleep(0.3)
            # a raw TCP client (no request sent) is not answered either
            assert read_first(outsider.netns, server.ip(), 8080, wait=20) == b""
        else:
            assert direct[0] == 200
            assert "x-forwarded-client-cert" not in json.loads(direct[2])["headers"]
    finally:
        srv.shutdown()


@pytest.mark.parametrize("svid_ttl", [6.0])
def test_svid_rotation_during_a_steady_request_stream_drops_nothing(
        mnode: EnvoyNode, svid_ttl: float) -> None:
    server, client, srv = _echo_pair(mnode)
    try:
        assert _get_ok(client.netns, SVC_IP)[0] == 200
        before = mnode.agent.status()["envoy"]["identity"]["rotations"]
        updates = mnode.stat("cluster.mtls|app|client.client_ssl_socket_factory."
                             "ssl_context_update_by_sds")
        statuses: list[int] = []
        errors: list[Any] = []
        # one kept-alive connection across the rotations (its tunnel's handshake was before
        # them) beside a new connection (a new handshake) per request
        kept = http.client.HTTPConnection(SVC_IP, 80, timeout=3)

        def on_kept() -> int:
            kept.request("GET", "/kept")
            r = kept.getresponse()
            r.read()
            return int(r.status)

        kept_statuses: list[int] = []
        slowest: list[tuple[float, float]] = []  # (s into the stream at its start, seconds)
        baseline = _failure_stats(mnode)  # the report counts from here, not from Envoy's start
        start, t0 = time.time(), time.monotonic()
        end = t0 + 8  # renewals every 3 s: at least two for each identity
        n = 0
        while time.monotonic() < end:
            kept_statuses.append(run_in_netns(client.netns, on_kept))
            for _ in range(5):
                # one request at a time, timed from its own start; the client waits longer
                # than any of the proxy's own timeouts (5 s connect), so a drop is a failed
                # request and a stall (a lost SYN under CI load) a slow one, told apart
                began = time.monotonic()
                (code, hdrs, _), = http_get_from(client.netns, SVC_IP, 80, timeout=10,
                                                 request_id=f"rot-{n}")
                took = time.monotonic() - began
                n += 1
                statuses.append(code)
                slowest = sorted([*slowest, (round(began - t0, 2), round(took, 2))],
                                 key=lambda x: -x[1])[:3]
                if code != 200:
                    errors.append((f"rot-{n - 1}", round(began - t0, 2), round(took, 2),
                                   hdrs.get("error")))
        after = mnode.agent.status()["envoy"]["identity"]["rotations"]
        assert after - before >= 4, (before, after)  # both identities, twice
        assert mnode.stat("cluster.mtls|app|client.client_ssl_socket_factory."
                          "ssl_context_update_by_sds") >= updates + 2
        assert len(statuses) > 20 and set(statuses) == {200}, _rotation_report(
            mnode, errors, start, baseline) + f"\nslowest (start s, seconds): {slowest}"
        assert len(kept_statuses) > 4 and set(kept_statuses) == {200}, _rotation_report(
            mnode, kept_statuses, start, baseline)
        kept.close()
    finally:
        srv.shutdown()


def _failure_stats(node: EnvoyNode) -> dict[str, int]:
    """Envoy's TLS and connection-failure counters, by name."""
    stats = node.admin("/stats?filter=(ssl\\.|cx_connect_fail|cx_connect_timeout|"
                       "rq_timeout|cx_destroy_with_active_rq|handshake|"
                       "downstream_cx_overflow|no_healthy|upstream_cx_total)")
    out = {}
    for ln in stats.splitlines():
        name, _, value = ln.partition(": ")
        if value.strip().isdigit():
            out[name] = int(value)
    return out


def _rotation_report(node: EnvoyNode, failures: Any, start: float,
                     baseline: dict[str, int] | None = None) -> str:
    """What a failed rotation run needs to be understood: the failures, the agent's
    rotations and connection records since the stream started (wall-clock offsets), and
    Envoy's TLS and connection-failure counters."""
    lines = [f"failures (request id, s into the stream at its start, seconds, error): "
             f"{failures}"]
    for r in node.agent.log_records():
        try:
            ts = datetime.datetime.strptime(str(r.get("ts")), "%Y-%m-%dT%H:%M:%S.%fZ").replace(
                tzinfo=datetime.UTC).timestamp()
        except ValueError:
            continue
        if ts < start - 1:
            continue
        msg = str(r.get("msg", ""))
        if "rotated" in msg or r.get("flags") not in (None, "", "-") or r.get("level") in (
                "warning", "error"):
            lines.append(f"{ts - start:+.2f} {json.dumps(r, default=str)[:400]}")
    # what moved during the stream (a counter from before it, e.g. the setup's probe, is
    # not the stream's)
    before = baseline or {}
    lines += [f"{k}: +{v - before.get(k, 0)}" for k, v in sorted(_failure_stats(node).items())
              if v != before.get(k, 0)]
    return "\n".join(lines)


def test_spire_delegate_provider_end_to_end(workdir: str, bridge_name: str) -> None:
    """The production provider against our double of SPIRE's Delegated Identity API: SVIDs
    for registered workloads only; an unregistered one fails closed until it is registered."""
    from agent.testing.spire_double import SpireDouble
    ca = os.path.join(workdir, "spire-ca")
    make_ca(ca, TD)
    sock = os.path.join(workdir, "spire-admin.sock")
    spire = SpireDouble(sock, ca, TD)
    spire.register("app", "client")
    spire.register("app", "server")
    spire.start()
    try:
        with running(EnvoyNode(workdir, bridge_name, extra=[
                "--identity-spire-socket", sock, "--trust-domain", TD])) as node:
            rogue = node.pod(name="rogue", service_account="rogue",
                             annotations={"aether.io/dependencies": "app/echo"})
            _server, client, srv = _echo_pair(node, rogue)
            try:
                status, _h, body = _get_ok(client.netns, SVC_IP)
                assert status == 200, body
                assert f"URI=spiffe://{TD}/ns/app/sa/client" in \
                    json.loads(body)["headers"]["x-forwarded-client-cert"]
                # no registration entry: no SVID; its mesh connections are refused, not
                # sent in plaintext
                st = node.agent.status()
                assert st["degraded"] and any("app/rogue" in p and "no SVID" in p
                                              for p in st["envoy"]["identity"]["problems"])
                assert http_get_from(rogue.netns, SVC_IP, 80, count=1, timeout=3)[0][0] == 0
                spire.register("app", "rogue")  # registered: the retry picks it up
                status, _h, body = _get_ok(rogue.netns, SVC_IP)
                assert status == 200
                assert "sa/rogue" in json.loads(body)["headers"]["x-forwarded-client-cert"]
            finally:
                srv.shutdown()
    finally:
        spire.stop()


def _mesh_client(ca_dir: str, spiffe: str | None, alpn: str | None = "aether-mesh"
                 ) -> ssl.SSLContext:
    """What a peer proxy presents: TLS 1.3, a hop ALPN, an SVID of ``spiffe`` (None: none)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(os.path.join(ca_dir, "ca.crt"))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    if alpn:
        ctx.set_alpn_protocols([alpn])
    if spiffe is not None:
        svid = CaDirProvider(ca_dir).issue(spiffe, time.time())
        d = os.path.join(ca_dir, f"client-{abs(hash(spiffe))}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "crt.pem"), "w") as f:
            f.write(svid.cert_chain_pem)
        with open(os.path.join(d, "key.pem"), "w") as f:
            f.write(svid.key_pem)
        ctx.load_cert_chain(os.path.join(d, "crt.pem"), os.path.join(d, "key.pem"))
    return ctx


def _mesh_get(netns: str, ip: str, ctx: ssl.SSLContext, sni: str) -> str:
    """Speak the mesh hop by hand: TLS to <ip>:15008 naming the port in SNI, then a GET.
    Returns the answer, or what went wrong."""
    def work() -> str:
        raw = socket.create_connection((ip, 15008), timeout=3)
        try:
            tls = ctx.wrap_socket(raw, server_hostname=sni)
            tls.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := tls.recv(65536):
                data += chunk
            return data.decode(errors="replace") or "closed"
        except (OSError, ssl.SSLError) as e:
            return f"error: {type(e).__name__}: {e}"
        finally:
            raw.close()
    return run_in_netns(netns, work)


def test_the_inbound_port_speaks_only_mesh_mtls_to_the_pod_itself(mnode: EnvoyNode) -> None:
    """The hop by hand, from outside the mesh: the pod's port is named in SNI and reached
    only with a client SVID of the trust domain and the mesh ALPN; the proxy's own ports are
    refused (no loop), and the caller is who its certificate says."""
    server = mnode.pod(name="server", labels={"app": "echo"}, service_account="server")
    outsider = mnode.pod(namespace="plain", name="outsider")
    mnode.add(server)
    mnode.add(outsider)
    srv = http_echo_server(server.netns, "0.0.0.0", 8080, "server")
    ca = os.path.join(mnode.agent.workdir, "ca")
    other_ca = os.path.join(mnode.agent.workdir, "other-ca")
    make_ca(other_ca, TD)
    try:
        tester = f"spiffe://{TD}/ns/t/sa/tester"
        for alpn in ("aether-mesh", "aether-mesh-http"):  # detected / declared HTTP
            ok = _mesh_get(outsider.netns, server.ip(), _mesh_client(ca, tester, alpn), "8080")
            assert ok.startswith("HTTP/1.1 200"), (alpn, ok)
            assert f"URI={tester}" in ok, (alpn, ok)  # the XFCC the app echoed back
        # declared opaque TCP: the bytes reach the app as sent, no header added
        raw = _mesh_get(outsider.netns, server.ip(), _mesh_client(ca, tester, "aether-mesh-tcp"),
                        "8080")
        assert raw.startswith("HTTP/1.1 200") and "x-forwarded-client-cert" not in raw, raw
        for sni in ("15008", "15001"):  # the proxy's own ports: closed, no loop
            got = _mesh_get(outsider.netns, server.ip(),
                            _mesh_client(ca, f"spiffe://{TD}/ns/t/sa/tester"), sni)
            assert not got.startswith("HTTP"), (sni, got)
        # not a port: nothing to deliver to (the proxy answers 503 itself)
        got = _mesh_get(outsider.netns, server.ip(),
                        _mesh_client(ca, f"spiffe://{TD}/ns/t/sa/tester"), "not-a-port")
        assert not got.startswith("HTTP/1.1 200") and '"pod"' not in got, got
        for ctx in (_mesh_client(ca, None),  # no client certificate
                    _mesh_client(other_ca, f"spiffe://{TD}/ns/t/sa/tester"),  # another CA
                    _mesh_client(ca, f"spiffe://{TD}/ns/t/sa/tester", alpn=None),
                    _mesh_client(ca, f"spiffe://{TD}/ns/t/sa/tester", alpn="h2")):
            got = _mesh_get(outsider.netns, server.ip(), ctx, "8080")
            assert not got.startswith("HTTP"), got
    finally:
        srv.shutdown()
    # every connection above is counted by caller on /metrics: the tester's four that
    # completed the handshake, and the others under "unauthenticated"
    series = {(f'caller="{tester}",identity="app/server"', 4),
              ('caller="unauthenticated",identity="app/server"', 7)}
    deadline = time.monotonic() + 10
    while True:
        _code, text = mnode.agent.http("/metrics")
        got_series = {(m.group(1), int(float(m.group(2)))) for m in re.finditer(
            r"aether_mesh_inbound_connections_total\{(.*?)\} (\S+)", text)}
        if got_series == series or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert got_series == series, got_series
    rx = re.search(rf'aether_mesh_inbound_received_bytes_total\{{caller="{re.escape(tester)}",'
                   rf'identity="app/server"\}} (\S+)', text)
    assert rx and float(rx.group(1)) > 0, text


def test_a_declared_app_protocol_picks_the_hop_and_skips_detection(mnode: EnvoyNode) -> None:
    """appProtocol http: the hop's ClientHello asks for aether-mesh-http and the backend gets
    XFCC straight from the TLS connection; appProtocol of another protocol: aether-mesh-tcp,
    relayed as sent (a server-closes-first answer arrives whole). Neither crosses the
    detection listener, which only undeclared ports use."""
    _service(mnode, "web", "10.96.70.21", app_protocol="http")
    _service(mnode, "opaque", "10.96.70.22", port=7000, target=7000, app_protocol="redis")
    server, client, srv = _echo_pair(mnode, deps="app/echo,app/web,app/opaque")
    payload = b"first-the-server-speaks\n" * 3000
    raw = _raw_server(server.netns, payload, read_first=False)  # no wait for the client
    try:
        assert _get_ok(client.netns, "10.96.70.21")[0] == 200
        detected_before = _detection_connections(mnode)
        with Sniffer(server.netns) as wire:
            status, _h, body = http_get_from(client.netns, "10.96.70.21", 80,
                                             headers={"x-forwarded-client-cert": "URI=forged"})[0]

            def opaque() -> tuple[int, float]:
                t0 = time.monotonic()
                s = socket.create_connection(("10.96.70.22", 7000), timeout=5)
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
                s.close()
                return len(data), time.monotonic() - t0

            got, took = run_in_netns(client.netns, opaque)
        assert status == 200, body
        xfcc = json.loads(body)["headers"].get("x-forwarded-client-cert", "")
        assert xfcc == (f"By=spiffe://{TD}/ns/app/sa/server;URI=spiffe://{TD}/ns/app/sa/client"), xfcc
        assert got == len(payload)
        # no first-byte wait for a declared protocol (the detection timeout is 0.5 s)
        assert took < mtls.DETECT_TIMEOUT_S, took
        hellos = [s.payload for s in wire.between(client.ip(), server.ip())
                  if s.src == client.ip() and s.payload[:1] == b"\x16" and s.payload[5:6] == b"\x01"]
        assert any(b"aether-mesh-http" in h for h in hellos), "no ClientHello asking for HTTP"
        assert any(b"aether-mesh-tcp" in h for h in hellos), "no ClientHello asking for TCP"
        assert not any(b"GET /" in s.payload for s in wire.between(client.ip(), server.ip()))
        assert _detection_connections(mnode) == detected_before
    finally:
        raw.close()
        srv.shutdown()



def _raw_server(netns: str, payload: bytes, read_first: bool) -> socket.socket:
    """A TCP server on :7000 in ``netns`` that sends ``payload`` and closes each connection
    (after reading the client's first bytes when ``read_first``; else server-first)."""
    def listen() -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", 7000))
        s.listen(8)
        return s

    raw = run_in_netns(netns, listen)

    def serve() -> None:
        while True:
            try:
                c, _ = raw.accept()
            except OSError:
                return
            if read_first:
                c.recv(100)
            c.sendall(payload)
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    return raw

def _detection_connections(node: EnvoyNode) -> int:
    """Connections the node's detection listener (undeclared ports only) has accepted."""
    stats = node.admin("/stats?filter=downstream_cx_total")
    m = re.search(rf"listener\.{re.escape(mtls.INBOUND_DETECT)}\.downstream_cx_total: (\d+)",
                  stats)
    assert m, stats[:2000]
    return int(m.group(1))


def test_the_server_closing_first_loses_nothing(mnode: EnvoyNode) -> None:
    """Server-closes-first over the mesh hop: a raw TCP server that answers and closes, and
    an HTTP request with `Connection: close` (the proxy closes after the response). Both
    answers arrive whole (an HTTP/2 CONNECT tunnel, or an Envoy internal listener on the
    inbound side, lost these tails on Envoy 1.40)."""
    mnode.agent.write("svc-raw.yaml", [{
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "raw", "namespace": "app"},
        "spec": {"clusterIP": "10.96.70.11", "clusterIPs": ["10.96.70.11"],
                 "selector": {"app": "echo"},
                 "ports": [{"name": "raw", "port": 7000, "targetPort": 7000}]}}])
    server, client, srv = _echo_pair(mnode, deps="app/echo,app/raw")
    payload = b"answer-then-close\n" * 4000  # 72 KB: more than one read
    raw = _raw_server(server.netns, payload, read_first=True)
    try:
        assert _get_ok(client.netns, SVC_IP)[0] == 200

        def calls() -> list[Any]:
            out: list[Any] = []
            for _ in range(5):
                s = socket.create_connection(("10.96.70.11", 7000), timeout=5)
                s.sendall(b"hello\n")
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
                s.close()
                out.append(len(data))
                conn = http.client.HTTPConnection(SVC_IP, 80, timeout=5)
                conn.request("GET", "/", headers={"Connection": "close"})
                r = conn.getresponse()
                body = r.read()
                conn.close()
                out.append((r.status, len(body) == int(r.headers["content-length"]),
                            b"sa/client" in body))
            return out

        got = run_in_netns(client.netns, calls)
        assert got == [len(payload), (200, True, True)] * 5, got
    finally:
        raw.close()
        srv.shutdown()


def test_an_ipv6_service_is_mtls_too(mnode: EnvoyNode) -> None:
    """A single-stack IPv6 Service: its endpoints are the pods' IPv6 addresses, the hop goes
    to [pod]:15008 and is delivered inside the backend pod."""
    ip6 = "fd00:96::70:10"
    mnode.agent.write("svc-echo6.yaml", [{
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "echo6", "namespace": "app"},
        "spec": {"clusterIP": ip6, "clusterIPs": [ip6], "ipFamilies": ["IPv6"],
                 "selector": {"app": "echo"},
                 "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}}])
    server, client, srv = _echo_pair(mnode, deps="app/echo,app/echo6")
    try:
        status, _h, body = _get_ok(client.netns, ip6)
        assert status == 200, body
        seen = json.loads(body)
        assert f"URI=spiffe://{TD}/ns/app/sa/client" in seen["headers"]["x-forwarded-client-cert"]
        # the hop itself went to the backend's IPv6 address on the inbound port
        hosts = mnode.admin("/clusters")
        hop = re.search(rf"mtls\|app\|client::\[{re.escape(server.ip(6))}\]:15008::cx_total::(\d+)",
                        hosts)
        assert hop and int(hop.group(1)) >= 1, hosts[-2000:]
    finally:
        srv.shutdown()


def _listening_ports(netns: str) -> set[int]:
    """TCP ports something listens on in ``netns`` (any address)."""
    out = subprocess.run(["nsenter", f"--net={netns}", "ss", "-Hltn"], capture_output=True,
                         text=True, check=True).stdout
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()}


def test_a_mesh_pod_sees_only_the_capture_and_inbound_ports_of_the_proxy(
        mnode: EnvoyNode) -> None:
    """Undeclared ports are detected in an internal listener, which no netns can reach: the
    only proxy sockets in a mesh pod are its capture port (loopback), :15008 and the pod
    DNS's :15053 (loopback), none of which takes anything from the pod it could not send
    directly (the capture listener forwards as the pod, the inbound one speaks only mTLS,
    the DNS answers mesh names and forwards the rest as the pod). A detected HTTP call still
    gets the caller's identity."""
    server, client, srv = _echo_pair(mnode)
    try:
        status, _h, body = _get_ok(client.netns, SVC_IP)
        assert status == 200, body
        xfcc = json.loads(body)["headers"].get("x-forwarded-client-cert", "")
        assert xfcc == f"By=spiffe://{TD}/ns/app/sa/server;URI=spiffe://{TD}/ns/app/sa/client"
        assert _detection_connections(mnode) >= 1
        assert _listening_ports(server.netns) == {CAPTURE_PORT, mtls.INBOUND_PORT, DNS_PORT, 8080}
        assert _listening_ports(client.netns) == {CAPTURE_PORT, mtls.INBOUND_PORT, DNS_PORT}
    finally:
        srv.shutdown()


def test_grpc_over_the_mesh_is_balanced_per_request_and_names_the_caller(
        mnode: EnvoyNode) -> None:
    """A Service port with appProtocol grpc and no route: 40 unary calls on one client
    connection are spread over both backend pods (per request, not per connection), each
    over mTLS, and every call reaches the server with the caller's identity in XFCC."""
    from integration.gamma_harness import _GRPC_CLIENT, GrpcBackend, _grpc_env
    _service(mnode, "rpc", "10.96.70.31", app="rpc", port=9090, target=9090, app_protocol="grpc")
    servers = [mnode.pod(name=f"rpc-{i}", labels={"app": "rpc"}, service_account="server")
               for i in range(2)]
    client = mnode.pod(name="client", service_account="client",
                       annotations={"aether.io/dependencies": "app/rpc"})
    for p in (*servers, client):
        mnode.add(p)
    backends = [GrpcBackend(p.netns_name, p.name, os.path.join(mnode.agent.workdir, f"{p.name}.log"))
                for p in servers]
    try:
        for b in backends:
            b.wait_ready()
        args = json.dumps({"target": "10.96.70.31:9090",
                           "calls": [{"method": "/echo.Echo/Ping", "count": 40, "timeout": 5}]})
        deadline = time.monotonic() + 20
        while True:
            r = subprocess.run(["ip", "netns", "exec", client.netns_name, sys.executable, "-c",
                                _GRPC_CLIENT, args], capture_output=True, text=True,
                               timeout=120, env=_grpc_env(), check=False)
            out = json.loads(r.stdout) if r.returncode == 0 else []
            if (out and all(a["ok"] for a in out)) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert out and all(a["ok"] for a in out), (r.stderr[-2000:], out[:3])
        pods = {a["answer"]["pod"] for a in out}
        assert pods == {"rpc-0", "rpc-1"}, pods
        xfcc = {a["answer"]["metadata"].get("x-forwarded-client-cert") for a in out}
        assert xfcc == {f"By=spiffe://{TD}/ns/app/sa/server;URI=spiffe://{TD}/ns/app/sa/client"}, xfcc
    finally:
        for b in backends:
            b.close()


def test_a_headless_services_pod_dialled_by_address_is_a_mesh_hop(mnode: EnvoyNode) -> None:
    """Headless Service db (clients dial its pods' addresses from DNS): a captured client's
    connection to the pod's address and target port goes as mTLS to that very pod, which
    sees the caller's identity; the pod address of a ClusterIP Service stays passthrough."""
    mnode.agent.write("svc-db.yaml", [{
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "db", "namespace": "app"},
        "spec": {"clusterIP": "None", "clusterIPs": ["None"], "selector": {"app": "db"},
                 "ports": [{"name": "http", "port": 80, "targetPort": 8080,
                            "appProtocol": "http"}]}}])
    db = mnode.pod(name="db-0", labels={"app": "db"}, service_account="db")
    server, client, srv = _echo_pair(mnode, db, deps="app/echo,app/db")
    db_srv = http_echo_server(db.netns, "0.0.0.0", 8080, "db-0")
    try:
        def xfcc(ip: str) -> str | None:
            status, _h, body = http_get_from(client.netns, ip, 8080, count=1, timeout=3)[0]
            if status != 200:
                return None
            return str(json.loads(body)["headers"].get("x-forwarded-client-cert", ""))

        deadline = time.monotonic() + 20
        while not (got := xfcc(db.ip())):
            assert time.monotonic() < deadline, f"the headless pod was never reached meshed: {got!r}"
            time.sleep(0.3)
        assert got == f"By=spiffe://{TD}/ns/app/sa/db;URI=spiffe://{TD}/ns/app/sa/client", got
        with Sniffer(db.netns) as wire:
            assert xfcc(db.ip())
        assert {s.dport for s in wire.between(client.ip(), db.ip())
                if s.src == client.ip() and s.payload} == {15008}
        # the echo Service has a ClusterIP: its pod's own address is passthrough (no XFCC)
        assert xfcc(server.ip()) == ""
    finally:
        db_srv.shutdown()
        srv.shutdown()
