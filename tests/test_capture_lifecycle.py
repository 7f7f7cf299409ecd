"""ADD's success and every rollback branch, reconcile at start, the undo of an ADD a crash
interrupted and uninstall's release, with a fake capture dataplane (no root, no netns):
what was done to the pod's netns is undone in reverse when a later step fails, the add
intent is always closed, and the answer says why. The root integration tests keep the real
thing honest (integration/test_cni_*.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.cni import codes
from agent.cni.handler import CniHandler
from agent.cni.state import CapturedPod, StateStore
from agent.common.config import NodeConfig
from agent.netns.enter import NetnsError, NetnsId
from agent.source.manifests import ManifestSource

POD_NETNS = "/proc/4242/ns/net"  # dies with the sandbox process: the ADD pins it


class FakeDataplane:
    """Records every call; ``fail`` names the one step that raises."""

    def __init__(self, fail: str = "") -> None:
        self.fail = fail
        self.calls: list[tuple[str, str]] = []
        self.tables: dict[str, str] = {}
        self.pins: dict[str, str] = {}
        self.gone: set[str] = set()  # paths that are no netns any more
        self.stale: set[str] = set()  # pins whose mount is gone (an empty file left)
        self.idents: dict[str, NetnsId] = {}  # a path's netns identity, (1, 4242) if unset

    def _step(self, name: str, arg: str) -> None:
        self.calls.append((name, arg))
        if name == self.fail:
            raise OSError(5, f"{name} failed (fake)")

    def check_netns(self, path: str) -> None:
        self._step("check_netns", path)
        if path in self.gone or path in self.stale:
            raise NetnsError(f"{path} is not a network namespace (fake)")

    def identity(self, path: str) -> NetnsId:
        return self.idents.get(path, (1, 4242))

    def host_identities(self) -> set[NetnsId]:
        return {(1, 1)}

    def needs_pin(self, path: str) -> bool:
        return path.startswith("/proc/")

    def pin(self, source: str, target: str) -> None:
        self._step("pin", target)
        self.pins[target] = source

    def unpin(self, target: str) -> None:
        self._step("unpin", target)
        self.pins.pop(target, None)

    def is_stale_pin(self, path: str) -> bool:
        return False

    def netns_state(self, path: str) -> str:
        return "missing" if path in self.gone else "stale" if path in self.stale else "netns"

    def apply(self, netns: str, ruleset: str, first: str | None = None) -> str:
        self._step("apply", netns)
        self.tables[netns] = ruleset
        return "fp-1"

    def capture(self, netns: str, ruleset: str, first: str | None = None
                ) -> tuple[str, tuple[bool, bool]]:
        return self.apply(netns, ruleset, first), (True, False)  # an IPv4-only pod

    def drop(self, netns: str) -> bool:
        self._step("drop", netns)
        return self.tables.pop(netns, None) is not None

    def live_fingerprint(self, netns: str) -> str | None:
        return "fp-1" if netns in self.tables else None

    def listing(self, netns: str) -> str | None:
        return self.tables.get(netns)


class Sink:
    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.added: list[str] = []
        self.loopback: dict[str, tuple[bool, bool] | None] = {}

    def add_pod(self, pod: CapturedPod) -> None:
        self.loopback[pod.container_id] = pod.loopback
        if self.refuse:
            raise TimeoutError("Envoy did not ACK the listener (fake)")
        self.added.append(pod.container_id)

    def remove_pod(self, pod: CapturedPod) -> None:
        if pod.container_id in self.added:  # removing a listener never confirmed is fine
            self.added.remove(pod.container_id)


class FailingStore(StateStore):
    def put(self, record: CapturedPod) -> None:
        raise OSError(28, "No space left on device (fake)")


def _handler(tmp_path: Path, dp: FakeDataplane, sink: Sink | None = None,
             store_cls: type[StateStore] = StateStore) -> CniHandler:
    m = tmp_path / "m"
    m.mkdir(exist_ok=True)
    (m / "objs.yaml").write_text(
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: app, labels: {aether.io/managed: 'true'}}\n"
        "---\napiVersion: v1\nkind: Pod\nmetadata: {name: web, namespace: app, uid: u-web}\n")
    return CniHandler(NodeConfig(run_dir=str(tmp_path / "run")), ManifestSource(str(m)),
                      store_cls(str(tmp_path / "state.json")), sink or Sink(), dataplane=dp)


def _add(h: CniHandler, command: str = "ADD") -> dict[str, Any]:
    return h.handle({"command": command, "container_id": "c1", "netns": POD_NETNS,
                     "ifname": "eth0", "netconf": {}, "ips": ["10.1.0.5/24"],
                     "args": {"K8S_POD_NAMESPACE": "app", "K8S_POD_NAME": "web"}})


def _pin_path(tmp_path: Path) -> str:
    return str(tmp_path / "run" / "netns" / "c1")


def test_add_pins_programs_records_and_serves(tmp_path: Path) -> None:
    dp, sink = FakeDataplane(), Sink()
    h = _handler(tmp_path, dp, sink)
    out = _add(h)
    assert out["ok"] is True
    pinned = _pin_path(tmp_path)
    assert [c for c, _ in dp.calls] == ["check_netns", "pin", "apply"]
    assert dp.pins == {pinned: POD_NETNS} and "redirect" in dp.tables[pinned]
    (rec,) = h.store.all()
    assert (rec.netns, rec.kubelet_netns, rec.pinned, rec.fingerprint) == (pinned, POD_NETNS,
                                                                          True, "fp-1")
    assert sink.added == ["c1"] and h.counters.add_ok == 1
    assert h.store.intents() == []  # the intent is closed
    # the loopback families came with the rules, from the same visit to the netns
    assert sink.loopback == {"c1": (True, False)}


def test_add_whose_rules_fail_releases_the_pin(tmp_path: Path) -> None:
    dp = FakeDataplane(fail="apply")
    h = _handler(tmp_path, dp)
    out = _add(h)
    assert out["ok"] is False and out["code"] == codes.ERR_CAPTURE_FAILED
    assert "programming capture rules" in out["msg"] and "pod not started" in out["msg"]
    assert [c for c, _ in dp.calls] == ["check_netns", "pin", "apply", "unpin"]
    assert dp.pins == {} and dp.tables == {} and h.store.all() == []
    assert h.store.intents() == []


def test_add_whose_pin_fails_touches_nothing_else(tmp_path: Path) -> None:
    dp = FakeDataplane(fail="pin")
    h = _handler(tmp_path, dp)
    out = _add(h)
    assert out["ok"] is False and "cannot pin netns" in out["msg"]
    assert [c for c, _ in dp.calls] == ["check_netns", "pin"]
    assert dp.tables == {} and h.store.all() == [] and h.store.intents() == []


def test_add_whose_record_cannot_be_written_removes_rules_then_pin(tmp_path: Path) -> None:
    dp = FakeDataplane()
    h = _handler(tmp_path, dp, store_cls=FailingStore)
    out = _add(h)
    assert out["ok"] is False and "cannot record the capture" in out["msg"]
    pinned = _pin_path(tmp_path)
    # undone in reverse: the table, then the pin
    assert dp.calls[-2:] == [("drop", pinned), ("unpin", pinned)]
    assert dp.tables == {} and dp.pins == {} and h.store.intents() == []


def test_add_whose_listener_is_refused_fails_and_del_cleans_up(tmp_path: Path) -> None:
    """The proxy did not confirm the listener: the ADD fails (the pod is not started, so
    its traffic is never refused by a missing listener); the record stays so the DEL that
    follows a failed ADD (CNI spec) removes the rules and the pin."""
    dp, sink = FakeDataplane(), Sink(refuse=True)
    h = _handler(tmp_path, dp, sink)
    out = _add(h)
    assert out["ok"] is False and "did not confirm the capture listener" in out["msg"]
    assert len(h.store.all()) == 1 and dp.tables and dp.pins
    assert _add(h, command="DEL")["ok"] is True
    assert h.store.all() == [] and dp.tables == {} and dp.pins == {}


def test_add_into_a_missing_netns_is_refused_before_any_step(tmp_path: Path) -> None:
    dp = FakeDataplane(fail="check_netns")
    h = _handler(tmp_path, dp)
    out = _add(h)
    assert out["ok"] is False and out["code"] == codes.ERR_INVALID_ENV
    assert dp.calls == [("check_netns", POD_NETNS)] and h.store.all() == []


def test_the_node_netns_is_never_captured(tmp_path: Path) -> None:
    dp = FakeDataplane()
    dp.identity = lambda path: (1, 1)  # type: ignore[method-assign]
    h = _handler(tmp_path, dp)
    out = _add(h)
    assert out["ok"] is False and "node's own network namespace" in out["msg"]
    assert [c for c, _ in dp.calls] == ["check_netns"]


# ---- reconcile at start (agent.runtime.app.Agent.reconcile), through the same fake ---------------

def _agent_with(tmp_path: Path, dp: FakeDataplane, sink: Sink) -> Any:
    from agent.runtime.app import Agent
    h = _handler(tmp_path, dp, sink)  # writes the manifests, makes the node config
    return Agent(h.node, h.source, sink, dataplane=dp)


def _recorded(agent: Any, netns: str = "/var/run/netns/cni-1", fp: str = "fp-1") -> CapturedPod:
    from agent.capture.policy import decide
    from agent.source.model import NamespaceMeta, PodMeta
    d = decide(PodMeta("app", "web", uid="u-web"),
               NamespaceMeta("app", labels={"aether.io/managed": "true"}), agent.node, True)
    assert d.policy is not None
    pod = CapturedPod(container_id="c1", uid="u-web", namespace="app", name="web",
                      service_account="default", netns=netns, kubelet_netns=netns,
                      ifname="eth0", ips=["10.1.0.5/24"], policy=d.policy, fingerprint=fp,
                      reason=d.reason, problems=[], pinned=False, captured_at=0.0)
    agent.store.put(pod)
    return pod


def test_reconcile_reprograms_a_drifted_table_and_restores_the_listener(tmp_path: Path) -> None:
    dp, sink = FakeDataplane(), Sink()
    agent = _agent_with(tmp_path, dp, sink)
    _recorded(agent, fp="fp-old")  # the kernel holds no table there (lost, or edited away)
    agent.reconcile()
    assert ("apply", "/var/run/netns/cni-1") in dp.calls
    (rec,) = agent.store.all()
    assert rec.fingerprint == "fp-1"  # the record follows what the kernel now holds
    assert sink.added == ["c1"]
    assert any("re-programmed" in n for n in agent.reconcile_report)


def test_reconcile_drops_a_pod_whose_netns_is_gone(tmp_path: Path) -> None:
    from agent.netns.enter import NetnsError

    def gone(path: str) -> None:
        raise NetnsError(f"{path}: no such network namespace (fake)")
    dp, sink = FakeDataplane(), Sink()
    dp.check_netns = gone  # type: ignore[method-assign]
    agent = _agent_with(tmp_path, dp, sink)
    _recorded(agent)
    agent.reconcile()
    assert agent.store.all() == [] and sink.added == []
    assert not any(c == "apply" for c, _ in dp.calls)  # nothing programmed into a dead netns
    assert any("gone" in n for n in agent.reconcile_report)


def test_reconcile_reports_a_table_it_cannot_program(tmp_path: Path) -> None:
    dp, sink = FakeDataplane(fail="apply"), Sink()
    agent = _agent_with(tmp_path, dp, sink)
    _recorded(agent, fp="fp-old")
    agent.reconcile()
    assert any("re-programming failed" in n for n in agent.reconcile_report)
    assert len(agent.store.all()) == 1  # kept: the next CHECK or repair sees the drift


# -- the undo of an interrupted ADD, uninstall's release: the same dataplane -------------------


def test_an_add_interrupted_before_its_record_is_undone_through_the_dataplane(
        tmp_path: Path) -> None:
    from agent.cni.state import AddIntent
    from agent.runtime.recovery import recover_interrupted_adds

    dp = FakeDataplane()
    pin = tmp_path / "netns" / "c9"
    pin.parent.mkdir()
    pin.write_text("")  # the pin the interrupted ADD made
    dp.tables[str(pin)] = "table"
    store = StateStore(str(tmp_path / "pods"))
    store.begin_add(AddIntent("c9", POD_NETNS, str(pin), True))
    notes: list[str] = []
    recover_interrupted_adds(store, str(pin.parent), notes.append, dp)
    assert ("drop", str(pin)) in dp.calls and ("unpin", str(pin)) in dp.calls
    assert dp.tables == {} and store.intents() == []
    assert "table dropped" in notes[0] and "pin" in notes[0]


def test_an_interrupted_add_leaves_a_netns_a_record_owns_alone(tmp_path: Path) -> None:
    from agent.runtime.recovery import undo

    dp = FakeDataplane()
    h = _handler(tmp_path, dp)
    assert _add(h)["ok"] is True  # c1 captured: its netns (fake identity) is owned
    dp.calls.clear()
    notes: list[str] = []
    assert undo(h.store, "c-other", "/var/run/netns/elsewhere", False, "", notes.append, dp)
    assert not any(c[0] == "drop" for c in dp.calls)
    assert "left alone (captured for app/web" in notes[0]


def test_uninstall_releases_a_record_through_the_dataplane_never_the_node_netns(
        tmp_path: Path) -> None:
    from dataclasses import replace

    from agent.ops.uninstall import release_record

    dp = FakeDataplane()
    h = _handler(tmp_path, dp)
    assert _add(h)["ok"] is True
    pod = h.store.all()[0]
    assert pod.pinned and dp.tables
    Path(pod.netns).parent.mkdir(parents=True, exist_ok=True)
    Path(pod.netns).write_text("")  # the fake pins nothing on disk; the release looks
    assert release_record(pod, dp) == ""
    assert dp.tables == {} and ("unpin", pod.netns) in dp.calls
    # a record naming the node's own netns (by identity) is never touched
    dp.identity = lambda path: (1, 1)  # type: ignore[method-assign]
    dp.calls.clear()
    assert release_record(replace(pod, pinned=False), dp) == ""
    assert not any(c[0] == "drop" for c in dp.calls)
    # a failing drop is reported, not raised
    dp = FakeDataplane(fail="drop")
    assert "dropping the table" in release_record(replace(pod, pinned=False), dp)


# -- reconcile at start, pinned pods: judged by kubelet's path, the pin re-made if lost --------


def _pinned(agent: Any) -> CapturedPod:
    from dataclasses import replace
    pod = replace(_recorded(agent), netns="/run/aether/netns/c1", kubelet_netns=POD_NETNS,
                  pinned=True)
    agent.store.put(pod)
    return pod


def test_reconcile_keeps_a_pinned_pod_whose_pin_and_sandbox_agree(tmp_path: Path) -> None:
    dp, sink = FakeDataplane(), Sink()
    agent = _agent_with(tmp_path, dp, sink)
    pod = _pinned(agent)
    dp.tables[pod.netns] = "table"
    agent.reconcile()
    assert [p.container_id for p in agent.store.all()] == ["c1"] and sink.added == ["c1"]
    assert not any(c[0] in ("pin", "unpin", "drop") for c in dp.calls)


def test_reconcile_remakes_a_lost_pin_from_the_sandbox_path(tmp_path: Path) -> None:
    dp, sink = FakeDataplane(), Sink()
    agent = _agent_with(tmp_path, dp, sink)
    pod = _pinned(agent)
    dp.stale.add(pod.netns)  # the agent's mounts did not survive
    dp.tables[POD_NETNS] = "table"  # the netns still holds our table
    agent.reconcile()
    assert dp.pins == {pod.netns: POD_NETNS}
    assert any("re-pinned" in n for n in agent.reconcile_report)
    assert [p.container_id for p in agent.store.all()] == ["c1"]


def test_reconcile_releases_a_pinned_pod_whose_sandbox_pid_is_another_netns(
        tmp_path: Path) -> None:
    dp, sink = FakeDataplane(), Sink()
    agent = _agent_with(tmp_path, dp, sink)
    pod = _pinned(agent)
    dp.idents[POD_NETNS] = (1, 9999)  # the pid was reused by another sandbox
    agent.reconcile()
    assert agent.store.all() == [] and ("unpin", pod.netns) in dp.calls
    assert any("another netns" in n for n in agent.reconcile_report)


def test_reconcile_releases_a_pinned_pod_whose_lost_pin_left_no_table(tmp_path: Path) -> None:
    dp, sink = FakeDataplane(), Sink()
    agent = _agent_with(tmp_path, dp, sink)
    pod = _pinned(agent)
    dp.stale.add(pod.netns)
    agent.reconcile()  # nothing of ours in the kubelet path: not re-pinned, released
    assert agent.store.all() == [] and pod.netns not in dp.pins
    assert any("holds no aether table" in n for n in agent.reconcile_report)


def test_the_handler_answers_with_a_frozen_typed_verdict(tmp_path: Path) -> None:
    import dataclasses

    import pytest

    from agent.cni.messages import CniAnswer

    h = _handler(tmp_path, FakeDataplane())
    ok = h.answer({"command": "ADD", "container_id": "c1", "netns": POD_NETNS, "ifname": "eth0",
                   "netconf": {}, "ips": ["10.1.0.5/24"],
                   "args": {"K8S_POD_NAMESPACE": "app", "K8S_POD_NAME": "web"}})
    assert ok == CniAnswer(True) and ok.to_json() == {"ok": True}
    bad = h.answer({"command": "ADD", "container_id": "no spaces allowed"})
    assert not bad.ok and bad.code == codes.ERR_INVALID_ENV and "CNI_CONTAINERID" in bad.msg
    assert bad.to_json() == {"ok": False, "code": bad.code, "msg": bad.msg, "details": ""}
    with pytest.raises(dataclasses.FrozenInstanceError):
        bad.ok = True  # type: ignore[misc]


def test_a_pod_listener_uses_the_families_its_add_read(monkeypatch: Any) -> None:
    """An ADD's listener binds the families read on the rules visit (no second entry into
    the netns); a pod re-served after a restart, with none recorded, is asked again."""
    import pytest

    from agent.envoy import sink as sink_mod
    from agent.netns.families import NoLoopback

    asked: list[str] = []
    monkeypatch.setattr(sink_mod, "loopback_families",
                        lambda netns: asked.append(netns) or (True, True))
    pod = CapturedPod(container_id="c1", uid="u", namespace="app", name="web",
                      service_account="default", netns="/n/1", kubelet_netns="/n/1",
                      ifname="eth0", ips=["10.1.0.5/24"], policy=None,  # type: ignore[arg-type]
                      fingerprint="", reason="", loopback=(True, False))
    lis = sink_mod.pod_listener(pod)
    assert (lis.ipv4, lis.ipv6) == (True, False) and asked == []
    pod.loopback = None
    lis = sink_mod.pod_listener(pod)
    assert (lis.ipv4, lis.ipv6) == (True, True) and asked == ["/n/1"]
    pod.loopback = (False, False)
    with pytest.raises(NoLoopback):
        sink_mod.pod_listener(pod)


def test_a_policy_update_after_the_pods_del_brings_nothing_back(tmp_path: Path) -> None:
    """A take-over's successor re-programs every recorded pod (the replaced proxy's RETURN
    out) while it serves CNI: a pod whose DEL won the race stays deleted, tables and record."""
    import dataclasses
    dp = FakeDataplane()
    h = _handler(tmp_path, dp)
    assert _add(h)["ok"] is True
    (snapshot,) = h.store.all()  # what the re-programming loop iterates over
    assert _add(h, "DEL")["ok"] is True
    dp.tables.clear()
    changed = h.update_policy(snapshot.container_id,
                              lambda p: dataclasses.replace(p, exclude_ports=((9999, 9999),)))
    assert changed is False and h.store.all() == [] and dp.tables == {}


def test_a_policy_update_starts_from_the_policy_recorded_now(tmp_path: Path) -> None:
    import dataclasses
    dp = FakeDataplane()
    h = _handler(tmp_path, dp)
    assert _add(h)["ok"] is True
    (rec,) = h.store.all()
    assert h.reapply(rec.container_id, dataclasses.replace(rec.policy, exclude_ports=((81, 81),)),
                     "annotation changed")
    assert h.update_policy(rec.container_id,
                           lambda p: dataclasses.replace(p, exclude_v4=("10.9.0.0/16",)))
    (now,) = h.store.all()
    assert now.policy.exclude_ports == ((81, 81),) and now.policy.exclude_v4 == ("10.9.0.0/16",)
    assert now.reason == "annotation changed"  # kept: no reason given
