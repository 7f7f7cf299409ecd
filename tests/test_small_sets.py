"""Index buckets: tuples while small, key-only dicts beyond, back to tuples when they shrink."""

from __future__ import annotations

from agent.scope.small_sets import SMALL, Bucket, add_to, bucket, discard_from


def test_a_bucket_grows_from_tuple_to_dict_and_shrinks_back() -> None:
    index: dict[str, Bucket] = {}
    for i in range(SMALL):
        add_to(index, "k", f"m{i}")
    add_to(index, "k", "m0")  # already there: no duplicate
    assert isinstance(index["k"], tuple) and len(index["k"]) == SMALL
    add_to(index, "k", "big")
    assert isinstance(index["k"], dict) and len(index["k"]) == SMALL + 1
    add_to(index, "k", "big")
    assert len(index["k"]) == SMALL + 1
    for i in range(SMALL // 2 + 1):
        discard_from(index, "k", f"m{i}")
    assert isinstance(index["k"], tuple) and len(index["k"]) == SMALL // 2
    for m in list(index["k"]):
        discard_from(index, "k", m)
    assert "k" not in index  # an empty bucket leaves the index
    discard_from(index, "k", "absent")  # unknown key: nothing happens
    assert index == {}


def test_bucket_shapes() -> None:
    assert isinstance(bucket({"a", "b"}), tuple)
    assert sorted(bucket({"a", "b"})) == ["a", "b"]
    big = {f"m{i}" for i in range(SMALL + 1)}
    assert set(bucket(big)) == big and isinstance(bucket(big), dict)
    assert bucket(["a", "a", "b"]) in (("a", "b"), ("b", "a"))  # no duplicates either way


def test_the_registry_keeps_membership_right_across_bucket_shapes() -> None:
    """A Service whose members cross SMALL both ways, and a pod that changes labels."""
    from agent.common.config import NodeConfig
    from agent.scope.registry import Registry

    reg = Registry(NodeConfig(node_name="n1"))
    reg.set_namespace({"metadata": {"name": "ns", "labels": {"aether.io/managed": "true"}}},
                      "ns")
    reg.set_service("ns/web", "ns", {"app": "web"})

    def pod(i: int, app: str) -> dict[str, object]:
        return {"metadata": {"name": f"p{i}", "namespace": "ns", "uid": f"u{i}",
                             "labels": {"app": app}},
                "spec": {"nodeName": "n2", "serviceAccountName": "web"},
                "status": {"phase": "Running", "podIP": f"10.0.0.{i + 1}"}}

    n = 3 * SMALL
    for i in range(n):
        reg.upsert_pod(pod(i, "web"))  # type: ignore[arg-type]
    assert [r.name for r in reg.members("ns/web")] == sorted(f"p{i}" for i in range(n))
    assert len(reg.by_identity("ns/web")) == n
    for i in range(n - 2):
        reg.upsert_pod(pod(i, "db"))  # type: ignore[arg-type]  # relabelled out of the Service
    assert [r.name for r in reg.members("ns/web")] == [f"p{n - 2}", f"p{n - 1}"]
    assert reg.services_of("ns/p0") == set() and reg.services_of(f"ns/p{n - 1}") == {"ns/web"}
    reg.set_service("ns/db", "ns", {"app": "db"})  # a Service arriving after its pods
    assert len(reg.members("ns/db")) == n - 2
    for i in range(n):
        reg.remove_pod("ns", f"p{i}")
    assert reg.members("ns/web") == [] and reg.members("ns/db") == []
    assert reg.by_identity("ns/web") == [] and reg.identities() == []


def test_a_pods_services_survive_the_one_and_many_shapes() -> None:
    """The registry keeps a pod's one Service as the key itself and several as a tuple."""
    from agent.common.config import NodeConfig
    from agent.scope.registry import Registry

    reg = Registry(NodeConfig(node_name="n1"))
    reg.set_namespace({"metadata": {"name": "ns", "labels": {"aether.io/managed": "true"}}},
                      "ns")
    reg.upsert_pod({"metadata": {"name": "p", "namespace": "ns", "uid": "u",  # type: ignore[typeddict-item]
                                 "labels": {"app": "web", "tier": "a"}},
                    "spec": {"nodeName": "n2"}, "status": {"podIP": "10.0.0.1"}})
    assert reg.services_of("ns/p") == set()
    reg.set_service("ns/web", "ns", {"app": "web"})
    assert reg.services_of("ns/p") == {"ns/web"}
    reg.set_service("ns/web-a", "ns", {"app": "web", "tier": "a"})
    reg.set_service("ns/all", "ns", {"tier": "a"})
    assert reg.services_of("ns/p") == {"ns/web", "ns/web-a", "ns/all"}
    reg.remove_service("ns/web-a")
    reg.remove_service("ns/web")
    assert reg.services_of("ns/p") == {"ns/all"}
    reg.set_service("ns/all", "ns", {"tier": "b"})
    assert reg.services_of("ns/p") == set()
