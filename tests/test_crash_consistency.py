"""Crash consistency of ADD/DEL (issue #13 item 3), no root needed.

The "kernel" is faked at the nft boundary and network namespaces are plain files (a hard
link is another path to the same namespace, like a pin); `netns_state` is told which files
are live namespaces, so a file outside that set is what a pin becomes once its mount is gone.
A crash at a fault point is an exception nothing in the agent catches.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from agent.cni import lifecycle as handler_mod  # the ADD steps and their fault points
from agent.cni.handler import CniHandler
from agent.cni.state import AddIntent, StateStore
from agent.common.config import NodeConfig
from agent.netns import dataplane as dataplane_mod
from agent.netns import nft
from agent.netns import pin as pin_mod
from agent.netns.enter import NetnsError, netns_identity
from agent.runtime import recovery
from agent.source.manifests import ManifestSource

POINTS = ["crash-after-pin", "crash-after-rules", "crash-before-listener", "crash-after-listener"]


class Crash(BaseException):
    """The agent dies here (os._exit in the real fault point)."""


class World:
    """Fake kernel: namespaces are files, tables are keyed by their identity, pins are hard
    links; `live` are the paths that are network namespaces."""

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp / "ns"
        self.dir.mkdir()
        self.tables: dict[tuple[int, int], str] = {}
        self.pins: set[str] = set()
        for name in ("host", "pod1", "pod2"):
            (self.dir / name).write_text(name)
        self.host = netns_identity(self.path("host"))

    def path(self, name: str) -> str:
        return str(self.dir / name)

    def proc(self, name: str) -> str:
        """A path that needs a pin, to the namespace `name` (like /proc/<pid>/ns/net)."""
        link = self.dir / f"proc-{name}"
        if not link.exists():
            os.link(self.dir / name, link)
        return str(link)

    def state(self, path: str) -> str:
        if not os.path.lexists(path):
            return "missing"
        ident = netns_identity(path)
        live = {netns_identity(self.path(n)) for n in ("host", "pod1", "pod2")}
        return "netns" if ident in live else "stale"

    # nft
    def apply_ruleset(self, netns: str, script: str, first: str | None = None) -> str:
        self._enterable(netns)
        self.tables[netns_identity(netns)] = script
        return "fp"

    def delete_table(self, netns: str) -> bool:
        self._enterable(netns)
        return self.tables.pop(netns_identity(netns), None) is not None

    def live_fingerprint(self, netns: str) -> str | None:
        self._enterable(netns)
        return "fp" if netns_identity(netns) in self.tables else None

    def _enterable(self, netns: str) -> None:
        if self.state(netns) == "stale":
            raise NetnsError(f"{netns} is not a network namespace")

    def has_table(self, name: str) -> bool:
        return netns_identity(self.path(name)) in self.tables

    # pins
    def pin(self, source: str, target: str) -> None:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.lexists(target):
            os.link(source, target)
        self.pins.add(target)

    def unpin(self, target: str) -> None:
        self.pins.discard(target)
        try:
            os.unlink(target)
        except FileNotFoundError:
            pass

    def lose_mount(self, target: str) -> None:
        """What a pin becomes when the mount namespace holding its mount goes away."""
        os.unlink(target)
        open(target, "w").close()


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> World:
    w = World(tmp_path)
    for name in ("apply_ruleset", "delete_table", "live_fingerprint"):
        monkeypatch.setattr(nft, name, getattr(w, name))
    # an ADD's visit (rules, then the loopback question) goes through whatever apply_ruleset
    # is at the time, so a test that breaks it later breaks the ADD too
    monkeypatch.setattr(nft, "apply_ruleset_and", lambda netns, script, first, then: (
        nft.apply_ruleset(netns, script, first), (True, True)))
    monkeypatch.setattr(dataplane_mod, "check_netns_path", lambda path: path)
    monkeypatch.setattr(dataplane_mod, "needs_pin", lambda path: "/proc-" in path)
    monkeypatch.setattr(dataplane_mod, "pin", w.pin)
    monkeypatch.setattr(dataplane_mod, "unpin", w.unpin)
    # the recovery of interrupted ADDs acts through the same dataplane
    monkeypatch.setattr(dataplane_mod, "netns_state", w.state)
    monkeypatch.setattr(dataplane_mod, "host_netns_identities", lambda: {w.host})
    return w


@pytest.fixture
def manifests(tmp_path: Path) -> str:
    m = tmp_path / "m"
    m.mkdir()
    (m / "ns.yaml").write_text(
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: app, labels: {aether.io/managed: 'true'}}\n")
    for name in ("web", "api"):
        (m / f"{name}.yaml").write_text(
            f"apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: app, uid: u-{name}}}\n")
    return str(m)


class Sink:
    def __init__(self) -> None:
        self.listeners: set[str] = set()

    def add_pod(self, pod: Any) -> None:
        self.listeners.add(pod.container_id)

    def remove_pod(self, pod: Any) -> None:
        self.listeners.discard(pod.container_id)


def agent(tmp_path: Path, manifests: str, sink: Sink | None = None) -> CniHandler:
    """A (re)started agent's handler over the run dir: state loaded, interrupted ADDs
    recovered, as Agent.start does before it serves."""
    run = tmp_path / "run"
    store = StateStore(str(run / "pods"))
    store.load()
    notes: list[str] = []
    recovery.recover_interrupted_adds(store, str(run / "netns"), notes.append)
    h = CniHandler(NodeConfig(run_dir=str(run)), ManifestSource(manifests), store, sink or Sink())
    h.notes = notes  # type: ignore[attr-defined]
    return h


def req(command: str = "ADD", cid: str = "c1", netns: str = "", pod: str = "web") -> dict[str, Any]:
    return {"command": command, "container_id": cid, "netns": netns, "ifname": "eth0",
            "netconf": {}, "ips": ["10.0.0.5"],
            "args": {"K8S_POD_NAMESPACE": "app", "K8S_POD_NAME": pod}}


def crash_at(monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    def fault(at: str) -> None:
        if at == point:
            raise Crash(at)

    monkeypatch.setattr(handler_mod, "_fault", fault)


def files(tmp_path: Path) -> dict[str, list[str]]:
    out = {}
    for sub in ("pods", "netns"):
        d = tmp_path / "run" / sub
        out[sub] = sorted(os.listdir(d)) if d.is_dir() else []
    return out


# ---- the state store ------------------------------------------------------------------------


def test_load_sweeps_temp_files_of_interrupted_writes(tmp_path: Path) -> None:
    d = tmp_path / "pods"
    d.mkdir()
    (d / ".pod.abc123").write_text('{"version": 1, "po')  # SIGKILL mid-write
    (d / ".pod.xyz").write_text("")
    store = StateStore(str(d))
    store.load()
    assert sorted(store.swept) == [".pod.abc123", ".pod.xyz"]
    assert os.listdir(d) == [] and store.load_problem is None


def test_intents_round_trip_and_survive_a_torn_one(tmp_path: Path) -> None:
    store = StateStore(str(tmp_path / "pods"))
    store.begin_add(AddIntent("c1", "/proc/7/ns/net", "/run/aether/netns/c1", True))
    store.begin_add(AddIntent("c2.x", "/var/run/netns/a", "/var/run/netns/a", False))
    (tmp_path / "pods" / "c3.adding").write_text("{")
    got = {i.container_id: i for i in store.intents()}
    assert got["c1"] == AddIntent("c1", "/proc/7/ns/net", "/run/aether/netns/c1", True)
    assert got["c2.x"].netns == "/var/run/netns/a" and not got["c2.x"].pinned
    assert got["c3"].netns == ""  # unreadable: only its name is known
    store.end_add("c1")
    store.end_add("c1")  # idempotent
    assert sorted(i.container_id for i in store.intents()) == ["c2.x", "c3"]
    store.load()  # intents are not records
    assert store.all() == []


# ---- ADD leaves no intent behind, on success or failure ---------------------------------------


def test_add_removes_its_intent_on_success_and_on_failure(
        tmp_path: Path, manifests: str, world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    h = agent(tmp_path, manifests)
    assert h.handle(req(netns=world.proc("pod1")))["ok"]
    assert files(tmp_path) == {"pods": ["c1.json"], "netns": ["c1"]}

    def broken(netns: str, script: str, first: str | None = None) -> str:
        raise nft.NftError("boom")

    monkeypatch.setattr(nft, "apply_ruleset", broken)
    out = h.handle(req(cid="c2", pod="api", netns=world.proc("pod2")))
    assert out["ok"] is False
    assert files(tmp_path) == {"pods": ["c1.json"], "netns": ["c1"]}  # pin released too


# ---- a crash at each step, then kubelet's DEL and ADD -----------------------------------------


@pytest.mark.parametrize("lost_mount", [False, True])
@pytest.mark.parametrize("point", POINTS)
def test_crash_at_each_step_then_restart_del_and_add_succeed(
        tmp_path: Path, manifests: str, world: World, monkeypatch: pytest.MonkeyPatch,
        point: str, lost_mount: bool) -> None:
    netns = world.proc("pod1")
    pin = str(tmp_path / "run" / "netns" / "c1")
    crash_at(monkeypatch, point)
    with pytest.raises(Crash):
        agent(tmp_path, manifests).handle(req(netns=netns))
    assert os.path.exists(pin)
    recorded = point in ("crash-before-listener", "crash-after-listener")
    assert files(tmp_path)["pods"] == (["c1.json"] if recorded else ["c1.adding"])
    if lost_mount:
        world.lose_mount(pin)
    (tmp_path / "run" / "pods" / ".pod.tmp1").write_text("{")

    monkeypatch.setattr(handler_mod, "_fault", lambda at: None)
    sink = Sink()
    h = agent(tmp_path, manifests, sink)
    if not recorded:  # undone by the restart: no intent, no pin, no table
        assert files(tmp_path) == {"pods": [], "netns": []}
        assert not world.has_table("pod1")
        assert any("c1: ADD interrupted" in n for n in h.notes)  # type: ignore[attr-defined]
    else:  # the record stays for reconcile to complete (not part of this unit)
        assert files(tmp_path)["pods"] == ["c1.json"]
    # kubelet: DEL (must succeed), ADD again (captures), final DEL (leaves nothing)
    out = h.handle(req(command="DEL", netns=netns))
    assert out["ok"], out
    assert files(tmp_path) == {"pods": [], "netns": []}
    assert not world.has_table("pod1")
    assert h.handle(req(netns=netns))["ok"]
    assert world.has_table("pod1") and sink.listeners == {"c1"}
    assert h.handle(req(command="DEL", netns=netns))["ok"]
    assert files(tmp_path) == {"pods": [], "netns": []}
    assert not world.has_table("pod1") and sink.listeners == set()


def test_del_without_a_restart_cleans_what_a_crashed_add_left(
        tmp_path: Path, manifests: str, world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """Even if the restart could not undo (or the intent was lost), DEL does: the table in a
    netns no record owns, the pin whether or not it is still a namespace, the intent."""
    h = agent(tmp_path, manifests)
    crash_at(monkeypatch, "crash-after-rules")
    with pytest.raises(Crash):
        h.handle(req(netns=world.proc("pod1")))
    monkeypatch.setattr(handler_mod, "_fault", lambda at: None)
    world.lose_mount(str(tmp_path / "run" / "netns" / "c1"))
    assert h.handle(req(command="DEL", netns=world.proc("pod1")))["ok"]
    assert files(tmp_path) == {"pods": [], "netns": []}
    assert not world.has_table("pod1")


def test_del_of_unknown_id_with_a_stale_pin_succeeds(
        tmp_path: Path, manifests: str, world: World) -> None:
    """The issue's state: a pin file that is no netns. DEL used to answer 11 for ever."""
    h = agent(tmp_path, manifests)
    stale = tmp_path / "run" / "netns" / "c9"
    stale.parent.mkdir(parents=True)
    stale.write_text("")
    out = h.handle(req(command="DEL", cid="c9", netns=world.path("gone")))
    assert out["ok"], out
    assert not stale.exists()


