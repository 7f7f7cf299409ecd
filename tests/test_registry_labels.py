"""The registry indexes pod labels only under the keys some selector uses, and its Service
membership stays exactly what matching every pod against every selector gives."""

from __future__ import annotations

import random
from typing import Any

from agent.common.config import NodeConfig
from agent.scope.registry import Registry

NS = ("a", "b")
LABELS = {"app": ("web", "api", "db"), "version": ("v1", "v2"), "tier": ("front", "back")}


def _pod(ns: str, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": labels,
                         "annotations": {"aether.io/managed": "true"}},
            "spec": {"nodeName": "n2"}, "status": {"podIP": f"10.0.{len(name)}.{hash(name) % 250}"}}


def _registry() -> Registry:
    reg = Registry(NodeConfig(node_name="n1"))
    for ns in NS:
        reg.set_namespace({"metadata": {"name": ns, "labels": {"aether.io/managed": "true"}}}, ns)
    return reg


def test_only_selected_label_keys_are_indexed_and_follow_the_selectors() -> None:
    reg = _registry()
    for i in range(6):
        reg.upsert_pod(_pod("a", f"p{i}", {"app": "web", "version": f"v{i % 2}",
                                          "pod-template-hash": f"h{i}"}))  # type: ignore[arg-type]
    assert reg._rec_by_label == {}
    reg.set_service("a/web", "a", {"app": "web"})
    assert {k[1] for k in reg._rec_by_label} == {"app"}
    assert len(reg.members("a/web")) == 6
    reg.set_service("a/v1", "a", {"app": "web", "version": "v1"})
    assert {k[1] for k in reg._rec_by_label} == {"app", "version"}
    assert sorted(r.name for r in reg.members("a/v1")) == ["p1", "p3", "p5"]
    reg.remove_service("a/v1")
    assert {k[1] for k in reg._rec_by_label} == {"app"}
    reg.set_service("a/web", "a", {"app": "web", "tier": "x"})  # same key kept, one added
    assert set(reg._selector_keys) == {"app", "tier"} and reg.members("a/web") == []
    assert {k[1] for k in reg._rec_by_label} == {"app"}  # no pod has a tier label
    reg.remove_service("a/web")
    assert reg._rec_by_label == {} and reg._selector_keys == {}


def test_membership_matches_brute_force_through_random_changes() -> None:
    rnd = random.Random(7)
    reg = _registry()
    pods: dict[str, dict[str, str]] = {}
    svcs: dict[str, tuple[str, dict[str, str]]] = {}
    for step in range(600):
        op = rnd.random()
        if op < 0.45:
            ns, name = rnd.choice(NS), f"p{rnd.randrange(40)}"
            labels = {k: rnd.choice(v) for k, v in LABELS.items() if rnd.random() < 0.8}
            pods[f"{ns}/{name}"] = labels
            reg.upsert_pod(_pod(ns, name, labels))  # type: ignore[arg-type]
        elif op < 0.6 and pods:
            key = rnd.choice(sorted(pods))
            del pods[key]
            reg.remove_pod(*key.split("/"))
        elif op < 0.9:
            ns, name = rnd.choice(NS), f"s{rnd.randrange(8)}"
            keys = rnd.sample(sorted(LABELS), rnd.randint(1, 2))
            selector = {k: rnd.choice(LABELS[k]) for k in keys}
            svcs[f"{ns}/{name}"] = (ns, selector)
            reg.set_service(f"{ns}/{name}", ns, selector)
        elif svcs:
            key = rnd.choice(sorted(svcs))
            del svcs[key]
            reg.remove_service(key)
        of_pod: dict[str, set[str]] = {k: set() for k in pods}
        for skey, (ns, selector) in svcs.items():
            want = sorted(k for k, labels in pods.items() if k.startswith(ns + "/")
                          and all(labels.get(a) == b for a, b in selector.items()))
            assert [r.key for r in reg.members(skey)] == want, (step, skey)
            for k in want:
                of_pod[k].add(skey)
        for k, want_svcs in of_pod.items():  # and the other way round
            assert reg.services_of(k) == want_svcs, (step, k)
        used = {k for _ns, sel in svcs.values() for k in sel}
        assert {k[1] for k in reg._rec_by_label} <= used
