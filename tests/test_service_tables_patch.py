"""One Service's change patched into the last pass's tables (issue #43: proportional to what
changed) builds exactly what a fresh builder builds, and falls back to a full pass whenever
the change moves a claim, a resource name or the set of Services."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from agent.envoy import service_tables
from agent.envoy.resources import ENDPOINT_TYPE, NodeXdsState, PodListener, ResourceBuilder, resource_hash
from agent.scope.model import Endpoint, ServiceView
from agent.scope.services import ServicePort

SAN = "spiffe://cluster.local/ns/mesh/sa/web"


def _ep(ip: str, ready: bool = True) -> Endpoint:
    return Endpoint(ip, 8080, "mesh/web", ready, False, SAN, "mesh/web-0")


def _view(name: str, ip: str, eps: tuple[Endpoint, ...] = (), port: int = 80,
          headless: bool = False) -> ServiceView:
    return ServiceView(key=f"mesh/{name}", namespace="mesh", name=name,
                       cluster_ips=() if headless else (ip,),
                       ports=(ServicePort(port, "http", target_port=8080),),
                       names=(f"{name}.mesh.svc.cluster.local",),
                       endpoints={port: eps or (_ep("10.1.0.5"),)})


def _hashes(res: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {t: {n: resource_hash(m) for n, m in r.items()} for t, r in res.items()}


@pytest.fixture
def patches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Whether each pass was a patch (True) or a full pass (False)."""
    seen: list[bool] = []
    real = service_tables.ServiceCache._patch

    def spy(self: Any, *a: Any) -> Any:
        got = real(self, *a)
        seen.append(got is not None)
        return got
    monkeypatch.setattr(service_tables.ServiceCache, "_patch", spy)
    yield seen


def _services(n: int) -> list[ServiceView]:
    return [_view(f"s{i}", f"10.96.1.{i}", (_ep(f"10.1.1.{i}"),)) for i in range(n)]


def _check(b: ResourceBuilder, views: list[ServiceView]) -> None:
    state = NodeXdsState(pods=(PodListener("p", "/n"),), services=tuple(views))
    built = b.build(state)
    assert _hashes(built) == _hashes(ResourceBuilder().build(state))
    # the endpoint hashes handed to the xDS server are those of what was built
    pre = b.prehashed[ENDPOINT_TYPE]
    assert pre[0] is built[ENDPOINT_TYPE] and pre[1] == _hashes(built)[ENDPOINT_TYPE]
    # every row names the Service's current entry (a caller's chains are built from it)
    cache = b._services
    assert cache._tables is not None
    by_key = {v.key: v for v in views}
    assert cache._tables.rows
    assert all(e is cache._services[e.view.key] and e.view is by_key[e.view.key]
               for e, _, _ in cache._tables.rows)


def test_an_endpoint_change_is_patched_and_builds_what_a_fresh_builder_builds(
        patches: list[bool]) -> None:
    b = ResourceBuilder()
    views = _services(6)
    _check(b, views)
    views[2] = replace(views[2], endpoints={80: (_ep("10.1.1.2", ready=False), _ep("10.1.9.9"))})
    _check(b, views)
    views[4] = replace(views[4], endpoints={80: (_ep("10.1.7.7"),)})
    views[5] = replace(views[5], endpoints={80: (_ep("10.1.8.8"),)})
    _check(b, views)
    assert patches == [True, True]


@pytest.mark.parametrize("change", ["port", "cluster_ip", "added", "removed", "clash"])
def test_a_change_of_claims_names_or_membership_takes_the_full_pass(
        patches: list[bool], change: str) -> None:
    b = ResourceBuilder()
    views = _services(4)
    _check(b, views)
    if change == "port":  # new resource names
        views[1] = _view("s1", "10.96.1.1", port=81)
    elif change == "cluster_ip":  # new claims
        views[1] = _view("s1", "10.96.2.1")
    elif change == "added":
        views.append(_view("new", "10.96.3.1"))
    elif change == "removed":
        views.pop(1)
    else:  # s3 now claims s0's ClusterIP:port: the first claim keeps it
        views[3] = _view("s3", "10.96.1.0")
    _check(b, views)
    assert True not in patches
    # and the patch path is taken again afterwards, still building the same
    views[0] = replace(views[0], endpoints={80: (_ep("10.1.5.5"),)})
    _check(b, views)
    assert patches[-1] is True


def test_a_headless_services_hosts_moving_takes_the_full_pass(patches: list[bool]) -> None:
    b = ResourceBuilder()
    views = [*_services(2), _view("h", "", (_ep("10.1.4.1"),), headless=True)]
    _check(b, views)
    views[2] = _view("h", "", (_ep("10.1.4.1"), _ep("10.1.4.2")), headless=True)
    _check(b, views)
    assert patches == [False]


def test_many_changes_at_once_take_the_full_pass(patches: list[bool]) -> None:
    b = ResourceBuilder()
    views = _services(service_tables.PATCH_MAX + 2)
    _check(b, views)
    views = [replace(v, endpoints={80: (_ep("10.2.0.1"),)}) for v in views]
    _check(b, views)
    assert patches == []
