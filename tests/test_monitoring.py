"""deploy/monitoring/: the Grafana dashboard asks only for series the agent exports, grouped
by labels those series carry, and the PodMonitor scrapes the DaemonSet's metrics port."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from agent.envoy.golden import GoldenFold, parse_prometheus
from agent.ops.metrics import LIVE, Metrics

ROOT = Path(__file__).resolve().parent.parent
MON = ROOT / "deploy" / "monitoring"
PROMQL_WORDS = {"sum", "by", "rate", "increase", "histogram_quantile", "min", "max", "or",
                "le", "on", "vector", "avg", "count"}


def _exported() -> dict[str, set[str]]:
    """Every series name the agent's /metrics can hold, with its label names: a Metrics
    with every source wired to plain data, rendered."""
    m = Metrics()
    m.set_sources(**{k: (lambda: 1.0) for k in LIVE})
    from tests.test_traffic import prom
    snap = GoldenFold().snapshot(parse_prometheus(prom(
        requests=[("app/web", "svc|app|db|80|http", "r", "503", "Unavailable", "UF", [10000])],
        tcp=[("app/web", "svc|app|db|5432", "UF", 1, 1, 1)])))
    m.traffic_source = lambda: snap
    m.envoy_traffic_source = lambda: {"passthrough": {"mesh": {"total": 1, "active": 0}},
                                      "active": {"app/db": 1}, "bytes": {"app/db": [1, 2]}}
    m.identity_source = lambda: {"svids": [{"identity": "app/web", "seconds_left": 5}],
                                 "rotations": 1}
    m.mesh_traffic_source = lambda: {"inbound": [{"identity": "app/db", "caller": "x",
                                                  "connections": 1, "received_bytes": 1,
                                                  "sent_bytes": 1}], "folded": 0}
    m.observe_cni("ADD", 0.01, "ok")
    m.observe_xds_push(0.01)
    out: dict[str, set[str]] = {}
    for line in m.render().decode().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        match = re.match(r"^([a-zA-Z_:][\w:]*)(\{(.*)\})? ", line)
        assert match, line
        labels = set(re.findall(r'(\w+)="', match.group(3) or ""))
        out.setdefault(match.group(1), set()).update(labels)
    return out


def _dashboard() -> dict[str, Any]:
    return json.loads((MON / "aether-dashboard.json").read_text())


def _exprs() -> list[str]:
    return [t["expr"] for p in _dashboard()["panels"] for t in p.get("targets", [])]


def test_every_dashboard_query_names_series_the_agent_exports() -> None:
    exported = _exported()
    exprs = _exprs()
    assert len(exprs) >= 25
    used = set()
    for e in exprs:
        assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e
        for name in re.findall(r"\b(aether_\w+)", e):
            assert name in exported, f"{name} (in {e!r}) is not exported by the agent"
            used.add(name)
    # the golden metrics and the agent's own health are all on it
    for must in ("aether_requests_total", "aether_request_duration_seconds_bucket",
                 "aether_tcp_connections_total", "aether_service_active_connections",
                 "aether_passthrough_connections_total", "aether_cni_request_duration_seconds_bucket",
                 "aether_pods_captured", "aether_xds_pushes_total", "aether_envoy_restarts_total",
                 "aether_traffic_folded_reports_total"):
        assert must in used, must


def test_grouping_and_matching_labels_exist_on_the_series() -> None:
    """`sum by (x)` and `{x=...}` name only labels the queried series carry (Grafana would
    otherwise draw one unlabelled line, or nothing)."""
    exported = _exported()
    for e in _exprs():
        names = re.findall(r"\b(aether_\w+)", e)
        # instance: the scrape target (the PodMonitor sets it to the node name)
        carried = set().union(*(exported[n] for n in names)) | {"le", "instance"}
        for group in re.findall(r"by \(([^)]*)\)", e):
            for label in (x.strip() for x in group.split(",")):
                assert label in carried, f"{label} not on {names} in {e!r}"
        for sel in re.findall(r"\{([^}]*)\}", e):
            for label in re.findall(r"(\w+)\s*(?:=~|!=|=)", sel):
                assert label in carried, f"{label} not on {names} in {e!r}"


def test_dashboard_shape() -> None:
    d = _dashboard()
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in d["templating"]["list"]} == {"datasource", "node", "namespace"}
    for p in d["panels"]:
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24


def test_the_podmonitor_scrapes_the_daemonsets_metrics_port() -> None:
    pm = yaml.safe_load((MON / "podmonitor.yaml").read_text())
    ds = yaml.safe_load((ROOT / "deploy" / "daemonset.yaml").read_text())
    assert pm["kind"] == "PodMonitor" and pm["apiVersion"] == "monitoring.coreos.com/v1"
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (agent,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "agent"]
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert "--metrics-port=15020" in agent["args"]
    assert ep["portNumber"] == 15020 and ep["path"] == "/metrics"
    kust = yaml.safe_load((MON / "kustomization.yaml").read_text())
    for res in kust["resources"]:
        assert (MON / res).is_file()
    (gen,) = kust["configMapGenerator"]
    assert gen["options"]["labels"]["grafana_dashboard"] == "1"
    assert all((MON / f).is_file() for f in gen["files"])