def test_del_of_a_record_whose_pin_lost_its_mount_succeeds(
        tmp_path: Path, manifests: str, world: World) -> None:
    h = agent(tmp_path, manifests)
    netns = world.proc("pod1")
    assert h.handle(req(netns=netns))["ok"]
    world.lose_mount(str(tmp_path / "run" / "netns" / "c1"))
    assert h.handle(req(command="DEL", netns=netns))["ok"]
    assert not world.has_table("pod1")  # dropped through kubelet's path
    assert files(tmp_path) == {"pods": [], "netns": []}


def test_del_of_unknown_id_never_touches_a_netns_another_record_owns(
        tmp_path: Path, manifests: str, world: World) -> None:
    h = agent(tmp_path, manifests)
    assert h.handle(req(cid="c1", netns=world.proc("pod1")))["ok"]
    # a stale id whose pin (a second path to pod1's netns) was left: table stays, pin goes
    os.link(world.path("pod1"), tmp_path / "run" / "netns" / "c7")
    assert h.handle(req(command="DEL", cid="c7", netns=world.path("pod1")))["ok"]
    assert world.has_table("pod1")
    assert files(tmp_path)["netns"] == ["c1"]


# ---- what the restart undoes, and what it leaves alone ----------------------------------------


def test_restart_leaves_tables_of_recorded_and_host_netns_alone(
        tmp_path: Path, manifests: str, world: World) -> None:
    h = agent(tmp_path, manifests)
    assert h.handle(req(cid="c1", netns=world.proc("pod1")))["ok"]
    store = h.store
    # intents of crashed ADDs pointing at pod1 (recorded for c1) and at the host's netns
    store.begin_add(AddIntent("c2", world.path("pod1"), world.path("pod1"), False))
    store.begin_add(AddIntent("c3", world.path("host"), world.path("host"), False))
    world.tables[world.host] = "someone's"
    # an orphan pin to pod1 under another id, and one whose mount is gone
    pins = tmp_path / "run" / "netns"
    os.link(world.path("pod1"), pins / "c4")
    (pins / "c5").write_text("")
    h2 = agent(tmp_path, manifests)
    assert world.has_table("pod1") and world.tables[world.host] == "someone's"
    assert files(tmp_path) == {"pods": ["c1.json"], "netns": ["c1"]}
    notes = " | ".join(h2.notes)  # type: ignore[attr-defined]
    assert "captured for app/web (container c1)" in notes
    assert "the node's own network namespace" in notes
    assert "pin" in notes and "c5" in notes


