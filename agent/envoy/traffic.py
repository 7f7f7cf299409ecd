"""The vocabulary of the golden traffic metrics (labels, destinations, buckets, quantiles)
and the access-log records of ``--access-log``.

The counting itself happens in Envoy (``agent.envoy.golden``); what reaches the agent on
the access-log stream (``agent.envoy.als``) only when ``--access-log`` asks for it:

* a TCP connection closed on a Service or passthrough chain (``aether-traffic``): the
  source pod (its capture listener), the upstream cluster, bytes and response flags;
* an HTTP request finished on an HTTP chain (``aether-requests``): the same, plus the
  route, the status code, the gRPC status and the duration.

Pure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

MAX_SERIES = 1000  # label sets the golden metrics export per node (agent.envoy.golden)
OTHER = "other"
# Request duration histogram buckets (seconds), Prometheus style (le, cumulative on export).
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class Source:
    """Who called: the pod's namespace, its workload (the owner, not the pod) and pod."""

    namespace: str
    workload: str
    pod: str = ""


UNKNOWN_SOURCE = Source("unknown", "unknown")


@dataclass(frozen=True)
class Report:
    """One access-log entry, reduced to what the metrics need."""

    listener: str  # the capture listener of the calling pod (capture-<cid>)
    cluster: str  # svc|<ns>|<name>|<port>, passthrough, …
    http: bool = False
    code: int = 0  # HTTP status (0: none, e.g. a reset before any response)
    grpc_status: str = ""
    route: str = ""
    flags: str = ""  # Envoy response flags, e.g. "UF,URX"; "" none
    duration_s: float = 0.0
    received: int = 0
    sent: int = 0
    chain: str = ""  # the filter chain that carried it (HTTP chains end in "|http")
    dst_ip: str = ""  # the original destination
    dst_port: int = 0
    endpoint: str = ""  # the upstream host Envoy picked ("ip:port"; "" if none)
    method: str = ""  # HTTP method, "" for a connection
    path: str = ""  # HTTP path, "" for a connection


@dataclass(frozen=True)
class Labels:
    """One series of the golden metrics."""

    src_namespace: str
    src_workload: str
    dst_namespace: str
    dst_service: str
    route: str = ""
    code: str = ""
    grpc_status: str = ""
    flags: str = ""
    # the calling pod, with --traffic-source-pods only ("" otherwise: one series a workload)
    src_pod: str = ""
    # whose proxy counted it: "source" (the caller's: HTTP it parsed, every connection) or
    # "destination" (the callee's: HTTP the caller relayed as bytes, an undeclared port).
    # Each request is counted by exactly one of them.
    reporter: str = "source"
    # the caller's identity (<ns>/<sa> of its SPIFFE ID) and the callee's workload: known to
    # the destination (its src_workload is ""), not to the source
    src_identity: str = ""
    dst_workload: str = ""


def destination(cluster: str) -> tuple[str, str]:
    """(namespace, Service) of a Service cluster name; passthrough and others as-is."""
    parts = cluster.split("|")
    if len(parts) >= 4 and parts[0] in ("svc", "pod"):  # svc|ns|name|port[|http], pod|ns|svc|ip|port
        return parts[1], parts[2]
    return "", cluster or "unknown"


def code_class(code: int) -> str:
    return f"{code // 100}xx" if code else "none"


def access_record(r: Report, src: Source) -> dict[str, object]:
    """One access-log record (``aether-agent run --access-log``): who called what, where it
    went, and how it ended; plain JSON-ready data."""
    dst_ns, dst = destination(r.chain if r.http and r.chain.startswith("svc|") else r.cluster)
    rec: dict[str, object] = {
        "kind": "request" if r.http else "connection",
        "listener": r.listener,
        "src_namespace": src.namespace, "src_workload": src.workload, "src_pod": src.pod,
        "dst": f"[{r.dst_ip}]:{r.dst_port}" if ":" in r.dst_ip else f"{r.dst_ip}:{r.dst_port}",
        "dst_namespace": dst_ns, "dst_service": dst if dst_ns else "",
        "cluster": r.cluster, "endpoint": r.endpoint, "flags": r.flags,
        "duration_ms": round(r.duration_s * 1000, 3),
        "bytes_received": r.received, "bytes_sent": r.sent,
    }
    if r.http:
        rec.update(method=r.method, path=r.path, route=r.route, code=r.code,
                   grpc_status=r.grpc_status)
    return rec


class AccessRecorder:
    """``aether-agent run --access-log``: every connection and request Envoy reports on the
    access-log stream becomes one ``access_record``, its caller resolved from the capture
    listener (``resolve``), handed to ``emit`` (the ``agent.access`` logger)."""

    def __init__(self, emit: Callable[[dict[str, object]], None],
                 resolve: Callable[[str], Source | None] | None = None) -> None:
        self.emit = emit
        self.resolve = resolve  # capture listener name → Source

    def add(self, r: Report) -> None:
        src = self.resolve(r.listener) if self.resolve is not None and r.listener else None
        self.emit(access_record(r, src or UNKNOWN_SOURCE))


def quantile(buckets: list[int], q: float) -> float | None:
    """The q-quantile of a bucketed histogram (upper bound of its bucket; None if empty)."""
    total = sum(buckets)
    if total == 0:
        return None
    want = q * total
    seen = 0
    for i, n in enumerate(buckets):
        seen += n
        if seen >= want:
            return BUCKETS[i] if i < len(BUCKETS) else float("inf")
    return float("inf")
