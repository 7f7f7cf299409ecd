"""A release whose table can be neither swapped nor dropped keeps the pod captured and says
so, instead of raising out of the enrollment pass or an uninstall."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from agent.capture.policy import CapturePolicy
from agent.cni import handler as handler_mod
from agent.cni.handler import CniFailure, CniHandler
from agent.cni.state import CapturedPod, StateStore
from agent.common.config import NodeConfig
from agent.netns import nft


def test_a_release_that_cannot_touch_the_table_keeps_the_capture(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = StateStore(str(tmp_path / "pods"))
    pod = CapturedPod(container_id="c1", uid="u1", namespace="app", name="p",
                      service_account="sa", netns=str(tmp_path / "gone"),
                      kubelet_netns=str(tmp_path / "gone"), ifname="eth0", ips=[],
                      policy=CapturePolicy(True, 15001, 18081, 0xAE, 0xFF), fingerprint="f",
                      reason="test")
    store.put(pod)
    source = types.SimpleNamespace(record_event=lambda _e: None)
    h = CniHandler(NodeConfig(node_name="n", run_dir=str(tmp_path)), source,  # type: ignore[arg-type]
                   store=store)

    def swap(netns: str, script: str, first: str | None = None) -> str:
        raise nft.NftError("busy")

    def drop(self: CniHandler, netns: str) -> None:
        raise CniFailure(11, "removing capture rules", "busy")

    monkeypatch.setattr(nft, "apply_ruleset", swap)
    monkeypatch.setattr(handler_mod.CniHandler, "_drop_table", drop)
    assert h.release("c1", "test") is False
    assert store.get("c1") is not None and h.counters.released == 0