def test_restart_completes_an_add_whose_record_was_written(
        tmp_path: Path, manifests: str, world: World) -> None:
    """Record and intent both on disk (a crash between the two writes): the record wins."""
    h = agent(tmp_path, manifests)
    assert h.handle(req(netns=world.proc("pod1")))["ok"]
    h.store.begin_add(AddIntent("c1", world.proc("pod1"), str(tmp_path / "run/netns/c1"), True))
    h2 = agent(tmp_path, manifests)
    assert files(tmp_path) == {"pods": ["c1.json"], "netns": ["c1"]}
    assert world.has_table("pod1") and [r.container_id for r in h2.store.all()] == ["c1"]


def test_netns_state_never_opens_what_is_not_a_namespace(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    plain = tmp_path / "plain"
    plain.write_text("")
    assert pin_mod.netns_state(str(fifo)) == "stale"  # would block if it were opened
    assert pin_mod.netns_state(str(plain)) == "stale"
    assert pin_mod.netns_state(str(tmp_path)) == "stale"
    assert pin_mod.netns_state(str(tmp_path / "missing")) == "missing"
    assert pin_mod.netns_state("/proc/self/ns/net") == "netns"
    assert pin_mod.netns_state("/proc/self/ns/uts") == "stale"  # a namespace, not a network one


def test_mount_entry_reads_mountinfo(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 0:21 / /proc rw,relatime - proc proc rw\n"
        "90 30 8:1 /tmp/a\\040b/run/netns /tmp/a\\040b/run/netns rw shared:77 - ext4 /dev/sda1 rw\n"
        "91 90 0:4 net:[4026532] /tmp/a\\040b/run/netns/c1 rw shared:77 - nsfs nsfs rw\n")
    assert pin_mod.mount_entry("/tmp/a b/run/netns", str(info)) == ["shared:77"]
    assert pin_mod.mount_entry("/proc", str(info)) == []
    assert pin_mod.mount_entry("/tmp/a b/run", str(info)) is None


def test_pins_are_visible_in_the_own_mount_namespace(tmp_path: Path) -> None:
    assert pin_mod.pins_visible_to(os.getpid(), str(tmp_path)) is True
    assert pin_mod.pins_visible_to(2 ** 22 + 7, str(tmp_path)) is None  # no such process
