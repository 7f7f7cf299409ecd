"""The plain parts of a take-over (agent.runtime.takeover): slots, names, the peer's RETURN in the
rules, sockets renamed over a live one, and what `status` says."""

from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import replace

from agent.capture.policy import CapturePolicy, decide, with_node_proxies
from agent.capture.rules import render_rules
from agent.cni.server import UnixJsonServer
from agent.common.config import NodeConfig
from agent.ops.status_view import takeover_lines
from agent.runtime.takeover import (
    Peer,
    control_socket,
    other_slot,
    peer_cgroup_name,
    xds_socket,
)
from agent.source.model import NamespaceMeta, PodMeta

NS = NamespaceMeta("app", labels={"aether.io/managed": "true"})


def _node(peer: tuple[str, int] | None = None) -> NodeConfig:
    node = NodeConfig(proxy_cgroup="unified/b/aether-proxy", proxy_cgroup_level=2)
    node.peer_proxy.set(peer)
    return node


def test_slots_alternate_and_the_first_keeps_the_old_paths() -> None:
    assert other_slot("envoy") == "envoy-b" and other_slot("envoy-b") == "envoy"
    assert xds_socket("/run/a", "envoy") == "/run/a/xds.sock"  # an adopted Envoy names it
    assert xds_socket("/run/a", "envoy-b") == "/run/a/envoy-b/xds.sock"
    assert control_socket("/run/a", "aether-agent-x7k2p") == "/run/a/agents/aether-agent-x7k2p.sock"
    assert control_socket("/run/a", "../../etc/x") == "/run/a/agents/.._.._etc_x.sock"


def test_the_peer_cgroup_is_named_through_its_envoys_root() -> None:
    # nft prefixes /sys/fs/cgroup/: three levels up is /, then the peer's own mount
    name = peer_cgroup_name(4242, "aether-proxy")
    assert os.path.normpath("/sys/fs/cgroup/" + name) == \
        "/proc/4242/root/sys/fs/cgroup/aether-proxy"


def test_during_a_takeover_both_proxies_return_and_nothing_else_changes() -> None:
    alone = decide(PodMeta("app", "p"), NS, _node(), True).policy
    both = decide(PodMeta("app", "p"), NS, _node(("../../../proc/self/fd/7", 3)), True).policy
    assert alone is not None and both is not None
    r1, r2 = render_rules(alone), render_rules(both)
    assert r2[0] == r1[0]  # this agent's own RETURN first
    assert r2[1].startswith('meta mark & 0x000000ff == 0x000000ae socket cgroupv2 level 3 '
                            '"../../../proc/self/fd/7" return')
    assert r2[2:] == r1[1:]  # then exactly the rules of a single agent
    assert "redirect" in r2[-1]
    # no peer without an own cgroup match: a mark-only node has nothing to bind it to
    mark_only = NodeConfig()
    mark_only.peer_proxy.set(("x", 1))
    d = decide(PodMeta("app", "p"), NS, mark_only, True).policy
    assert d is not None and d.peer_cgroup is None


def test_a_recorded_policy_takes_this_agents_cgroups() -> None:
    """A record written by the replaced agent names its cgroup; reconcile renders ours (and
    the peer's while it drains), then ours alone once it is gone."""
    recorded = decide(PodMeta("app", "p"), NS, NodeConfig(proxy_cgroup="unified/a/aether-proxy",
                                                         proxy_cgroup_level=2), True).policy
    assert recorded is not None
    during = with_node_proxies(recorded, _node(("../../../proc/self/fd/7", 2)))
    assert (during.proxy_cgroup, during.peer_cgroup) == ("unified/b/aether-proxy",
                                                         "../../../proc/self/fd/7")
    after = with_node_proxies(during, _node())
    assert after.peer_cgroup is None and after.proxy_cgroup == "unified/b/aether-proxy"
    assert replace(after, proxy_cgroup=recorded.proxy_cgroup) == recorded
    # the peer survives the record round trip; a policy without one keeps its old JSON
    assert CapturePolicy.from_json(during.to_json()) == during
    assert "peer_cgroup" not in after.to_json()


def test_a_socket_renamed_over_a_live_one_and_stopping_leaves_the_successors() -> None:
    d = tempfile.mkdtemp()
    path = os.path.join(d, "cni.sock")
    old = UnixJsonServer(path, lambda raw: b'{"who": "old"}', "old")
    old.start()
    new = UnixJsonServer(path, lambda raw: b'{"who": "new"}', "new")
    new.start(replace=True)
    assert new.owns_path() and not old.owns_path()
    old.stop()  # the old agent's stop must not remove the successor's socket
    assert os.path.exists(path)
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(b"{}")
        s.shutdown(socket.SHUT_WR)
        assert b"new" in s.recv(100)
    new.stop()
    assert not os.path.exists(path)


def test_peer_from_hello_and_status_lines() -> None:
    peer = Peer.from_hello({"hello": {"pid": 10, "instance": "agent-a", "control": "/c",
                                      "slot": "envoy", "envoy_pid": None,
                                      "proxy_cgroup": "aether-proxy", "proxy_cgroup_level": 4}})
    assert peer.cgroup_for_rules() is None  # no Envoy to name the cgroup through
    assert takeover_lines({"role": "serving"}) == []
    (line,) = takeover_lines({"instance": "agent-b", "pid": 11, "slot": "envoy-b",
                              "replaced": {"instance": "agent-a", "pid": 10, "version": "0.1.0",
                                           "state": "draining", "connections_left": 3,
                                           "seconds_left": 12.5}})
    assert "serving as agent-b" in line and "replacing agent-a" in line
    assert "3 connections left" in line and "12.5s left" in line


def test_a_plain_start_adopts_the_slot_that_serves() -> None:
    from agent.runtime.takeover import choose_slot
    assert choose_slot(None, []) == ("envoy", None)
    assert choose_slot("envoy-b", ["envoy-b"]) == ("envoy-b", None)  # adopt the new agent's
    assert choose_slot("envoy", ["envoy-b"]) == ("envoy-b", None)  # the record lagged
    assert choose_slot("envoy-b", []) == ("envoy-b", None)
    # a take-over cut short by a crash: both live; the recorded one is adopted
    assert choose_slot("envoy-b", ["envoy", "envoy-b"]) == ("envoy-b", "envoy")
    assert choose_slot("bogus", []) == ("envoy", None)
