"""``NodeXdsState``, everything one xDS build is made from (split out of
``agent.envoy.resources``, which re-exports it), so the builders of each resource kind
can take it without importing the builder that drives them."""

from __future__ import annotations

from dataclasses import dataclass

from agent.common.config import CAPTURE_PORT, PASSTHROUGH_MARK
from agent.envoy.clusters import Resilience
from agent.envoy.mtls_common import MeshTls
from agent.envoy.pod_listener import PodListener
from agent.scope.model import ServiceView
from agent.scope.route_tables import GammaResult


@dataclass(frozen=True)
class NodeXdsState:
    """Everything the xDS builder needs; frozen so it can be shared across threads."""

    pods: tuple[PodListener, ...]
    capture_port: int = CAPTURE_PORT
    passthrough_mark: int = PASSTHROUGH_MARK
    connect_timeout_s: float = 5.0
    # In-scope Services (agent.scope.model views): chains, EDS clusters and endpoints. Pass
    # the same tuple (or the same view objects) when they did not change: the builder then
    # skips them entirely.
    services: tuple[ServiceView, ...] = ()
    # Stream passthrough connections to the agent's access log service (dependency learning).
    learn_access_log: bool = True
    # Which passthrough destinations to stream: (ClusterIP, port) of the in-mesh Services
    # not in scope (``MeshModel.learnable_targets``), the only ones learning can act on; each
    # port gets a chain of its own. None: stream every passthrough connection (no model).
    learn_targets: tuple[tuple[str, int], ...] | None = None
    # One stdout line per passthrough connection (``--access-log``): off by default, since
    # writing and relaying it costs more per connection than proxying it does.
    connection_log: bool = False
    # GAMMA route tables (agent.scope.route_tables.GammaResult) for the in-scope route targets; the
    # same object while routes are unchanged, so unchanged chains are reused.
    gamma: GammaResult | None = None
    # Mesh identity (agent.envoy.mtls.MeshTls): Service traffic becomes mTLS to the endpoint
    # pod's inbound port, every captured pod gets its inbound listeners. None:
    # no identity provider, Service traffic goes to the endpoints in plaintext.
    mesh_tls: MeshTls | None = None
    resilience: Resilience = Resilience()
    # Golden metrics: Service and HTTP chains count every connection and request in Envoy's
    # stats (agent.envoy.golden); off: nothing counted per connection or request.
    traffic_metrics: bool = True
    # The single mesh port (proposal 022): each in-scope Service's HTTP port is also served
    # on ClusterIP:mesh_port (``<svc>.<ns>.<meshDomain>:18081``). None: not served.
    mesh_port: int | None = None
