"""The pure conflist transforms against the shapes real primary CNIs write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.install import conflist as cl

FIX = Path(__file__).parent / "fixtures" / "cni"
ENTRY = cl.NetconfOptions(agent_socket="/run/a.sock", capture_redirect_all_default=True,
                          log_level="debug").entry()


def load(name: str) -> cl.JSON:
    return cl.parse((FIX / name).read_text())


def test_entry_carries_the_netconf_keys() -> None:
    assert ENTRY == {"type": "aether-cni", "agent_socket": "/run/a.sock",
                     "capture_redirect_all_default": True, "log_level": "debug"}


@pytest.mark.parametrize("name", ["10-flannel.conflist", "10-calico.conflist",
                                  "05-cilium.conflist"])
def test_insert_last_into_conflist_and_idempotent(name: str) -> None:
    doc = load(name)
    out = cl.insert_entry(doc, ENTRY)
    assert out["plugins"][:-1] == doc["plugins"]
    assert out["plugins"][-1] == ENTRY
    assert {k: v for k, v in out.items() if k != "plugins"} == {
        k: v for k, v in doc.items() if k != "plugins"}
    assert cl.has_entry(out, ENTRY)
    assert cl.insert_entry(out, ENTRY) == out
    assert cl.remove_entry(out) == doc
    assert doc == load(name), "input must not be mutated"


def test_older_entries_replaced_never_duplicated() -> None:
    doc = load("10-calico-old-aether.conflist")
    assert not cl.has_entry(doc)
    out = cl.insert_entry(doc, ENTRY)
    types = [p["type"] for p in out["plugins"]]
    assert types == ["calico", "portmap", "aether-cni"]
    assert out["plugins"][-1] == ENTRY


def test_lone_conf_is_wrapped() -> None:
    doc = load("10-bridge.conf")
    out = cl.insert_entry(doc, ENTRY)
    assert out["cniVersion"] == "1.0.0" and out["name"] == "bridge-net"
    assert out["plugins"][0]["type"] == "bridge"
    assert "name" not in out["plugins"][0] and "cniVersion" not in out["plugins"][0]
    assert out["plugins"][1] == ENTRY
    assert cl.conflist_name("10-bridge.conf", doc) == "10-bridge.conflist"
    assert cl.conflist_name("10-x.conflist", out) == "10-x.conflist"
    assert cl.conflist_name("99-x.json", doc) == "99-x.conflist"


def test_multus_entry_once_at_top_level_removed_from_delegates() -> None:
    doc = load("00-multus.conf")
    assert cl.is_multus(doc) and cl.contains_entry(doc)
    out = cl.insert_entry(doc, ENTRY)
    assert [p["type"] for p in out["plugins"]] == ["multus", "aether-cni"]
    delegate = out["plugins"][0]["delegates"][0]
    assert [p["type"] for p in delegate["plugins"]] == ["calico", "portmap"]
    assert json.dumps(out).count('"aether-cni"') == 1
    assert cl.insert_entry(out, ENTRY) == out
    removed = cl.remove_entry(out)
    assert not cl.contains_entry(removed)
    assert [p["type"] for p in removed["plugins"]] == ["multus"]


def test_selection_follows_kubelet_rule() -> None:
    files = {
        "10-flannel.conflist": (FIX / "10-flannel.conflist").read_text(),
        "05-cilium.conflist": (FIX / "05-cilium.conflist").read_text(),
        "99-loopback.conf": (FIX / "10-bridge.conf").read_text(),
        "01-notes.txt": "{}",
        ".05-cilium.conflist.abc.tmp": "{}",
        "calico-kubeconfig": "apiVersion: v1",
    }
    assert cl.select_config(files) == "05-cilium.conflist"
    files["00-broken.conflist"] = "{not json"
    assert cl.select_config(files) == "05-cilium.conflist", "unparsable files are skipped"
    files["00-multus.conf"] = (FIX / "00-multus.conf").read_text()
    assert cl.select_config(files) == "00-multus.conf"
    assert cl.select_config({}) is None
    assert cl.select_config({"a.txt": "{}"}) is None


@pytest.mark.parametrize("text", ["[]", "{}", '{"plugins": "x"}', '{"plugins": [1]}', "nope"])
def test_parse_rejects_non_configs(text: str) -> None:
    with pytest.raises(cl.ConfigError):
        cl.parse(text)


def test_primary_type_and_hints() -> None:
    assert cl.primary_type(load("05-cilium.conflist")) == "cilium-cni"
    assert cl.primary_type(load("10-bridge.conf")) == "bridge"
    assert "cni.exclusive" in cl.fight_hint("cilium-cni")
    assert "weird" in cl.fight_hint("weird")


def test_has_entry_requires_ours_last() -> None:
    doc = load("10-flannel.conflist")
    wrong = dict(doc, plugins=[ENTRY, *doc["plugins"]])
    assert not cl.has_entry(wrong)
    assert not cl.has_entry(cl.insert_entry(doc, ENTRY), dict(ENTRY, log_level="info"))
