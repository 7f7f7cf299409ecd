"""Publish what aether supports on the experimental XMesh resource (GEP-3949), if installed.

XMesh (``gateway.networking.x-k8s.io/v1alpha1``, cluster-scoped) is how a platform team sees
which mesh claims the cluster and which conformance features it implements. We write the
status of every XMesh whose ``spec.controllerName`` is ours and never touch any spec. Our
contract is to keep one named ``aether`` (the agent passes ``create_missing=True``; operators
who ship their own, as GEP-3949 prefers, run ``--no-xmesh-create``). An existing object's spec
is never changed. CRD absent: nothing, no error.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from agent.gamma import DEFAULT_CONTROLLER_NAME
from agent.gamma.status import AlwaysLeader, Leader
from agent.kube.client import done, raw_options
from agent.kube.rest import CustomObjects

log = logging.getLogger("aether.gamma.xmesh")

GROUP = "gateway.networking.x-k8s.io"
VERSION = "v1alpha1"
PLURAL = "xmeshes"
DEFAULT_NAME = "aether"

#: Gateway API feature names (pkg/features: mesh.go, httproute.go, grpcroute.go) we claim,
#: each with the tests of ``integration/test_gamma_conformance.py`` that show it on the real
#: Envoy. The claim is generated from this map, and ``tests/test_gamma_features.py`` fails if
#: a feature names no test or a test that does not exist: we claim what CI runs.
FEATURE_TESTS: dict[str, tuple[str, ...]] = {
    "Mesh": ("test_backend_services_reachable", "test_identity_route_spreads_over_endpoints"),
    "HTTPRoute": ("test_match_path_exact", "test_match_path_prefix_whole_segments",
                  "test_match_header_exact_case_insensitive_name", "test_match_method",
                  "test_weights_split", "test_request_header_modifier",
                  "test_response_header_modifier", "test_missing_backend_share_is_500"),
    "GRPCRoute": ("test_grpc_route_method_match_over_h2c", "test_grpc_route_weights",
                  "test_grpc_route_wins_over_http_route"),
    "MeshClusterIPMatching": ("test_plain_service_routed_by_cluster_ip_not_host",
                              "test_route_by_cluster_ip_with_misleading_host"),
    "MeshConsumerRoute": ("test_consumer_route_vs_producer_route",
                          "test_consumer_route_on_all_ports"),
    "MeshHTTPRouteBackendRequestHeaderModification": ("test_backend_level_filters",),
    "MeshHTTPRouteNamedRouteRule": ("test_named_route_rule",),
    "MeshHTTPRouteQueryParamMatching": ("test_match_query_exact", "test_match_query_regex"),
    "MeshHTTPRouteRedirectPath": ("test_request_redirect",),
    "MeshHTTPRouteRedirectPort": ("test_request_redirect",),
    "MeshHTTPRouteRewritePath": ("test_url_rewrite_prefix",
                                 "test_url_rewrite_hostname_and_full_path"),
    "MeshHTTPRouteSchemeRedirect": ("test_request_redirect_scheme_change_from_service_port",),
}
SUPPORTED_FEATURES: tuple[str, ...] = tuple(sorted(FEATURE_TESTS))


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _no_times(conds: Any) -> list[Any]:
    return [{k: v for k, v in c.items() if k != "lastTransitionTime"} if isinstance(c, dict) else c
            for c in conds or []]


def desired_status(obj: dict[str, Any], controller_name: str, identity: str,
                   features: Iterable[str], now: str | None = None) -> dict[str, Any]:
    """Status with our Accepted condition and sorted supportedFeatures; other conditions kept."""
    status = dict(obj.get("status") or {})
    conds = [c for c in status.get("conditions") or [] if isinstance(c, dict)]
    prev = next((c for c in conds if c.get("type") == "Accepted"), None)
    accepted = {
        "type": "Accepted", "status": "True", "reason": "Accepted",
        "message": f"{controller_name}: claimed by the aether agent on node {identity} "
                   "(status leader)",
        "observedGeneration": int((obj.get("metadata") or {}).get("generation") or 0),
        "lastTransitionTime": (prev.get("lastTransitionTime") or now or _now())
        if prev is not None and prev.get("status") == "True" else (now or _now()),
    }
    status["conditions"] = [accepted if c is prev else c for c in conds] if prev else [accepted, *conds]
    status["supportedFeatures"] = [{"name": n} for n in sorted(set(features))]
    return status


class XMeshPublisher:
    """Keeps our XMesh status current; ``sync()`` is cheap enough to call every pass."""

    def __init__(self, api: client.ApiClient, controller_name: str = DEFAULT_CONTROLLER_NAME,
                 identity: str = "", *, name: str = DEFAULT_NAME,
                 features: Iterable[str] = SUPPORTED_FEATURES, create_missing: bool = False,
                 lease: Leader | None = None, discovery_interval: float = 300.0,
                 timeout: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.custom = CustomObjects(api)
        self.controller_name = controller_name
        self.identity = identity
        self.name = name
        self.features = tuple(features)
        self.create_missing = create_missing
        self.lease: Leader = lease or AlwaysLeader()
        self.discovery_interval = discovery_interval
        self.timeout = timeout
        self.clock = clock
        self._installed: bool | None = None
        self._checked_at = 0.0
        self._warned = False
        self.writes = 0
        self.state = "unknown"

    def _opts(self) -> dict[str, Any]:
        return raw_options(self.timeout)

    def installed(self) -> bool:
        """Discovery: does the API serve xmeshes? Re-checked every ``discovery_interval``."""
        if self._installed is not None and self.clock() - self._checked_at < self.discovery_interval:
            return self._installed
        try:
            resp = self.custom.get_api_resources(GROUP, VERSION, **self._opts())
            names = {r.get("name") for r in json.loads(resp.data).get("resources") or []}
            self._installed = PLURAL in names
        except ApiException as e:
            if e.status != 404:
                raise
            self._installed = False
        self._checked_at = self.clock()
        return self._installed

    def sync(self) -> str:
        """One pass: "not-leader" | "not-installed" | "missing" | "ok" (also kept in .state)."""
        self.state = self._sync()
        return self.state

    def _sync(self) -> str:
        if not self.lease.is_leader():
            return "not-leader"
        if not self.installed():
            return "not-installed"
        try:
            resp = self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, **self._opts())
        except ApiException as e:
            if e.status == 404:  # CRD removed since discovery
                self._installed = None
                return "not-installed"
            raise
        items = json.loads(resp.data).get("items") or []
        ours = [o for o in items if (o.get("spec") or {}).get("controllerName") == self.controller_name]
        for o in items:
            if (o.get("metadata") or {}).get("name") == self.name and o not in ours and not self._warned:
                log.warning("XMesh %s belongs to controller %s: left alone", self.name,
                            (o.get("spec") or {}).get("controllerName"))
                self._warned = True
        if not ours:
            if not self.create_missing:
                if not self._warned:
                    log.warning("no XMesh with controllerName %s: supported features are not "
                                "published (create one, see docs/ownership.md)", self.controller_name)
                    self._warned = True
                return "missing"
            created = self._create()
            if created is None:
                return "missing"
            ours = [created]
        for obj in ours:
            self._write(obj)
        return "ok"

    def _create(self) -> dict[str, Any] | None:
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "XMesh",
                "metadata": {"name": self.name}, "spec": {"controllerName": self.controller_name}}
        try:
            resp = self.custom.create_cluster_custom_object(GROUP, VERSION, PLURAL, body, **self._opts())
        except ApiException as e:
            if e.status == 409:  # someone made it meanwhile: the next pass sees it
                return None
            raise
        log.info("XMesh %s created for %s", self.name, self.controller_name)
        obj: dict[str, Any] = json.loads(resp.data)
        return obj

    def _write(self, obj: dict[str, Any]) -> None:
        want = desired_status(obj, self.controller_name, self.identity, self.features)
        have = obj.get("status") or {}
        if (_no_times(want.get("conditions")) == _no_times(have.get("conditions"))
                and want.get("supportedFeatures") == have.get("supportedFeatures")):
            return
        body = dict(obj)
        body.setdefault("apiVersion", f"{GROUP}/{VERSION}")
        body.setdefault("kind", "XMesh")
        body["status"] = want
        name = str((obj.get("metadata") or {}).get("name"))
        try:
            done(self.custom.replace_cluster_custom_object_status(GROUP, VERSION, PLURAL, name,
                                                                  body, **self._opts()))
        except ApiException as e:
            if e.status in (404, 409):  # gone or changed: the next pass re-lists
                return
            raise
        self.writes += 1
        log.info("XMesh %s status written (%d features)", name, len(self.features))
