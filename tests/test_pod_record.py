"""PodRecord: one per pod of the cluster, so what pods of a ReplicaSet share is held once."""

from __future__ import annotations

import pytest

from agent.scope.registry import PodRecord

PORTS = {"http": 8080}  # shared maps, as the registry's are (agent.source.model.shared)


def _rec(name: str, **kw: object) -> PodRecord:
    base: dict[str, object] = dict(
        namespace="shop", name=name, service_account="web", ips=("10.0.0.1",),
        node_name="n1", ready=True, labels={"app": "web"}, named_ports=PORTS)
    base.update(kw)
    labels = base.pop("labels")
    return PodRecord(labels=labels, **base)  # type: ignore[arg-type]


def test_pods_of_one_replicaset_share_their_shape_and_read_as_before() -> None:
    labels = {"app": "web"}
    a, b = _rec("web-1", labels=labels), _rec("web-2", labels=labels, ips=("10.0.0.2",))
    assert a._shape is b._shape
    assert (a.namespace, a.name, a.key, a.service_account) == ("shop", "web-1", "shop/web-1", "web")
    assert a.labels is labels and a.ready and not a.local and a.target_port("http") == 8080
    assert a.identity == "shop/web" and a.san("td") == "spiffe://td/ns/shop/sa/web"
    assert a.san("td") is b.san("td")


def test_equality_follows_every_field_and_records_are_immutable() -> None:
    labels = {"app": "web"}
    a = _rec("web-1", labels=labels)
    assert a == _rec("web-1", labels=labels) and hash(a) == hash(_rec("web-1", labels=labels))
    assert a == _rec("web-1", labels={"app": "web"})  # equal maps, other objects
    assert a != _rec("web-1", labels=labels, ready=False)
    assert a != _rec("web-1", labels=labels, ips=("10.0.0.9",))
    assert a != _rec("web-1", labels={"app": "api"})
    with pytest.raises(AttributeError):
        a.uid = "x"  # type: ignore[misc]


def test_evolve_changes_only_what_it_is_given() -> None:
    a = _rec("web-1")
    b = a.evolve(uid="u1", local=True, sources=frozenset({"api", "cni"}))
    assert (b.uid, b.local, b.sources) == ("u1", True, frozenset({"api", "cni"}))
    assert (b.key, b.ips, b.labels, b.ready) == (a.key, a.ips, a.labels, a.ready)
    assert not a.local and a.uid == ""


def test_the_registry_knows_a_record_from_a_meshpod_from_one_from_the_pod() -> None:
    """What the model used to keep a set of 100k keys for."""
    from agent.common.config import NodeConfig
    from agent.scope.registry import Registry

    reg = Registry(NodeConfig(node_name="n1"))
    obj = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "web-1", "namespace": "shop", "labels": {"app": "web"}},
           "spec": {"nodeName": "n2"}, "status": {"podIP": "10.0.0.5"}}
    reg.upsert_pod(obj, remote=True)  # type: ignore[arg-type]
    assert reg.is_remote("shop/web-1") and reg.api_pod("shop/web-1") is not None
    reg.upsert_pod(obj)  # type: ignore[arg-type]  # the Pod itself takes over
    assert not reg.is_remote("shop/web-1") and reg.api_pod("shop/web-1") is not None
    reg.remove_pod("shop", "web-1")
    assert not reg.is_remote("shop/web-1") and reg.api_pod("shop/web-1") is None


def test_a_shape_goes_with_the_last_record_holding_it() -> None:
    """The shape cache is weak: the shapes of gone ReplicaSets are not kept for sharing."""
    import gc

    from agent.scope import registry

    labels = {"app": "gone"}
    a, b = _rec("gone-1", labels=labels), _rec("gone-2", labels=labels)
    shape = a._shape
    assert shape in registry._SHAPES.values()
    del a
    gc.collect()
    assert shape in registry._SHAPES.values()  # b still holds it
    del b, shape
    gc.collect()
    assert not [s for s in registry._SHAPES.values() if s.labels is labels]


def test_records_and_endpoints_copy_and_pickle_by_value() -> None:
    import copy
    import pickle

    from agent.scope.model import Endpoint

    rec = PodRecord("ns", "p", uid="u1", ips=("10.0.0.1",), labels={"app": "a"}, ready=True)
    dual = PodRecord("ns", "q", ips=("10.0.0.2", "fd00::2"))
    ep = Endpoint("10.0.0.1", 80, "ns/sa", True, False, "spiffe://td/ns/ns/sa/sa", pod="ns/p",
                  local=True, preferred=False)
    for value in (rec, dual, ep):
        for twin in (copy.copy(value), copy.deepcopy(value), pickle.loads(pickle.dumps(value))):
            assert twin == value and hash(twin) == hash(value)
    assert copy.deepcopy(dual).ips == ("10.0.0.2", "fd00::2")
    assert (ep.ready, ep.draining, ep.local, ep.always_ready, ep.preferred) == \
        (True, False, True, False, False)
    assert ep.evolve(draining=True) != ep and ep.evolve(draining=True).draining
