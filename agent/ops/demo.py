"""`aether-agent demo`: a small node on this machine, no Kubernetes needed (root).

Builds a manifest directory (a managed namespace, a client pod, `echo` with `echo-v1` and
`echo-v2` behind it, an HTTPRoute that matches a header and splits the rest), creates the
pods' network namespaces through the reference CNI plugins + `aether-cni` exactly as kubelet
would, starts the agent and its Envoy, sends requests from the client pod to
`http://echo/` — a ClusterIP nothing else routes — and shows which backend answered and that
Envoy carried them. Cleans everything up, also on Ctrl-C. Exit 0 only when the split splits
and the header match matches.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from types import FrameType
from typing import Any

import yaml

from agent.envoy.resources import HTTP_FAILURE_LOG_TAG, service_cluster_name
from agent.envoy.supervisor import admin_request
from agent.netns.pin import release_pin_dir

NS = "demo"
ECHO_IP, V1_IP, V2_IP = "10.96.213.10", "10.96.213.11", "10.96.213.12"
SUBNET4, SUBNET6 = "10.88.213.0/24", "fd00:88:213::/64"


def _say(step: int, total: int, msg: str) -> None:
    print(f"[{step}/{total}] {msg}", file=sys.stderr, flush=True)


def manifests() -> list[dict[str, Any]]:
    def pod(name: str, labels: dict[str, str], ann: dict[str, str] | None = None) -> dict[str, Any]:
        # each app its own ServiceAccount: its mesh identity spiffe://cluster.local/ns/demo/sa/<app>
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": NS, "labels": labels,
                             "annotations": ann or {}},
                "spec": {"nodeName": "demo-node", "serviceAccountName": labels["app"],
                         "containers": [{"name": "app", "image": "demo",
                                         "ports": [{"name": "http", "containerPort": 8080}]}]}}

    def svc(name: str, ip: str, selector: dict[str, str]) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": name, "namespace": NS},
                "spec": {"clusterIP": ip, "clusterIPs": [ip], "selector": selector,
                         "ports": [{"name": "http", "port": 80, "targetPort": "http",
                                    "protocol": "TCP", "appProtocol": "http"}]}}

    route = {
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": {"name": "echo-split", "namespace": NS,
                     "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {
            "parentRefs": [{"group": "", "kind": "Service", "name": "echo", "port": 80}],
            "rules": [
                {"matches": [{"headers": [{"name": "x-version", "value": "v2"}]}],
                 "backendRefs": [{"name": "echo-v2", "port": 80}]},
                {"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                 "backendRefs": [{"name": "echo-v1", "port": 80, "weight": 50},
                                 {"name": "echo-v2", "port": 80, "weight": 50}]},
            ],
        },
    }
    return [
        {"apiVersion": "v1", "kind": "Namespace",
         "metadata": {"name": NS, "labels": {"aether.io/managed": "true"}}},
        pod("client", {"app": "client"}, {"aether.io/dependencies": "echo"}),
        pod("echo-v1-0", {"app": "echo", "version": "v1"}),
        pod("echo-v2-0", {"app": "echo", "version": "v2"}),
        svc("echo", ECHO_IP, {"app": "echo"}),
        svc("echo-v1", V1_IP, {"app": "echo", "version": "v1"}),
        svc("echo-v2", V2_IP, {"app": "echo", "version": "v2"}),
        route,
    ]


class Demo:
    STEPS = 7

    def __init__(self, requests: int = 200, keep: bool = False) -> None:
        self.requests = requests
        self.keep = keep
        self.workdir = tempfile.mkdtemp(prefix="aether-demo-")
        self.run_dir = os.path.join(self.workdir, "run")
        self.mdir = os.path.join(self.workdir, "manifests")
        self.bridge = f"aetdemo{os.getpid() % 1000}"
        self.admin = os.path.join(self.run_dir, "envoy", "admin.sock")  # root-only, the default
        self.agent: subprocess.Popen[bytes] | None = None
        self.kubelet: Any = None
        self.pods: dict[str, Any] = {}
        self.servers: list[Any] = []
        self._routes: list[tuple[str, str]] = []
        self.failures: list[dict[str, Any]] = []
        self.run_id = f"demo-{os.getpid()}"  # x-request-id prefix: names requests in Envoy's log
        self.counter_delta: dict[str, int] = {}

    # -- steps -------------------------------------------------------------------------------
    def run(self) -> int:
        from agent.testing.kubelet import Kubelet, reference_plugin_dir

        if os.geteuid() != 0:
            print("aether-agent demo needs root (network namespaces, nftables, Envoy)",
                  file=sys.stderr)
            return 2
        reference_plugin_dir()  # fails with a clear message when the plugins are missing
        # The demo's ClusterIPs are routed by nothing but Envoy: a connection that reaches
        # the passthrough before the mesh config must fail here, never leave the machine.
        for fam, net in (("-4", "10.96.213.0/24"),):
            if subprocess.run(["ip", fam, "route", "add", "blackhole", net], capture_output=True,
                              check=False).returncode == 0:
                self._routes.append((fam, net))
        _say(1, self.STEPS, f"writing manifests to {self.mdir}")
        os.makedirs(self.mdir)
        with open(os.path.join(self.mdir, "demo.yaml"), "w") as f:
            yaml.safe_dump_all(manifests(), f)

        _say(2, self.STEPS, "starting aether-agent with its node Envoy (mesh identity: SVIDs "
             "signed with a CA made for the demo)")
        from agent.identity.ca_dir import make_ca
        ca = os.path.join(self.workdir, "ca")
        make_ca(ca)
        # The demo is its own kubelet: its conflist (bridge + host-local + aether-cni) and its
        # plugin dir (the shim cni-install deploys) are what the agent's status reads.
        self.kubelet = Kubelet(self.workdir, self.bridge, SUBNET4, SUBNET6,
                               {"agent_socket": os.path.join(self.run_dir, "cni.sock"),
                                "capture_redirect_all_default": True})
        conf_dir = os.path.join(self.workdir, "net.d")
        os.makedirs(conf_dir)
        with open(os.path.join(conf_dir, "10-aether-demo.conflist"), "w") as f:
            json.dump(self.kubelet.conflist, f, indent=2)
        log = open(os.path.join(self.workdir, "agent.log"), "wb")  # noqa: SIM115
        self.agent = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "run", "--manifests", self.mdir, "--node-name",
             "demo-node", "--run-dir", self.run_dir, "--identity-ca-dir", ca,
             "--cni-conf-dir", conf_dir, "--cni-bin-dir", self.kubelet.plugin_dir,
             "--metrics-port", "0", "--log-format", "json"], stdout=log, stderr=log)
        self._wait(lambda: os.path.exists(os.path.join(self.run_dir, "status.sock")), 60,
                   "the agent did not start")
        self._wait(lambda: self._admin("/ready").strip() == "LIVE", 60, "Envoy did not get ready")

        _say(3, self.STEPS, "creating pods through bridge + host-local + aether-cni (as kubelet)")
        for name in ("echo-v1-0", "echo-v2-0", "client"):
            pod = self.kubelet.new_pod(NS, name)
            self.kubelet.add(pod)
            self.pods[name] = pod
            print(f"      {NS}/{name}: {pod.ip(4)} netns {pod.netns_name} captured",
                  file=sys.stderr)

        _say(4, self.STEPS, "starting backends that answer with their pod name")
        from agent.testing.netutil import http_echo_server
        for name in ("echo-v1-0", "echo-v2-0"):
            self.servers.append(http_echo_server(self.pods[name].netns, "0.0.0.0", 8080, name))

        _say(5, self.STEPS, "waiting for the mesh config: every backend of the route an "
             "endpoint in Envoy, then http://echo/ routed")
        # One answer through the route is not enough: it proves one backend of the split. The
        # other backend's endpoint reaches Envoy in its own EDS push, after that pod's ADD;
        # until then the split's share for it answers 503 UH (no healthy upstream).
        self._wait(self._endpoints_in_envoy, 30, "Envoy never had every backend's endpoint")
        self._wait(self._echo_routed, 30, "Envoy never routed http://echo/")

        _say(6, self.STEPS, f"sending {self.requests} requests from {NS}/client to "
             f"http://echo/ ({ECHO_IP}:80) and 20 with x-version: v2")
        from agent.testing.netutil import http_get_from
        client = self.pods["client"].netns
        before = self._envoy_counters()
        plain = http_get_from(client, ECHO_IP, 80, "/", {"Host": "echo"}, count=self.requests,
                              request_id=f"{self.run_id}-plain")
        v2 = http_get_from(client, ECHO_IP, 80, "/", {"Host": "echo", "x-version": "v2"},
                           count=20, request_id=f"{self.run_id}-v2")
        self._record_failures("plain", plain)
        self._record_failures("v2", v2)
        if self.failures:
            after = self._envoy_counters()
            self.counter_delta = {k: v - before.get(k, 0) for k, v in after.items()
                                  if v != before.get(k, 0)}
            self._attach_access_log()
        split = Counter(h.get("x-pod", f"status {s}") for s, h, _ in plain)
        callers = Counter(caller_identity(body) for s, _h, body in plain + v2 if s == 200)
        header = Counter(h.get("x-pod", f"status {s}") for s, h, _ in v2)
        stats = self._envoy_stats()

        _say(7, self.STEPS, "aether-agent status")
        subprocess.run([sys.executable, "-m", "agent.cli", "status", "--run-dir", self.run_dir],
                       check=False)
        code = self._report(split, header, stats, callers)
        self._wait_counted(self.requests + 20)
        print("\n$ aether-agent top --once   (the calls above, by Service and by workload)")
        subprocess.run([sys.executable, "-m", "agent.cli", "top", "--once", "--interval", "1",
                        "--run-dir", self.run_dir], check=False)
        return code

    def _wait_counted(self, sent: int, timeout: float = 12.0) -> None:
        """Until the golden metrics hold the calls made (Envoy merges its request histograms
        on its 5 s stats flush), so ``top`` shows them; at most ``timeout``."""
        from agent.cni import protocol
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                answer = protocol.call(os.path.join(self.run_dir, "status.sock"),
                                       {"command": "traffic"}, 5)
            except (OSError, ValueError):
                answer = {}
            rows = (answer.get("traffic") or {}).get("requests") or []
            if sum(r["count"] for r in rows if r.get("dst_service") == "echo") >= sent:
                return
            time.sleep(0.5)

    def expected_endpoints(self) -> set[str]:
        """``<cluster>::<ip>:<port>`` of every (Service, pod) the demo's route can send to."""
        members = {"echo": ("echo-v1-0", "echo-v2-0"), "echo-v1": ("echo-v1-0",),
                   "echo-v2": ("echo-v2-0",)}
        return {f"{service_cluster_name(NS, svc, 80)}::{self.pods[pod].ip(4)}:8080"
                for svc, pods in members.items() for pod in pods}

    def _endpoints_in_envoy(self) -> bool:
        return self.expected_endpoints() <= healthy_hosts(self._admin("/clusters"))

    def _echo_routed(self) -> bool:
        from agent.testing.netutil import http_get_from
        answers = http_get_from(self.pods["client"].netns, ECHO_IP, 80, "/", count=1, timeout=2)
        return answers[0][0] == 200 and "x-pod" in answers[0][1]

    def _report(self, split: Counter[str], header: Counter[str], stats: dict[str, int],
                callers: Counter[str]) -> int:
        print()
        print(f"http://echo/ from {NS}/client ({sum(split.values())} requests):")
        for pod, n in sorted(split.items()):
            print(f"  {pod:<12} {n:>4}  {'#' * int(40 * n / max(1, sum(split.values())))}")
        print("with header x-version: v2 (20 requests):")
        for pod, n in sorted(header.items()):
            print(f"  {pod:<12} {n:>4}")
        print("who the backends saw calling (x-forwarded-client-cert, set by their side of the "
              "mTLS hop):")
        for who, n in sorted(callers.items()):
            print(f"  {who:<48} {n:>4}")
        print("Envoy carried them (cluster upstream requests):")
        for name, n in sorted(stats.items()):
            print(f"  {name:<40} {n}")
        total = sum(split.values())
        v1, v2n = split.get("echo-v1-0", 0), split.get("echo-v2-0", 0)
        ok_split = total > 0 and v1 + v2n == total and 0.3 <= v1 / total <= 0.7
        ok_header = header.get("echo-v2-0", 0) == 20
        ok_envoy = sum(stats.values()) >= total
        ok_id = set(callers) == {CLIENT_ID} and sum(callers.values()) == sum(
            split.values()) + sum(header.values())
        for ok, what in ((ok_split, "the 50/50 split splits"), (ok_header, "the header match matches"),
                         (ok_envoy, "every request went through the node Envoy"),
                         (ok_id, f"every backend saw the caller as {CLIENT_ID} (mTLS)")):
            print(f"{'PASS' if ok else 'FAIL'}: {what}")
        if self.failures:
            self._print_failures()
        return 0 if ok_split and ok_header and ok_envoy and ok_id and not self.failures else 1

    def _print_failures(self, show: int = 5) -> None:
        """Failed requests grouped by Envoy's account of them (response flags, details,
        cluster from the failure access log, matched by x-request-id), then the first log
        lines in full."""
        print(f"FAIL: {len(self.failures)} requests failed; Envoy's response flags:")
        groups = Counter((f["status"], f.get("flags", "?"), f.get("details", "?"),
                          f.get("cluster", "?"), f["body"][:60]) for f in self.failures)
        for (status, flags, details, cluster, body), n in groups.most_common():
            print(f"  {n:>4} x status {status} flags={flags} details={details} "
                  f"cluster={cluster} body={body!r}")
        for f in self.failures[:show]:
            line = f.get("log") or (f"no answer: {f['headers'].get('error', '')}"
                                    if not f["status"] else "no Envoy failure log line")
            print(f"  {f['request_id']}: {line}")
        if len(self.failures) > show:
            print(f"  ... {len(self.failures) - show} more (agent.log: '{HTTP_FAILURE_LOG_TAG}')")
        moved = {k: n for k, n in self.counter_delta.items() if _is_failure_counter(k)}
        if moved:
            print("Envoy failure counters that moved during the requests:")
            for name, n in sorted(moved.items()):
                print(f"  {name:<60} +{n}")

    # -- failures ----------------------------------------------------------------------------
    def _record_failures(self, batch: str, answers: list[tuple[int, dict[str, str], bytes]]
                         ) -> None:
        """Keep every answer that is not a backend's 200 (the request id names it in Envoy's
        failure log)."""
        for i, (status, headers, body) in enumerate(answers):
            if status == 200 and "x-pod" in headers:
                continue
            self.failures.append({
                "request_id": f"{self.run_id}-{batch}-{i}", "status": status,
                "headers": headers, "body": body[:200].decode(errors="replace"),
            })

    def _attach_access_log(self, timeout: float = 12.0) -> None:
        """Find Envoy's failure access log line of every failed request in the agent log.
        Envoy flushes access logs on a timer (10 s by default), hence the wait."""
        want = {f["request_id"]: f for f in self.failures if f["status"]}
        deadline = time.monotonic() + timeout
        while want:
            for fields in envoy_failure_lines(os.path.join(self.workdir, "agent.log")):
                f = want.pop(fields.get("request_id", ""), None)
                if f is not None:
                    f.update(fields)
            if not want or time.monotonic() >= deadline:
                return
            time.sleep(0.5)

    def _envoy_counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for line in self._admin("/stats").splitlines():
            name, _, value = line.partition(": ")
            if value.strip().isdigit() and name.startswith(("cluster.svc|", "http.")):
                out[name] = int(value)
        return out

    # -- helpers -----------------------------------------------------------------------------
    def _admin(self, path: str) -> str:
        try:
            return admin_request(self.admin, "GET", path, timeout=2)[1]
        except OSError:
            return ""

    def _envoy_stats(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for line in self._admin("/stats?filter=upstream_rq_total$").splitlines():
            name, _, value = line.partition(": ")
            if name.startswith("cluster.svc|"):
                out[name.removeprefix("cluster.").removesuffix(".upstream_rq_total")] = int(value)
        return {k: v for k, v in out.items() if v}

    def _wait(self, pred: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if pred():
                    return
            except Exception:  # noqa: BLE001 - keep polling until the deadline
                pass
            if self.agent is not None and self.agent.poll() is not None:
                raise RuntimeError(f"{what}: the agent exited ({self._tail()})")
            time.sleep(0.2)
        raise RuntimeError(f"{what} within {timeout:.0f}s ({self._tail()})")

    def _tail(self) -> str:
        try:
            with open(os.path.join(self.workdir, "agent.log"), errors="replace") as f:
                lines = [ln for ln in f.read().splitlines() if '"error"' in ln or "Traceback" in ln]
            return " | ".join(json.loads(ln).get("msg", ln)[:200] if ln.startswith("{") else ln
                              for ln in lines[-3:]) or "see agent.log"
        except OSError:
            return "no agent log"

    def cleanup(self) -> None:
        print("cleaning up", file=sys.stderr)
        for srv in self.servers:
            srv.shutdown()
        for pod in self.pods.values():
            try:
                self.kubelet.delete(pod)
            except Exception:  # noqa: BLE001 - best effort; the netns goes regardless
                subprocess.run(["ip", "netns", "del", pod.netns_name], check=False,
                               capture_output=True)
        if self.agent is not None and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGTERM)
            try:
                self.agent.wait(20)
            except subprocess.TimeoutExpired:
                self.agent.kill()
        subprocess.run(["ip", "link", "del", self.bridge], check=False, capture_output=True)
        for fam, net in self._routes:
            subprocess.run(["ip", fam, "route", "del", "blackhole", net], check=False,
                           capture_output=True)
        if not self.keep:
            release_pin_dir(os.path.join(self.run_dir, "netns"))  # the agent's shared mount
            shutil.rmtree(self.workdir, ignore_errors=True)
        else:
            print(f"kept {self.workdir}", file=sys.stderr)


def _is_failure_counter(name: str) -> bool:
    return any(w in name for w in ("fail", "reset", "timeout", "5xx", "503", "none_healthy",
                                   "overflow", "no_route", "no_cluster", "retry"))


def envoy_failure_lines(agent_log: str) -> list[dict[str, str]]:
    """The mesh's HTTP failure access log lines (``http-failure``) in an agent log (JSON or
    text), each as its ``key=value`` fields plus ``log`` (the line itself)."""
    out: list[dict[str, str]] = []
    try:
        with open(agent_log, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for raw in lines:
        if HTTP_FAILURE_LOG_TAG not in raw:
            continue
        line = raw
        if raw.startswith("{"):
            try:
                line = str(json.loads(raw).get("msg", raw))
            except ValueError:
                pass
        fields = {k: v for k, sep, v in (w.partition("=") for w in line.split()) if sep}
        fields["log"] = line
        out.append(fields)
    return out


def healthy_hosts(clusters: str) -> set[str]:
    """``<cluster>::<ip>:<port>`` of every host Envoy's admin ``/clusters`` (text) lists as
    healthy: an endpoint the load balancer can pick (EDS delivered, HEALTHY). A mesh endpoint
    reached through the mTLS tunnel is listed as ``envoy://mtls-out/<ip>:<port>``."""
    suffix = "::health_flags::healthy"
    return {line.removesuffix(suffix).replace("envoy://mtls-out/", "")
            for line in clusters.splitlines() if line.endswith(suffix)}


CLIENT_ID = f"spiffe://cluster.local/ns/{NS}/sa/client"


def caller_identity(body: bytes) -> str:
    """The URI of the x-forwarded-client-cert the echo backend saw ("none" without one)."""
    import json
    try:
        xfcc = str(json.loads(body)["headers"].get("x-forwarded-client-cert", ""))
    except (ValueError, KeyError, TypeError):
        return "unreadable answer"
    for part in xfcc.split(";"):
        if part.startswith("URI="):
            return part[4:]
    return "none (plaintext)"


def run_demo(requests: int = 200, keep: bool = False) -> int:
    demo = Demo(requests, keep)

    def on_term(_sig: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        return demo.run()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    finally:
        demo.cleanup()
        signal.signal(signal.SIGTERM, old)
