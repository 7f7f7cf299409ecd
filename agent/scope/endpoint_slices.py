"""An EndpointSlice as the mesh model keeps it: the Service it belongs to, its pod refs,
addresses and named ports, and the topology hints of its endpoints.

Split out of ``agent.scope.model``, which unions the digests of a Service's slices (for a
selectorless Service's members, its named ports and its hints); reading one slice object
is here. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.common.ids import pod_key, service_key
from agent.scope.services import canonical_ip
from agent.source.model import shared
from agent.source.objects import Endpoint as SliceEndpoint
from agent.source.objects import EndpointSliceObject

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


@dataclass
class _Slice:
    service: str
    pods: tuple[str, ...]  # tuples: a set of ten is 728 bytes, 10k Services hold two each
    ips: tuple[str, ...]
    ports: dict[str, int]
    # address → (forZones, forNodes) of the endpoints the EndpointSlice controller hinted
    hints: dict[str, Hint] = field(default_factory=lambda: _NO_HINTS)


#: An endpoint's EndpointSlice hints: the zones and the nodes it is meant for.
Hint = tuple[frozenset[str], frozenset[str]]
_NO_HINTS: dict[str, Hint] = {}  # shared by the slices without hints (never changed in place)
_NO_HINT: Hint = (frozenset(), frozenset())


def _hint(ep: SliceEndpoint) -> Hint | None:
    """An endpoint's ``hints.forZones`` / ``hints.forNodes`` names, None without either."""
    hints = ep.get("hints")
    if not isinstance(hints, dict):
        return None
    zones = frozenset(str(h.get("name")) for h in hints.get("forZones") or []
                      if isinstance(h, dict) and h.get("name"))
    nodes = frozenset(str(h.get("name")) for h in hints.get("forNodes") or []
                      if isinstance(h, dict) and h.get("name"))
    return (zones, nodes) if zones or nodes else None


def slice_digest(ns: str, obj: EndpointSliceObject) -> _Slice | None:
    """The slice's refs, addresses, ports and hints; None for a slice of no Service."""
    svc_name = ((obj.get("metadata") or {}).get("labels") or {}).get(SERVICE_NAME_LABEL)
    if not svc_name:
        return None
    pods: set[str] = set()
    ips: set[str] = set()
    slice_ports: dict[str, int] = {}
    slice_hints: dict[str, Hint] = {}
    for p in obj.get("ports") or []:
        if isinstance(p, dict) and isinstance(p.get("port"), int):
            slice_ports[str(p.get("name") or "")] = p["port"]
    for ep in obj.get("endpoints") or []:
        if not isinstance(ep, Mapping):  # a dict, or packed (slim)
            continue
        ref = ep.get("targetRef") or {}
        if ref.get("kind") == "Pod" and ref.get("name"):
            pods.add(pod_key(ref.get("namespace") or ns, ref["name"]))
        addresses = [str(a) for a in ep.get("addresses") or []]
        ips.update(addresses)
        if (hint := _hint(ep)) is not None:
            slice_hints.update((canonical_ip(a) or a, hint) for a in addresses)
    # ports: one shared map for every slice saying {"http": 8080}
    return _Slice(service_key(ns, svc_name), tuple(pods), tuple(ips),
                  shared(slice_ports) or {}, slice_hints or _NO_HINTS)
