"""Prometheus metrics and the probe endpoints (`/metrics`, `/healthz`, `/readyz`).

Each `Metrics` owns its own `CollectorRegistry` rather than the process-global one, so tests
(and a process embedding several agents) can make as many as they like without "duplicated
timeseries" errors. Values that other components already count (Envoy restarts, xDS ACKs,
the dependency set) are not copied into counters: a collector calls the callables given to
`set_sources()` at scrape time, so the numbers come live from their owner and cannot drift.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.common.bounded import BoundedThreadingMixIn

log = logging.getLogger("aether.metrics")

CNI_COMMANDS = ("ADD", "DEL", "CHECK")
CNI_OUTCOMES = ("ok", "failed", "skipped")
#: Any other command string (a malformed request) is counted under this label, so a
#: misbehaving caller cannot blow up the label cardinality.
CNI_INVALID = "invalid"

# ADD waits for Envoy's ACK (default timeout 10 s): buckets reach past it.
CNI_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
XDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class LiveSpec:
    """A metric whose value is read from a callable at scrape time."""

    name: str  # exposition name (counters without the `_total` suffix, which is added)
    kind: str  # "gauge" or "counter"
    help: str


#: `set_sources()` keyword → metric. The keyword is what owners wire; the name is the contract.
LIVE: dict[str, LiveSpec] = {
    "pods_captured": LiveSpec("aether_pods_captured", "gauge",
                              "Pods whose capture rules and listener this agent holds."),
    "envoy_restarts": LiveSpec("aether_envoy_restarts", "counter",
                               "Times the supervisor restarted the node Envoy."),
    "envoy_ready": LiveSpec("aether_envoy_ready", "gauge",
                            "1 when Envoy's admin /ready answers LIVE, else 0."),
    "xds_pushes": LiveSpec("aether_xds_pushes", "counter", "xDS responses sent to Envoy."),
    "xds_acks": LiveSpec("aether_xds_acks", "counter", "xDS responses Envoy ACKed."),
    "xds_nacks": LiveSpec("aether_xds_nacks", "counter", "xDS responses Envoy rejected (NACK)."),
    "dependency_set_size": LiveSpec("aether_dependency_set_size", "gauge",
                                    "Services in this node's dependency set (its xDS scope)."),
    "annotation_errors": LiveSpec("aether_annotation_errors", "counter",
                                  "Malformed capture annotation entries seen on ADD."),
    "cni_repairs": LiveSpec("aether_cni_repairs", "counter",
                            "Times the CNI entry or plugin binary was put back after removal."),
}


class _LiveCollector(Collector):
    """Reads the registered callables on every scrape; a failing one is skipped, not fatal."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # values are dynamic: skip the registry's collect-at-register probe

    def collect(self) -> Iterator[Metric]:
        for key, read in self._metrics.sources().items():
            spec = LIVE[key]
            try:
                value = float(read())
            except Exception as e:  # noqa: BLE001 - one broken source must not fail the scrape
                log.debug("metrics source %s failed: %s", key, e)
                continue
            if spec.kind == "counter":
                yield CounterMetricFamily(spec.name, spec.help, value=value)
            else:
                yield GaugeMetricFamily(spec.name, spec.help, value=value)


class _IdentityCollector(Collector):
    """Per identity: seconds until its SVID expires (negative: none held, failing closed)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        read = self._metrics.identity_source
        if read is None:
            return
        try:
            st = read()
        except Exception as e:  # noqa: BLE001 - never fail the scrape
            log.debug("identity metrics failed: %s", e)
            return
        expiry = GaugeMetricFamily(
            "aether_svid_expiry_seconds",
            "Seconds until the SVID of a ServiceAccount with pods on this node expires "
            "(-1: none held; its pods' mesh connections fail closed).", labels=["identity"])
        for r in st.get("svids") or []:
            left = r.get("seconds_left")
            expiry.add_metric([r["identity"]], -1.0 if left is None else float(left))
        yield expiry
        yield CounterMetricFamily("aether_svid_rotations", "SVIDs renewed and pushed to Envoy.",
                                  value=float(st.get("rotations") or 0))


class _MeshTrafficCollector(Collector):
    """Mesh connections this node's pods accepted, by their identity and the caller's
    SPIFFE ID (``agent.envoy.mesh_traffic``; capped, the fold counted)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        read = self._metrics.mesh_traffic_source
        if read is None:
            return
        try:
            st = read()
        except Exception as e:  # noqa: BLE001 - never fail the scrape
            log.debug("mesh traffic metrics failed: %s", e)
            return
        labels = ["identity", "caller"]
        conns = CounterMetricFamily(
            "aether_mesh_inbound_connections",
            "Mesh (mTLS) connections accepted by this node's pods, by the pods' identity "
            "(<ns>/<sa>) and the caller's SPIFFE ID ('unauthenticated': no client "
            "certificate; 'other': past the series cap).", labels=labels)
        rx = CounterMetricFamily("aether_mesh_inbound_received_bytes",
                                 "Bytes received from callers on those connections.",
                                 labels=labels)
        tx = CounterMetricFamily("aether_mesh_inbound_sent_bytes",
                                 "Bytes sent to callers on those connections.", labels=labels)
        for r in st.get("inbound") or []:
            key = [r["identity"], r["caller"]]
            conns.add_metric(key, float(r["connections"]))
            rx.add_metric(key, float(r["received_bytes"]))
            tx.add_metric(key, float(r["sent_bytes"]))
        yield conns
        yield rx
        yield tx
        yield CounterMetricFamily(
            "aether_mesh_inbound_folded_connections",
            f"Connections counted under caller='other' because {st.get('max_series')} "
            "(identity, caller) series were already held.", value=float(st.get("folded") or 0))


