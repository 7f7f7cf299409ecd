"""The cardinality cap (#19) over what the real Envoy exports for 1,200 distinct callers.

A node cannot host 1,200 caller workloads in a test, so this Envoy is static and takes the
caller from a request header instead of the capture listener (the only difference from the
node's HTTP chain): the stats logger and its buckets are the ones the agent builds
(``http_stats_log()``, ``bootstrap_stats_config()``), the text read back is the admin's,
and the cap is the agent's (``GoldenFold``, default 1,000) feeding its ``/metrics``."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import urllib.parse
from collections.abc import Iterator

import pytest
from google.protobuf.json_format import MessageToDict

from agent.envoy import golden
from agent.envoy.supervisor import admin_request, find_envoy_binary
from agent.envoy.traffic import MAX_SERIES, OTHER
from agent.ops.metrics import Metrics
from integration.conftest import free_port, until

CALLERS = 1200
CHAIN = "svc|app|web|80|http"
SOURCE_HEADER = "x-test-source"


def _bootstrap(port: int, admin: str) -> dict[str, object]:
    logger = MessageToDict(golden.http_stats_log(), preserving_proto_field_name=True)
    source = {"name": "envoy.filters.http.set_filter_state", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.set_filter_state.v3.Config",
        "on_request_headers": [{"object_key": golden.SOURCE_STATE, "factory_key": "envoy.string",
                                "format_string": {"text_format_source": {
                                    "inline_string": f"%REQ({SOURCE_HEADER})%"}}}]}}
    hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network."
                    "http_connection_manager.v3.HttpConnectionManager",
           "stat_prefix": "cap", "access_log": [logger],
           "route_config": {"virtual_hosts": [{"name": "v", "domains": ["*"], "routes": [
               {"name": "r0", "match": {"prefix": "/"},
                "direct_response": {"status": 200, "body": {"inline_string": "ok"}}}]}]},
           "http_filters": [source, {"name": "envoy.filters.http.router", "typed_config": {
               "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}
    return {"admin": {"address": {"pipe": {"path": admin}}},
            "stats_config": golden.bootstrap_stats_config(),
            "stats_flush_interval": "1s",
            "static_resources": {"listeners": [{
                "name": "cap", "address": {"socket_address": {"address": "127.0.0.1",
                                                              "port_value": port}},
                "filter_chains": [{"name": CHAIN, "filters": [
                    {"name": "envoy.filters.network.http_connection_manager",
                     "typed_config": hcm}]}]}]}}


@pytest.fixture
def envoy(workdir: str) -> Iterator[tuple[int, str]]:
    port, admin = free_port(), os.path.join(workdir, "cap-admin.sock")
    path = os.path.join(workdir, "cap.json")
    with open(path, "w") as f:
        json.dump(_bootstrap(port, admin), f)
    with open(os.path.join(workdir, "cap-envoy.log"), "ab") as log:
        proc = subprocess.Popen([find_envoy_binary(), "-c", path, "--concurrency", "1",
                                 "--use-dynamic-base-id", "-l", "warning"],
                                stdout=log, stderr=log)
    try:
        def ready() -> bool:
            assert proc.poll() is None, "the Envoy exited"
            try:
                return admin_request(admin, "GET", "/ready", timeout=1)[1].strip() == "LIVE"
            except OSError:
                return False
        until(ready, "the Envoy never became ready")
        yield port, admin
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_cap_holds_under_1200_distinct_callers_of_the_real_envoy(
        envoy: tuple[int, str]) -> None:
    port, admin = envoy
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    for i in range(CALLERS):  # one request from each caller workload, two from the first 10
        for _ in range(2 if i < 10 else 1):
            conn.request("GET", "/", headers={SOURCE_HEADER: f"app/caller-{i:04d}"})
            resp = conn.getresponse()
            assert (resp.status, resp.read()) == (200, b"ok")
    conn.close()
    sent = CALLERS + 10
    path = "/stats/prometheus?filter=" + urllib.parse.quote(golden.STATS_FILTER)

    def series() -> golden.Series:
        return golden.parse_prometheus(admin_request(admin, "GET", path, timeout=5)[1])

    def counted() -> float:
        return sum(cum.get("+Inf", 0.0) for cum, _ in series().requests.values())
    until(lambda: counted() == sent, "Envoy never showed every request", timeout=30)
    raw = series()
    assert len(raw.requests) == CALLERS  # Envoy itself holds one series per caller
    snap = golden.GoldenFold().snapshot(raw)
    rows = snap["requests"]
    assert isinstance(rows, list)
    assert len(rows) == MAX_SERIES + 1  # the cap's label sets and one "other"
    assert sum(r["count"] for r in rows) == sent  # folded, not lost
    (other,) = [r for r in rows if r["src_workload"] == OTHER]
    assert other["count"] == CALLERS - MAX_SERIES and snap["folded"] == CALLERS - MAX_SERIES
    kept = [r for r in rows if r["src_workload"] != OTHER]
    assert {r["dst_service"] for r in kept} == {"web"} and all(r["code"] == "200" for r in kept)
    # what /metrics exports from it: the same bound, the fold counted
    metrics = Metrics()
    metrics.traffic_source = lambda: snap
    out = metrics.render().decode()
    exported = re.findall(r"^aether_requests_total\{.*\} (\S+)$", out, re.M)
    assert len(exported) == MAX_SERIES + 1 and sum(map(float, exported)) == sent
    folded = re.search(r"^aether_traffic_folded_reports_total (\S+)$", out, re.M)
    assert folded and float(folded.group(1)) == CALLERS - MAX_SERIES
