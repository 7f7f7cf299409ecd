"""Golden traffic metrics (#19) on the real Envoy: requests and connections from known pods
to known Services are counted exactly, with their labels, and `aether-agent top` shows the
same numbers."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent.netns.enter import run_in_netns
from agent.testing.netutil import http_echo_server, http_get_from
from integration.conftest import EnvoyNode, running, until

WEB_IP, RAW_IP = "10.96.72.10", "10.96.72.11"
FLUSH_S = 5.5  # Envoy's stats flush interval (5 s) and a margin


@pytest.fixture
def tnode(workdir: str, bridge_name: str) -> Iterator[EnvoyNode]:
    with running(EnvoyNode(workdir, bridge_name)) as n:
        yield n


def _metric(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}\{{(.*?)\}} (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


_until = until


def test_requests_and_connections_are_counted_exactly(tnode: EnvoyNode) -> None:
    """From pod `caller` (workload `caller`, owned by ReplicaSet caller-7d9f) to Service web
    (appProtocol http: the HTTP codec, no route needed) N requests of which K answer 503,
    and M TCP connections to Service raw (no appProtocol: L4): the counters are exactly N,
    K and M, with those labels."""
    tnode.agent.write("svcs.yaml", [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "app"},
         "spec": {"clusterIP": WEB_IP, "clusterIPs": [WEB_IP], "selector": {"app": "web"},
                  "ports": [{"name": "http", "port": 80, "targetPort": 8080,
                             "appProtocol": "http"}]}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "raw", "namespace": "app"},
         "spec": {"clusterIP": RAW_IP, "clusterIPs": [RAW_IP], "selector": {"app": "raw"},
                  "ports": [{"name": "tcp", "port": 7000, "targetPort": 7000}]}}])
    web = tnode.pod(name="web-0", labels={"app": "web"})
    raw = tnode.pod(name="raw-0", labels={"app": "raw"})
    caller = tnode.pod(name="caller-7d9f-abcde", labels={"pod-template-hash": "7d9f"},
                       annotations={"aether.io/dependencies": "app/web,app/raw"})
    # the caller's owner, as the API reports it: ReplicaSet caller-7d9f of Deployment caller
    # (known at ADD: the source the pod's traffic is counted under is fixed then)
    tnode.agent.write(f"pod-{caller.namespace}-{caller.name}.yaml", [{
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": caller.name, "namespace": "app", "uid": caller.uid,
                     "labels": {"pod-template-hash": "7d9f"},
                     "annotations": {"aether.io/dependencies": "app/web,app/raw"},
                     "ownerReferences": [{"kind": "ReplicaSet", "name": "caller-7d9f",
                                          "controller": True}]},
        "spec": {"nodeName": "test-node"}}])
    for p in (web, raw, caller):
        tnode.add(p)
    srv = http_echo_server(web.netns, "0.0.0.0", 8080, "web-0")
    lst = run_in_netns(raw.netns, lambda: socket.create_server(("0.0.0.0", 7000)))

    def serve() -> None:  # read to the client's end, then close: the connection ends
        while True:
            try:
                c, _ = lst.accept()
            except OSError:
                return
            while c.recv(65536):
                pass
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        # the Services' config reaches Envoy shortly after the pods' ADDs (not awaited)
        _until(lambda: http_get_from(caller.netns, WEB_IP, 80, count=1, timeout=3)[0][0] == 200,
               "Service web never answered")
        try:
            _until(lambda: _metric(tnode.agent.http("/metrics")[1], "aether_requests_total",
                                   src_workload="caller") >= 1, "no request was counted at all")
        except AssertionError as e:
            raise AssertionError(f"{e}\nEnvoy: {tnode.admin('/stats/prometheus?filter=aether')}"
                                 ) from None
        # requests are counted by a histogram, merged on Envoy's stats flush (every 5 s):
        # past one flush every warm-up request is in the baseline
        time.sleep(FLUSH_S)
        text0 = tnode.agent.http("/metrics")[1]
        n, k, m = 20, 6, 7
        got = http_get_from(caller.netns, WEB_IP, 80, count=n - k, timeout=5)
        got += http_get_from(caller.netns, WEB_IP, 80, path="/status/503", count=k, timeout=5)
        assert [s for s, _h, _b in got].count(200) == n - k, got[:2]

        def tcp() -> None:
            for _ in range(m):
                c = socket.create_connection((RAW_IP, 7000), timeout=5)
                c.sendall(b"x" * 100)
                c.close()
        run_in_netns(caller.netns, tcp)
        base = dict(src_namespace="app", src_workload="caller", dst_namespace="app")

        def delta(text: str, name: str, **labels: str) -> float:
            return _metric(text, name, **{**base, **labels}) - _metric(text0, name,
                                                                     **{**base, **labels})

        def settled() -> str | None:
            text = tnode.agent.http("/metrics")[1]
            ok = (delta(text, "aether_requests_total", dst_service="web") == n
                  and delta(text, "aether_request_duration_seconds_count", dst_service="web") == n
                  and delta(text, "aether_tcp_connections_total", dst_service="raw") == m)
            return text if ok else None

        def evidence() -> str:
            t = tnode.agent.http("/metrics")[1]
            return "\n".join(ln for ln in t.splitlines()
                             if ln.startswith(("aether_requests_total", "aether_tcp_conn",
                                               "aether_passthrough")))

        try:
            _until(settled, "the counters never reached N requests and M connections")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{evidence()}") from None
        time.sleep(FLUSH_S)  # another flush: nothing more may arrive
        text = tnode.agent.http("/metrics")[1]
        assert delta(text, "aether_requests_total", dst_service="web") == n
        assert delta(text, "aether_requests_total", dst_service="web", code="503") == k
        assert delta(text, "aether_requests_total", dst_service="web", code_class="5xx") == k
        assert delta(text, "aether_request_duration_seconds_count", dst_service="web") == n
        assert delta(text, "aether_tcp_connections_total", dst_service="raw") == m
        # bytes per destination Service (Envoy's cluster counters, every source summed)
        sent = [float(x) for x in re.findall(
            r'^aether_service_sent_bytes_total\{dst_namespace="app",dst_service="raw"\} (\S+)$',
            text, re.M)] + [float(x) for x in re.findall(
            r'^aether_service_sent_bytes_total\{dst_namespace="app",dst_service="raw"\} (\S+)$',
            text0, re.M)]
        assert len(sent) == 2 and sent[0] - sent[1] == 100 * m, sent
        # `aether-agent top --once --json`: the same numbers, per destination Service
        out = subprocess.run([sys.executable, "-m", "agent.cli", "top", "--once", "--json",
                              "--run-dir", tnode.agent.run_dir, "--interval", "0.5"],
                             capture_output=True, text=True, check=True).stdout
        rows = {r["name"]: r for r in json.loads(out)["services"]}
        warmup = _metric(text0, "aether_requests_total", **base, dst_service="web")
        assert rows["app/web"]["requests"] == n + warmup
        assert rows["app/web"]["errors"] == k
        assert rows["app/raw"]["connections"] == m
        human = subprocess.run([sys.executable, "-m", "agent.cli", "top", "--once",
                                "--run-dir", tnode.agent.run_dir, "--interval", "0.5"],
                               capture_output=True, text=True, check=True).stdout
        total = int(n + warmup)
        pct = f"{(total - k) * 100 / total:.1f}%"
        assert re.search(rf"app/web\s+\S+\s+{total}\s+{re.escape(pct)}", human), human
    finally:
        srv.shutdown()
        lst.close()


def test_passthrough_classes_and_open_connections_come_from_envoys_stats(tnode: EnvoyNode
                                                                           ) -> None:
    """Passthrough connections (no Service chain) are counted by destination class from
    Envoy's own stats, and a connection held open to a Service shows as active, in /metrics
    and in `aether-agent top`."""
    from agent.testing.netutil import dial, host_server
    from integration.conftest import GW4

    tnode.agent.write("svcs.yaml", [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "raw", "namespace": "app"},
         "spec": {"clusterIP": RAW_IP, "clusterIPs": [RAW_IP], "selector": {"app": "raw"},
                  "ports": [{"name": "tcp", "port": 7000, "targetPort": 7000}]}}])
    raw = tnode.pod(name="raw-0", labels={"app": "raw"})
    caller = tnode.pod(name="caller-0", annotations={"aether.io/dependencies": "app/raw"})
    for p in (raw, caller):
        tnode.add(p)
    lst = run_in_netns(raw.netns, lambda: socket.create_server(("0.0.0.0", 7000)))
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(lst.accept()[0]), daemon=True).start()
    srv, port = host_server()

    def outside() -> float:
        return _metric(tnode.agent.http("/metrics")[1], "aether_passthrough_connections_total",
                       **{"class": "outside"})
    try:
        before = outside()
        k = 5
        for _ in range(k):
            assert dial(caller.netns, GW4, port) == "direct"
        _until(lambda: outside() - before == k, "passthrough connections not counted")
        # a connection to the Service, held open
        def connect() -> socket.socket | None:
            try:
                return run_in_netns(caller.netns,
                                    lambda: socket.create_connection((RAW_IP, 7000), 3))
            except OSError:
                return None
        c = _until(connect, "Service raw never accepted")

        def active() -> float:
            return _metric(tnode.agent.http("/metrics")[1], "aether_service_active_connections",
                           dst_namespace="app", dst_service="raw")
        _until(lambda: active() == 1, "the open connection is not active")
        out = subprocess.run([sys.executable, "-m", "agent.cli", "top", "--once", "--json",
                              "--run-dir", tnode.agent.run_dir, "--interval", "0.5"],
                             capture_output=True, text=True, check=True).stdout
        doc = json.loads(out)
        rows = {r["name"]: r for r in doc["services"]}
        assert rows["app/raw"]["active"] == 1 and rows["app/raw"]["connections"] == 0
        assert doc["passthrough"]["outside"]["connections"] >= k
        c.close()  # half-closed until the server closes too (tcp_proxy relays the FIN)
        for h in held:
            h.close()
        _until(lambda: active() == 0, "the closed connection is still active")
    finally:
        srv.close()
        lst.close()
        for h in held:
            h.close()


def _web_and_callers(n: EnvoyNode, names: list[str]) -> tuple[list[Any], Any]:
    """Service web (appProtocol http) over pod web-0, and one caller pod per name; returns
    the callers and web-0's server once each caller has had one answer (one request each)."""
    n.agent.write("svcs.yaml", [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "app"},
         "spec": {"clusterIP": WEB_IP, "clusterIPs": [WEB_IP], "selector": {"app": "web"},
                  "ports": [{"name": "http", "port": 80, "targetPort": 8080,
                             "appProtocol": "http"}]}}])
    web = n.pod(name="web-0", labels={"app": "web"})
    n.add(web)
    callers = [n.pod(name=name, annotations={"aether.io/dependencies": "app/web"})
               for name in names]
    for c in callers:
        n.add(c)
    srv = http_echo_server(web.netns, "0.0.0.0", 8080, "web-0")
    for c in callers:
        _until(lambda c=c: http_get_from(c.netns, WEB_IP, 80, count=1, timeout=3)[0][0] == 200,
               "Service web never answered")
    return callers, srv


