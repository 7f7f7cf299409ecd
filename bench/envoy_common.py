"""Pieces of the Envoy benchmarks: a static HTTP server (a separate Envoy), wrk, versions.

The upstream server is a second Envoy process, independent of the node Envoy the agent
supervises: a static listener whose only route is a `direct_response` with a fixed body. It is
fast, needs nothing beyond what the agent already depends on, and does the same work for the
captured and the direct client, so their difference is the capture path alone.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.envoy.supervisor import admin_request, find_envoy_binary
from integration.conftest import free_port


def envoy_version() -> str:
    try:
        out = subprocess.run([find_envoy_binary(), "--version"], capture_output=True, text=True,
                             timeout=30, check=False)
    except Exception:  # noqa: BLE001 - informational only
        return "unknown"
    m = re.search(r"version: [0-9a-f]+/(\d+\.\d+\.\d+)/", out.stdout + out.stderr)
    return m.group(1) if m else "unknown"


def grpc_message(payload_bytes: int) -> str:
    """A gRPC length-prefixed message (uncompressed flag, 4-byte big-endian length) whose
    payload is ``payload_bytes`` of filler: what a unary answer's DATA frame carries. Envoy
    takes the body as UTF-8 text, so each length byte must be ASCII (1024 is)."""
    if any(b >= 0x80 for b in payload_bytes.to_bytes(4, "big")):
        raise ValueError(f"a {payload_bytes}-byte payload's length prefix is not ASCII")
    return "\0" + payload_bytes.to_bytes(4, "big").decode("latin-1") + "x" * payload_bytes


GRPC_ANSWER_HEADERS = {"content-type": "application/grpc", "grpc-status": "0"}


def _server_bootstrap(port: int, admin: str, body_bytes: int, codec: str = "HTTP1",
                      grpc: bool = False) -> dict[str, Any]:
    """``grpc``: answer as a unary gRPC method does (a trailers-only status is not used:
    the status rides in the headers, which gRPC clients and h2load accept)."""
    answer: dict[str, Any] = {"match": {"prefix": "/"}, "direct_response": {
        "status": 200,
        "body": {"inline_string": grpc_message(body_bytes) if grpc else "x" * body_bytes}}}
    if grpc:
        answer["response_headers_to_add"] = [
            {"header": {"key": k, "value": v}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
            for k, v in GRPC_ANSWER_HEADERS.items()]
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager"
                 ".v3.HttpConnectionManager",
        "stat_prefix": "bench_server",
        "codec_type": codec,
        "route_config": {"virtual_hosts": [{
            "name": "all", "domains": ["*"],
            "routes": [answer],
        }]},
        "http_filters": [{
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router"
                                      ".v3.Router"},
        }],
    }
    return {
        "admin": {"address": {"pipe": {"path": admin, "mode": 0o600}}},
        "static_resources": {"listeners": [{
            "name": "bench_server",
            "address": {"socket_address": {"address": "0.0.0.0", "port_value": port}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                            "typed_config": hcm}]}],
        }]},
    }


class ServerEnvoy:
    """`envoy` with a static direct_response listener on 0.0.0.0:<port> in the host netns."""

    def __init__(self, workdir: str, body_bytes: int = 1024, workers: int = 1,
                 port: int | None = None, netns_name: str | None = None,
                 codec: str = "HTTP1", name: str = "server-envoy", grpc: bool = False,
                 bootstrap: Callable[[str], dict[str, Any]] | None = None) -> None:
        self.port = port or free_port()
        # inside a pod's netns instead of the host's (a mesh pod's server)
        self.prefix = ["ip", "netns", "exec", netns_name] if netns_name else []
        self.admin = os.path.join(workdir, f"{name}-admin.sock")
        self.body_bytes = body_bytes
        self.workers = workers
        self.codec = codec  # "AUTO" also serves h2c prior knowledge
        self.grpc = grpc
        # another Envoy than the static server (the sidecar): its bootstrap, given the
        # admin socket path
        self.bootstrap = bootstrap
        self.config = os.path.join(workdir, f"{name}.json")
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> ServerEnvoy:
        with open(self.config, "w") as f:
            json.dump(self.bootstrap(self.admin) if self.bootstrap else _server_bootstrap(
                self.port, self.admin, self.body_bytes, self.codec, self.grpc), f)
        log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [*self.prefix, find_envoy_binary(), "-c", self.config, "--concurrency", str(self.workers),
             "--use-dynamic-base-id", "-l", "warning"], stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server envoy exited {self.proc.returncode}: {self.logs()}")
            try:
                if admin_request(self.admin, "GET", "/ready", timeout=1)[1].strip() == "LIVE":
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server envoy not ready after {timeout:.0f}s: {self.logs()}")

    def stat(self, name: str) -> int:
        """One counter of this Envoy's (0 when it has none by that name)."""
        return counter(admin_request(self.admin, "GET", stats_path(name), timeout=5)[1], name)

    def requests(self) -> int:
        """Requests this server has answered (its HCM's counter)."""
        body = admin_request(self.admin, "GET", "/stats?filter=^http.bench_server.downstream_rq_total$")[1]
        m = re.search(r"downstream_rq_total: (\d+)", body)
        return int(m.group(1)) if m else 0

    def logs(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        terminate(self.proc)


def stats_path(name: str) -> str:
    """The admin path that asks for exactly one stat."""
    return "/stats?filter=" + urllib.parse.quote(f"^{name}$")


def counter(stats_text: str, name: str) -> int:
    """``name``'s value in an admin ``/stats`` answer (0 when absent)."""
    for line in stats_text.splitlines():
        key, _, value = line.partition(": ")
        if key == name:
            return int(value)
    return 0


def terminate(proc: subprocess.Popen[bytes] | None, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; nothing if it is gone already."""
    if proc and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


_UNITS_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text.strip())
    if not m:
        raise ValueError(f"cannot parse wrk latency {text!r}")
    return float(m.group(1)) * _UNITS_MS[m.group(2)]


@dataclass(frozen=True)
class WrkResult:
    requests: int
    rps: float
    p50_ms: float
    p75_ms: float
    p90_ms: float
    p99_ms: float
    socket_errors: int
    non_2xx: int
    raw: str

    @classmethod
    def parse(cls, out: str) -> WrkResult:
        pct: dict[str, float] = {}
        for m in re.finditer(r"^\s+(50|75|90|99)%\s+(\S+)\s*$", out, re.M):
            pct[m.group(1)] = _ms(m.group(2))
        rps = re.search(r"^Requests/sec:\s+([\d.]+)", out, re.M)
        reqs = re.search(r"^\s+(\d+) requests in", out, re.M)
        if rps is None or reqs is None or len(pct) != 4:
            raise ValueError(f"unexpected wrk output:\n{out}")
        errs = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)",
                         out)
        non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
        return cls(int(reqs.group(1)), float(rps.group(1)), pct["50"], pct["75"], pct["90"],
                   pct["99"], sum(int(g) for g in errs.groups()) if errs else 0,
                   int(non2xx.group(1)) if non2xx else 0, out)

    def to_json(self) -> dict[str, Any]:
        return {"requests": self.requests, "rps": round(self.rps, 1),
                "p50_ms": round(self.p50_ms, 3), "p75_ms": round(self.p75_ms, 3),
                "p90_ms": round(self.p90_ms, 3), "p99_ms": round(self.p99_ms, 3),
                "socket_errors": self.socket_errors, "non_2xx": self.non_2xx}


def run_wrk(netns_name: str, url: str, duration: float, threads: int = 2,
            connections: int = 32, new_connection: bool = False) -> WrkResult:
    """wrk from inside a pod netns (`ip netns exec`), as a workload in that pod would run.
    ``new_connection``: `Connection: close` on every request, so each one sets up (and
    captures, and proxies from the pod's netns) a fresh TCP connection."""
    argv = ["ip", "netns", "exec", netns_name, "wrk", f"-t{threads}", f"-c{connections}",
            f"-d{max(1, round(duration))}s", "--latency",
            *(["-H", "Connection: close"] if new_connection else []), url]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 60, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stderr.strip()}\n{out.stdout}")
    return WrkResult.parse(out.stdout)
