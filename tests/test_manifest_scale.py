"""Manifests that are big, hostile or odd never stop lookups (issue #13, item 5), no root.

Parsing happens off the lookup path (a lookup reads the loader's snapshot and waits at most
``lookup_wait`` for a scan), big files parse on a background thread while their last good
version is served, edits reparse only the changed file, and YAML is loaded with the C loader
(or the pure-Python fallback) behind bounds on alias expansion and nesting.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.source import manifests, yamlsafe
from agent.source.events import ObjectStore
from agent.source.manifests import (
    ManifestDir,
    ManifestError,
    ManifestLoader,
    ManifestSource,
    parse_manifest,
)
from agent.source.model import pod_from_object
from agent.source.watch import ManifestWatcher
from agent.source.yamlsafe import MAX_DEPTH, ManifestLimitError, check_limits, load_all, pick_loader

LOADERS = [yaml.SafeLoader] + ([yaml.CSafeLoader] if hasattr(yaml, "CSafeLoader") else [])

NS = """\
apiVersion: v1
kind: Namespace
metadata:
  name: app
  labels:
    aether.io/managed: "true"
"""


def pod_doc(name: str, **labels: str) -> str:
    return yaml.safe_dump({"apiVersion": "v1", "kind": "Pod",
                           "metadata": {"name": name, "namespace": "app", "labels": labels}})


def big_file(n: int, marker: str = "a") -> str:
    return "---\n".join(pod_doc(f"big-{i}", marker=marker) for i in range(n))


def billion_laughs(levels: int = 9) -> str:
    lines = ['lol0: &lol0 "lol"']
    for i in range(1, levels + 1):
        lines.append(f"lol{i}: &lol{i} [" + ", ".join([f"*lol{i - 1}"] * 9) + "]")
    body = "\n".join("  " + ln for ln in lines)
    return f"apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: laughs}}\ndata:\n{body}\n"


def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def rewrite(path: Path, data: str) -> None:
    """In place, with a visibly new mtime."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(data)
    if path.stat().st_mtime_ns == before:
        os.utime(path, ns=(before + 1_000_000, before + 1_000_000))


