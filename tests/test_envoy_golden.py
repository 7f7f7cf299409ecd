"""The Envoy config the agent generates, against golden files (regenerate with
AETHER_UPDATE_GOLDEN=1, as the nft goldens): the bootstrap, a pod's capture listener, a
namespace's internal listener with one HTTP and one L4 Service, a Service cluster and the
passthrough cluster. A diff here is a change to what every node runs: review it as such."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from agent.envoy.bootstrap import build_bootstrap
from agent.envoy.resources import (
    CLUSTER_TYPE,
    LISTENER_TYPE,
    NodeXdsState,
    PodListener,
    RawResource,
    build_passthrough_cluster,
    build_resources,
)
from agent.scope.model import Endpoint, ServiceView
from agent.scope.services import ServicePort

GOLDEN = Path(__file__).parent / "golden"

POD = PodListener("uid-1", "/var/run/netns/cni-1", namespace="shop", workload="web",
                  service_account="web", ips=("10.1.0.5", "fd00:10::5"))
VIEWS = (
    ServiceView(key="shop/api", namespace="shop", name="api",
                cluster_ips=("10.96.0.20",), names=("api.shop.svc.cluster.local",),
                ports=(ServicePort(80, "http", target_port=8080, app_protocol="http"),),
                endpoints={80: (Endpoint("10.1.0.7", 8080, "shop/api", True, False,
                                         san="spiffe://cluster.local/ns/shop/sa/api",
                                         pod="shop/api-0"),)}),
    ServiceView(key="shop/db", namespace="shop", name="db",
                cluster_ips=("10.96.0.21",), names=("db.shop.svc.cluster.local",),
                ports=(ServicePort(5432, "pg", target_port=5432),),
                endpoints={5432: (Endpoint("10.1.0.8", 5432, "shop/db", True, False,
                                           san="spiffe://cluster.local/ns/shop/sa/db",
                                           pod="shop/db-0"),)}),
)


def as_json(msg: Message | RawResource) -> dict[str, Any]:
    proto = msg.message() if isinstance(msg, RawResource) else msg
    out: dict[str, Any] = MessageToDict(proto, preserving_proto_field_name=True)
    return out


def _cases() -> dict[str, dict[str, Any]]:
    res = build_resources(NodeXdsState(pods=(POD,), services=VIEWS))
    return {
        "envoy_bootstrap": build_bootstrap("node-a~aether", "/run/aether/xds.sock",
                                           "/run/aether/envoy/admin.sock"),
        "envoy_pod_listener": as_json(res[LISTENER_TYPE][f"capture-{POD.uid}"]),
        "envoy_namespace_listener": as_json(res[LISTENER_TYPE]["mesh"]),  # shared: no consumer route
        "envoy_service_cluster": as_json(res[CLUSTER_TYPE]["svc|shop|api|80"]),
        "envoy_passthrough_cluster": as_json(build_passthrough_cluster(0xAE, 5.0)),
    }


def matches_golden(name: str, data: Any) -> None:
    """``data`` as JSON equals ``tests/golden/<name>.json`` (written instead with
    AETHER_UPDATE_GOLDEN=1)."""
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    path = GOLDEN / f"{name}.json"
    if os.environ.get("AETHER_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()


@pytest.mark.parametrize("name", sorted(_cases()))
def test_envoy_golden(name: str) -> None:
    matches_golden(name, _cases()[name])
