"""Manifest source and the state file (no root)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from agent.capture.policy import AnnotationProblem, CapturePolicy
from agent.cni.state import CapturedPod, StateStore
from agent.source.base import PodEvent
from agent.source.manifests import ManifestSource


def test_manifest_source_reads_and_rereads(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: app, labels: {aether.io/managed: 'true'}}\n"
        "---\napiVersion: v1\nkind: Pod\nmetadata: {name: web, namespace: app, uid: u1,\n"
        "  annotations: {capture.aether.io/exclude-outbound-ports: '53'}}\n"
        "spec: {serviceAccountName: web-sa, nodeName: n1}\n"
    )
    src = ManifestSource(str(tmp_path))
    pod = src.get_pod("app", "web")
    assert pod is not None and pod.service_account == "web-sa" and pod.uid == "u1"
    assert pod.annotations["capture.aether.io/exclude-outbound-ports"] == "53"
    ns = src.get_namespace("app")
    assert ns is not None and ns.labels["aether.io/managed"] == "true"
    assert src.get_pod("app", "missing") is None
    time.sleep(0.01)
    (tmp_path / "b.yaml").write_text(
        "apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Pod, metadata: {name: db}}\n")
    assert src.get_pod("default", "db") is not None
    (tmp_path / "broken.yaml").write_text("kind: [unclosed\n")
    assert src.get_pod("app", "web") is not None
    assert any("broken.yaml" in p for p in src.problems)
    kinds = {e.kind for e in src.snapshot()}
    assert kinds == {"Namespace", "Pod"}
    src.record_event(PodEvent("app", "web", "u1", "CaptureAnnotationInvalid", "bad"))
    assert src.events[-1].reason == "CaptureAnnotationInvalid"


def _pod(cid: str) -> CapturedPod:
    return CapturedPod(cid, "u", "app", "web", "sa", "/var/run/netns/x", "/var/run/netns/x",
                       "eth0", ["10.0.0.1"], CapturePolicy(True, 15001, 18081, 0xAE, 0xFF,
                                                          ((53, 53),), ("10.0.0.0/8",), ()),
                       "fp", "why", [AnnotationProblem("a", "b", "c")])


def test_state_roundtrip_and_atomic_file(tmp_path: Path) -> None:
    d = str(tmp_path / "pods")
    store = StateStore(d)
    store.put(_pod("c1"))
    store.put(_pod("c2"))
    store.remove("c2")
    assert sorted(os.listdir(d)) == ["c1.json"]
    assert os.stat(os.path.join(d, "c1.json")).st_mode & 0o777 == 0o600
    again = StateStore(d)
    again.load()
    assert list(again.pods) == ["c1"] and again.pods["c1"] == _pod("c1")


def test_a_record_serialises_exactly_as_asdict_did() -> None:
    """to_json skips asdict's deep copy; the JSON on disk must not change for it."""
    from dataclasses import asdict

    pod = _pod("c1")
    legacy = asdict(pod)
    del legacy["loopback"]  # read at ADD, never recorded
    del legacy["labels"]  # read at ADD, never recorded
    legacy["policy"] = pod.policy.to_json()
    legacy["problems"] = [asdict(p) for p in pod.problems]
    got = pod.to_json()
    assert json.dumps(got, sort_keys=True) == json.dumps(legacy, sort_keys=True)
    got["ips"].append("10.9.9.9")  # a copy, as asdict's was
    assert pod.ips == ["10.0.0.1"]
    assert CapturedPod.from_json(json.loads(json.dumps(pod.to_json()))) == pod


def test_corrupt_record_reported_moved_aside_others_kept(tmp_path: Path) -> None:
    d = tmp_path / "pods"
    store = StateStore(str(d))
    store.put(_pod("good"))
    (d / "bad.json").write_text('{"version": 1, "pod": {"uid": 1}}')
    (d / "trunc.json").write_text('{"version": 1, "pod": ')
    (d / "future.json").write_text(json.dumps({"version": 99, "pod": {}}))
    again = StateStore(str(d))
    again.load()
    assert list(again.pods) == ["good"]
    assert again.load_problem and "unreadable" in again.load_problem
    assert (d / "bad.json.corrupt").exists() and not (d / "bad.json").exists()
