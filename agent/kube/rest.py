"""The few Kubernetes API calls the agent makes, over the official client's transport.

The typed API classes of the ``kubernetes`` package are pydantic models: importing
``CoreV1Api`` alone loads ~250 model classes, ~22 MB resident in every agent for calls
whose bodies the agent already builds and parses as plain JSON. These classes keep the
method names and arguments of the typed ones (so call sites, fakes in tests and the RBAC
check in ``tests/test_deploy.py`` read the same) and go through the same ``ApiClient``
(config, auth, TLS, urllib3 retries) with its raw-answer semantics: the urllib3 response
is returned, a non-2xx answer raises ``ApiException``.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

JSON_TYPE = "application/json"


def _param(name: str) -> str:
    """The typed client's keyword as the API's query parameter (``label_selector`` →
    ``labelSelector``, ``_continue`` → ``continue``)."""
    head, *rest = name.lstrip("_").split("_")
    return head + "".join(w.capitalize() for w in rest)


def _value(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def _seg(*parts: str) -> str:
    return "/".join(quote(p, safe="") for p in parts)


class Rest:
    """One request through ``ApiClient``: the typed classes' ``_preload_content=False`` path."""

    def __init__(self, api: ApiClient) -> None:
        self.api = api

    def call(self, method: str, path: str, *, body: Any = None, _request_timeout: Any = None,
             _preload_content: bool = False, _content_type: str | None = None,
             **query: Any) -> Any:
        """The raw urllib3 answer (``_preload_content`` is accepted for the typed signature:
        every agent call reads raw JSON). ``query``: the API's parameters, as the typed
        client's keywords (``label_selector``) or as the API spells them (``fieldSelector``)."""
        headers = {"Accept": JSON_TYPE}
        if body is not None:
            headers["Content-Type"] = _content_type or JSON_TYPE
        req = self.api.param_serialize(
            method=method, resource_path=path,
            query_params=[(_param(k), _value(v)) for k, v in query.items() if v is not None],
            header_params=headers, body=body, auth_settings=["BearerToken"])
        resp = self.api.call_api(*req, _request_timeout=_request_timeout)
        if not 200 <= resp.status <= 299:
            resp.read()
            raise ApiException.from_response(http_resp=resp, body=None, data=None)
        return resp.response


class CoreV1(Rest):
    """``/api/v1``: pods, namespaces, events, nodes."""

    def read_namespaced_pod(self, name: str, namespace: str, **kw: Any) -> Any:
        return self.call("GET", f"/api/v1/namespaces/{_seg(namespace)}/pods/{_seg(name)}", **kw)

    def read_namespace(self, name: str, **kw: Any) -> Any:
        return self.call("GET", f"/api/v1/namespaces/{_seg(name)}", **kw)

    def create_namespaced_event(self, namespace: str, body: Any, **kw: Any) -> Any:
        return self.call("POST", f"/api/v1/namespaces/{_seg(namespace)}/events", body=body, **kw)

    def list_pod_for_all_namespaces(self, **kw: Any) -> Any:
        return self.call("GET", "/api/v1/pods", **kw)

    def create_namespaced_pod_eviction(self, name: str, namespace: str, body: Any,
                                       **kw: Any) -> Any:
        return self.call("POST", f"/api/v1/namespaces/{_seg(namespace)}/pods/{_seg(name)}/eviction",
                         body=body, **kw)

    def delete_namespaced_pod(self, name: str, namespace: str, body: Any = None,
                              **kw: Any) -> Any:
        return self.call("DELETE", f"/api/v1/namespaces/{_seg(namespace)}/pods/{_seg(name)}",
                         body=body, **kw)

    def read_node(self, name: str, **kw: Any) -> Any:
        return self.call("GET", f"/api/v1/nodes/{_seg(name)}", **kw)

    def patch_node(self, name: str, body: Any, **kw: Any) -> Any:
        return self.call("PATCH", f"/api/v1/nodes/{_seg(name)}", body=body, **kw)


class _Namespaced(Rest):
    """One namespaced resource of one group: list everywhere, CRUD by name."""

    base = ""  # /apis/<group>/<version>
    plural = ""

    def _all(self) -> str:
        return f"{self.base}/{self.plural}"

    def _in(self, namespace: str, name: str = "") -> str:
        path = f"{self.base}/namespaces/{_seg(namespace)}/{self.plural}"
        return f"{path}/{_seg(name)}" if name else path