def test_the_cardinality_cap_folds_new_callers_on_the_real_path(workdir: str, bridge_name: str
                                                               ) -> None:
    """With the cap lowered to 3 label sets (`--traffic-max-series 3`; 1000 by default, held
    under 1,200 callers in tests/test_traffic.py and integration/test_traffic_cap.py), five
    caller pods: at most 3 sets plus 'other' are exported, the fold is counted, and every
    request is still counted."""
    with running(EnvoyNode(workdir, bridge_name, extra=["--traffic-max-series", "3"])) as n:
        callers, srv = _web_and_callers(n, [f"caller{i}-0" for i in range(5)])
        try:
            for c in callers:
                assert [s for s, _h, _b in http_get_from(c.netns, WEB_IP, 80, count=2,
                                                         timeout=5)] == [200, 200]

            def total() -> float:
                return _metric(n.agent.http("/metrics")[1], "aether_requests_total")
            _until(lambda: total() >= 15, "not every request was counted")
            time.sleep(1.5)
            text = n.agent.http("/metrics")[1]
            series = re.findall(r"^aether_requests_total\{(.*)\} \S+$", text, re.M)
            workloads = {dict(re.findall(r'(\w+)="([^"]*)"', s))["src_workload"] for s in series}
            assert "other" in workloads and len(workloads - {"other"}) <= 3, workloads
            assert _metric(text, "aether_requests_total") == 15  # 5 callers x (1 + 2)
            folded = re.search(r"^aether_traffic_folded_reports_total (\S+)$", text, re.M)
            assert folded and float(folded.group(1)) >= 2
        finally:
            srv.shutdown()


