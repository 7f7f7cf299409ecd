"""agent_scale's pure parts: medians over rounds, per-round ratios, targets on the medians."""

from __future__ import annotations

import argparse
from typing import Any

from bench.__main__ import rows_agent_scale
from bench.agent_scale import report, summarize


def _run(rnd: int, pods: int, mode: str, ready: float, rss: float) -> dict[str, Any]:
    return {"round": rnd, "pods": pods, "remote_pods": mode, "services": 10_000,
            "ready_s": ready, "agent_cpu_s": ready / 2, "api_cpu_s": ready,
            "at_ready": {"agent_rss_mb": rss}, "agent_rss_mb": rss, "agent_uss_mb": rss - 10,
            "envoy_rss_mb": 1000.0,
            "endpoint_change": {"seconds": 0.2, "agent_cpu_s": 0.1, "api_delete_s": 0.01}}


RUNS = [
    _run(1, 100_000, "meshpods", 26.0, 440.0), _run(1, 100_000, "pods", 40.0, 550.0),
    _run(2, 100_000, "pods", 30.0, 560.0), _run(2, 100_000, "meshpods", 37.0, 446.0),
    _run(3, 100_000, "meshpods", 29.0, 442.0), _run(3, 100_000, "pods", 29.0, 540.0),
]


def test_each_figure_is_the_median_of_its_rounds_and_ratios_pair_the_same_round() -> None:
    mesh, pods = summarize(RUNS)
    assert (mesh["remote_pods"], pods["remote_pods"]) == ("meshpods", "pods")
    assert mesh["rounds"] == 3 and mesh["ready_s"] == 29.0 and mesh["ready_s_spread"] == [26.0, 37.0]
    assert mesh["agent_rss_mb"] == 442.0 and mesh["agent_rss_mb_spread"] == [440.0, 446.0]
    # per round: 26/40, 37/30, 29/29 -> median 1.0; not median/median (29/30)
    assert mesh["vs_pods_ready"] == 1.0
    assert mesh["vs_pods_ready_spread"] == [0.65, 37.0 / 30.0]
    assert "vs_pods_ready" not in pods


def test_the_targets_are_judged_on_the_medians_and_the_table_shows_the_spread() -> None:
    a = argparse.Namespace(services=10_000, nodes=300, local=110)
    d = report(RUNS, a)
    # one round (26 s) would pass, another (37 s) would not: the median (29 s) decides
    assert d["targets"] == {"checked": True, "ready_ok": True, "rss_ok": False, "rounds": 3}
    ready, rss, _change = rows_agent_scale(d)
    assert ready[2] == "29.0 s (26.0–37.0)" and "median of 3 rounds" in ready[1]
    assert ready[4] == "1.00× (spread 0.65–1.23)" and ready[5].startswith("PASS")
    assert rss[2] == "442 MB (440–446)" and rss[5].startswith("MISS")