class DiscoveryV1(_Namespaced):
    """EndpointSlices."""

    base, plural = "/apis/discovery.k8s.io/v1", "endpointslices"

    def list_endpoint_slice_for_all_namespaces(self, **kw: Any) -> Any:
        return self.call("GET", self._all(), **kw)

    def create_namespaced_endpoint_slice(self, namespace: str, body: Any, **kw: Any) -> Any:
        return self.call("POST", self._in(namespace), body=body, **kw)

    def read_namespaced_endpoint_slice(self, name: str, namespace: str, **kw: Any) -> Any:
        return self.call("GET", self._in(namespace, name), **kw)

    def replace_namespaced_endpoint_slice(self, name: str, namespace: str, body: Any,
                                          **kw: Any) -> Any:
        return self.call("PUT", self._in(namespace, name), body=body, **kw)

    def delete_namespaced_endpoint_slice(self, name: str, namespace: str, body: Any = None,
                                         **kw: Any) -> Any:
        return self.call("DELETE", self._in(namespace, name), body=body, **kw)


class CoordinationV1(_Namespaced):
    """Leases."""

    base, plural = "/apis/coordination.k8s.io/v1", "leases"

    def read_namespaced_lease(self, name: str, namespace: str, **kw: Any) -> Any:
        return self.call("GET", self._in(namespace, name), **kw)

    def create_namespaced_lease(self, namespace: str, body: Any, **kw: Any) -> Any:
        return self.call("POST", self._in(namespace), body=body, **kw)

    def replace_namespaced_lease(self, name: str, namespace: str, body: Any, **kw: Any) -> Any:
        return self.call("PUT", self._in(namespace, name), body=body, **kw)


class CustomObjects(Rest):
    """Custom resources (MeshPods, Gateway API routes, XMesh) by group, version and plural."""

    @staticmethod
    def _path(group: str, version: str, plural: str, namespace: str = "", name: str = "",
              sub: str = "") -> str:
        path = f"/apis/{_seg(group)}/{_seg(version)}"
        if namespace:
            path += f"/namespaces/{_seg(namespace)}"
        path += f"/{_seg(plural)}"
        if name:
            path += f"/{_seg(name)}"
        return f"{path}/{sub}" if sub else path

    def get_api_resources(self, group: str, version: str, **kw: Any) -> Any:
        return self.call("GET", f"/apis/{_seg(group)}/{_seg(version)}", **kw)

    def list_custom_object_for_all_namespaces(self, group: str, version: str, plural: str,
                                              **kw: Any) -> Any:
        return self.call("GET", self._path(group, version, plural), **kw)

    def list_cluster_custom_object(self, group: str, version: str, plural: str,
                                   **kw: Any) -> Any:
        return self.call("GET", self._path(group, version, plural), **kw)

    def create_cluster_custom_object(self, group: str, version: str, plural: str, body: Any,
                                     **kw: Any) -> Any:
        return self.call("POST", self._path(group, version, plural), body=body, **kw)

    def replace_cluster_custom_object_status(self, group: str, version: str, plural: str,
                                             name: str, body: Any, **kw: Any) -> Any:
        return self.call("PUT", self._path(group, version, plural, name=name, sub="status"),
                         body=body, **kw)

    def create_namespaced_custom_object(self, group: str, version: str, namespace: str,
                                        plural: str, body: Any, **kw: Any) -> Any:
        return self.call("POST", self._path(group, version, plural, namespace), body=body, **kw)

    def get_namespaced_custom_object(self, group: str, version: str, namespace: str,
                                     plural: str, name: str, **kw: Any) -> Any:
        return self.call("GET", self._path(group, version, plural, namespace, name), **kw)

    def replace_namespaced_custom_object(self, group: str, version: str, namespace: str,
                                         plural: str, name: str, body: Any, **kw: Any) -> Any:
        return self.call("PUT", self._path(group, version, plural, namespace, name),
                         body=body, **kw)

    def replace_namespaced_custom_object_status(self, group: str, version: str, namespace: str,
                                                plural: str, name: str, body: Any,
                                                **kw: Any) -> Any:
        return self.call("PUT", self._path(group, version, plural, namespace, name, "status"),
                         body=body, **kw)

    def delete_namespaced_custom_object(self, group: str, version: str, namespace: str,
                                        plural: str, name: str, body: Any = None,
                                        **kw: Any) -> Any:
        return self.call("DELETE", self._path(group, version, plural, namespace, name),
                         body=body, **kw)
