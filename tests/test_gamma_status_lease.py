"""Leader election (agent/gamma/lease.py): two electors against FakeApiServer."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

from agent.gamma.lease import LeaseElector
from agent.testing import FakeApiServer

pytestmark = pytest.mark.timeout(60)

NS, NAME = "aether-system", "aether-gamma-status"



@pytest.fixture
def make_api(server: FakeApiServer, tmp_path: Path) -> Iterator[Callable[[], client.ApiClient]]:
    made: list[client.ApiClient] = []

    def make() -> client.ApiClient:
        cfg = client.Configuration()
        config.load_kube_config(config_file=server.kubeconfig(tmp_path / "kubeconfig"),
                                client_configuration=cfg)
        made.append(client.ApiClient(cfg))
        return made[-1]

    yield make
    for a in made:
        a.close()


def elector(make_api: Callable[[], client.ApiClient], node: str, **kw: object) -> LeaseElector:
    opts: dict[str, object] = {"lease_duration": 2, "renew_interval": 0.2, "retry_interval": 0.1}
    opts.update(kw)
    return LeaseElector(make_api(), node, **opts)  # type: ignore[arg-type]


def wait_for(pred: Callable[[], bool], timeout: float) -> float:
    start = time.monotonic()
    while not pred():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.02)
    return time.monotonic() - start


def holder(server: FakeApiServer) -> str | None:
    obj = server.get_object("Lease", NAME, NS, "coordination.k8s.io/v1")
    return None if obj is None else obj["spec"].get("holderIdentity")


def test_exactly_one_leads_and_release_hands_over_at_once(server, make_api):
    a, b = elector(make_api, "node-a"), elector(make_api, "node-b")
    changes: list[tuple[str, bool]] = []
    a.on_change = lambda v: changes.append(("a", v))
    b.on_change = lambda v: changes.append(("b", v))
    a.start()
    b.start()
    try:
        wait_for(lambda: a.is_leader() or b.is_leader(), 5)
        for _ in range(20):  # over several renewals, never two leaders
            assert a.is_leader() != b.is_leader()
            time.sleep(0.05)
        leader, other = (a, b) if a.is_leader() else (b, a)
        lease = server.get_object("Lease", NAME, NS, "coordination.k8s.io/v1")
        assert lease["spec"]["holderIdentity"] == leader.identity
        assert lease["spec"]["leaseDurationSeconds"] == 2
        leader.stop(release=True)
        assert not leader.is_leader()
        took = wait_for(other.is_leader, 2)
        assert took < 1.0  # released: no waiting for expiry
        assert holder(server) == other.identity
        assert server.get_object("Lease", NAME, NS, "coordination.k8s.io/v1")["spec"][
            "leaseTransitions"] >= 1
        assert (leader.identity[-1], False) in changes and (other.identity[-1], True) in changes
    finally:
        a.stop()
        b.stop()


def test_crashed_leader_is_replaced_within_lease_duration(server, make_api):
    a = elector(make_api, "node-a")
    assert a.try_acquire_or_renew()
    b = elector(make_api, "node-b")
    b.start()
    try:
        time.sleep(0.5)
        assert not b.is_leader()  # a's lease is live (b has been watching it)
        # a crashes: no release, no more renewals
        t0 = time.monotonic()
        took = wait_for(b.is_leader, 5)
        assert took <= 2.0 + 0.5, took  # within lease duration (+ one retry)
        assert time.monotonic() - t0 >= 1.0  # and not before the lease could expire
        assert holder(server) == "node-b"
        # a comes back: sees b's live lease and does not lead
        assert not a.try_acquire_or_renew()
    finally:
        b.stop()


def test_leader_stops_claiming_when_it_cannot_renew(server, make_api):
    a = elector(make_api, "node-a", renew_deadline=0.5)
    assert a.try_acquire_or_renew()
    server.fail_next(100, 503)
    assert not a.try_acquire_or_renew() or a.is_leader()
    time.sleep(0.6)
    assert not a.try_acquire_or_renew()  # deadline passed without a renewal
    assert a.last_error and "503" in a.last_error
    server.clear_faults()
    assert a.try_acquire_or_renew()  # still the holder in the API: renews


def test_create_race_and_conflict_lose_quietly(server, make_api):
    a, b = elector(make_api, "node-a"), elector(make_api, "node-b")
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()  # live lease held by a (first observation)
    assert b.holder() == "node-a"
