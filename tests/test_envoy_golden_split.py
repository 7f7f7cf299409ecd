"""Golden files for the builders split out of ``agent.envoy.resources`` and
``agent.envoy.mtls`` that ``test_envoy_golden`` does not cover (regenerate with
AETHER_UPDATE_GOLDEN=1, as the other goldens): the mesh hop's outbound end (``mtls-out``,
a caller's mtls cluster, a tunnelled Service cluster and its endpoints, a captured pod's
listener with an identity), its inbound end (a pod's inbound listener with and without
policies, the node's and a pod's detection listener and their clusters, the delivery
cluster, the judge), the namespace tier (a namespace cluster, the learn chains) and the
Service endpoints. Most come from one build of ``ResourceBuilder``, as a node runs them.
A diff here is a change to what every node runs: review it as such."""

from __future__ import annotations

from typing import Any

import pytest

from agent.authz.policy import parse_policy
from agent.envoy import mtls
from agent.envoy.judge import judge_listener_name
from agent.envoy.resources import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    LISTENER_TYPE,
    NodeXdsState,
    PodListener,
    build_resources,
    learn_chains,
)
from agent.identity.svid import Svid, spiffe_id
from tests.test_envoy_golden import POD, VIEWS, as_json, matches_golden

TD = "cluster.local"


def _svid(identity: str) -> Svid:
    ns, _, sa = identity.partition("/")
    return Svid(spiffe_id(TD, ns, sa), f"CERT {identity}", f"KEY {identity}", 0.0, 1e12, 0.0)


def _policy(name: str, spec: dict[str, Any]) -> Any:
    return parse_policy({"metadata": {"name": name, "namespace": "shop"}, "spec": spec})


# L4 only (judged on the inbound listener) and naming HTTP fields (judged past detection,
# in the pod's own detection listener)
FROM_WEB = _policy("from-web", {"rules": [
    {"from": [{"source": {"principals": [f"{TD}/ns/shop/sa/web"]}}]}]})
GET_FROM_WEB = _policy("get-from-web", {"rules": [
    {"from": [{"source": {"principals": [f"{TD}/ns/shop/sa/web"]}}],
     "to": [{"operation": {"methods": ["GET"], "ports": ["8080"]}}]}]})
API = PodListener("uid-2", "/var/run/netns/cni-2", namespace="shop", workload="api",
                  service_account="api", ips=("10.1.0.7",), authz=(FROM_WEB,))
DB = PodListener("uid-3", "/var/run/netns/cni-3", namespace="shop", workload="db",
                 service_account="db", ips=("10.1.0.8",), authz=(GET_FROM_WEB,))
TLS = mtls.MeshTls(TD, {i: _svid(i) for i in ("shop/web", "shop/api", "shop/db")}, "BUNDLE")


def _cases() -> dict[str, Any]:
    res = build_resources(NodeXdsState(pods=(POD, API, DB), services=VIEWS, mesh_tls=TLS))
    lis, clusters = res[LISTENER_TYPE], res[CLUSTER_TYPE]
    plain = build_resources(NodeXdsState(pods=(POD,), services=VIEWS))
    return {
        # the outbound end of the mesh hop
        "envoy_mtls_out_listener": as_json(lis[mtls.MTLS_OUT_LISTENER]),
        "envoy_mtls_cluster": as_json(clusters[mtls.mtls_cluster_name("shop/web")]),
        "envoy_mtls_pod_listener": as_json(lis[f"capture-{POD.uid}"]),
        "envoy_mtls_service_cluster": as_json(clusters["svc|shop|api|80"]),
        "envoy_mtls_service_endpoints": as_json(res[ENDPOINT_TYPE]["svc|shop|api|80"]),
        "envoy_mtls_secrets": {n: as_json(s) for n, s in res[mtls.SECRET_TYPE].items()},
        # the inbound end
        "envoy_inbound_listener": as_json(lis[mtls.inbound_listener_name(POD.uid)]),
        "envoy_inbound_listener_authz": as_json(lis[mtls.inbound_listener_name(API.uid)]),
        "envoy_inbound_listener_http_authz": as_json(lis[mtls.inbound_listener_name(DB.uid)]),
        "envoy_inbound_detect_listener": as_json(lis[mtls.INBOUND_DETECT]),
        "envoy_inbound_detect_cluster": as_json(clusters[mtls.INBOUND_DETECT]),
        "envoy_pod_detect_listener": as_json(lis[mtls.pod_detect_name(DB.uid)]),
        "envoy_pod_detect_cluster": as_json(clusters[mtls.pod_detect_name(DB.uid)]),
        "envoy_inbound_deliver_cluster": as_json(clusters[mtls.INBOUND_DELIVER_CLUSTER]),
        "envoy_judge_listener": as_json(lis[judge_listener_name(API.uid)]),
        "envoy_judge_listener_detect": as_json(lis[judge_listener_name(DB.uid)]),
        # the namespace tier and the Services, without identity
        "envoy_namespace_cluster": as_json(plain[CLUSTER_TYPE]["mesh-shop"]),
        "envoy_service_endpoints": as_json(plain[ENDPOINT_TYPE]["svc|shop|api|80"]),
        "envoy_learn_chains": [as_json(c) for c in learn_chains(
            [("10.96.0.30", 80), ("10.96.0.30", 443)], connection_log=False)],
    }


def test_the_cases_name_resources_the_build_holds() -> None:
    # every key above exists (a renamed resource fails here, not as a KeyError below)
    assert len(_cases()) == 19


@pytest.mark.parametrize("name", sorted(_cases()))
def test_envoy_golden_split(name: str) -> None:
    matches_golden(name, _cases()[name])
