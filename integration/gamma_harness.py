"""Harness of the GAMMA conformance suite (integration/test_gamma_conformance.py).

One node for the whole module: a manifest directory with two managed namespaces (``gamma``,
the producer, and ``consumer``), backend pods ``echo-v1-0``/``echo-v2-0``/``echo-v3-0`` that
answer every HTTP request with JSON naming their pod and the request they saw (and keep a log
of it), a gRPC server (h2c, raw bytes) in each backend pod, one client pod per namespace, and
the agent with its Envoy. Every Service gets a ClusterIP nothing routes, so only the node
Envoy can answer it. Routes are added by writing manifest files (the agent re-reads the
directory every 0.5 s) and tests wait for the behaviour they expect by polling requests
(``converge``), never by sleeping a fixed time; a timeout fails with what was seen and the
relevant part of Envoy's ``/config_dump``.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from agent.netns.enter import run_in_netns
from agent.netns.pin import release_pin_dir
from agent.testing.kubelet import Pod
from agent.testing.netutil import ClosingHTTPServer

PRODUCER_NS = "gamma"
CONSUMER_NS = "consumer"
HTTP_PORT, TARGET_PORT = 80, 8080
ALT_PORT = 8081
GRPC_PORT = 9090
VERSIONS = ("v1", "v2", "v3")
BACKEND_PODS = tuple(f"echo-{v}-0" for v in VERSIONS)
CLUSTER_IP_NET = "10.96.214"
# Header our routes add (RequestHeaderModifier) so a test can tell "route applied" apart.
MARK = "x-gamma-route"
DEFAULT_CREATED = "2026-01-01T00:00:00Z"
CONVERGE_TIMEOUT = float(os.environ.get("AETHER_GAMMA_CONVERGE_TIMEOUT", "20"))
H2C = "kubernetes.io/h2c"


# ---- manifests -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SvcPort:
    port: int = HTTP_PORT
    target: int = TARGET_PORT
    name: str = "http"
    app_protocol: str | None = "http"

    def manifest(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "port": self.port, "targetPort": self.target,
                               "protocol": "TCP"}
        if self.app_protocol is not None:
            out["appProtocol"] = self.app_protocol
        return out


HTTP = (SvcPort(),)
GRPC = (SvcPort(GRPC_PORT, GRPC_PORT, "grpc", H2C),)


@dataclass(frozen=True)
class Svc:
    """A Service of the suite; ``versions`` selects the echo pods behind it."""

    name: str
    versions: tuple[str, ...] = ("v1",)
    ports: tuple[SvcPort, ...] = HTTP
    annotations: dict[str, str] = field(default_factory=dict)
    namespace: str = PRODUCER_NS

    def selector(self) -> dict[str, str]:
        sel = {"app": "echo"}
        if len(self.versions) == 1:
            sel["version"] = self.versions[0]
        elif set(self.versions) != set(VERSIONS):
            raise ValueError(f"{self.name}: select one version or all of them")
        return sel

    def manifest(self, ip: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": self.name, "namespace": self.namespace,
                             "annotations": dict(self.annotations)},
                "spec": {"clusterIP": ip, "clusterIPs": [ip], "selector": self.selector(),
                         "ports": [p.manifest() for p in self.ports]}}


def backend_services() -> list[Svc]:
    """echo-vN (HTTP), grpc-vN (h2c), echo (all versions, ports 80 and 8081), echo-grpc."""
    out = [Svc(f"echo-{v}", (v,)) for v in VERSIONS]
    out += [Svc(f"grpc-{v}", (v,), GRPC) for v in VERSIONS]
    out.append(Svc("echo", VERSIONS, (SvcPort(), SvcPort(ALT_PORT, TARGET_PORT, "http-alt"))))
    out.append(Svc("echo-grpc", VERSIONS, GRPC))
    return out


def parent(name: str, *, port: int | None = HTTP_PORT, namespace: str | None = None,
           section: str | None = None) -> dict[str, Any]:
    ref: dict[str, Any] = {"group": "", "kind": "Service", "name": name}
    if namespace is not None:
        ref["namespace"] = namespace
    if port is not None:
        ref["port"] = port
    if section is not None:
        ref["sectionName"] = section
    return ref


def backend(name: str, weight: int | None = None, *, port: int = HTTP_PORT,
            namespace: str | None = None, filters: list[dict[str, Any]] | None = None
            ) -> dict[str, Any]:
    ref: dict[str, Any] = {"name": name, "port": port}
    if weight is not None:
        ref["weight"] = weight
    if namespace is not None:
        ref["namespace"] = namespace
    if filters:
        ref["filters"] = filters
    return ref


def mark(value: str) -> dict[str, Any]:
    """A RequestHeaderModifier setting ``x-gamma-route: value`` (proves which rule ran)."""
    return {"type": "RequestHeaderModifier",
            "requestHeaderModifier": {"set": [{"name": MARK, "value": value}]}}


def path(kind: str, value: str) -> dict[str, Any]:
    return {"path": {"type": kind, "value": value}}


def rule(*backends: dict[str, Any], matches: list[dict[str, Any]] | None = None,
         filters: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = dict(extra)
    if matches is not None:
        out["matches"] = matches
    if filters:
        out["filters"] = filters
    if backends:
        out["backendRefs"] = list(backends)
    return out


def route(name: str, parents: dict[str, Any] | list[dict[str, Any]], rules: list[dict[str, Any]],
          *, kind: str = "HTTPRoute", namespace: str = PRODUCER_NS, created: str = DEFAULT_CREATED,
          annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "creationTimestamp": created,
                            "generation": 1}
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": kind, "metadata": meta,
            "spec": {"parentRefs": parents if isinstance(parents, list) else [parents],
                     "rules": rules}}


# ---- backends ------------------------------------------------------------------------------


class EchoBackend:
    """HTTP server inside a pod netns: answers JSON {pod, method, path, host, headers} and
    logs every request it saw (the mirror test reads the log of the mirror backend)."""

    def __init__(self, netns: str, pod: str, port: int = TARGET_PORT) -> None:
        self.pod = pod
        self.lock = threading.Lock()
        self.log: list[dict[str, Any]] = []
        me = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # an idle kept-alive connection ends: a peer whose netns went away never sends FIN,
            # and its handler thread would otherwise hold the socket for the process's lifetime
            timeout = 20
            # headers and body are separate writes: without this, Nagle + delayed ACK costs
            # 40 ms per request on a kept-alive connection
            disable_nagle_algorithm = True

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                headers: dict[str, str] = {}
                for k in dict.fromkeys(k.lower() for k in self.headers):
                    headers[k] = ", ".join(self.headers.get_all(k) or [])
                seen = {"pod": pod, "method": self.command, "path": self.path,
                        "host": self.headers.get("Host", ""), "headers": headers}
                with me.lock:
                    me.log.append(seen)
                    tries = sum(1 for r in me.log if r["path"] == self.path)
                delay = int(headers.get("x-delay-ms") or 0)
                if delay:
                    time.sleep(delay / 1000)
                status = 200
                if tries <= int(headers.get("x-fail-first") or 0):
                    status = 503  # the first N tries of this path fail (retry tests)
                body = json.dumps(seen).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("X-Pod", pod)
                self.send_header("X-Backend-Header", "original")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _answer  # noqa: N815

            def log_message(self, *args: Any) -> None:
                return

        class Server(ClosingHTTPServer):
            allow_reuse_address = True

        self.server = run_in_netns(netns, lambda: Server(("0.0.0.0", port), Handler))
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def requests(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.log)

    def close(self) -> None:
        self.server.shutdown()  # and every connection it accepted


GRPC_METHODS = {"echo.Echo": ("Ping", "Other"), "other.Svc": ("Call",),
                "admin.v1.Admin": ("GetStatus",)}

_GRPC_SERVER = r"""
import json, sys
from concurrent import futures
import grpc
pod, port, methods = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
def make(path):
    def handler(request, context):
        md = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        return json.dumps({"pod": pod, "method": path, "metadata": md}).encode()
    # no (de)serializers: the request and the answer are raw bytes
    return grpc.unary_unary_rpc_method_handler(handler)