# src_pod: the calling pod with --traffic-source-pods, "" (no value) otherwise; reporter:
# whose proxy counted it, "source" or "destination" (each request by exactly one)
PAIR_LABELS = ["src_namespace", "src_workload", "dst_namespace", "dst_service", "src_pod",
               "reporter"]
# src_identity, dst_workload: set on what the destination counted (it knows the caller's
# SPIFFE identity and its own workload, not the caller's workload)
REQUEST_LABELS = [*PAIR_LABELS, "route", "code", "code_class", "grpc_status", "response_flags",
                  "src_identity", "dst_workload"]


class _TrafficCollector(Collector):
    """Golden metrics (counted in Envoy, agent.envoy.golden): requests, their durations and
    TCP connections by source workload and destination Service (bytes are per destination
    only: ``_EnvoyTrafficCollector``)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import HistogramMetricFamily

        from agent.envoy.traffic import code_class
        read = self._metrics.traffic_source
        if read is None:
            return
        try:
            snap = read()
        except Exception as e:  # noqa: BLE001 - never fail the scrape
            log.debug("traffic metrics failed: %s", e)
            return
        req: dict[tuple[str, ...], float] = {}
        for r in snap.get("requests") or []:
            pair = tuple(r[k] for k in PAIR_LABELS)
            code = int(r["code"]) if str(r["code"]).isdigit() else 0
            key = (*pair, r["route"], r["code"], code_class(code), r["grpc_status"], r["flags"],
                   r["src_identity"], r["dst_workload"])
            req[key] = req.get(key, 0) + r["count"]
        hist: dict[tuple[str, ...], tuple[list[int], float]] = {}
        for d in snap.get("durations") or []:
            pair = tuple(d[k] for k in PAIR_LABELS)
            b, total = hist.get(pair, ([0] * len(d["buckets"]), 0.0))
            hist[pair] = ([x + y for x, y in zip(b, d["buckets"], strict=True)], total + d["sum_s"])
        fam = CounterMetricFamily("aether_requests", "HTTP/gRPC requests from captured pods, "
                                  "by source workload, destination Service, route and outcome "
                                  "(HTTP status, gRPC status, Envoy response flags); on "
                                  "undeclared ports with mesh identity, counted by the "
                                  "destination (reporter=destination: by the caller's "
                                  "identity and the destination workload).",
                                  labels=REQUEST_LABELS)
        for key, n in sorted(req.items()):
            fam.add_metric(list(key), n)
        yield fam
        bounds = [str(b) for b in snap.get("buckets") or []] + ["+Inf"]
        h = HistogramMetricFamily("aether_request_duration_seconds",
                                  "Request duration as the reporting proxy saw it (first request "
                                  "byte to last response byte; Envoy flushes it every 5 s).",
                                  labels=PAIR_LABELS)
        for pair, (buckets, total) in sorted(hist.items()):
            cum, acc = [], 0
            for bound, n in zip(bounds, buckets, strict=True):
                acc += n
                cum.append((bound, acc))
            h.add_metric(list(pair), cum, total)
        yield h
        tcp: dict[tuple[str, ...], float] = {}
        for r in snap.get("tcp") or []:
            key = (*(r[k] for k in PAIR_LABELS), r["flags"])
            tcp[key] = tcp.get(key, 0.0) + r["connections"]
        f = CounterMetricFamily("aether_tcp_connections", "TCP connections (closed) from "
                                "captured pods to Services, by source workload and destination "
                                "Service.", labels=[*PAIR_LABELS, "response_flags"])
        for key, n in sorted(tcp.items()):
            f.add_metric(list(key), n)
        yield f
        yield CounterMetricFamily(
            "aether_traffic_folded_reports",
            f"Requests and connections counted under 'other' labels because "
            f"{snap.get('max_series')} label sets were already held (the cardinality cap).",
            value=float(snap.get("folded") or 0))


class _EnvoyTrafficCollector(Collector):
    """What Envoy's own stats hold (agent.envoy.envoy_stats): passthrough connections by
    destination class; per destination Service, open connections and bytes each way. Left out of the scrape
    when Envoy's admin does not answer, never reported as 0."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        read = self._metrics.envoy_traffic_source
        if read is None:
            return
        try:
            figures = read()
        except Exception as e:  # noqa: BLE001 - never fail the scrape
            log.debug("envoy traffic stats failed: %s", e)
            return
        total = CounterMetricFamily(
            "aether_passthrough_connections", "Connections from captured pods that no Service "
            "chain took, by destination class: mesh (an in-mesh Service not in this node's "
            "scope yet) or outside (everything else).", labels=["class"])
        active = GaugeMetricFamily("aether_passthrough_active_connections",
                                   "Passthrough connections open now, by destination class.",
                                   labels=["class"])
        for cls, v in sorted(figures["passthrough"].items()):
            total.add_metric([cls], float(v["total"]))
            active.add_metric([cls], float(v["active"]))
        yield total
        yield active
        sent = CounterMetricFamily("aether_service_sent_bytes", "Bytes this node's captured "
                                   "pods sent to each destination Service.",
                                   labels=["dst_namespace", "dst_service"])
        received = CounterMetricFamily("aether_service_received_bytes", "Bytes they received "
                                       "from it.", labels=["dst_namespace", "dst_service"])
        for name, (tx, rx) in sorted((figures.get("bytes") or {}).items()):
            sent.add_metric(name.split("/", 1), float(tx))
            received.add_metric(name.split("/", 1), float(rx))
        yield sent
        yield received
        svc = GaugeMetricFamily("aether_service_active_connections",
                                "Upstream connections open now to each destination Service "
                                "(HTTP/2 streams share one).", labels=["dst_namespace", "dst_service"])
        for name, n in sorted(figures["active"].items()):
            svc.add_metric(name.split("/", 1), float(n))
        yield svc
        authz = CounterMetricFamily(
            "aether_authz_decisions", "AuthorizationPolicy decisions at this node's inbound, "
            "by destination workload: a DENY policy's denials (policy named), the ALLOW "
            "policies' allow/deny (policy *), an AUDIT policy's matches (decision audit).",
            labels=["dst_namespace", "dst_workload", "policy", "action", "decision"])
        for labels, n in sorted((figures.get("authz") or {}).items()):
            authz.add_metric(list(labels), float(n))
        yield authz


