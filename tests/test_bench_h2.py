"""h2_balance's pure parts: per-round ratios against L4 and against the plain Envoy floor."""

from __future__ import annotations

from typing import Any

from bench.__main__ import rows_h2_balance
from bench.h2_balance import plain_bootstrap, summarize


def _run(r: int, mode: str, rps: float, split: tuple[int, int]) -> dict[str, Any]:
    return {"round": r, "mode": mode, "rps": rps, "requests": 1, "succeeded": 1, "failed": 0,
            "errored": 0, "backend_split": list(split)}


def test_ratios_are_taken_within_each_round() -> None:
    runs = [_run(0, "l4", 100, (50, 50)), _run(0, "per_request", 20, (10, 10)),
            _run(0, "plain_l4", 110, (55, 55)), _run(0, "plain_h2", 25, (12, 13)),
            _run(1, "l4", 50, (40, 10)), _run(1, "per_request", 15, (7, 8)),
            _run(1, "plain_l4", 60, (30, 30)), _run(1, "plain_h2", 15, (8, 7))]
    d = summarize(runs, 2, 1.0)
    assert d["spread"] == [0.2, 0.3] and d["ratio_median"] == 0.25
    assert d["plain_spread"] == [0.227, 0.25]
    assert d["vs_plain_spread"] == [0.8, 1.0] and d["vs_plain_ratio_median"] == 0.9
    assert d["l4_min_backend_share_median"] == 0.35  # (0.5 + 0.2) / 2
    assert not d["target_met"]
    rows = rows_h2_balance(d)
    assert [r[4] for r in rows[2:]] == ["0.24× (spread 0.23–0.25)", "0.90× (spread 0.80–1.00)"]


def test_the_plain_envoy_balances_per_request_on_one_listener_and_relays_on_the_other() -> None:
    cfg = plain_bootstrap("/tmp/admin.sock", {"h2": 1001, "l4": 1002}, ["10.0.0.1", "10.0.0.2"])
    listeners = {x["name"]: x for x in cfg["static_resources"]["listeners"]}
    assert listeners["h2"]["address"]["socket_address"]["port_value"] == 1001
    (f,) = listeners["l4"]["filter_chains"][0]["filters"]
    assert f["name"] == "envoy.filters.network.tcp_proxy"
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    assert "typed_extension_protocol_options" in clusters["h2"]  # HTTP/2 to the backends
    assert len(clusters["l4"]["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 2
