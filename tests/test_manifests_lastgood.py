"""A manifest that cannot be used is not an empty manifest (issue #12, item 7), no root.

Each file is parsed on its own, all or nothing; a file that fails keeps its last good
version; an in-place rewrite caught empty or half-written waits out a grace period.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agent.source.events import ObjectStore
from agent.source.manifests import ManifestDir, ManifestSource, load_objects
from agent.source.watch import ManifestWatcher

NS = """\
apiVersion: v1
kind: Namespace
metadata:
  name: app
  labels:
    aether.io/managed: "true"
"""
POD = """\
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: app}
"""


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def labels(src: ManifestSource, name: str = "app") -> dict[str, str] | None:
    ns = src.get_namespace(name)
    return None if ns is None else ns.labels


def rewrite(path: Path, data: bytes | str) -> None:
    """In place (same inode), the way `open(path, "w")` does it, with a new mtime."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    mode = "wb" if isinstance(data, bytes) else "w"
    with open(path, mode) as f:
        f.write(data)
    if path.stat().st_mtime_ns == before:  # coarse timestamps: make the change visible
        os.utime(path, ns=(before + 1_000_000, before + 1_000_000))


@pytest.mark.parametrize("bad", [
    "kind: Namespace\nmetadata: {name: app, labels: [\n",          # YAML error
    b"kind: Namespace\nmetadata: {name: \xff\xfe}\n",              # not UTF-8
    "this is garbage, not a manifest\n",                           # a document that is a str
    NS + "---\n- a list\n- at the top\n",                          # a later document not a mapping
    "apiVersion: v1\nkind: List\nitems: {a: b}\n",                 # List items not a list
    "apiVersion: v1\nkind: List\nitems: [1, 2]\n",                 # List items not mappings
])
def test_a_file_that_fails_to_parse_keeps_its_last_good_version(
        tmp_path: Path, bad: str | bytes) -> None:
    (tmp_path / "ns.yaml").write_text(NS)
    (tmp_path / "pod.yaml").write_text(POD)
    src = ManifestSource(str(tmp_path))
    assert labels(src) == {"aether.io/managed": "true"}
    rewrite(tmp_path / "ns.yaml", bad)
    assert labels(src) == {"aether.io/managed": "true"}  # last good, not "unmanaged"
    assert src.get_pod("app", "web") is not None  # the other file is untouched
    (problem,) = [p for p in src.problems if "ns.yaml" in p]
    assert "keeping its last good version (1 objects)" in problem
    # fixed: the new content is used and the problem is gone
    rewrite(tmp_path / "ns.yaml", NS.replace('"true"', '"false"'))
    assert labels(src) == {"aether.io/managed": "false"}
    assert src.problems == []


def test_a_bad_file_never_hides_the_other_files(tmp_path: Path) -> None:
    (tmp_path / "a-broken.yaml").write_text("kind: [unclosed\n")
    (tmp_path / "ns.yaml").write_text(NS)
    (tmp_path / "pod.yaml").write_text(POD)
    objects, problems = load_objects(str(tmp_path))
    assert set(objects) == {("Namespace", "", "app"), ("Pod", "app", "web")}
    assert len(problems) == 1 and "a-broken.yaml" in problems[0]
    assert "not loaded (no good version yet)" in problems[0]


def test_a_document_without_a_name_is_skipped_not_fatal(tmp_path: Path) -> None:
    (tmp_path / "ns.yaml").write_text(NS + "---\nkind: Pod\nmetadata: {}\n---\n")
    objects, problems = load_objects(str(tmp_path))
    assert set(objects) == {("Namespace", "", "app")}
    assert problems == [f"{tmp_path / 'ns.yaml'}: document without kind/metadata.name skipped"]


def test_an_emptied_file_keeps_its_objects_through_the_grace_period(tmp_path: Path) -> None:
    clock = Clock()
    (tmp_path / "ns.yaml").write_text(NS)
    src = ManifestSource(str(tmp_path), grace=2.0, clock=clock)
    assert labels(src) is not None
    rewrite(tmp_path / "ns.yaml", "")  # the truncation that starts every in-place rewrite
    clock.now = (tmp_path / "ns.yaml").stat().st_mtime + 0.5
    assert labels(src) == {"aether.io/managed": "true"}
    assert any("emptied, probably being rewritten" in p for p in src.problems)
    # the file stays empty past the grace period (no change on disk): emptied on purpose
    clock.now += 2.0
    assert labels(src) is None
    assert src.problems == []


