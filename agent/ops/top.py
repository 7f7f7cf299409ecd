"""`aether-agent top`: per destination Service and per source workload, requests/s, success
rate, p50/p99 latency and connections, from two samples of the agent's traffic counters,
plus Envoy's own figures (connections open per Service, passthrough by destination class).

Pure: snapshots (``GoldenFold.snapshot()`` and Envoy's figures) in, rows and text out; the
CLI samples.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from agent.envoy.traffic import quantile

SORT_KEYS = ("rps", "success", "p99", "name")


@dataclass
class Row:
    name: str  # <ns>/<service> or <ns>/<workload>
    requests: int = 0
    errors: int = 0  # 5xx answers and requests that got no answer at all
    rps: float = 0.0
    connections: int = 0
    cps: float = 0.0  # TCP connections per second
    buckets: list[int] = field(default_factory=list)
    active: int | None = None  # connections open now (Services; from Envoy's stats)

    @property
    def success(self) -> float | None:
        return None if not self.requests else (self.requests - self.errors) / self.requests

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["buckets"]
        out["success"] = self.success
        out["p50_s"] = quantile(self.buckets, 0.5) if self.buckets else None
        out["p99_s"] = quantile(self.buckets, 0.99) if self.buckets else None
        return out


def _keep(r: dict[str, Any], namespace: str | None, workload: str | None) -> bool:
    if namespace and namespace not in (r.get("src_namespace"), r.get("dst_namespace")):
        return False
    return not workload or f"{r.get('src_namespace')}/{r.get('src_workload')}" == workload


def pod_workload(snap: dict[str, Any], pod: str | None) -> str | None:
    """``--pod <ns>/<name>``: the workload it is counted under (requests and connections
    are counted per workload in Envoy, so that pod churn does not grow its stats); the pod
    itself when it is not captured here."""
    if not pod:
        return None
    return str((snap.get("pods") or {}).get(pod) or pod)


def _rows(snap: dict[str, Any], by: str, namespace: str | None, pod: str | None
          ) -> dict[str, Row]:
    def name(r: dict[str, Any]) -> str:
        # what a destination counted names its workload where this node does not hold the
        # Service, and the caller by its identity (it does not know the caller's workload)
        if by == "service":
            return f"{r['dst_namespace']}/{r['dst_service'] or r.get('dst_workload') or '?'}"
        if r["src_workload"] or not r.get("src_identity"):
            return f"{r['src_namespace']}/{r['src_workload']}"
        return f"sa:{r['src_identity']}"

    workload = pod_workload(snap, pod)
    out: dict[str, Row] = {}
    for r in snap.get("requests") or []:
        if not _keep(r, namespace, workload):
            continue
        row = out.setdefault(name(r), Row(name(r)))
        row.requests += r["count"]
        code = int(r["code"]) if str(r["code"]).isdigit() else 0
        if code >= 500 or code == 0:
            row.errors += r["count"]
    for d in snap.get("durations") or []:
        if _keep(d, namespace, workload):
            row = out.setdefault(name(d), Row(name(d)))
            row.buckets = ([a + b for a, b in zip(row.buckets, d["buckets"], strict=True)]
                           if row.buckets else list(d["buckets"]))
    for r in snap.get("tcp") or []:
        if _keep(r, namespace, workload):
            out.setdefault(name(r), Row(name(r))).connections += r["connections"]
    return out


def table(before: dict[str, Any], after: dict[str, Any], interval_s: float, by: str,
          namespace: str | None = None, pod: str | None = None, sort: str = "rps"
          ) -> list[Row]:
    """Rows of ``after`` (cumulative counts, success and latency since the agent started),
    with rates from the change since ``before``."""
    old = _rows(before, by, namespace, pod)
    now = _rows(after, by, namespace, pod)
    active = (after.get("envoy") or {}).get("active") or {}
    if by == "service" and not pod and "envoy" in after:  # per Service, not per pod
        for name in active:
            if not namespace or name.split("/", 1)[0] == namespace:
                now.setdefault(name, Row(name))
        for row in now.values():
            row.active = int(active.get(row.name, 0))
    rows = list(now.values())
    for row in rows:
        prev = old.get(row.name)
        if interval_s > 0:
            row.rps = max(0, row.requests - (prev.requests if prev else 0)) / interval_s
            row.cps = max(0, row.connections - (prev.connections if prev else 0)) / interval_s
    if sort == "name":
        rows.sort(key=lambda r: r.name)
    elif sort == "success":
        rows.sort(key=lambda r: (r.success if r.success is not None else 2.0, r.name))
    elif sort == "p99":
        rows.sort(key=lambda r: (-(quantile(r.buckets, 0.99) or 0.0), r.name))
    else:
        rows.sort(key=lambda r: (-r.rps, -r.cps, r.name))
    return rows


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds == float("inf"):
        return ">10s"
    return f"{seconds * 1000:.0f}ms" if seconds >= 0.001 else "<1ms"


def passthrough(before: dict[str, Any], after: dict[str, Any], interval_s: float
                ) -> dict[str, dict[str, float]]:
    """Passthrough connections by destination class: since start, per second, open now
    (empty when the agent could not read Envoy's stats)."""
    now = (after.get("envoy") or {}).get("passthrough") or {}
    then = (before.get("envoy") or {}).get("passthrough") or {}
    out = {}
    for cls, v in sorted(now.items()):
        prev = (then.get(cls) or {}).get("total", v["total"])
        rate = max(0, v["total"] - prev) / interval_s if interval_s > 0 else 0.0
        out[cls] = {"connections": v["total"], "cps": rate, "active": v["active"]}
    return out


def render(services: list[Row], workloads: list[Row], interval_s: float, stamp: str,
           passthrough: dict[str, dict[str, float]] | None = None) -> str:
    """The human screen: two tables, Services then source workloads, and a passthrough line."""
    def block(title: str, rows: list[Row]) -> list[str]:
        head = [title, "RPS", "REQUESTS", "SUCCESS", "P50", "P99", "CONN/S", "CONNECTIONS",
                "ACTIVE"]
        body = [[r.name, f"{r.rps:.1f}", str(r.requests),
                 "-" if r.success is None else f"{r.success * 100:.1f}%",
                 _ms(quantile(r.buckets, 0.5) if r.buckets else None),
                 _ms(quantile(r.buckets, 0.99) if r.buckets else None),
                 f"{r.cps:.1f}", str(r.connections),
                 "-" if r.active is None else str(r.active)] for r in rows]
        widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(head, widths, strict=True))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)) for b in body]
        return lines if body else [*lines, "(no traffic yet)"]

    tail = []
    if passthrough:
        tail = ["", "PASSTHROUGH (no Service chain)  " + "   ".join(
            f"{cls}: {int(v['connections'])} connections, {v['cps']:.1f}/s, "
            f"{int(v['active'])} open" for cls, v in passthrough.items())]
    return "\n".join([f"aether-agent top · {stamp} · rates over {interval_s:g}s, the rest since "
                      "the agent started", "", *block("DESTINATION SERVICE", services), "",
                      *block("SOURCE WORKLOAD", workloads), *tail])
