"""KubeSource against the fake API server, through a kubeconfig file like the agent uses."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.source.base import MetadataSource, PodEvent, SourceError
from agent.source.kube import KubeSource
from agent.testing import FakeApiServer

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer() as srv:
        srv.put_object(
            {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": "shop", "labels": {"aether.io/capture": "enabled"}},
            }
        )
        srv.put_object(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": "web-1",
                    "namespace": "shop",
                    "uid": "uid-web-1",
                    "labels": {"app": "web"},
                    "annotations": {"aether.io/inject": "true"},
                },
                "spec": {"nodeName": "node-a", "serviceAccountName": "web", "containers": []},
            }
        )
        yield srv


@pytest.fixture
def source(server: FakeApiServer, tmp_path: Path) -> Iterator[KubeSource]:
    src = KubeSource(
        server.kubeconfig(tmp_path / "kubeconfig"),
        node_name="node-a",
        retry_budget=2.0,
        request_timeout=1.0,
    )
    yield src
    src.close()


def test_is_a_metadata_source(source: KubeSource, server: FakeApiServer) -> None:
    src: MetadataSource = source
    assert src.describe() == f"kubernetes API {server.url}"


def test_get_pod_and_namespace(source: KubeSource, server: FakeApiServer) -> None:
    pod = source.get_pod("shop", "web-1")
    assert pod is not None
    assert (pod.key, pod.uid, pod.node_name, pod.service_account) == (
        "shop/web-1", "uid-web-1", "node-a", "web"
    )
    assert pod.labels == {"app": "web"}
    assert pod.annotations == {"aether.io/inject": "true"}
    assert not pod.host_network
    ns = source.get_namespace("shop")
    assert ns is not None and ns.labels == {"aether.io/capture": "enabled"}
    assert ("GET", "/api/v1/namespaces/shop/pods/web-1") in server.requests
    assert ("GET", "/api/v1/namespaces/shop") in server.requests


def test_missing_is_none_without_retry(source: KubeSource, server: FakeApiServer) -> None:
    server.clear_requests()
    assert source.get_pod("shop", "nope") is None
    assert source.get_namespace("nope") is None
    assert len(server.requests) == 2


def test_retries_transient_errors(source: KubeSource, server: FakeApiServer) -> None:
    server.clear_requests()
    server.fail_next(2)
    pod = source.get_pod("shop", "web-1")
    assert pod is not None and pod.name == "web-1"
    assert server.requests.count(("GET", "/api/v1/namespaces/shop/pods/web-1")) == 3


def test_gives_up_with_source_error(source: KubeSource, server: FakeApiServer) -> None:
    server.fail_next(100, status=503)
    with pytest.raises(SourceError, match="503"):
        source.get_namespace("shop")
    assert len(server.requests) <= source.max_attempts + 2


def test_source_error_when_server_is_gone(server: FakeApiServer, tmp_path: Path) -> None:
    src = KubeSource(
        server.kubeconfig(tmp_path / "kc"), retry_budget=0.5, max_attempts=3, request_timeout=0.5
    )
    assert src.get_pod("shop", "web-1") is not None  # leaves a pooled keep-alive connection
    server.stop()
    started = time.monotonic()
    with pytest.raises(SourceError, match=r"cannot read pod shop/web-1"):
        src.get_pod("shop", "web-1")
    assert time.monotonic() - started < 3


def test_slow_server_is_bounded_by_budget(server: FakeApiServer, tmp_path: Path) -> None:
    src = KubeSource(
        server.kubeconfig(tmp_path / "kc"), retry_budget=1.0, max_attempts=10, request_timeout=5
    )
    server.delay(3)
    started = time.monotonic()
    with pytest.raises(SourceError):
        src.get_pod("shop", "web-1")
    assert time.monotonic() - started < 2
    server.delay(0)


def test_record_event(source: KubeSource, server: FakeApiServer) -> None:
    source.record_event(
        PodEvent("shop", "web-1", "uid-web-1", "CaptureFailed", "nft: permission denied")
    )
    [ev] = server.events_for("shop", "web-1")
    assert ev["involvedObject"] == {
        "apiVersion": "v1", "kind": "Pod", "namespace": "shop", "name": "web-1",
        "uid": "uid-web-1",
    }
    assert (ev["reason"], ev["message"], ev["type"]) == (
        "CaptureFailed", "nft: permission denied", "Warning"
    )
    assert ev["source"] == {"component": "aether-agent", "host": "node-a"}
    assert ev["reportingComponent"] == "aether-agent"
    assert ev["count"] == 1 and ev["firstTimestamp"] == ev["lastTimestamp"]
    assert ev["metadata"]["name"].startswith("web-1.")


def test_record_event_on_an_authorization_policy(source: KubeSource, server: FakeApiServer
                                                  ) -> None:
    source.record_event(PodEvent("shop", "allow-web", "uid-p", "InvalidAuthorizationPolicy",
                                 "cannot be read", kind="AuthorizationPolicy",
                                 api_version="security.aether.io/v1alpha1"))
    [ev] = server.events_for("shop", "allow-web")
    assert ev["involvedObject"] == {
        "apiVersion": "security.aether.io/v1alpha1", "kind": "AuthorizationPolicy",
        "namespace": "shop", "name": "allow-web", "uid": "uid-p"}


def test_record_event_never_raises(
    source: KubeSource, server: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    server.fail_next(2)  # both attempts fail
    with caplog.at_level(logging.WARNING, logger="agent.source.kube"):
        source.record_event(PodEvent("shop", "web-1", "", "Captured", "ok", type="Normal"))
    assert server.events_for("shop", "web-1") == []
    assert "could not record Captured event on pod shop/web-1" in caplog.text, caplog.text
    server.stop()
    source.record_event(PodEvent("shop", "web-1", "", "Captured", "ok", type="Normal"))


def test_api_get_json(source: KubeSource) -> None:
    ns = source._api_get_json("/api/v1/namespaces/shop")
    assert ns is not None and ns["metadata"]["name"] == "shop"
    pods = source._api_get_json("/api/v1/pods", {"fieldSelector": "spec.nodeName=node-a"})
    assert pods is not None and [p["metadata"]["name"] for p in pods["items"]] == ["web-1"]
    assert source._api_get_json("/api/v1/namespaces/nope") is None


def test_bad_kubeconfig_is_source_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="cannot load Kubernetes config"):
        KubeSource(str(tmp_path / "missing"))