def test_the_calling_pod_is_labelled_where_wanted(workdir: str, bridge_name: str) -> None:
    """`--traffic-source-pods`: the real Envoy counts each calling pod apart (src_pod), with
    its workload beside it; the counts are exact per pod."""
    with running(EnvoyNode(workdir, bridge_name, extra=["--traffic-source-pods"])) as n:
        callers, srv = _web_and_callers(n, ["caller-0", "caller-1"])
        try:
            sent = {"caller-0": 3, "caller-1": 5}
            for c in callers:
                got = http_get_from(c.netns, WEB_IP, 80, count=sent[c.name], timeout=5)
                assert [s for s, _h, _b in got] == [200] * sent[c.name]

            def per_pod() -> dict[str, float]:
                text = n.agent.http("/metrics")[1]
                return {p: _metric(text, "aether_requests_total", src_pod=p, dst_service="web")
                        for p in sent}
            # each pod's count: its probe request plus what it sent
            _until(lambda: per_pod() == {p: k + 1 for p, k in sent.items()},
                   f"per-pod counts never matched: {per_pod()}", timeout=FLUSH_S * 3)
            text = n.agent.http("/metrics")[1]
            assert _metric(text, "aether_requests_total", src_pod="caller-0",
                           src_workload="caller-0") == 4  # the workload label stays
        finally:
            srv.shutdown()


