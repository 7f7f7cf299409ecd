"""Golden traffic metrics, counted inside Envoy: requests and connections by source workload
and destination Service, as Envoy stats with tags (the stats access logger), read from
Envoy's admin when ``/metrics`` is scraped or ``aether-agent top`` samples.

Why in Envoy: an access-log entry per request, streamed to the agent and counted in Python,
cost the node ~55 µs of CPU a request (bench.traffic_metrics: 0.8× the requests/s of the
same traffic uncounted); a tagged stat in Envoy costs its worker a few µs a request and the
agent nothing. One stat per request (a histogram whose count is the request counter) with
one tag (``key``: every label joined by ``;``): Envoy's stats logger encodes each tag's
name and value anew for every sample, so six tags cost its worker ~9,800 instructions a
request over no logger, one packed tag ~5,300 (callgrind, Envoy 1.40, 2,000 kept-alive
requests each; a tag-less histogram: ~1,600).

Every tag value comes from what the node controls or bounds: the source is filter state
the pod's capture listener sets (``<ns>/<workload>``, fixed at ADD: a workload, not a pod,
so pod churn does not grow Envoy's stats), the chain and route names are our config, the
status code is three digits, gRPC status a name Envoy maps from the 17 codes, the flags
Envoy's own. The agent still caps what it exports (``GoldenFold``).

Pure: resource builders and the admin's Prometheus text in, plain data out.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.extensions.access_loggers.stats.v3 import stats_pb2

from agent.envoy.traffic import BUCKETS, MAX_SERIES, OTHER, Labels, destination
from agent.identity.svid import parse_spiffe_id

# (namespace, workload, target port) of a pod on this node -> the Service name ("" unknown)
Resolve = Callable[[str, str, int], str]
DESTINATION = "destination"
UNAUTHENTICATED = "unauthenticated"  # as agent.envoy.mesh_traffic says it


def identity_of(uri: str) -> str:
    """``spiffe://td/ns/<ns>/sa/<sa>`` -> ``<ns>/<sa>``; anything else -> "unknown"."""
    parsed = parse_spiffe_id(uri)
    return f"{parsed[1]}/{parsed[2]}" if parsed is not None else "unknown"

STAT_PREFIX = "aether"
# filter state: "<namespace>/<workload>" of the calling pod ("<namespace>/<workload>/<pod>"
# with --traffic-source-pods)
SOURCE_STATE = "aether.source"
SOURCE_FORMAT = f"%FILTER_STATE({SOURCE_STATE}:PLAIN)%"
# one stats namespace, read back with the admin's ``/stats/prometheus?filter=``
STATS_FILTER = rf"^{STAT_PREFIX}\."
# histogram buckets (µs) for the request duration, set in the bootstrap: BUCKETS in seconds
DURATION_BUCKETS_US = tuple(round(b * 1e6) for b in BUCKETS)

# The one tag's value: these fields joined by KEY_SEP, a character none of them holds
# (Kubernetes names, our chain and route names, which use "|", IPs, digits, gRPC status
# names, Envoy's comma-separated flags).
KEY_TAG = "key"
KEY_SEP = ";"
REQUEST_FIELDS = (("src", SOURCE_FORMAT), ("chain", "%FILTER_CHAIN_NAME%"),
                  ("route", "%ROUTE_NAME%"), ("code", "%RESPONSE_CODE%"),
                  ("grpc", "%GRPC_STATUS%"), ("flags", "%RESPONSE_FLAGS%"))
TCP_FIELDS = (("src", SOURCE_FORMAT), ("chain", "%FILTER_CHAIN_NAME%"),
              ("flags", "%RESPONSE_FLAGS%"))
# Requests counted by the destination's proxy (``inbound_stats_log``): the caller's SPIFFE
# ID and ``<ns>/<workload>|<port>`` of the pod it reached; the same outcome fields.
INBOUND_FIELDS = (("caller", ""), ("dst", ""), ("code", "%RESPONSE_CODE%"),
                  ("grpc", "%GRPC_STATUS%"), ("flags", "%RESPONSE_FLAGS%"))
INBOUND_STAT = "inbound_request_duration"

# gRPC status names (%GRPC_STATUS%) → the numbers the metrics label carries
GRPC_CODES = {name: str(i) for i, name in enumerate((
    "OK", "Canceled", "Unknown", "InvalidArgument", "DeadlineExceeded", "NotFound",
    "AlreadyExists", "PermissionDenied", "ResourceExhausted", "FailedPrecondition", "Aborted",
    "OutOfRange", "Unimplemented", "Internal", "Unavailable", "DataLoss", "Unauthenticated"))}


