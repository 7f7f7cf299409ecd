"""The layer contracts in ``.importlinter`` (import-linter, run by .ci/run): they hold on the
tree, they fail on a deliberate violation, and their pure-core list is tests/test_layers.py's."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.test_layers import IO, PURE

ROOT = Path(__file__).resolve().parent.parent


def _contracts() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / ".importlinter")
    return cfg


def _lines(value: str) -> set[str]:
    return {ln.strip() for ln in value.splitlines() if ln.strip()}


def test_the_pure_core_contract_names_what_test_layers_names() -> None:
    pure = _contracts()["importlinter:contract:pure-core"]
    assert _lines(pure["source_modules"]) == set(PURE)
    assert _lines(pure["forbidden_modules"]) == set(IO)


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    lint = shutil.which("lint-imports") or os.path.join(os.path.dirname(sys.executable),
                                                        "lint-imports")
    return subprocess.run([lint, "--no-cache"], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)}, timeout=120)


def test_the_contracts_hold_and_fail_on_a_deliberate_violation(tmp_path: Path) -> None:
    ok = _lint(ROOT)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # a copy where the pure policy module opens a socket and an edge imports the app
    shutil.copytree(ROOT / "agent", tmp_path / "agent",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    policy = tmp_path / "agent" / "authz" / "policy.py"
    policy.write_text(policy.read_text() + "\nimport socket  # noqa: E402\n")
    backoff = tmp_path / "agent" / "common" / "backoff.py"
    backoff.write_text(backoff.read_text() + "\nimport agent.runtime.app  # noqa: E402\n")
    bad = _lint(tmp_path)
    assert bad.returncode != 0
    assert "agent.authz.policy -> socket" in bad.stdout, bad.stdout
    assert "agent.common.backoff -> agent.runtime.app" in bad.stdout, bad.stdout
    # the same import breaks agent.common's own contract: it stands on no other package
    assert "agent.common (config, ids, logs, limits, back-off) stands on no other agent " \
        "package BROKEN" in " ".join(bad.stdout.split()), bad.stdout


def cycles(adj: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``adj`` (module -> the modules it imports): its strongly
    connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(adj.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in sorted(adj):
        if m not in index:
            visit(m)
    return out


def test_no_import_cycle() -> None:
    import grimp  # import-linter's graph builder
    g = grimp.build_graph("agent", cache_dir=None)
    mods = set(g.modules)
    assert cycles({m: g.find_modules_directly_imported_by(m) & mods for m in mods}) == []
    # the check sees one: the manifest directory and its parse worker once imported each
    # other (parsing now lives in agent.source.manifest_parse)
    assert cycles({"agent.source.manifests": {"agent.source.parse_worker"},
                   "agent.source.parse_worker": {"agent.source.manifests"},
                   "agent.common.ids": set()}) == [["agent.source.manifests",
                                                     "agent.source.parse_worker"]]
