"""A Service's endpoints as this node serves them: per Service port, from its member pods,
with trafficDistribution and the EndpointSlice hints deciding which ones are preferred.

Split out of ``agent.scope.model`` (which caches the result in a ``ServiceView``): turning a
Service and its member records into ``Endpoint`` tuples, and the topology reading behind
the ``preferred`` flag, apart from the bookkeeping of who the members are. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.scope.endpoint_slices import _NO_HINT, Hint
from agent.scope.pod_record import PodRecord
from agent.scope.services import Service
from agent.scope.views import Endpoint


def hint_mode(hints: list[Hint], node: str, zone: str) -> str:
    """kube-proxy's reading of the hints of a Service port's ready endpoints: "node" when
    every one has a node hint and one is for this node, else "zone" when every one has a
    zone hint and one is for this node's zone, else "" (the hints say nothing usable: an
    endpoint without them, or none meant for us)."""
    if not hints:
        return ""
    if all(h[1] for h in hints) and any(node in h[1] for h in hints):
        return "node"
    if zone and all(h[0] for h in hints) and any(zone in h[0] for h in hints):
        return "zone"
    return ""


def preferred(svc: Service, rec: Any, zones: Mapping[str, str], node_name: str) -> bool:
    """Whether trafficDistribution prefers this endpoint for callers on this node. A
    zone preference with this node's zone unknown prefers nothing (no fallback needed)."""
    if svc.traffic.prefer == "node":
        return bool(rec.local)
    if svc.traffic.prefer == "zone":
        mine = zones.get(node_name, "")
        return not mine or zones.get(rec.node_name or "", "") == mine
    return True


def by_hints(eps: list[Endpoint], hints: dict[str, Hint], node_name: str, zone: str
             ) -> list[Endpoint]:
    """EndpointSlice hints, where they say something, decide which endpoints are
    preferred, as they decide for kube-proxy (the controller may hint an endpoint of
    another zone to ours, to balance zones by capacity); where they do not (an endpoint
    without them, none meant for this node or zone) trafficDistribution's own reading
    stays. kube-proxy drops the endpoints not hinted for us; here they stay behind the
    hinted ones as a fallback priority, used only if those fail. ``zone``: this node's."""
    ready = [hints.get(ep.ip, _NO_HINT) for ep in eps
             if ep.ready and (ep.always_ready or not ep.draining)]
    mode = hint_mode(ready, node_name, zone)
    if not mode:
        return eps
    which = 1 if mode == "node" else 0
    mine = node_name if mode == "node" else zone
    return [ep.evolve(preferred=mine in hints.get(ep.ip, _NO_HINT)[which]) for ep in eps]


def service_endpoints(svc: Service, members: list[PodRecord], slice_ports: Mapping[str, int],
                      hinted: dict[str, Hint] | None, trust_domain: str, node_name: str,
                      zones: Mapping[str, str]) -> dict[int, tuple[Endpoint, ...]]:
    """Service port → its endpoints: each member's addresses at the port's targetPort
    (``slice_ports``: a selectorless Service's, by port name), ``hinted``: the addresses'
    EndpointSlice hints, ``zones``: node name → zone."""
    # Endpoints of the Service's own IP families only, as EndpointSlices are per family:
    # an IPv4-only Service never sends a client to a pod's IPv6 address.
    families = {6 if ":" in ip else 4 for ip in svc.cluster_ips}
    endpoints: dict[int, tuple[Endpoint, ...]] = {}
    for sp in svc.ports:
        eps: list[Endpoint] = []
        for rec in members:
            if svc.traffic.local_only and not rec.local:
                continue  # internalTrafficPolicy: Local: this node's pods only
            target = slice_ports.get(sp.name) or rec.target_port(sp.target_port)
            if target is None:
                continue  # a named targetPort this pod does not define: not an endpoint
            san = rec.san(trust_domain)
            ready = rec.ready or svc.traffic.publish_not_ready
            prefer = preferred(svc, rec, zones, node_name)
            eps.extend(
                Endpoint(ip, target, rec.identity, ready, rec.terminating, san,
                         rec.key, rec.local, svc.traffic.publish_not_ready, prefer)
                for ip in rec.ips
                if not families or (6 if ":" in ip else 4) in families
            )
        endpoints[sp.port] = tuple(by_hints(eps, hinted, node_name, zones.get(node_name, ""))
                                   if hinted else eps)
    return endpoints