def _stat(name: str, fields: Iterable[tuple[str, str]]) -> stats_pb2.Config.Stat:
    """A stat with one tag, ``key``, whose value is ``fields``' formats joined."""
    value = KEY_SEP.join(fmt for _, fmt in fields)
    return stats_pb2.Config.Stat(name=name, tags=[stats_pb2.Config.Tag(name=KEY_TAG,
                                                                       value_format=value)])


def _logger(cfg: stats_pb2.Config) -> accesslog_pb2.AccessLog:
    log = accesslog_pb2.AccessLog(name="envoy.access_loggers.stats")
    log.typed_config.Pack(cfg)
    return log


_HTTP_LOG: accesslog_pb2.AccessLog | None = None
_TCP_LOG: accesslog_pb2.AccessLog | None = None


def http_stats_log() -> accesslog_pb2.AccessLog:
    """An HTTP chain's logger: one duration histogram by (source, chain, route, status, gRPC
    status, flags). Its count is the request counter: one stat, not a counter and a
    histogram, as each costs Envoy's worker per request. Built once, shared."""
    global _HTTP_LOG
    if _HTTP_LOG is None:
        _HTTP_LOG = _logger(stats_pb2.Config(
            stat_prefix=STAT_PREFIX,
            histograms=[stats_pb2.Config.Histogram(
                stat=_stat("request_duration", REQUEST_FIELDS),
                unit=stats_pb2.Config.Histogram.Microseconds,
                value_format="%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%")]))
    return _HTTP_LOG


_INBOUND_LOGS: dict[tuple[str, str], accesslog_pb2.AccessLog] = {}


def inbound_stats_log(caller_fmt: str, dst_fmt: str) -> accesslog_pb2.AccessLog:
    """The logger of the destination's detection HCM (``mtls.build_inbound_detect_listener``):
    requests the caller's proxy relayed as bytes (an undeclared port) are counted once, here,
    by (caller SPIFFE ID, destination workload and port, status, gRPC status, flags). Every
    request the caller's proxy parsed crosses on aether-mesh-http instead, never this HCM,
    so no request is counted at both ends."""
    key = (caller_fmt, dst_fmt)
    if key not in _INBOUND_LOGS:
        fields = (("caller", caller_fmt), ("dst", dst_fmt), *INBOUND_FIELDS[2:])
        _INBOUND_LOGS[key] = _logger(stats_pb2.Config(
            stat_prefix=STAT_PREFIX,
            histograms=[stats_pb2.Config.Histogram(
                stat=_stat(INBOUND_STAT, fields),
                unit=stats_pb2.Config.Histogram.Microseconds,
                value_format="%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%")]))
    return _INBOUND_LOGS[key]


def tcp_stats_log() -> accesslog_pb2.AccessLog:
    """An L4 Service chain's logger: connections (counted when they close) by (source,
    chain, flags). One stat: bytes per source would be two more tagged stats a connection
    (~20 µs of Envoy's worker with three tags each, measured); bytes are counted per destination Service from
    its cluster's own counters instead (agent.envoy.envoy_stats)."""
    global _TCP_LOG
    if _TCP_LOG is None:
        _TCP_LOG = _logger(stats_pb2.Config(
            stat_prefix=STAT_PREFIX,
            counters=[stats_pb2.Config.Counter(stat=_stat("tcp_connections", TCP_FIELDS),
                                               value_fixed={"value": 1})]))
    return _TCP_LOG


def bootstrap_stats_config() -> dict[str, object]:
    """The bootstrap's ``stats_config``: the request-duration histogram's buckets, and no
    default tag extraction. Envoy runs its ~30 default tag regexes over every stat name it
    creates; at 10k Services that was a third of adding their clusters (4.6 -> 2.9 s for
    10k clusters on this machine, measured with a bare Envoy). Nothing reads those tags:
    the agent reads built-in stats by name (``/stats``) and its own ``aether.*`` stats,
    whose tags the stats access loggers set explicitly (``_stat``), from Prometheus."""
    return {"use_all_default_tags": False,
            "histogram_bucket_settings": [{
                "match": {"prefix": f"{STAT_PREFIX}.{name}"},
                "buckets": list(DURATION_BUCKETS_US)}
                for name in ("request_duration", INBOUND_STAT)]}


# ---- reading Envoy's stats back ---------------------------------------------------------

