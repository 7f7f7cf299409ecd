"""The README's first command runs end to end and checks its own outcome."""

from __future__ import annotations

import subprocess
import sys


def test_demo_splits_matches_and_cleans_up() -> None:
    before = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                check=True).stdout.split())
    r = subprocess.run([sys.executable, "-m", "agent.cli", "demo", "--requests", "200"],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "PASS: the 50/50 split splits" in r.stdout
    assert "PASS: the header match matches" in r.stdout
    assert "PASS: every request went through the node Envoy" in r.stdout
    assert "[7/7]" in r.stderr  # progress was shown
    # it ends with `aether-agent top --once`: the demo's calls by destination Service
    top = r.stdout[r.stdout.index("aether-agent top --once"):]
    assert "DESTINATION SERVICE" in top and "demo/echo" in top, top
    after = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                               check=True).stdout.split())
    assert not {n for n in after - before if n.startswith("aet-")}, "demo left netns behind"
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert "aetdemo" not in links
