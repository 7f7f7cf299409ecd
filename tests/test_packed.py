"""Remote pods and slice endpoints are packed: one object each, read and compared as dicts."""

from __future__ import annotations

import json

import pytest

from agent.common.config import NodeConfig
from agent.meshpods.record import record_of
from agent.scope.registry import Registry
from agent.source.model import slim_pod
from agent.source.packed import Packed, pack, unpacked
from agent.source.watch import meshpod_object
from tests.test_slim_pod import realistic_pod


def test_a_packed_object_reads_as_the_dict_it_came_from() -> None:
    obj = {"kind": "X", "metadata": {"name": "a", "labels": {"k": "v"}}, "spec": {},
           "list": [1, 2]}
    p = pack(obj, ("metadata", "spec"))
    assert p == obj and dict(p) == obj and p.unpack() == obj
    assert p["metadata"] == {"name": "a", "labels": {"k": "v"}}
    assert p["metadata"]["labels"] is obj["metadata"]["labels"]  # values are shared
    assert p["metadata"] is not p["metadata"]  # sections are fresh: no one mutates a pack
    assert p.get("missing") is None and p.get("missing", 7) == 7 and "missing" not in p
    assert p["spec"] == {} and p["list"] == [1, 2]
    assert list(p) == ["kind", "metadata", "spec", "list"] and len(p) == 4
    with pytest.raises(KeyError):
        p["missing"]


def test_equality_and_shapes() -> None:
    a = pack({"m": {"n": "a"}, "k": 1}, ("m",))
    b = pack({"m": {"n": "a"}, "k": 1}, ("m",))
    c = pack({"m": {"n": "b"}, "k": 1}, ("m",))
    assert a == b and a != c
    assert a._layout is b._layout is c._layout  # one shape, held once
    assert a != pack({"m": {"n": "a", "x": 1}, "k": 1}, ("m",))  # another shape
    reordered = pack({"k": 1, "m": {"n": "a"}}, ("m",))  # same content, keys in another order
    assert reordered._layout is not a._layout and reordered == a  # equal, as the dicts are
    assert a != {"m": {"n": "a"}} and a != 3


def test_json_refuses_a_pack_and_unpacked_gives_the_dicts() -> None:
    p = pack({"m": {"n": "a"}}, ("m",))
    with pytest.raises(TypeError):
        json.dumps(p)
    assert json.loads(json.dumps(unpacked(p))) == {"m": {"n": "a"}}
    assert unpacked({"x": 1}) == {"x": 1}


def test_a_meshpod_is_stored_packed_and_the_registry_reads_it_as_the_pod() -> None:
    """What the registry builds from the packed record is what it builds from the dict."""
    pod = slim_pod(realistic_pod(3, node="node-9"))
    stored = meshpod_object(json.loads(json.dumps(record_of(pod, "node-9"))))
    assert isinstance(stored, Packed)
    assert stored["kind"] == "MeshPod" and stored["spec"]["nodeName"] == "node-9"
    plain = unpacked(stored)
    records = []
    for obj in (stored, plain):
        reg = Registry(NodeConfig(node_name="node-1"))
        reg.set_namespace({"metadata": {"name": "shop", "labels": {"aether.io/managed": "true"}}},
                          "shop")
        reg.set_service("shop/web", "shop", {"app": "web"})
        svcs, _pods = reg.upsert_pod(obj)  # type: ignore[arg-type]
        assert svcs == {"shop/web"}
        records.append(reg.get("shop/web-7d9f8c6b5-00003"))
    assert records[0] is not None and records[0] == records[1]
    assert records[0].ips == ("10.8.0.4",) and records[0].ready
    assert records[0].identity == "shop/web" and records[0].named_ports == {"http": 8080}