_LINE = re.compile(r"^envoy_aether_(\w+)\{(.*)\} (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _value(v: str) -> str:
    return "" if v == "-" else v.replace('\\"', '"').replace("\\\\", "\\")


def _fields(labels: dict[str, str], n: int) -> tuple[str, ...] | None:
    """The ``key`` tag split back into its ``n`` fields ("-", Envoy's no-value, as "")."""
    parts = labels.get(KEY_TAG, "").split(KEY_SEP)
    return tuple(_value(v) for v in parts) if len(parts) == n else None


@dataclass
class Series:
    """Envoy's golden stats, by their tags (cumulative since Envoy started; histograms as
    of Envoy's last stats flush, every 5 s)."""

    # (src, chain, route, code, grpc, flags) -> (cumulative counts by bucket bound in µs
    # and "+Inf", sum in µs); the "+Inf" count is the number of requests
    requests: dict[tuple[str, ...], tuple[dict[str, float], float]] = field(default_factory=dict)
    tcp: dict[tuple[str, ...], float] = field(default_factory=dict)  # connections
    # (caller, dst, code, grpc, flags) -> as ``requests``: counted by the destination
    inbound: dict[tuple[str, ...], tuple[dict[str, float], float]] = field(default_factory=dict)


def parse_prometheus(text: str) -> Series:
    """The admin's ``/stats/prometheus?filter=^aether\\.`` → ``Series``."""
    out = Series()
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        name, labels, raw = m.group(1), dict(_LABEL.findall(m.group(2))), m.group(3)
        try:
            value = float(raw)
        except ValueError:
            continue
        stat, _, part = name.rpartition("_")
        if stat in ("request_duration", INBOUND_STAT) and part in ("bucket", "sum"):
            into, n = ((out.requests, len(REQUEST_FIELDS)) if stat == "request_duration"
                       else (out.inbound, len(INBOUND_FIELDS)))
            key = _fields(labels, n)
            if key is None:
                continue
            buckets, total = into.get(key, ({}, 0.0))
            if part == "bucket":
                buckets[labels.get("le", "")] = value
            else:
                total = value
            into[key] = (buckets, total)
        elif name == "tcp_connections":
            tkey = _fields(labels, len(TCP_FIELDS))
            if tkey is None:
                continue
            out.tcp[tkey] = out.tcp.get(tkey, 0.0) + value
    return out


def _source(src: str) -> tuple[str, str, str]:
    """``<ns>/<workload>[/<pod>]`` → (namespace, workload, pod or "")."""
    ns, _, rest = src.partition("/")
    workload, _, pod = rest.partition("/")
    return (ns, workload, pod) if ns and workload else ("unknown", "unknown", "")


def _interval(cumulative: dict[str, float]) -> list[int]:
    """Envoy's cumulative buckets (µs bounds, "+Inf") → counts per BUCKETS bound and above."""
    bounds = [str(b) for b in DURATION_BUCKETS_US]
    cum = [cumulative.get(b, 0.0) for b in bounds] + [cumulative.get("+Inf", 0.0)]
    return [int(c - (cum[i - 1] if i else 0.0)) for i, c in enumerate(cum)]


_OTHER = Labels(OTHER, OTHER, OTHER, OTHER)


class GoldenFold:
    """The cardinality cap over Envoy's series: the first ``max_series`` label sets seen are
    kept (for the agent's lifetime, so every kept counter stays monotonic); later ones are
    summed under ``other`` labels, and how many reports went there is ``folded``."""

    def __init__(self, max_series: int = MAX_SERIES) -> None:
        self.max_series = max_series
        self._kept: set[Labels] = set()

    def _keep(self, labels: Labels) -> bool:
        if labels in self._kept:
            return True
        if len(self._kept) < self.max_series:
            self._kept.add(labels)
            return True
        return False

    def snapshot(self, series: Series, resolve: Resolve | None = None) -> dict[str, object]:
        """Plain data for ``/metrics``, ``status`` and ``aether-agent top``: requests and
        connections by labels, request durations by (source, destination) pair.
        ``resolve`` names the Service of a destination-counted request: (namespace,
        workload, target port) -> Service name, "" when this node does not know it."""
        folded = 0.0
        requests: dict[Labels, float] = {}
        durations: dict[tuple[str, ...], tuple[list[int], float]] = {}

        def count(labels: Labels, pair: tuple[str, ...], cum: dict[str, float],
                  total_us: float) -> None:
            nonlocal folded
            n = cum.get("+Inf", 0.0)
            if not self._keep(labels):
                labels, folded = replace(_OTHER, reporter=labels.reporter), folded + n
                pair = (OTHER, OTHER, OTHER, OTHER, "", labels.reporter)
            requests[labels] = requests.get(labels, 0.0) + n
            counts = _interval(cum)
            old, old_total = durations.get(pair, ([0] * len(counts), 0.0))
            durations[pair] = ([a + b for a, b in zip(old, counts, strict=True)],
                               old_total + total_us / 1e6)

        for (src, chain, route, code, grpc, flags), (cum, total_us) in sorted(
                series.requests.items()):
            ns, workload, pod = _source(src)
            dst_ns, dst = destination(chain)
            labels = Labels(ns, workload, dst_ns, dst, route=route,
                            code="" if code in ("0", "") else code,
                            grpc_status=GRPC_CODES.get(grpc, grpc), flags=flags, src_pod=pod)
            count(labels, (ns, workload, dst_ns, dst, pod, labels.reporter), cum, total_us)
        for (caller, dst_key, code, grpc, flags), (cum, total_us) in sorted(
                series.inbound.items()):
            identity = identity_of(caller) if caller else UNAUTHENTICATED
            src_ns = identity.partition("/")[0] if caller else ""
            dst_ns, dst_workload, port = _destination_key(dst_key)
            service = resolve(dst_ns, dst_workload, port) if resolve is not None else ""
            labels = Labels(src_ns, "", dst_ns, service, route="",
                            code="" if code in ("0", "") else code,
                            grpc_status=GRPC_CODES.get(grpc, grpc), flags=flags,
                            reporter=DESTINATION, src_identity=identity,
                            dst_workload=dst_workload)
            count(labels, (src_ns, "", dst_ns, service, "", DESTINATION), cum, total_us)
        tcp: dict[Labels, float] = {}
        for (src, chain, flags), conns in sorted(series.tcp.items()):
            ns, workload, pod = _source(src)
            dst_ns, dst = destination(chain)
            labels = Labels(ns, workload, dst_ns, dst, flags=flags, src_pod=pod)
            if not self._keep(labels):
                labels, folded = _OTHER, folded + conns
            tcp[labels] = tcp.get(labels, 0.0) + conns
        pair_keys = ("src_namespace", "src_workload", "dst_namespace", "dst_service", "src_pod",
                     "reporter")
        return {
            "requests": [{**_public(lab), "count": int(n)} for lab, n in requests.items()],
            "durations": [{**dict(zip(pair_keys, pair, strict=True)), "buckets": b,
                           "sum_s": round(total, 6)} for pair, (b, total) in durations.items()],
            "tcp": [{**_public(lab, tcp_only=True), "connections": int(n)}
                    for lab, n in tcp.items()],
            "buckets": list(BUCKETS), "max_series": self.max_series, "folded": int(folded)}


def _destination_key(key: str) -> tuple[str, str, int]:
    """``<ns>/<workload>|<port>`` (``mtls.DESTINATION_STATE``) -> (ns, workload, port);
    what does not parse -> ("", "unknown", 0)."""
    who, _, port = key.rpartition("|")
    ns, _, workload = who.partition("/")
    if not ns or not workload or not port.isdigit():
        return "", "unknown", 0
    return ns, workload, int(port)


def _public(lab: Labels, tcp_only: bool = False) -> dict[str, str]:
    out = {"src_namespace": lab.src_namespace, "src_workload": lab.src_workload,
           "dst_namespace": lab.dst_namespace, "dst_service": lab.dst_service,
           "flags": lab.flags, "src_pod": lab.src_pod, "reporter": lab.reporter}
    if not tcp_only:
        out.update(route=lab.route, code=lab.code, grpc_status=lab.grpc_status,
                   src_identity=lab.src_identity, dst_workload=lab.dst_workload)
    return out


def service_resolver(views: Iterable[Any], pods: Iterable[Any]) -> Resolve:
    """``Resolve`` over what this node holds: the Services (``ServiceView``) whose endpoints
    are its pods (``PodListener``: addresses, namespace, workload). A workload port that
    backs no Service here, or several, resolves to "" (not a guess)."""
    workload_of: dict[str, tuple[str, str]] = {}
    for p in pods:
        for ip in p.ips:
            workload_of[ip] = (p.namespace or "default", p.workload or p.uid)
    found: dict[tuple[str, str, int], set[str]] = {}
    if workload_of:
        for v in views:
            for eps in v.endpoints.values():
                for ep in eps:
                    who = workload_of.get(ep.ip)
                    if who is not None and who[0] == v.namespace:
                        found.setdefault((*who, ep.port), set()).add(v.name)

    def resolve(namespace: str, workload: str, port: int) -> str:
        names = found.get((namespace, workload, port), set())
        return next(iter(names)) if len(names) == 1 else ""
    return resolve
