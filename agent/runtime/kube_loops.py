"""The agent's loops against the Kubernetes API, built and started for the composition.

Split out of ``agent.runtime.app``: the EndpointSlice projection and the MeshPod records of
this node's pods (both follow the mesh model), GAMMA route status (one writer cluster-wide,
elected by a Lease; every agent routes) and the node loops (the readiness taint and the
repair of uncaptured managed pods). Each function builds its loops, starts them and hands
them back; the agent keeps them and stops them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from agent.cni.handler import ListenerSink
from agent.common.config import NodeConfig
from agent.runtime.options import AgentOptions
from agent.source.base import PodEvent

if TYPE_CHECKING:  # their modules load only with the Kubernetes API
    from agent.gamma.conditions import ParentStatus
    from agent.gamma.lease import LeaseElector
    from agent.gamma.status import StatusLoop
    from agent.meshpods.publisher import MeshPodPublisher
    from agent.node.readiness import ReadinessLoop
    from agent.node.repair import RepairLoop
    from agent.scope.model import MeshModel
    from agent.slices.writer import SliceProjector
    from agent.source.events import ObjectStore


class ApiMesh(Protocol):
    """What the API loops follow of the mesh runtime (``agent.runtime.mesh.MeshRuntime``)."""

    @property
    def objects(self) -> ObjectStore: ...
    @property
    def model(self) -> MeshModel: ...
    @property
    def followers(self) -> list[Any]: ...

    def route_statuses(self) -> list[ParentStatus]: ...


def start_projections(mesh: ApiMesh, node_name: str, options: AgentOptions, watcher: Any
                      ) -> tuple[SliceProjector, MeshPodPublisher]:
    """EndpointSlices of the mesh's Services and MeshPod records of this node's pods."""
    from agent.kube import api_client
    from agent.meshpods.publisher import MeshPodPublisher, MeshPodWriter
    from agent.slices.writer import SliceProjector, SliceWriter
    o = options
    synced = watcher.wait_synced if watcher is not None else None
    slices = SliceProjector.for_mesh(
        mesh.objects, mesh.model, SliceWriter(api_client(o.kubeconfig), node_name))
    meshpods = MeshPodPublisher.for_mesh(
        mesh.objects, mesh.model, MeshPodWriter(api_client(o.kubeconfig), node_name))
    mesh.followers.extend([slices, meshpods])
    slices.start(synced=synced)
    meshpods.start(synced=synced)
    return slices, meshpods


def start_route_status(mesh: ApiMesh, node_name: str, options: AgentOptions, watcher: Any
                       ) -> tuple[LeaseElector, StatusLoop]:
    """GAMMA route status: one writer cluster-wide (Lease), every agent routes."""
    from agent.gamma.lease import LeaseElector
    from agent.gamma.status import StatusLoop, StatusWriter
    from agent.gamma.xmesh import XMeshPublisher
    from agent.kube import api_client

    o = options
    gapi, ctrl, objects = api_client(o.kubeconfig), o.gamma_controller_name, mesh.objects
    lease = LeaseElector(gapi, node_name, namespace=o.daemonset_namespace)
    status_loop = StatusLoop(
        mesh.route_statuses, StatusWriter(gapi, ctrl, lease),
        xmesh=XMeshPublisher(gapi, ctrl, node_name, lease=lease,
                             create_missing=o.xmesh_create))
    lease.on_change = lambda _l: status_loop.mark_dirty()
    kinds = ("HTTPRoute", "GRPCRoute", "Service", "Namespace")
    objects.on_event(lambda ev: status_loop.mark_dirty() if ev.kind in kinds else None,
                     replay=False)
    lease.start()
    status_loop.start(synced=watcher.wait_synced if watcher is not None else None)
    return lease, status_loop


def start_node_loops(node: NodeConfig, options: AgentOptions, sink: ListenerSink,
                     captured_uids: Callable[[], set[str]],
                     record_event: Callable[[PodEvent], None]
                     ) -> tuple[RepairLoop, ReadinessLoop]:
    """The repair of uncaptured managed pods and the node's readiness taint."""
    from agent.kube import api_client
    from agent.node.readiness import (
        NodeReadiness,
        ReadinessLoop,
        plugin_installed,
        socket_serving,
    )
    from agent.node.repair import RepairLoop

    o = options
    api = api_client(o.kubeconfig)
    repair = RepairLoop(api, node, captured_uids, record_event, mode=o.repair)
    repair.start()
    envoy_ready = getattr(sink, "ready", None)
    readiness = ReadinessLoop(NodeReadiness(api, node.node_name), {
        "plugin": lambda: plugin_installed(o.cni_conf_dir, o.cni_bin_dir),
        "socket": lambda: socket_serving(node.cni_socket),
        "envoy": envoy_ready if callable(envoy_ready) else (lambda: True),
    })
    readiness.start()
    return repair, readiness
