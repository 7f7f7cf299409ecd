"""The live-enrollment planner: policy in, steps out, no root."""

from __future__ import annotations

from agent.capture.policy import decide
from agent.cni.state import CapturedPod, SeenPod
from agent.common.config import NodeConfig
from agent.runtime.enroll import plan
from agent.source.model import NamespaceMeta, PodMeta

NODE = NodeConfig(node_name="n")
MANAGED = NamespaceMeta("app", {"aether.io/managed": "true"})
PLAIN = NamespaceMeta("app")


def _record(pod: PodMeta, ns: NamespaceMeta) -> CapturedPod:
    d = decide(pod, ns, NODE, True)
    assert d.policy is not None
    return CapturedPod(container_id="c1", uid=pod.uid, namespace=pod.namespace, name=pod.name,
                       service_account="default", netns="/n", kubelet_netns="/n", ifname="eth0",
                       ips=[], policy=d.policy, fingerprint="f", reason=d.reason,
                       redirect_all_default=True)


def _seen(pod: PodMeta) -> SeenPod:
    return SeenPod(container_id="c2", uid=pod.uid, namespace=pod.namespace, name=pod.name,
                   kubelet_netns="/n2", ifname="eth0", ips=[], netns_id=[1, 2],
                   redirect_all_default=True)


def test_label_gone_releases_and_label_added_captures() -> None:
    a, b = PodMeta("app", "a", uid="u1"), PodMeta("app", "b", uid="u2")
    recs, seen = [_record(a, MANAGED)], [_seen(b)]
    steps = plan(recs, seen, lambda ns, n: ({"a": a, "b": b}[n], PLAIN), NODE)
    assert [(s.action, s.key) for s in steps] == [("release", "app/a")]
    steps = plan(recs, seen, lambda ns, n: ({"a": a, "b": b}[n], MANAGED), NODE)
    assert [(s.action, s.key) for s in steps] == [("capture", "app/b")]


def test_changed_exclusions_are_reapplied() -> None:
    a = PodMeta("app", "a", uid="u1")
    changed = PodMeta("app", "a", uid="u1",
                      annotations={"capture.aether.io/exclude-outbound-ports": "5432"})
    steps = plan([_record(a, MANAGED)], [], lambda ns, n: (changed, MANAGED), NODE)
    assert [s.action for s in steps] == ["reapply"]
    assert steps[0].policy is not None and steps[0].policy.exclude_ports == ((5432, 5432),)


def test_unknown_or_replaced_pods_are_left_alone() -> None:
    a = PodMeta("app", "a", uid="u1")
    rec = _record(a, MANAGED)
    assert plan([rec], [], lambda ns, n: (None, None), NODE) == []
    assert plan([rec], [], lambda ns, n: (a, None), NODE) == []
    other = PodMeta("app", "a", uid="u-new")  # same name, recreated: its own ADD decides
    assert plan([rec], [], lambda ns, n: (other, PLAIN), NODE) == []
    assert plan([], [_seen(a)], lambda ns, n: (other, MANAGED), NODE) == []
    assert [s.action for s in plan([], [_seen(a)], lambda ns, n: (a, MANAGED), NODE)] == ["capture"]


def test_pods_older_than_the_agent_are_discovered_only_when_unknown_and_managed() -> None:
    from agent.runtime.enroll import to_discover
    node = NodeConfig(node_name="n1")
    mk = lambda name, **kw: PodMeta("app", name, uid=f"u-{name}", node_name="n1",  # noqa: E731
                                     ips=("10.0.0.9",), phase="Running", **kw)
    pods = [mk("new"), mk("known"), mk("hostnet", host_network=True),
            PodMeta("app", "elsewhere", uid="u-x", node_name="n2", ips=("10.0.0.8",)),
            PodMeta("app", "noip", uid="u-y", node_name="n1"), mk("optout",
                                                                 labels={"aether.io/managed": "false"})]
    rec = _record(PodMeta("app", "known", uid="u-known"), MANAGED)
    got = to_discover(pods, {"app": MANAGED}, [rec], [], node, True)
    assert [p.name for p in got] == ["new"]
    assert to_discover(pods, {"app": PLAIN}, [], [], node, True) == []


def test_addresses_are_read_from_procfs_listings() -> None:
    from agent.netns.discover import parse_fib_trie, parse_if_inet6
    trie = """Main:
  +-- 0.0.0.0/0 3 0 5
     +-- 10.213.0.0/16 2 0 2
        |-- 10.213.0.7
           /32 host LOCAL
        |-- 10.213.255.255
           /32 link BROADCAST
Local:
  +-- 127.0.0.0/8 2 0 2
     |-- 127.0.0.1
        /32 host LOCAL
"""
    assert parse_fib_trie(trie) == {"10.213.0.7", "127.0.0.1"}
    inet6 = ("fd00a3e100cb00000000000000000007 02 40 00 80     eth0\n"
             "00000000000000000000000000000001 01 80 10 80       lo\n")
    assert parse_if_inet6(inet6) == {"fd00:a3e1:cb::7", "::1"}
