"""What the agent tells the outside about itself: readiness, and the metrics server.

Split out of ``agent.runtime.app`` (the composition): the readiness checks behind /readyz,
the node taint and a successor's "ready" question; the metrics wired to the agent's parts
(the CNI handler, the sink's Envoy, the mesh, the repair loop) and the metrics server, bound
with a moment's retry on a take-over (the predecessor has just let go of the port); and the
traffic metrics' names of a calling pod.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from agent.cni.handler import ListenerSink
from agent.common.config import NodeConfig
from agent.common.workload import workload_of
from agent.runtime.options import AgentOptions
from agent.runtime.parts import AgentParts

if TYPE_CHECKING:  # their modules load only when the metrics start
    from agent.ops.metrics import Metrics, MetricsServer
    from agent.scope.model import MeshModel
    from agent.source.events import ObjectStore


def readiness_checks(node: NodeConfig, options: AgentOptions, sink: ListenerSink,
                     serving: Callable[[], bool]) -> dict[str, bool]:
    """What /readyz and the node taint wait for: plugin installed, socket served, Envoy
    (and, with ``serving`` false, "serving": starting, frozen or retired)."""
    from agent.node.readiness import plugin_installed, socket_serving
    o = options
    ready = getattr(sink, "ready", None)
    checks = {
        "socket": socket_serving(node.cni_socket),
        "envoy": bool(ready()) if callable(ready) else True,
    }
    if o.kube:
        checks["plugin"] = plugin_installed(o.cni_conf_dir, o.cni_bin_dir)
    if not serving():
        # starting (a take-over not yet committed), frozen or retired: not this agent's
        # node to serve (yet, or any more)
        checks["serving"] = False
    return checks


class MeshParts(Protocol):
    """What the metrics read of the mesh runtime."""

    @property
    def objects(self) -> ObjectStore: ...
    @property
    def model(self) -> MeshModel: ...


class MetricsHost(AgentParts, Protocol):
    """The running agent as its metrics read it (``agent.runtime.app.Agent``)."""

    @property
    def mesh(self) -> MeshParts | None: ...


class TrafficSources:
    """``capture-<container id>`` → the calling pod's namespace, workload and name (for
    the traffic metrics; a gRPC thread, so dict reads and a small cache only)."""

    def __init__(self, agent: MetricsHost) -> None:
        self.agent = agent
        self.cache: dict[str, Any] = {}  # capture listener → traffic Source

    def __call__(self, listener: str) -> Any:
        from agent.envoy.resources import LISTENER_PREFIX
        from agent.envoy.traffic import Source
        cached = self.cache.get(listener)
        if cached is not None:
            return cached
        pod = self.agent.store.get(listener[len(LISTENER_PREFIX):]) \
            if listener.startswith(LISTENER_PREFIX) else None
        if pod is None:
            return None
        mesh = self.agent.mesh
        obj = mesh.objects.get("Pod", pod.namespace, pod.name) if mesh else None
        src = Source(pod.namespace, workload_of(pod.name, obj), pod.name)
        if len(self.cache) > 10_000:
            self.cache.clear()
        self.cache[listener] = src
        return src


def wire_metrics(agent: MetricsHost) -> Metrics:
    """The metrics, fed by the agent's parts (the handler's and the sink's included)."""
    from agent.ops.metrics import Metrics
    m = Metrics()
    agent.handler.metrics = m
    sink: Any = agent.sink
    if hasattr(sink, "metrics"):
        sink.metrics = m
    ident = getattr(sink, "identity", None)
    if ident is not None:
        m.identity_source = ident.status
        xds = getattr(sink, "xds", None)
        if xds is not None:
            m.mesh_traffic_source = xds.inbound.status
    xds = getattr(sink, "xds", None)
    if xds is not None and xds.access_records is not None:
        xds.access_records.resolve = TrafficSources(agent)
    if hasattr(sink, "envoy_traffic"):
        m.traffic_source = sink.golden_traffic
        m.envoy_traffic_source = sink.envoy_figures

    def repairs() -> float:
        """Uncaptured managed pods acted on (reported or evicted) by the repair loop."""
        return float(len(agent.repair.found)) if agent.repair is not None else 0.0

    def dependency_set_size() -> float:
        return float(len(agent.mesh.model.in_scope_keys())) if agent.mesh is not None else 0.0

    m.set_sources(
        pods_captured=lambda: float(len(agent.store.all())),
        annotation_errors=lambda: float(agent.handler.counters.annotation_errors),
        dependency_set_size=dependency_set_size if agent.mesh is not None else None,
        cni_repairs=repairs if agent.options.kube else None,
        envoy_restarts=(lambda: float(sink.supervisor.restarts))
        if hasattr(sink, "supervisor") else None,
        envoy_ready=(lambda: float(bool(sink.ready()))) if hasattr(sink, "ready") else None,
        xds_nacks=(lambda: float(sink.xds.status().get("nack_count") or 0))
        if hasattr(sink, "xds") else None,
    )
    return m


def bind_metrics_server(m: Metrics, options: AgentOptions, live: Callable[[], bool],
                        ready: Callable[[], tuple[bool, str]]) -> MetricsServer:
    """The metrics server on its port (not started yet)."""
    from agent.ops.metrics import MetricsServer
    # a take-over binds the port its predecessor has just let go of: a moment's retry
    deadline = time.monotonic() + (10.0 if options.peer is not None else 0.0)
    while True:
        try:
            return MetricsServer(m, options.metrics_host, options.metrics_port or 0,
                                 live=live, ready=ready)
        except OSError as e:
            if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
