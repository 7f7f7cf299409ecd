"""bench.takeover's pure parts: totals over take-overs and crashes, and the table's rows."""

from __future__ import annotations

from typing import Any

from bench.__main__ import rows_takeover
from bench.takeover import summarize


class _Load:
    http_retries = 2
    long_cut: list[float] = []


def _k(p: int, s: int, h: int) -> dict[str, int]:
    return {"passthrough": p, "service": s, "http": h}


def _takeover(ready: float, overlap: float, failed: dict[str, int]) -> dict[str, Any]:
    return {"ready_s": ready, "overlap_s": overlap, "exit_after_term_s": 1.0,
            "agent_cpu_s": overlap / 4, "envoy_cpu_s": 0.5, "ok": _k(100, 100, 50),
            "failed": failed}


def test_a_clean_set_of_takeovers_meets_the_goal_beside_the_crash_baseline() -> None:
    tk = [_takeover(2.0, 6.0, _k(0, 0, 0)), _takeover(3.0, 8.0, _k(0, 0, 0)),
          _takeover(2.5, 7.0, _k(0, 0, 0))]
    crash = [{"live_s": 4.0, "live_after_kill_s": 4.2, "ready_s": 3.0, "ok": _k(10, 10, 5),
              "failed": _k(40, 40, 20)}]
    d = summarize(tk, crash, 110, _Load())  # type: ignore[arg-type]
    t = d["takeover"]
    assert (t["new_connection_failures"], t["new_connections"]) == (0, 600)
    assert (t["http_failures"], t["http_requests"]) == (0, 150)
    assert t["overlap_s"] == {"median": 7.0, "spread": [6.0, 8.0], "n": 3}
    assert d["crash"]["new_connection_failures"] == 80 and d["target_met"]
    rows = rows_takeover(d)
    assert rows[0][2] == "0 of 600" and rows[0][5] == "PASS (0)"
    assert rows[0][3] == "crash of the whole pod: 80 of 100 failed (1 crashes)"
    assert rows[2][2] == "7.0 s (spread 6.0–8.0)"
    assert rows[-1][4] == "1.60×"  # 4.0 s to all listeners live against 2.5 s to ready


def test_one_failed_request_misses_the_goal() -> None:
    tk = [_takeover(2.0, 6.0, _k(0, 0, 1))]
    d = summarize(tk, [], 110, _Load())  # type: ignore[arg-type]
    assert not d["target_met"] and "crash" not in d
    rows = rows_takeover(d)
    assert rows[1][2] == "1 of 51" and rows[1][5] == "MISS (0)"
    assert len(rows) == 4  # no crash row without crashes
