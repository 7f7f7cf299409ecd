"""Write the projected EndpointSlices: adopt what exists, send only changes, never crash.

``SliceWriter`` owns this node's slices on the protocol of ``agent.kube.owned`` (found by
label, so a restarted agent adopts its slices; unchanged projections cost no request).
``SliceProjector`` is the background loop: model changes only mark it dirty, and one
debounced pass per burst recomputes and writes, so a relist of 10k objects is one write per
changed slice. Slices are removed only when the node leaves for good (a restart keeps
serving non-mesh traffic).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from kubernetes import client

from agent.kube import done
from agent.kube.owned import (
    Desired,
    ObjectSource,
    OwnedLoop,
    OwnedWriter,
    RawApi,
    WriteError,
    raw_json,
    unchanged,
)
from agent.kube.rest import DiscoveryV1
from agent.scope.model import ServiceView
from agent.slices.project import (
    JSON,
    desired_slices,
    exposed,
    local_pods,
    owned_selector,
    skip_reason,
)

log = logging.getLogger("aether.slices")

__all__ = ["Desired", "SliceProjector", "SliceWriteError", "SliceWriter", "mesh_desired",
           "unchanged"]
COMPARED = ("addressType", "endpoints", "ports")
SliceWriteError = WriteError


class _SliceApi(RawApi):
    """EndpointSlices through the discovery API, raw JSON in and out (no model classes)."""

    kind = "EndpointSlice"

    def __init__(self, api: client.ApiClient, timeout: float) -> None:
        super().__init__(timeout)
        self.discovery = DiscoveryV1(api)

    def list_owned(self, selector: str) -> list[JSON]:
        resp = self.discovery.list_endpoint_slice_for_all_namespaces(
            label_selector=selector, **self.opts())
        return list(raw_json(resp).get("items") or [])

    def create(self, ns: str, body: JSON) -> JSON:
        return raw_json(self.discovery.create_namespaced_endpoint_slice(ns, body, **self.opts()))

    def read(self, ns: str, name: str) -> JSON:
        return raw_json(self.discovery.read_namespaced_endpoint_slice(name, ns, **self.opts()))

    def replace(self, ns: str, name: str, body: JSON) -> JSON:
        return raw_json(self.discovery.replace_namespaced_endpoint_slice(
            name, ns, body, **self.opts()))

    def delete(self, ns: str, name: str, uid: str) -> None:
        done(self.discovery.delete_namespaced_endpoint_slice(
            name, ns, body=self.only(uid), **self.opts()))


class SliceWriter(OwnedWriter):
    """This node's EndpointSlices (``agent.kube.owned``: adopt by label, write on diff)."""

    def __init__(self, api: client.ApiClient, node_name: str, timeout: float = 5.0) -> None:
        super().__init__(_SliceApi(api, timeout), owned_selector(node_name), COMPARED)
        self.node_name = node_name


class _Model(Protocol):
    def view(self, service_key: str) -> ServiceView | None: ...


def mesh_desired(objects: ObjectSource, model: _Model, node_name: str,
                 skipped: dict[str, str] | None = None) -> Desired:
    """The node's desired slices from the mesh: opted-in Services × their local registered
    endpoints. ``skipped`` (if given) is filled with opted-in Services refused, and why."""
    items = []
    for svc in objects.of_kind("Service"):
        if not exposed(svc):
            continue
        meta = svc.get("metadata") or {}
        key = f"{meta.get('namespace') or 'default'}/{meta.get('name') or ''}"
        reason = skip_reason(svc)
        if reason is not None:
            if skipped is not None:
                skipped[key] = reason
            continue
        items.append((svc, local_pods(model.view(key))))
    return desired_slices(node_name, items)


class SliceProjector(OwnedLoop):
    """The debounced projection loop; ``skipped`` lists opted-in Services refused (status)."""

    thread_name = "slice-projector"
    what = "EndpointSlice projection"
    objects = "EndpointSlices"

    def __init__(self, compute: Callable[[], Desired], writer: SliceWriter, **kw: Any) -> None:
        super().__init__(compute, writer, **kw)
        self.skipped: dict[str, str] = {}  # opted-in Services refused → why (status)

    @classmethod
    def for_mesh(cls, objects: ObjectSource, model: _Model, writer: SliceWriter,
                 **kw: Any) -> SliceProjector:
        """A projector fed by a MeshRuntime's ObjectStore and MeshModel."""
        skipped: dict[str, str] = {}
        warned: dict[str, str] = {}

        def compute() -> Desired:
            skipped.clear()
            out = mesh_desired(objects, model, writer.node_name, skipped)
            for key, why in skipped.items():
                if warned.get(key) != why:
                    log.warning("%s=true on Service %s ignored: %s",
                                "aether.io/expose-endpoints", key, why)
            warned.clear()
            warned.update(skipped)
            return out

        proj = cls(compute, writer, **kw)
        proj.skipped = skipped
        return proj

    def status(self) -> dict[str, Any]:
        return {**super().status(), "refused": dict(self.skipped)}