PLAIN_IP, ROUTED_IP = "10.96.72.20", "10.96.72.21"


def _kept_alive(netns: str, ip: str, count: int, path: str = "/") -> list[int]:
    """``count`` GETs on one kept-alive connection (only its first bytes are detected)."""
    import http.client

    def work() -> list[int]:
        conn = http.client.HTTPConnection(ip, 80, timeout=5)
        out = []
        try:
            for _ in range(count):
                conn.request("GET", path)
                r = conn.getresponse()
                r.read()
                out.append(r.status)
        finally:
            conn.close()
        return out
    return run_in_netns(netns, work)


def test_http_on_an_undeclared_port_is_counted_once_by_the_destination(workdir: str,
                                                                       bridge_name: str
                                                                       ) -> None:
    """Mesh identity on. Service plain has no appProtocol: the caller's proxy relays its
    bytes, the destination detects HTTP and counts every request there, exactly N
    (new connections and kept-alive ones, a 503 among them), reporter=destination, by the
    caller's identity and the pod's workload, the Service named. Service routed (no
    appProtocol either) has an HTTPRoute sending to plain: the caller's proxy parses and
    counts those requests (reporter=source) and the destination does not count them again
    (they cross on aether-mesh-http). No request is counted twice."""
    from agent.identity.ca_dir import make_ca
    ca = os.path.join(workdir, "ca")
    make_ca(ca, "cluster.local")
    plain_port = {"name": "p", "port": 80, "targetPort": 8080}
    with running(EnvoyNode(workdir, bridge_name, extra=[
            "--identity-ca-dir", ca, "--trust-domain", "cluster.local"])) as n:
        n.agent.write("svcs.yaml", [
            {"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": "plain", "namespace": "app"},
             "spec": {"clusterIP": PLAIN_IP, "clusterIPs": [PLAIN_IP],
                      "selector": {"app": "plain"}, "ports": [plain_port]}},
            {"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": "routed", "namespace": "app"},
             "spec": {"clusterIP": ROUTED_IP, "clusterIPs": [ROUTED_IP],
                      "selector": {"app": "nobody"}, "ports": [plain_port]}},
            {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
             "metadata": {"name": "to-plain", "namespace": "app"},
             "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "routed",
                                      "port": 80}],
                      "rules": [{"backendRefs": [{"name": "plain", "port": 80}]}]}}])
        server = n.pod(name="plain-0", labels={"app": "plain"}, service_account="server")
        caller = n.pod(name="caller-0", service_account="client",
                       annotations={"aether.io/dependencies": "app/plain,app/routed"})
        for p in (server, caller):
            n.add(p)
        srv = http_echo_server(server.netns, "0.0.0.0", 8080, "plain-0")
        try:
            for ip in (PLAIN_IP, ROUTED_IP):
                _until(lambda ip=ip: http_get_from(caller.netns, ip, 80, count=1,
                                                   timeout=3)[0][0] == 200,
                       f"{ip} never answered")
            dst = dict(reporter="destination", dst_namespace="app")

            def counted(text: str, **labels: str) -> float:
                return _metric(text, "aether_requests_total", **labels)
            _until(lambda: counted(n.agent.http("/metrics")[1], **dst) >= 1,
                   "the destination counted nothing")
            time.sleep(FLUSH_S)  # past a flush: the warm-up requests are in the baseline
            text0 = n.agent.http("/metrics")[1]
            k, fresh, kept, routed = 3, 12, 25, 9
            got = [s for s, _h, _b in http_get_from(caller.netns, PLAIN_IP, 80, count=fresh)]
            got += [s for s, _h, _b in http_get_from(caller.netns, PLAIN_IP, 80,
                                                     path="/status/503", count=k)]
            got += _kept_alive(caller.netns, PLAIN_IP, kept)
            assert got == [200] * fresh + [503] * k + [200] * kept, got
            assert _kept_alive(caller.netns, ROUTED_IP, routed) == [200] * routed
            total = fresh + k + kept

            def delta(text: str, name: str = "aether_requests_total", **labels: str) -> float:
                return _metric(text, name, **labels) - _metric(text0, name, **labels)

            def settled() -> bool:
                text = n.agent.http("/metrics")[1]
                return (delta(text, dst_service="plain", **dst) == total
                        and delta(text, reporter="source", dst_service="routed") == routed)
            _until(settled, "the counts never reached N", timeout=FLUSH_S * 4)
            time.sleep(FLUSH_S)  # another flush: nothing more may arrive
            text = n.agent.http("/metrics")[1]
            mine = dict(src_identity="app/client", src_namespace="app", dst_workload="plain-0")
            assert delta(text, dst_service="plain", **dst, **mine) == total
            assert delta(text, dst_service="plain", code="503", **dst) == k
            assert delta(text, "aether_request_duration_seconds_count", dst_service="plain",
                         **dst) == total
            # counted once: the caller relayed plain's bytes (no source count) and parsed
            # routed's requests (no destination count)
            assert delta(text, reporter="source", dst_service="plain") == 0
            assert delta(text, reporter="source", dst_service="routed") == routed
            assert delta(text, **dst) == total, "the destination counted routed's requests"
            assert delta(text) == total + routed
        finally:
            srv.shutdown()
