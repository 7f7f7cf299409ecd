"""agent.kube.rest: the agent's API calls without the typed client's model classes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from agent.kube.client import done
from agent.kube.rest import CoordinationV1, CoreV1, CustomObjects, DiscoveryV1, _param
from agent.testing import FakeApiServer

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer() as srv:
        yield srv


def test_keywords_become_query_parameters() -> None:
    assert _param("label_selector") == "labelSelector"
    assert _param("allow_watch_bookmarks") == "allowWatchBookmarks"
    assert _param("_continue") == "continue"
    assert _param("watch") == "watch"


def test_core_calls_against_the_api_server(server: FakeApiServer, api: client.ApiClient) -> None:
    core = CoreV1(api)
    server.put_object({"apiVersion": "v1", "kind": "Namespace",
                       "metadata": {"name": "shop", "labels": {"mesh": "on"}}})
    server.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
    assert json.loads(core.read_namespace("shop").data)["metadata"]["labels"] == {"mesh": "on"}

    with pytest.raises(ApiException) as err:
        core.read_namespaced_pod("missing", "shop", _request_timeout=(2, 2))
    assert err.value.status == 404
    assert ("GET", "/api/v1/namespaces/shop/pods/missing") in server.requests

    done(core.patch_node("n1", {"spec": {"taints": [{"key": "k", "effect": "NoSchedule"}]}},
                    _content_type="application/merge-patch+json"))
    node = json.loads(core.read_node("n1").data)
    assert node["spec"]["taints"] == [{"key": "k", "effect": "NoSchedule"}]

    server.put_object({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "a", "namespace": "shop"},
                       "spec": {"nodeName": "n1"}})
    server.put_object({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "b", "namespace": "shop"},
                       "spec": {"nodeName": "n2"}})
    items = json.loads(core.list_pod_for_all_namespaces(field_selector="spec.nodeName=n1").data)["items"]
    assert [i["metadata"]["name"] for i in items] == ["a"]


def test_namespaced_and_custom_objects(server: FakeApiServer, api: client.ApiClient) -> None:
    leases = CoordinationV1(api)
    body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "l", "namespace": "kube-system"}, "spec": {"holderIdentity": "me"}}
    done(leases.create_namespaced_lease("kube-system", body))
    got = json.loads(leases.read_namespaced_lease("l", "kube-system").data)
    assert got["spec"]["holderIdentity"] == "me"
    with pytest.raises(ApiException) as err:
        leases.create_namespaced_lease("kube-system", body)
    assert err.value.status == 409

    slices = DiscoveryV1(api)
    s = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
         "metadata": {"name": "s", "namespace": "shop", "labels": {"owner": "x"}}, "endpoints": []}
    done(slices.create_namespaced_endpoint_slice("shop", s))
    listed = json.loads(slices.list_endpoint_slice_for_all_namespaces(label_selector="owner=x").data)
    assert [i["metadata"]["name"] for i in listed["items"]] == ["s"]
    done(slices.delete_namespaced_endpoint_slice("s", "shop"))
    with pytest.raises(ApiException):
        slices.read_namespaced_endpoint_slice("s", "shop")

    custom = CustomObjects(api)
    route = {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
             "metadata": {"name": "r", "namespace": "shop"}, "spec": {}}
    done(custom.create_namespaced_custom_object("gateway.networking.k8s.io", "v1", "shop", "httproutes",
                                           route))
    live = json.loads(custom.get_namespaced_custom_object(
        "gateway.networking.k8s.io", "v1", "shop", "httproutes", "r").data)
    live["status"] = {"parents": [{"controllerName": "aether.io/mesh"}]}
    done(custom.replace_namespaced_custom_object_status(
        "gateway.networking.k8s.io", "v1", "shop", "httproutes", "r", live))
    again = json.loads(custom.list_custom_object_for_all_namespaces(
        "gateway.networking.k8s.io", "v1", "httproutes").data)["items"][0]
    assert again["status"]["parents"][0]["controllerName"] == "aether.io/mesh"


def test_the_agent_loads_no_model_classes() -> None:
    """The point of agent.kube.rest: ~250 pydantic classes (~22 MB) stay out of the agent."""
    code = (
        "import sys\n"
        "import agent.runtime.app, agent.source.kube, agent.node.repair, agent.node.readiness\n"
        "import agent.slices.writer, agent.meshpods.publisher, agent.gamma.status\n"
        "import agent.gamma.xmesh, agent.gamma.lease\n"
        "from kubernetes import client\n"
        "from agent.kube.rest import CoreV1, CustomObjects\n"
        "CoreV1(client.ApiClient()); CustomObjects(client.ApiClient())\n"
        "print(sum(1 for m in sys.modules if m.startswith('kubernetes.client.models.')),\n"
        "      sum(1 for m in sys.modules if m.startswith('kubernetes.client.api.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "0"]