def test_a_half_written_yaml_file_waits_then_counts(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "ns.yaml"
    path.write_text(NS)
    src = ManifestSource(str(tmp_path), grace=2.0, clock=clock)
    assert labels(src) == {"aether.io/managed": "true"}
    # cut mid-line: parses, but as a namespace without its labels
    rewrite(path, NS[: NS.index("  labels:") + len("  lab")])
    clock.now = path.stat().st_mtime + 0.1
    assert labels(src) == {"aether.io/managed": "true"}
    assert any("no final newline" in p for p in src.problems)
    # the writer finishes: the new content counts at once
    rewrite(path, NS.replace('"true"', '"false"'))
    assert labels(src) == {"aether.io/managed": "false"}
    # a file that really ends without a newline counts once it is old enough
    rewrite(path, NS.rstrip("\n"))
    clock.now = path.stat().st_mtime + 0.1
    assert labels(src) == {"aether.io/managed": "false"}
    clock.now += 5
    assert labels(src) == {"aether.io/managed": "true"}


def test_a_new_half_written_file_is_not_loaded_until_it_settles(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "ns.yaml"
    path.write_text(NS.rstrip("\n"))
    d = ManifestDir(str(tmp_path), grace=2.0, clock=clock)
    clock.now = path.stat().st_mtime + 0.1
    objects, problems = d.read()
    assert objects == {} and d.pending and "not loaded" in problems[0]
    clock.now += 5
    objects, _ = d.read()
    assert set(objects) == {("Namespace", "", "app")} and not d.pending


def test_deleting_a_file_removes_its_objects_at_once(tmp_path: Path) -> None:
    (tmp_path / "ns.yaml").write_text(NS)
    (tmp_path / "pod.yaml").write_text(POD)
    src = ManifestSource(str(tmp_path))
    assert src.get_pod("app", "web") is not None
    os.unlink(tmp_path / "pod.yaml")
    assert src.get_pod("app", "web") is None
    assert labels(src) is not None


def test_unchanged_files_are_not_parsed_again(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.source import manifests
    (tmp_path / "ns.yaml").write_text(NS)
    (tmp_path / "pod.yaml").write_text(POD)
    d = ManifestDir(str(tmp_path))
    d.read()
    parsed: list[str] = []
    real = manifests.parse_manifest

    def counting(path: str, data: bytes) -> Any:
        parsed.append(path)
        return real(path, data)

    monkeypatch.setattr(manifests, "parse_manifest", counting)
    rewrite(tmp_path / "pod.yaml", POD.replace("web", "api"))
    objects, _ = d.read()
    assert parsed == [str(tmp_path / "pod.yaml")]
    assert ("Pod", "app", "api") in objects and ("Namespace", "", "app") in objects


def test_manifest_watcher_keeps_last_good_objects_and_reports(tmp_path: Path) -> None:
    (tmp_path / "ns.yaml").write_text(NS)
    (tmp_path / "pod.yaml").write_text(POD)
    store = ObjectStore()
    seen: list[tuple[str, str]] = []
    store.on_event(lambda e: seen.append((e.type, e.obj["metadata"]["name"])))
    stop = threading.Event()
    w = ManifestWatcher(str(tmp_path), store, stop, interval=0.05)
    w.poll_once()
    assert sorted(seen) == [("ADDED", "app"), ("ADDED", "web")]
    seen.clear()
    rewrite(tmp_path / "ns.yaml", "{{{ garbage\n")
    assert w.poll_once() == []
    assert store.get("Namespace", "", "app") is not None and seen == []
    assert any("ns.yaml" in p and "last good" in p for p in w.problems)
    rewrite(tmp_path / "ns.yaml", NS.replace('"true"', '"false"'))
    assert [e.type for e in w.poll_once()] == ["MODIFIED"]
    assert w.problems == []