handlers = [grpc.method_handlers_generic_handler(s, {m: make(f"/{s}/{m}") for m in ms})
            for s, ms in methods.items()]
server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), handlers=handlers)
server.add_insecure_port(f"0.0.0.0:{port}")
server.start()
print("ready", flush=True)
server.wait_for_termination()
"""

_GRPC_CLIENT = r"""
import json, sys
import grpc
args = json.loads(sys.argv[1])
channel = grpc.insecure_channel(args["target"], options=[("grpc.enable_http_proxy", 0)])
out = []
for call in args["calls"]:
    stub = channel.unary_unary(call["method"])  # raw bytes in and out
    md = tuple((k, v) for k, v in call.get("metadata", {}).items())
    for _ in range(call.get("count", 1)):
        try:
            answer = stub(b"ping", metadata=md, timeout=call.get("timeout", 5))
            out.append({"ok": True, "answer": json.loads(answer)})
        except grpc.RpcError as e:
            out.append({"ok": False, "code": e.code().name, "details": e.details()})
print(json.dumps(out))
"""


def _grpc_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env["GRPC_VERBOSITY"] = "ERROR"
    return env


class GrpcBackend:
    """A grpcio server (h2c, generic raw-bytes handlers answering the pod name and the method)
    in a subprocess inside the pod netns: gRPC opens its sockets on threads of its own."""

    def __init__(self, netns_name: str, pod: str, log_path: str, port: int = GRPC_PORT) -> None:
        self.log = open(log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", netns_name, sys.executable, "-c", _GRPC_SERVER, pod, str(port),
             json.dumps(GRPC_METHODS)], stdout=subprocess.PIPE, stderr=self.log, env=_grpc_env())

    def wait_ready(self, timeout: float = 30) -> None:
        assert self.proc.stdout is not None
        ready: list[bytes] = []
        t = threading.Thread(target=lambda: ready.append(self.proc.stdout.readline()),  # type: ignore[union-attr]
                             daemon=True)
        t.start()
        t.join(timeout)
        if not ready or ready[0].strip() != b"ready":
            raise RuntimeError(f"gRPC backend did not start (exit {self.proc.poll()})")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ---- answers -------------------------------------------------------------------------------


@dataclass
class Answer:
    """One HTTP exchange as the client saw it (status 0: the connection failed)."""

    status: int
    headers: dict[str, str]
    body: bytes
    error: str = ""

    @property
    def seen(self) -> dict[str, Any]:
        """What the echo backend saw (empty when the answer did not come from a backend)."""
        try:
            data = json.loads(self.body)
        except ValueError:
            return {}
        return data if isinstance(data, dict) and "pod" in data else {}

    @property
    def pod(self) -> str:
        """The backend pod that answered, or ``status N`` / ``error ...``."""
        if self.status == 0:
            return f"error {self.error}"
        return str(self.seen.get("pod") or f"status {self.status}")

    @property
    def seen_headers(self) -> dict[str, str]:
        return dict(self.seen.get("headers") or {})

    @property
    def route_mark(self) -> str | None:
        return self.seen_headers.get(MARK)

    def brief(self) -> str:
        seen = self.seen
        if not seen:
            loc = self.headers.get("location")
            return f"{self.status}" + (f" location={loc}" if loc else "") + (
                f" body={self.body[:80]!r}" if self.body else "") + (
                f" {self.error}" if self.error else "")
        return (f"{self.status} {seen['pod']} {seen['method']} {seen['path']} host={seen['host']}"
                + (f" {MARK}={self.route_mark}" if self.route_mark else ""))


def pods(answers: Iterable[Answer]) -> Counter[str]:
    return Counter(a.pod for a in answers)


def summary(answers: Sequence[Answer], limit: int = 4) -> str:
    if not answers:
        return "no answers"
    first = dict.fromkeys(a.brief() for a in answers)
    return f"{dict(pods(answers))}; e.g. " + " | ".join(list(first)[:limit])


@dataclass
class GrpcAnswer:
    ok: bool
    answer: dict[str, Any] = field(default_factory=dict)
    code: str = "OK"
    details: str = ""

    @property
    def pod(self) -> str:
        return str(self.answer.get("pod")) if self.ok else f"grpc {self.code}"


# ---- the node ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GammaNode:
    """The module's node: manifests, pods, backends, agent + Envoy, and request helpers."""

    def __init__(self, bridge: str, services: Sequence[Svc]) -> None:
        from integration.conftest import EnvoyNode

        self.workdir = tempfile.mkdtemp(prefix="aether-gamma-")
        self.node = EnvoyNode(self.workdir, bridge)
        self.agent = self.node.agent
        self.services = {s.name: s for s in [*backend_services(), *services]}
        if len(self.services) > 200:
            raise ValueError("too many Services for one /24 of ClusterIPs")
        self.ips = {name: f"{CLUSTER_IP_NET}.{10 + i}" for i, name in enumerate(self.services)}
        self.pods: dict[str, Pod] = {}
        self.echo: dict[str, EchoBackend] = {}
        self.grpc: list[GrpcBackend] = []

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> GammaNode:
        self.agent.write("gamma-namespaces.yaml", [
            {"apiVersion": "v1", "kind": "Namespace",
             "metadata": {"name": ns, "labels": {"aether.io/managed": "true"}}}
            for ns in (PRODUCER_NS, CONSUMER_NS)])
        self.agent.write("gamma-services.yaml",
                         [s.manifest(self.ips[name]) for name, s in self.services.items()])
        deps = {"aether.io/dependencies": f"{PRODUCER_NS}/*,{CONSUMER_NS}/*"}
        for version, name in zip(VERSIONS, BACKEND_PODS, strict=True):
            self.pods[name] = self.node.pod(PRODUCER_NS, name, {"app": "echo", "version": version})
        self.pods["gamma/client"] = self.node.pod(PRODUCER_NS, "client", {"app": "client"}, deps)
        self.pods["consumer/client"] = self.node.pod(CONSUMER_NS, "client", {"app": "client"}, deps)
        self.agent.start()
        self.node.wait_ready(60)
        for name, pod in self.pods.items():
            self.node.add(pod)
            if name in BACKEND_PODS:
                self.echo[name] = EchoBackend(pod.netns, name)
                self.grpc.append(GrpcBackend(pod.netns_name, name,
                                             os.path.join(self.workdir, f"grpc-{name}.log")))
        for g in self.grpc:
            g.wait_ready()
        # Every backend Service answers through Envoy from both clients before any test runs.
        for client in self.clients:
            for version, pod_name in zip(VERSIONS, BACKEND_PODS, strict=True):
                self.converge(lambda a, p=pod_name: a.pod == p,
                              f"{client} reaches echo-{version} over L4", client=client,
                              target=f"echo-{version}", timeout=60)
        return self

    def close(self) -> None:
        for e in self.echo.values():
            e.close()
        for g in self.grpc:
            g.close()
        self.node.cleanup()
        self.agent.stop()
        if not os.environ.get("AETHER_KEEP_WORKDIR"):
            release_pin_dir(os.path.join(self.workdir, "run", "netns"))  # the agent's mount
            shutil.rmtree(self.workdir, ignore_errors=True)

    @property
    def clients(self) -> tuple[str, str]:
        return ("gamma/client", "consumer/client")

    def pod_ip(self, name: str) -> str:
        return self.pods[name].ip(4)

    # -- manifests ---------------------------------------------------------------------------
    def write(self, name: str, objects: list[dict[str, Any]]) -> None:
        """Atomically (re)write one manifest file (the agent ignores the .tmp name)."""
        final = os.path.join(self.agent.manifests, f"{name}.yaml")
        tmp = final + ".tmp"
        with open(tmp, "w") as f:
            yaml.safe_dump_all(objects, f)
        os.replace(tmp, final)

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.agent.manifests, f"{name}.yaml"))

    @contextlib.contextmanager
    def routes(self, name: str, *objects: dict[str, Any]) -> Iterator[None]:
        """Routes present for the duration of the block; removed afterwards."""
        self.write(f"route-{name}", list(objects))
        try:
            yield
        finally:
            self.remove(f"route-{name}")

    # -- HTTP --------------------------------------------------------------------------------
    def http(self, target: str, path: str = "/", *, client: str = "gamma/client",
             port: int = HTTP_PORT, method: str = "GET", headers: dict[str, str] | None = None,
             count: int = 1, keepalive: bool = False, timeout: float = 5.0, ip: str | None = None,
             body: bytes | None = None) -> list[Answer]:
        """``count`` requests from ``client``'s netns to the target's ClusterIP:port (or ``ip``).

        Host defaults to the Service name (what a client dialling ``http://<svc>/`` sends).
        A new connection per request unless ``keepalive``.
        """
        addr = ip or self.ips[target]
        hdrs = {"Host": target if port == HTTP_PORT else f"{target}:{port}", **(headers or {})}
        netns = self.pods[client].netns

        def work() -> list[Answer]:
            out: list[Answer] = []
            conn: http.client.HTTPConnection | None = None
            for _ in range(count):
                if conn is None:
                    conn = http.client.HTTPConnection(addr, port, timeout=timeout)
                try:
                    conn.request(method, path, body=body if body is not None else (
                        b"" if method in ("POST", "PUT", "PATCH") else None), headers=hdrs)
                    r = conn.getresponse()
                    hs: dict[str, str] = {}
                    for k, v in r.getheaders():
                        hs[k.lower()] = f"{hs[k.lower()]}, {v}" if k.lower() in hs else v
                    out.append(Answer(r.status, hs, r.read()))
                    if r.will_close:
                        conn.close()
                        conn = None
                except (OSError, http.client.HTTPException) as e:
                    out.append(Answer(0, {}, b"", f"{type(e).__name__}: {e}"))
                    conn.close()
                    conn = None
                if not keepalive and conn is not None:
                    conn.close()
                    conn = None
            if conn is not None:
                conn.close()
            return out

        return run_in_netns(netns, work, timeout=max(60.0, count * timeout))

    def one(self, target: str, path: str = "/", **kw: Any) -> Answer:
        return self.http(target, path, **kw)[0]

    def converge(self, ok: Callable[[Answer], bool], what: str, target: str, path: str = "/",
                 *, samples: int = 1, timeout: float = CONVERGE_TIMEOUT, **kw: Any) -> list[Answer]:
        """Poll until ``samples`` consecutive answers all satisfy ``ok``; return them.

        On timeout: AssertionError with what was expected, the last answers and the target's
        route configuration as Envoy has it.
        """
        deadline = time.monotonic() + timeout
        last: list[Answer] = []
        while True:
            last = self.http(target, path, count=samples, timeout=3.0, **kw)
            if all(ok(a) for a in last):
                return last
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"not converged within {timeout:.0f}s: {what}\n"
                    f"  request: {kw.get('method', 'GET')} {target}:{kw.get('port', HTTP_PORT)}{path}"
                    f" headers={kw.get('headers') or {}} from {kw.get('client', 'gamma/client')}\n"
                    f"  last answers: {summary(last)}\n{self.envoy_evidence(target)}")
            if self.agent.proc is not None and self.agent.proc.poll() is not None:
                raise AssertionError(f"the agent exited while waiting for: {what}")
            time.sleep(0.2)

    # -- gRPC --------------------------------------------------------------------------------
    def grpc_calls(self, target: str, calls: list[dict[str, Any]], *, client: str = "gamma/client",
                   port: int = GRPC_PORT) -> list[GrpcAnswer]:
        """Unary calls through a subprocess in the client netns (``calls``: method, metadata,
        count): grpc opens its sockets on threads of its own, so no setns on our threads."""
        args = json.dumps({"target": f"{self.ips[target]}:{port}", "calls": calls})
        netns = self.pods[client].netns_name
        r = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", _GRPC_CLIENT, args],
                           capture_output=True, text=True, timeout=120, env=_grpc_env(), check=False)
        if r.returncode != 0:
            raise AssertionError(f"gRPC client failed ({r.returncode}): {r.stderr[-2000:]}")
        return [GrpcAnswer(**a) for a in json.loads(r.stdout)]

    def grpc_converge(self, ok: Callable[[GrpcAnswer], bool], what: str, target: str,
                      method: str, metadata: dict[str, str] | None = None, *, samples: int = 3,
                      timeout: float = CONVERGE_TIMEOUT) -> list[GrpcAnswer]:
        deadline = time.monotonic() + timeout
        while True:
            last = self.grpc_calls(target, [{"method": method, "metadata": metadata or {},
                                             "count": samples, "timeout": 3}])
            if all(ok(a) for a in last):
                return last
            if time.monotonic() > deadline:
                seen = Counter(a.pod for a in last)
                detail = next((a.details for a in last if not a.ok), "")
                raise AssertionError(
                    f"not converged within {timeout:.0f}s: {what}\n  call: {method} "
                    f"metadata={metadata or {}} to {target}\n  last answers: {dict(seen)} {detail}\n"
                    f"{self.envoy_evidence(target)}")
            time.sleep(0.2)

    # -- Envoy evidence ----------------------------------------------------------------------
    def config_dump(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.node.admin("/config_dump", timeout=10))
        return data

    def cluster_thresholds(self, name: str) -> dict[str, Any]:
        """The circuit-breaker thresholds Envoy holds for cluster ``name`` ({} if none)."""
        dump = json.loads(self.node.admin("/config_dump?resource=dynamic_active_clusters",
                                          timeout=10))
        for c in dump.get("configs", []):
            cluster = c.get("cluster", {})
            if cluster.get("name") == name:
                return dict(cluster.get("circuit_breakers", {}).get("thresholds", [{}])[0])
        return {}

    def envoy_evidence(self, target: str, limit: int = 6000) -> str:
        """The route configurations Envoy holds for ``target`` (HCM inline route_config or
        RDS), or, when there is none, the filter chains matching its ClusterIP."""
        try:
            dump = self.config_dump()
        except OSError as e:
            return f"  (no config_dump: {e})"
        needle = f"|{target}|"
        routes: list[dict[str, Any]] = []
        chains: list[str] = []
        ip = self.ips.get(target, "")

        def walk(node: Any, listener: str) -> None:
            if isinstance(node, dict):
                if "virtual_hosts" in node and needle in json.dumps(node.get("name", "")) + json.dumps(
                        [vh.get("name", "") for vh in node["virtual_hosts"]]):
                    routes.append(_compact_route_config(node, listener))
                if "filter_chain_match" in node and ip and ip in json.dumps(node["filter_chain_match"]):
                    filters = [f.get("name", "?") for f in node.get("filters", [])]
                    chains.append(f"{listener}: chain {node.get('name', '?')} "
                                  f"match={json.dumps(node['filter_chain_match'])} filters={filters}")
                is_listener = isinstance(node.get("name"), str) and "filter_chains" in node
                name = node["name"] if is_listener else listener
                for v in node.values():
                    walk(v, name)
            elif isinstance(node, list):
                for v in node:
                    walk(v, listener)

        walk(dump, "")
        if routes:
            text = json.dumps(routes, indent=1)
            return f"  Envoy route config for {target}:\n{text[:limit]}"
        return (f"  Envoy has no HTTP route config for {target} (|{target}| in no route "
                f"configuration); chains matching {ip}:\n    " + "\n    ".join(chains[:8] or ["none"]))


def _compact_route_config(cfg: dict[str, Any], listener: str) -> dict[str, Any]:
    out: dict[str, Any] = {"listener": listener, "name": cfg.get("name"), "routes": []}
    for vh in cfg.get("virtual_hosts", []):
        for r in vh.get("routes", []):
            action = {k: r[k] for k in ("route", "redirect", "direct_response") if k in r}
            extra = {k: r[k] for k in r if k.endswith("headers_to_add") or k.endswith("to_remove")}
            out["routes"].append({"name": r.get("name"), "match": r.get("match"), **action, **extra})
    return out
