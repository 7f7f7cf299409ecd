"""Golden traffic metrics: requests and connections by source workload and destination
Service, folded from what Envoy already reports on the access-log stream (no extra hop).

Two kinds of reports arrive (``agent.envoy.als``):

* a TCP connection closed on a Service chain (``aether-traffic``): the source pod (its
  capture listener), the upstream cluster (a Service port), bytes and response flags;
* an HTTP request finished on an HTTP chain (``aether-requests``): the same, plus the
  route, the status code, the gRPC status and the duration.

Pure and thread-safe. Cardinality is capped: past ``max_series`` distinct label sets, new
ones are counted under ``other`` labels and the fold itself is counted.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_SERIES = 1000
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
    src_namespace: str
    src_workload: str
    dst_namespace: str
    dst_service: str
    src_pod: str = ""  # for `aether-agent top --pod`; /metrics sums it away
    route: str = ""
    code: str = ""
    grpc_status: str = ""
    flags: str = ""


@dataclass
class _Requests:
    count: int = 0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total_s: float = 0.0


@dataclass
class _Connections:
    opened: int = 0  # reported when closed; "active" comes from Envoy's own gauge
    received: int = 0
    sent: int = 0


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


_OTHER_LABELS = Labels(OTHER, OTHER, OTHER, OTHER)

# What identifies a report before its source is resolved, as plain tuples the access-log
# handler builds without a Report per entry (the per-request path: agent.envoy.als).
# request: (listener, chain, cluster, route, code, grpc_status, flags)
RequestKey = tuple[str, str, str, str, int, str, str]
# connection: (listener, chain, cluster, flags)
ConnectionKey = tuple[str, str, str, str]


class TrafficTally:
    """Request and connection counters by labels, at most ``max_series`` label sets.

    A report's raw key is resolved to its labels (source pod and workload, destination
    Service) the first time it is seen; after that a report costs one dict lookup.
    ``access_log``, when set, receives every report as an ``access_record`` (passthrough
    connections included, which the counters leave to Envoy's own stats)."""

    def __init__(self, max_series: int = MAX_SERIES,
                 resolve: Callable[[str], Source | None] | None = None,
                 access_log: Callable[[dict[str, object]], None] | None = None) -> None:
        self.max_series = max_series
        self.resolve = resolve  # capture listener name → Source
        self.access_log = access_log
        self._lock = threading.Lock()
        self._requests: dict[Labels, _Requests] = {}
        self._tcp: dict[Labels, _Connections] = {}
        # raw key → (its counters, whether they are the folded 'other' set)
        self._req_slots: dict[RequestKey, tuple[_Requests, bool]] = {}
        self._tcp_slots: dict[ConnectionKey, tuple[_Connections | None, bool]] = {}
        self.folded = 0

    def _source(self, listener: str) -> Source:
        src = self.resolve(listener) if self.resolve is not None and listener else None
        return src or UNKNOWN_SOURCE

    def _fold(self, labels: Labels) -> Labels:
        """A new label set: itself while under the cap, else the ``other`` set."""
        if len(self._requests) + len(self._tcp) < self.max_series:
            return labels
        return _OTHER_LABELS

    def _request_slot(self, key: RequestKey) -> _Requests:
        """Under the lock: the counters a request key adds to (resolved once)."""
        cached = self._req_slots.get(key)
        if cached is not None:
            self.folded += cached[1]  # folded keys stay folded; every report of one counts
            return cached[0]
        listener, chain, cluster, route, code, grpc, flags = key
        src = self._source(listener)
        # counted against the Service called (its chain), not the backend a route chose
        dst_ns, dst = destination(chain if chain.startswith("svc|") else cluster)
        labels = Labels(src.namespace, src.workload, dst_ns, dst, src.pod, route,
                        str(code or ""), grpc, flags)
        if labels not in self._requests:
            labels = self._fold(labels)
        folded = labels is _OTHER_LABELS
        self.folded += folded
        slot = self._requests.setdefault(labels, _Requests())
        if len(self._req_slots) < 4 * self.max_series:  # keys beyond are resolved each time
            self._req_slots[key] = (slot, folded)
        return slot

    def _connection_slot(self, key: ConnectionKey) -> _Connections | None:
        cached = self._tcp_slots.get(key)
        if cached is not None:
            self.folded += cached[1]
            return cached[0]
        listener, chain, cluster, flags = key
        conn: _Connections | None = None
        folded = False
        # an HTTP chain's connection: its requests are counted one by one; and only Service
        # chains are counted (passthrough is Envoy's own stats)
        if not chain.endswith("|http") and cluster.startswith(("svc|", "pod|")):
            src = self._source(listener)
            dst_ns, dst = destination(cluster)
            labels = Labels(src.namespace, src.workload, dst_ns, dst, src.pod, flags=flags)
            if labels not in self._tcp:
                labels = self._fold(labels)
            folded = labels is _OTHER_LABELS
            self.folded += folded
            conn = self._tcp.setdefault(labels, _Connections())
        if len(self._tcp_slots) < 4 * self.max_series:
            self._tcp_slots[key] = (conn, folded)
        return conn

    def add_requests(self, batch: list[tuple[RequestKey, float]]) -> None:
        """Requests of one access-log message: (key, duration in seconds) each."""
        with self._lock:
            for key, duration_s in batch:
                req = self._request_slot(key)
                req.count += 1
                req.buckets[bisect.bisect_left(BUCKETS, duration_s)] += 1
                req.total_s += max(0.0, duration_s)

    def add_connections(self, batch: list[tuple[ConnectionKey, int, int]]) -> None:
        """Connections of one access-log message: (key, bytes received, bytes sent) each."""
        with self._lock:
            for key, received, sent in batch:
                conn = self._connection_slot(key)
                if conn is not None:
                    conn.opened += 1
                    conn.received += max(0, received)
                    conn.sent += max(0, sent)

    def add(self, r: Report) -> None:
        """One report (the access-log path, and tests): counted as the batches are."""
        if self.access_log is not None:
            self.access_log(access_record(r, self._source(r.listener)))
        if r.http:
            self.add_requests([((r.listener, r.chain, r.cluster, r.route, r.code,
                                 r.grpc_status, r.flags), r.duration_s)])
        else:
            self.add_connections([((r.listener, r.chain, r.cluster, r.flags),
                                   r.received, r.sent)])

    def snapshot(self) -> dict[str, object]:
        """Plain data for ``/metrics``, ``status --json`` and ``aether-agent top``."""
        with self._lock:
            requests = [{**lab.__dict__, "count": v.count, "buckets": list(v.buckets),
                         "sum_s": round(v.total_s, 6)} for lab, v in self._requests.items()]
            tcp = [{**lab.__dict__, "connections": v.opened, "received_bytes": v.received,
                    "sent_bytes": v.sent} for lab, v in self._tcp.items()]
            return {"requests": requests, "tcp": tcp,
                    "buckets": list(BUCKETS), "max_series": self.max_series,
                    "folded": self.folded}


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
