"""Publish this node's MeshPod records (``agent.meshpods.record``) and keep them current.

``MeshPodWriter`` owns this node's records on the protocol of ``agent.kube.owned`` (found
by the node label, so a restarted agent adopts them; an unchanged pod costs no request).
``MeshPodPublisher`` is the debounced loop the mesh marks dirty on every change: it
recomputes the records from this node's Pods and the registry's verdicts and writes the
difference; a pod gone (or no longer managed) loses its record on the next pass, and the
garbage collector removes it anyway when the Pod is deleted (owner reference).
"""

from __future__ import annotations

from typing import Any, Protocol

from kubernetes import client

from agent.kube import done
from agent.kube.owned import Desired, ObjectSource, OwnedLoop, OwnedWriter, RawApi, raw_json
from agent.kube.rest import CustomObjects
from agent.meshpods.record import GROUP, JSON, PLURAL, VERSION, desired_records, owned_selector

COMPARED = ("spec",)


class _MeshPodApi(RawApi):
    """MeshPods as custom objects, raw JSON in and out."""

    kind = "MeshPod"

    def __init__(self, api: client.ApiClient, timeout: float) -> None:
        super().__init__(timeout)
        self.custom = CustomObjects(api)

    def list_owned(self, selector: str) -> list[JSON]:
        resp = self.custom.list_custom_object_for_all_namespaces(
            GROUP, VERSION, PLURAL, label_selector=selector, **self.opts())
        return list(raw_json(resp).get("items") or [])

    def create(self, ns: str, body: JSON) -> JSON:
        return raw_json(self.custom.create_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, body, **self.opts()))

    def read(self, ns: str, name: str) -> JSON:
        return raw_json(self.custom.get_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, name, **self.opts()))

    def replace(self, ns: str, name: str, body: JSON) -> JSON:
        return raw_json(self.custom.replace_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, name, body, **self.opts()))

    def delete(self, ns: str, name: str, uid: str) -> None:
        done(self.custom.delete_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, name, body=self.only(uid), **self.opts()))


class MeshPodWriter(OwnedWriter):
    """This node's MeshPod records."""

    def __init__(self, api: client.ApiClient, node_name: str, timeout: float = 5.0) -> None:
        super().__init__(_MeshPodApi(api, timeout), owned_selector(node_name), COMPARED)
        self.node_name = node_name


class _Registry(Protocol):
    def get(self, pod_key: str) -> Any: ...


class _Model(Protocol):
    @property
    def registry(self) -> _Registry: ...


class MeshPodPublisher(OwnedLoop):
    """The debounced publishing loop."""

    thread_name = "meshpod-publisher"
    what = "MeshPod publishing"
    objects = "MeshPod records"

    @classmethod
    def for_mesh(cls, objects: ObjectSource, model: _Model, writer: MeshPodWriter,
                 **kw: Any) -> MeshPodPublisher:
        """A publisher fed by a MeshRuntime's ObjectStore (this node's Pods) and MeshModel
        (which of them the mesh manages)."""

        def compute() -> Desired:
            return desired_records(writer.node_name, objects.of_kind("Pod"),
                                   lambda key: model.registry.get(key) is not None)

        return cls(compute, writer, **kw)