class Gate:
    """parse_manifest that blocks on files named in ``hold`` and records who parsed what."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.hold: set[str] = set()
        self.open = threading.Event()
        self.parsed: list[str] = []
        self.threads: set[str] = set()
        real = manifests.parse_manifest

        def gated(path: str, data: bytes) -> Any:
            self.parsed.append(os.path.basename(path))
            self.threads.add(threading.current_thread().name)
            if os.path.basename(path) in self.hold:
                assert self.open.wait(20), "test never released the gate"
            return real(path, data)

        monkeypatch.setattr(manifests, "parse_manifest", gated)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate(monkeypatch)
    yield g
    g.open.set()  # never leave a parse thread blocked


# ---- the YAML bounds -----------------------------------------------------------------------


@pytest.mark.parametrize("loader", LOADERS)
def test_an_alias_bomb_is_refused_before_it_is_built(loader: type[Any]) -> None:
    started = time.monotonic()
    with pytest.raises(ManifestLimitError, match="alias bomb"):
        load_all(billion_laughs(), loader)
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("loader", LOADERS)
def test_ordinary_anchors_and_merge_keys_load(loader: type[Any]) -> None:
    shared = {"app": "web", "tier": "front"}
    dumped = yaml.safe_dump({"kind": "List", "items": [  # PyYAML writes &id001 / *id001
        {"kind": "Pod", "metadata": {"name": f"p{i}", "labels": shared}} for i in range(50)]})
    assert "*id001" in dumped
    (doc,) = load_all(dumped, loader)
    assert [d["metadata"]["labels"] for d in doc["items"]] == [shared] * 50
    merged = load_all("base: &b {a: 1, b: 2}\nderived:\n  <<: *b\n  c: 3\n", loader)
    assert merged == [{"base": {"a": 1, "b": 2}, "derived": {"a": 1, "b": 2, "c": 3}}]


def test_the_alias_bound_counts_each_alias_as_the_nodes_it_names() -> None:
    # written: the mapping, 2 keys... an alias of the 5-node list adds 5 nodes
    ok = "{a: &x [1, 2, 3, 4], b: *x}"
    assert check_limits(ok, max_alias_nodes=0) == 8  # 1 + "a" + 5 + "b"
    # counted as the file streams in: at `c: *x` aliases have added 10 nodes to the 9 written
    with pytest.raises(ManifestLimitError, match="more than 0 nodes beyond the 9 "):
        check_limits("{a: &x [1, 2, 3, 4], b: *x, c: *x, d: *x}", max_alias_nodes=0)
    check_limits("{a: &x [1, 2, 3, 4], b: *x, c: *x, d: *x}", max_alias_nodes=5)


@pytest.mark.parametrize("loader", LOADERS)
def test_a_recursive_alias_is_refused(loader: type[Any]) -> None:
    with pytest.raises(ManifestLimitError, match="recursive"):
        load_all("a: &a [1, *a]\n", loader)


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("shape", ["flow", "block", "alias"])
def test_nesting_is_bounded(loader: type[Any], shape: str) -> None:
    def doc(depth: int) -> str:
        if shape == "flow":
            return "[" * depth + "]" * depth
        if shape == "block":
            return "".join(" " * i + "- \n" for i in range(depth - 1)) + " " * depth + "- x\n"
        half = depth // 2
        return (f"a: &a {'[' * half}{']' * half}\n"
                f"b: {'[' * (depth - half - 1)}*a{']' * (depth - half - 1)}\n")
    load_all(doc(MAX_DEPTH), loader)
    with pytest.raises(ManifestLimitError, match=f"deeper than {MAX_DEPTH}"):
        load_all(doc(MAX_DEPTH + 1), loader)


@pytest.mark.parametrize("loader", LOADERS)
def test_a_million_open_brackets_are_refused_without_a_crash(loader: type[Any]) -> None:
    started = time.monotonic()
    with pytest.raises(ManifestLimitError):
        load_all(b"[" * 1_000_000, loader)
    assert time.monotonic() - started < 2.0


# ---- the C loader and its fallback ---------------------------------------------------------


def test_the_c_loader_is_used_when_pyyaml_has_libyaml() -> None:
    assert yamlsafe.LOADER is getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def test_without_libyaml_the_pure_python_loader_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(yaml, "CSafeLoader", raising=False)
    assert pick_loader() is yaml.SafeLoader


@pytest.mark.parametrize("bad", [billion_laughs(), "kind: [unclosed\n", "a: &a [*a]\n"])
def test_both_loaders_read_manifests_alike(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    good = (NS + "---\n" + big_file(20)).encode()
    results = []
    for loader in LOADERS:
        monkeypatch.setattr(yamlsafe, "LOADER", loader)
        objects, warnings = parse_manifest("f.yaml", good)
        with pytest.raises(ManifestError) as err:
            parse_manifest("f.yaml", bad.encode())
        results.append((objects, warnings, str(err.value).split(":")[0]))
    assert all(r == results[0] for r in results)
    assert len(results[0][0]) == 21


@pytest.mark.parametrize("value", ["2024-13-45", "1" * 5000])
def test_a_value_python_cannot_build_refuses_the_file_not_the_lookup(value: str) -> None:
    with pytest.raises(ManifestError, match="value error"):
        parse_manifest("f.yaml", f"kind: ConfigMap\nmetadata: {{name: c}}\ndata: {{v: {value}}}\n"
                       .encode())


# ---- files the directory refuses -----------------------------------------------------------


def test_an_alias_bomb_file_is_reported_and_skipped_others_unaffected(tmp_path: Path) -> None:
    (tmp_path / "ns.yaml").write_text(NS)
    (tmp_path / "pod.yaml").write_text(pod_doc("web"))
    (tmp_path / "laughs.yaml").write_text(billion_laughs())
    src = ManifestSource(str(tmp_path), loader=ManifestLoader(str(tmp_path)), lookup_wait=5)
    assert src.get_pod("app", "web") is not None
    assert src.get_namespace("app") is not None
    (problem,) = src.problems
    assert "laughs.yaml" in problem and "alias bomb" in problem and "not loaded" in problem


def test_a_fifo_named_like_a_manifest_is_refused_without_blocking(tmp_path: Path) -> None:
    (tmp_path / "ns.yaml").write_text(NS)
    os.mkfifo(tmp_path / "pipe.yaml")
    objects, problems = ManifestDir(str(tmp_path)).read()
    assert ("Namespace", "", "app") in objects
    assert problems == [f"{tmp_path / 'pipe.yaml'}: not a regular file: not loaded (no good "
                        "version yet)"]
    with pytest.raises(ManifestError, match="not a regular file"):
        manifests._read_file(str(tmp_path / "pipe.yaml"), 1000)  # opened O_NONBLOCK


def test_a_file_over_the_size_limit_keeps_its_last_good_version(tmp_path: Path) -> None:
    (tmp_path / "ns.yaml").write_text(NS)
    d = ManifestDir(str(tmp_path), max_bytes=len(NS) + 10)
    d.read()
    rewrite(tmp_path / "ns.yaml", NS + "# padding " * 10 + "\n")
    objects, problems = d.read()
    assert ("Namespace", "", "app") in objects
    assert "-byte limit for one file: keeping its last good version (1 objects)" in problems[0]


def test_a_pod_with_fields_of_the_wrong_type_still_reads() -> None:
    for spec in ([1], "x", {"containers": {"a": 1}}, {"containers": [{"securityContext": "x"}]},
                 {"containers": [{"securityContext": {"capabilities": {"add": "NET_ADMIN"}}}]},
                 {"initContainers": 5, "containers": [{"securityContext": {"capabilities": 3}}]}):
        pod = pod_from_object({"metadata": {"name": "p", "labels": [1]}, "spec": spec})
        assert pod.name == "p" and not pod.net_admin and pod.labels == {}


# ---- off the lookup path -------------------------------------------------------------------


def test_lookups_never_parse_on_their_own_thread(tmp_path: Path, gate: Gate) -> None:
    (tmp_path / "ns.yaml").write_text(NS)
    (tmp_path / "web.yaml").write_text(pod_doc("web"))
    src = ManifestSource(str(tmp_path), loader=ManifestLoader(str(tmp_path)), lookup_wait=5)
    assert src.get_pod("app", "web") is not None
    (tmp_path / "api.yaml").write_text(pod_doc("api"))
    assert src.get_pod("app", "api") is not None  # a fresh file counts on the first lookup
    assert gate.parsed and threading.current_thread().name not in gate.threads


def test_a_big_file_parses_in_the_background_while_lookups_answer(
        tmp_path: Path, gate: Gate) -> None:
    (tmp_path / "ns.yaml").write_text(NS)
    (tmp_path / "big.yaml").write_text(big_file(200))
    gate.hold.add("big.yaml")
    loader = ManifestLoader(str(tmp_path), background_over=4096, isolate=False)
    src = ManifestSource(str(tmp_path), loader=loader, lookup_wait=5)
    started = time.monotonic()
    assert src.get_namespace("app") is not None
    assert src.get_pod("app", "big-7") is None  # not known yet: the handler's try-again
    (tmp_path / "web.yaml").write_text(pod_doc("web"))
    assert src.get_pod("app", "web") is not None  # a new file is not held up by the big one
    assert time.monotonic() - started < 2.0  # nowhere near the 5 s wait: no lookup waited
    assert any("big.yaml" in p and "being parsed in the background; its objects are not "
               "known until then" in p for p in src.problems)
    assert not loader.snapshot.complete
    for name in ("api", "db"):  # more scans while it parses: it is not queued again
        (tmp_path / f"{name}.yaml").write_text(pod_doc(name))
        assert src.get_pod("app", name) is not None
    gate.open.set()
    eventually(lambda: src.get_pod("app", "big-7") is not None)
    eventually(lambda: loader.snapshot.complete)
    assert src.problems == []
    assert "manifest-parse" in gate.threads
    assert gate.parsed.count("big.yaml") == 1


def test_an_edit_reparses_only_the_changed_file_serving_its_last_version_meanwhile(
        tmp_path: Path, gate: Gate) -> None:
    (tmp_path / "ns.yaml").write_text(NS)
    (tmp_path / "big.yaml").write_text(big_file(200))
    loader = ManifestLoader(str(tmp_path), background_over=4096, isolate=False)
    src = ManifestSource(str(tmp_path), loader=loader, lookup_wait=5)
    eventually(lambda: src.get_pod("app", "big-7") is not None)
    gate.parsed.clear()
    gate.open.clear()
    gate.hold.add("big.yaml")
    rewrite(tmp_path / "big.yaml", big_file(200, marker="b"))  # every label, one line each
    started = time.monotonic()
    pod = src.get_pod("app", "big-7")
    assert pod is not None and pod.labels == {"marker": "a"}  # the last good version
    assert time.monotonic() - started < 2.0
    assert any("its last good version (200 objects) is served meanwhile" in p
               for p in src.problems)
    gate.open.set()
    eventually(lambda: (src.get_pod("app", "big-7") or pod).labels == {"marker": "b"})

    # a small edit elsewhere: only that file is parsed again
    rewrite(tmp_path / "ns.yaml", NS.replace('"true"', '"false"'))

    def managed() -> str | None:
        ns = src.get_namespace("app")
        return None if ns is None else ns.labels.get("aether.io/managed")

    eventually(lambda: managed() == "false")
    assert gate.parsed == ["big.yaml", "ns.yaml"]


def test_a_slow_scan_costs_a_lookup_at_most_the_wait_once(tmp_path: Path, gate: Gate) -> None:
    (tmp_path / "ns.yaml").write_text(NS)
    src = ManifestSource(str(tmp_path), loader=ManifestLoader(str(tmp_path)), lookup_wait=0.3)
    assert src.get_namespace("app") is not None
    gate.hold.add("slow.yaml")
    (tmp_path / "slow.yaml").write_text(pod_doc("slow"))
    started = time.monotonic()
    assert src.get_pod("app", "slow") is None  # the scan is stuck: answered from the snapshot
    first = time.monotonic() - started
    assert 0.25 <= first < 1.0
    started = time.monotonic()
    assert src.get_namespace("app") is not None  # the same stuck scan: no second wait
    assert time.monotonic() - started < 0.1
    gate.open.set()
    eventually(lambda: src.get_pod("app", "slow") is not None)


def test_the_watcher_syncs_on_the_complete_view_and_shares_the_parse(
        tmp_path: Path, gate: Gate) -> None:
    (tmp_path / "ns.yaml").write_text(NS)
    (tmp_path / "big.yaml").write_text(big_file(200))
    gate.hold.add("big.yaml")
    loader = ManifestLoader(str(tmp_path), background_over=4096, isolate=False)
    store = ObjectStore()
    w = ManifestWatcher(str(tmp_path), store, interval=0.05, loader=loader).start()
    try:
        src = ManifestSource(str(tmp_path), loader=loader, lookup_wait=5)
        assert not w.wait_synced(0.3)  # the big file is still parsing...
        eventually(lambda: store.get("Namespace", "", "app") is not None)  # ...the rest is in
        assert store.get("Pod", "app", "big-7") is None
        gate.open.set()
        assert w.wait_synced(10)
        assert store.get("Pod", "app", "big-7") is not None
        assert src.get_pod("app", "big-7") is not None
        assert gate.parsed.count("big.yaml") == 1 and gate.parsed.count("ns.yaml") == 1
    finally:
        w.stop()


def test_the_source_and_the_watcher_of_one_directory_share_a_loader(tmp_path: Path) -> None:
    (tmp_path / "ns.yaml").write_text(NS)
    src = ManifestSource(str(tmp_path))
    w = ManifestWatcher(str(tmp_path), ObjectStore())
    assert src.loader is w.loader
    assert ManifestSource(str(tmp_path), grace=0.5).loader is not src.loader


# ---- big files parse in a child process ---------------------------------------------------


def test_a_big_file_parses_in_a_child_process_with_the_same_result(tmp_path: Path) -> None:
    (tmp_path / "ns.yaml").write_text(NS)
    (tmp_path / "big.yaml").write_text(big_file(300))
    (tmp_path / "laughs.yaml").write_text(billion_laughs() + "#" * 5000 + "\n")
    loader = ManifestLoader(str(tmp_path), background_over=4096)
    src = ManifestSource(str(tmp_path), loader=loader, lookup_wait=5)
    eventually(lambda: loader.snapshot.complete, timeout=30)
    assert loader.background_parses == 2
    expected, _ = ManifestDir(str(tmp_path)).read()  # in-process, no background
    assert dict(loader.snapshot.objects) == expected
    assert len(expected) == 301
    (problem,) = src.problems
    assert "laughs.yaml: refused: aliases expand" in problem


def test_a_child_out_of_memory_or_time_refuses_the_file_not_the_agent(tmp_path: Path) -> None:
    from agent.source.parse_worker import parse_in_child
    data = big_file(20_000).encode()  # 2 MB, ~25 MB of objects
    objects, _ = parse_in_child("big.yaml", data)
    assert len(objects) == 20_000
    with pytest.raises(ManifestError, match="refused: (MemoryError|the parser process failed)"):
        parse_in_child("big.yaml", data, memory=24 * 1024 * 1024)
    with pytest.raises(ManifestError, match="took longer than"):
        parse_in_child("big.yaml", data, timeout=0.05)


# ---- the text-only depth bound that lets ordinary files skip the event walk ----------------


def _depth(node: yaml.Node) -> int:
    if isinstance(node, yaml.SequenceNode):
        return 1 + max((_depth(n) for n in node.value), default=0)
    if isinstance(node, yaml.MappingNode):
        return 1 + max((max(_depth(k), _depth(v)) for k, v in node.value), default=0)
    return 0


def _actual_depth(data: bytes) -> int:
    return max((_depth(n) for n in yaml.compose_all(data, Loader=yaml.SafeLoader)), default=0)


def _assert_bound_holds(data: bytes) -> None:
    actual = _actual_depth(data)
    assert yamlsafe.depth_bound(data) >= actual, data
    assert not yamlsafe.within_depth(data, actual - 1), data
    if yamlsafe.within_depth(data, actual + 200):
        assert yamlsafe.depth_bound(data) <= actual + 200


@pytest.mark.parametrize("text", [
    "- - - - x\n",
    "a:\n- b:\n  - c:\n    - d: [e, {f: [g]}]\n",
    "? - a\n  - b\n: - c\n",
    "- !!map\n  a: !!seq\n  - &n {b: [c]}\n  - *n\n",
    "- &x a: 1\n  b: 2\n",
    "a:\r  b:\r    c:\r      d: 1\r",
    "a:\r\n  b:\r\n    c: 1\r\n",
    "a:\u0085  b:\u0085    c: 1\u0085",
    "\ufeffa:\n  b:\n    c: 1\n",
    "--- [[[1]]]\n--- {a: {b: {c: 1}}}\n---\n- - - 1\n",
    "a: [\n  [\n    [1],\n  ],\n]\n",
    "a: {}\nb: []\nc: [[], {}, [[]]]\n",
])
def test_the_depth_bound_holds_on_tricky_yaml(text: str) -> None:
    _assert_bound_holds(text.encode())


def _nested() -> Any:
    from hypothesis import strategies as st
    scalars = st.one_of(st.integers(), st.text(max_size=8), st.booleans(), st.none())
    return st.recursive(
        scalars,
        lambda children: st.one_of(st.lists(children, max_size=4),
                                   st.dictionaries(st.text(max_size=5), children, max_size=4)),
        max_leaves=40)


def test_the_depth_bound_holds_on_dumped_structures() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=300, deadline=None)
    @given(_nested(), st.sampled_from([False, True, None]), st.integers(2, 8),
           st.sampled_from([20, 80]))
    def check(obj: Any, flow: bool | None, indent: int, width: int) -> None:
        data = yaml.safe_dump(obj, default_flow_style=flow, indent=indent, width=width,
                              allow_unicode=True).encode()
        _assert_bound_holds(data)

    check()


def test_the_watcher_diffs_only_what_changed_and_stays_exact(tmp_path: Path) -> None:
    """Random edits (duplicates across files, deletions, skipped generations): after every
    poll the store equals a full read of the directory."""
    import random
    rng = random.Random(13)
    loader = ManifestLoader(str(tmp_path), grace=0.0)
    store = ObjectStore()
    w = ManifestWatcher(str(tmp_path), store, loader=loader)
    incremental = 0
    for step in range(60):
        name = tmp_path / f"f{rng.randrange(6)}.yaml"
        if rng.random() < 0.2 and name.exists():
            name.unlink()
        else:
            pods = [pod_doc(f"p{rng.randrange(12)}", v=str(rng.randrange(3)))
                    for _ in range(rng.randrange(1, 4))]
            rewrite(name, "---\n".join(pods))
        for _ in range(rng.randrange(3)):  # the scan thread moves on between polls
            loader.scan()
        before = w._generation
        w.poll_once()
        incremental += loader.changed_between(before, w._generation) is not None
        truth, _ = ManifestDir(str(tmp_path)).read()
        assert {k: v for k, v in store.snapshot().items()} == truth, step
    assert incremental > 50


def test_the_watch_cache_in_manifest_mode_reads_the_snapshot_not_a_lagging_store(
        tmp_path: Path, gate: Gate) -> None:
    from agent.source.cached import CachedSource
    (tmp_path / "ns.yaml").write_text(NS)
    (tmp_path / "web.yaml").write_text(pod_doc("web", v="1"))
    loader = ManifestLoader(str(tmp_path))
    store = ObjectStore()
    ManifestWatcher(str(tmp_path), store, loader=loader).poll_once()  # the store: v=1
    src = CachedSource(ManifestSource(str(tmp_path), loader=loader, lookup_wait=5), store)
    rewrite(tmp_path / "web.yaml", pod_doc("web", v="2"))
    loader.scan()  # the snapshot moved on; the watcher (applying something big) has not
    pod = src.get_pod("app", "web")
    assert pod is not None and pod.labels == {"v": "2"}
    gate.hold.add("api.yaml")
    (tmp_path / "api.yaml").write_text(pod_doc("api"))
    started = time.monotonic()
    assert src.get_namespace("app") is not None  # a hit: no wait for the stuck scan
    assert time.monotonic() - started < 0.5
    gate.open.set()
    assert src.get_pod("app", "api") is not None  # a miss waits for a scan


def test_namespaces_are_applied_before_their_pods(tmp_path: Path) -> None:
    """The mesh model re-evaluates a namespace's every pod when the namespace changes: a
    namespace applied after 50k pods holds its lock for seconds, so it always goes first."""
    loader = ManifestLoader(str(tmp_path), grace=0.0)
    store = ObjectStore()
    seen: list[str] = []
    store.on_event(lambda e: seen.append(e.kind))
    w = ManifestWatcher(str(tmp_path), store, loader=loader)
    w.poll_once()  # empty: from now on the watcher diffs incrementally
    (tmp_path / "all.yaml").write_text("---\n".join(
        [pod_doc(f"p{i}") for i in range(40)] + [NS]))
    w.poll_once()
    assert seen[0] == "Namespace" and seen.count("Namespace") == 1 and len(seen) == 41
