"""XMesh publication (agent/gamma/xmesh.py): CRD present / absent, spec never changed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

from agent.gamma.xmesh import SUPPORTED_FEATURES, XMeshPublisher
from agent.testing import FakeApiServer
from agent.testing import apiserver as fake
from tests.test_gamma_status import EXTRA, Leadership, writes

pytestmark = pytest.mark.timeout(60)

CTRL = "aether.io/mesh"
XV = "gateway.networking.x-k8s.io/v1alpha1"


def _api(server: FakeApiServer, tmp_path: Path) -> client.ApiClient:
    cfg = client.Configuration()
    config.load_kube_config(config_file=server.kubeconfig(tmp_path / "kubeconfig"),
                            client_configuration=cfg)
    return client.ApiClient(cfg)


@pytest.fixture
def with_crd(monkeypatch: pytest.MonkeyPatch,
             tmp_path: Path) -> Iterator[tuple[FakeApiServer, client.ApiClient]]:
    monkeypatch.setattr(fake, "RESOURCES", fake.RESOURCES + EXTRA)
    with FakeApiServer() as srv, _api(srv, tmp_path) as api:
        yield srv, api


def xmesh(name: str, controller: str, **spec: str) -> dict:
    return {"apiVersion": XV, "kind": "XMesh", "metadata": {"name": name},
            "spec": {"controllerName": controller, **spec}}


def test_absent_crd_does_nothing(tmp_path: Path):
    with FakeApiServer() as srv, _api(srv, tmp_path) as api:
        pub = XMeshPublisher(api, CTRL, "node-a", create_missing=True)
        assert pub.sync() == "not-installed"
        assert writes(srv) == []
        assert pub.sync() == "not-installed"  # discovery cached: one GET in all
        assert srv.requests == [("GET", "/apis/gateway.networking.x-k8s.io/v1alpha1")]


def test_existing_xmesh_gets_status_and_keeps_its_spec(with_crd):
    srv, api = with_crd
    srv.put_object(xmesh("aether", CTRL, description="platform-owned"))
    pub = XMeshPublisher(api, CTRL, "node-a")
    assert pub.sync() == "ok"
    obj = srv.get_object("XMesh", "aether", None, XV)
    assert obj["spec"] == {"controllerName": CTRL, "description": "platform-owned"}
    [acc] = [c for c in obj["status"]["conditions"] if c["type"] == "Accepted"]
    assert (acc["status"], acc["reason"], acc["observedGeneration"]) == ("True", "Accepted", 1)
    assert "node-a" in acc["message"]
    names = [f["name"] for f in obj["status"]["supportedFeatures"]]
    assert names == sorted(SUPPORTED_FEATURES) and "Mesh" in names
    srv.clear_requests()
    assert pub.sync() == "ok"
    assert writes(srv) == []  # unchanged: no write


def test_missing_xmesh_not_created_by_default_but_created_when_asked(with_crd):
    srv, api = with_crd
    srv.put_object(xmesh("istio", "istio.io/mesh-controller"))
    assert XMeshPublisher(api, CTRL, "node-a").sync() == "missing"
    assert srv.get_object("XMesh", "aether", None, XV) is None
    assert XMeshPublisher(api, CTRL, "node-a", create_missing=True).sync() == "ok"
    obj = srv.get_object("XMesh", "aether", None, XV)
    assert obj["spec"] == {"controllerName": CTRL}
    assert obj["status"]["conditions"][0]["type"] == "Accepted"
    other = srv.get_object("XMesh", "istio", None, XV)
    assert "status" not in other  # another mesh's XMesh is never touched


def test_name_taken_by_another_controller_is_left_alone(with_crd):
    srv, api = with_crd
    srv.put_object(xmesh("aether", "example.com/other"))
    assert XMeshPublisher(api, CTRL, "node-a", create_missing=True).sync() == "missing"
    obj = srv.get_object("XMesh", "aether", None, XV)
    assert obj["spec"]["controllerName"] == "example.com/other" and "status" not in obj


def test_only_the_leader_publishes(with_crd):
    srv, api = with_crd
    srv.put_object(xmesh("aether", CTRL))
    lead = Leadership(False)
    pub = XMeshPublisher(api, CTRL, "node-a", lease=lead)
    srv.clear_requests()
    assert pub.sync() == "not-leader" and srv.requests == []
    lead.leader = True
    assert pub.sync() == "ok" and pub.writes == 1