class Metrics:
    """The agent's metrics; owners push CNI/xDS timings and register live sources."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.cni_duration = Histogram(
            "aether_cni_request_duration_seconds", "CNI request handling time in the agent.",
            ["command"], buckets=CNI_BUCKETS, registry=self.registry)
        self.cni_requests = Counter(
            "aether_cni_requests", "CNI requests by command and outcome.",
            ["command", "outcome"], registry=self.registry)
        self.xds_push_duration = Histogram(
            "aether_xds_push_duration_seconds", "From publishing an xDS version to Envoy's ACK.",
            buckets=XDS_BUCKETS, registry=self.registry)
        # Pre-create every series so rate() sees 0 before the first request, not "no data".
        for command in CNI_COMMANDS:
            self.cni_duration.labels(command)
            for outcome in CNI_OUTCOMES:
                self.cni_requests.labels(command, outcome)
        self._sources: dict[str, Callable[[], float]] = {}
        self._lock = threading.Lock()
        self.registry.register(_LiveCollector(self))
        # the identity manager's status(), when the agent has an identity provider
        self.identity_source: Callable[[], dict[str, Any]] | None = None
        self.registry.register(_IdentityCollector(self))
        # the xDS server's InboundTally.status(), when the agent runs Envoy
        self.mesh_traffic_source: Callable[[], dict[str, Any]] | None = None
        self.registry.register(_MeshTrafficCollector(self))
        # the sink's golden_traffic() (Envoy's stats, capped), when the agent runs Envoy
        self.traffic_source: Callable[[], dict[str, Any]] | None = None
        self.registry.register(_TrafficCollector(self))
        # the sink's envoy_traffic(), when the agent runs Envoy
        self.envoy_traffic_source: Callable[[], dict[str, Any]] | None = None
        self.registry.register(_EnvoyTrafficCollector(self))

    def observe_cni(self, command: Any, seconds: float, outcome: str) -> None:
        """Record one CNI request; unknown commands are folded into `invalid`."""
        if outcome not in CNI_OUTCOMES:
            raise ValueError(f"CNI outcome must be one of {', '.join(CNI_OUTCOMES)}, not {outcome!r}")
        label = command if command in CNI_COMMANDS else CNI_INVALID
        self.cni_duration.labels(label).observe(max(0.0, seconds))
        self.cni_requests.labels(label, outcome).inc()

    def observe_xds_push(self, seconds: float) -> None:
        self.xds_push_duration.observe(max(0.0, seconds))

    def set_sources(self, **callables: Callable[[], float] | None) -> None:
        """Register (or with None, drop) live value callables; keys are those of `LIVE`."""
        unknown = sorted(set(callables) - set(LIVE))
        if unknown:
            raise ValueError(f"unknown metrics sources: {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(LIVE))})")
        with self._lock:
            for key, fn in callables.items():
                if fn is None:
                    self._sources.pop(key, None)
                else:
                    self._sources[key] = fn

    def sources(self) -> dict[str, Callable[[], float]]:
        with self._lock:
            return dict(self._sources)

    def render(self) -> bytes:
        """The text exposition format, as served on /metrics."""
        return generate_latest(self.registry)


# Probes and scrapes are a handful of connections; an idle one is dropped after the timeout.
METRICS_MAX_CONNECTIONS = 32
METRICS_REQUEST_TIMEOUT_S = 10.0


class _Server(BoundedThreadingMixIn, ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    max_connections = METRICS_MAX_CONNECTIONS
    busy_answer = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 5\r\n"
                   b"Retry-After: 1\r\n\r\nbusy\n")


class MetricsServer:
    """`/metrics`, `/healthz`, `/readyz` on a daemon thread (kubelet probes and Prometheus).

    Readiness is whatever `ready()` says (plugin installed, socket served, Envoy ready); the
    server only maps it to 200 "ready" or 503 with the reason, so probes explain themselves.
    """

    def __init__(self, metrics: Metrics, host: str, port: int, live: Callable[[], bool],
                 ready: Callable[[], tuple[bool, str]]) -> None:
        self.metrics = metrics
        self.live = live
        self.ready = ready
        handler = _handler_class(self)
        server_cls: type[_Server] = _Server
        if ":" in host:  # an IPv6 literal needs an AF_INET6 socket
            server_cls = type("_Server6", (_Server,), {"address_family": socket.AF_INET6})
        self._httpd = server_cls((host, port), handler)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        return int(self._httpd.server_address[1])

    @property
    def host(self) -> str:
        return str(self._httpd.server_address[0])

    def start(self) -> MetricsServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics-http",
                                        daemon=True)
        self._thread.start()
        log.info("metrics and probes on %s:%d", self.host, self.port)
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._httpd.server_close()

    # -- request answers -----------------------------------------------------------------
    def answer(self, path: str) -> tuple[int, str, bytes]:
        """(status, content type, body) for a GET of `path`."""
        text = "text/plain; charset=utf-8"
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, self.metrics.render()
        if path == "/healthz":
            try:
                ok = bool(self.live())
            except Exception as e:  # noqa: BLE001 - a crashing check means not live
                return 503, text, f"liveness check failed: {e}\n".encode()
            return (200, text, b"ok\n") if ok else (503, text, b"not live\n")
        if path == "/readyz":
            try:
                ok, reason = self.ready()
            except Exception as e:  # noqa: BLE001
                return 503, text, f"readiness check failed: {e}\n".encode()
            if ok:
                return 200, text, b"ready\n"
            return 503, text, f"{reason or 'not ready'}\n".encode()
        return 404, text, b"not found: try /metrics, /healthz or /readyz\n"


def _handler_class(server: MetricsServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "aether-agent"
        timeout = METRICS_REQUEST_TIMEOUT_S  # an idle connection does not keep its slot

        def _serve(self, body_too: bool) -> None:
            status, ctype, body = server.answer(self.path.split("?", 1)[0])
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if body_too:
                self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self._serve(True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._serve(False)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            log.debug("metrics http: " + format, *args)  # probes every few seconds: not info

    return Handler
