"""No stale identity (#14): a cached Pod whose uid is not kubelet's K8S_POD_UID is another pod
of the same name; the lookup goes to the API, and an ADD is never captured with it."""

from __future__ import annotations

from typing import Any

import pytest

from agent.cni import protocol as p
from agent.cni.handler import CniFailure, CniHandler
from agent.cni.state import StateStore
from agent.common.config import NodeConfig
from agent.source.base import PodEvent, SourceError, WatchEvent
from agent.source.cached import CachedSource
from agent.source.events import ObjectStore
from agent.source.model import NamespaceMeta, PodMeta


class Api:
    """The inner source: what a fresh GET answers (or raises)."""

    def __init__(self, pod: PodMeta | None = None, down: bool = False) -> None:
        self.pod, self.down, self.calls = pod, down, 0

    def get_pod(self, namespace: str, name: str, uid: str = "") -> PodMeta | None:
        self.calls += 1
        if self.down:
            raise SourceError("API server unreachable")
        return self.pod

    def get_namespace(self, name: str) -> NamespaceMeta | None:
        return NamespaceMeta(name, labels={"aether.io/managed": "true"})

    def record_event(self, event: PodEvent) -> None:
        return None

    def describe(self) -> str:
        return "test API"


def _cache(uid: str, labels: dict[str, str]) -> ObjectStore:
    store = ObjectStore()
    for obj in ({"kind": "Pod", "metadata": {"namespace": "app", "name": "db-0", "uid": uid,
                                             "labels": labels}, "spec": {}},
                {"kind": "Namespace", "metadata": {"name": "app",
                                                   "labels": {"aether.io/managed": "true"}}}):
        store.apply(WatchEvent("ADDED", str(obj["kind"]), obj))
    return store


def test_a_cached_pod_with_another_uid_is_looked_up_again() -> None:
    api = Api(PodMeta("app", "db-0", uid="new", labels={"aether.io/managed": "false"}))
    src = CachedSource(api, _cache("old", {}))
    assert src.get_pod("app", "db-0", "old") is not None and api.calls == 0  # same pod: cache
    got = src.get_pod("app", "db-0", "new")
    assert got is not None and got.uid == "new" and api.calls == 1 and src.stale == 1


def _handler(api: Api, tmp: Any) -> CniHandler:
    return CniHandler(NodeConfig(run_dir=str(tmp)), CachedSource(api, _cache("old", {})),
                      StateStore(str(tmp / "pods")))


def _lookup(h: CniHandler, uid: str) -> Any:
    return h._lookup({"K8S_POD_NAMESPACE": "app", "K8S_POD_NAME": "db-0", "K8S_POD_UID": uid})


def test_api_down_with_a_stale_cache_is_try_again(tmp_path: Any) -> None:
    with pytest.raises(CniFailure) as err:
        _lookup(_handler(Api(down=True), tmp_path), "new")
    assert err.value.code == p.ERR_TRY_AGAIN


def test_the_api_still_naming_the_old_pod_is_try_again(tmp_path: Any) -> None:
    with pytest.raises(CniFailure) as err:
        _lookup(_handler(Api(PodMeta("app", "db-0", uid="old")), tmp_path), "new")
    assert err.value.code == p.ERR_TRY_AGAIN and "another pod's metadata" in err.value.msg


def test_the_fresh_pod_is_used_when_the_api_knows_it(tmp_path: Any) -> None:
    fresh = PodMeta("app", "db-0", uid="new", labels={"team": "x"})
    pod, _ns = _lookup(_handler(Api(fresh), tmp_path), "new")
    assert pod.uid == "new" and pod.labels == {"team": "x"}
