"""The sidecar comparison's pure parts: round order, per-round ratios, the sidecar's config."""

from __future__ import annotations

from bench.__main__ import rows_sidecar_path
from bench.envoy_common import WrkResult, grpc_message
from bench.sidecar_path import (
    MODES,
    SIDECAR_MARK,
    SIDECAR_PORT,
    Run,
    order,
    parse_h2load,
    sidecar_bootstrap,
    sidecar_nft,
    summarize,
)


def _wrk(rps: float, p50: float = 1.0) -> WrkResult:
    return WrkResult(int(rps), rps, p50, p50, p50, 2 * p50, 0, 0, "")


def test_every_round_runs_each_mode_once_and_no_mode_always_leads() -> None:
    plan = order(4)
    assert all(sorted(r) == sorted(MODES) for r in plan)
    assert len({r[0] for r in plan}) > 1
    assert plan[1] != plan[0]


def test_ratios_are_taken_within_a_round_and_their_median_reported() -> None:
    runs = []
    for direct, node, side in ((100.0, 50.0, 60.0), (200.0, 120.0, 100.0), (100.0, 70.0, 70.0)):
        for mode, rps in (("direct", direct), ("node", node), ("sidecar", side)):
            runs.append(Run("keepalive", mode, _wrk(rps), 0.0, 1))
    s = summarize(runs)["keepalive"]
    assert s["node_over_direct"] == {"median": 0.6, "spread": [0.5, 0.7]}
    assert s["sidecar_over_direct"]["median"] == 0.6
    assert s["node_over_sidecar"]["spread"] == [0.833, 1.2]
    assert s["modes"]["direct"]["rps_median"] == 100.0
    rows = rows_sidecar_path({"shapes": {"keepalive": s}, "memory": {
        "node_kb_per_pod": 40.0, "sidecar_rss_mb": 40.0}})
    assert rows[0][4].startswith("1.00×") and "0.60× direct" in rows[0][3]
    assert rows[-1][2] == "40 KB" and rows[-1][4] == "0.0010×"


def test_the_sidecar_returns_its_own_marked_upstreams_and_loopback_before_redirecting() -> None:
    text = sidecar_nft()
    assert text.index(f"meta mark {SIDECAR_MARK:#x} return") < text.index("redirect")
    assert f"redirect to :{SIDECAR_PORT}" in text
    boot = sidecar_bootstrap("/tmp/a.sock", "10.1.0.1", 8080)
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    for c in clusters.values():  # every upstream it opens is marked, or it would loop
        opts = c["upstream_bind_config"]["socket_options"]
        assert opts[0]["int_value"] == str(SIDECAR_MARK)
    listener = boot["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"]["port_value"] == SIDECAR_PORT
    assert listener["default_filter_chain"]["filters"][0]["typed_config"]["cluster"] == \
        "passthrough"


def test_h2load_summary_and_its_request_log_give_wrk_figures() -> None:
    out = ("finished in 2.00s, 1500.50 req/s, 1.2MB/s\n"
           "requests: 3001 total, 3001 started, 3001 done, 2999 succeeded, 2 failed, 0 errored, "
           "0 timeout\n")
    log = [f"1700000000{i:06d}\t{200 if i < 98 else 503}\t{(i + 1) * 10}" for i in range(100)]
    w = parse_h2load(out, log)
    assert (w.requests, w.rps, w.socket_errors, w.non_2xx) == (3001, 1500.5, 2, 2)
    assert w.p50_ms == 0.51 and w.p99_ms == 1.0


def test_a_grpc_message_is_length_prefixed() -> None:
    msg = grpc_message(1024)
    assert msg[0] == "\0" and msg[1:5].encode("latin-1") == (1024).to_bytes(4, "big")
    assert len(msg) == 5 + 1024
