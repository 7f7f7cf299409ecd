"""What the mesh model serves: ``Endpoint`` (one backend address of one Service port) and
``ServiceView`` (one in-scope Service as the xDS builder reads it).

Split out of ``agent.scope.model``: the value types the model hands out stand apart from the
bookkeeping that makes them; both names stay importable from ``agent.scope.model``. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agent.scope.routes import Route
from agent.scope.services import ServicePort, TrafficPolicy

_READY, _DRAINING, _LOCAL, _ALWAYS_READY, _PREFERRED = 1, 2, 4, 8, 16  # Endpoint._flags


class Endpoint:
    """One backend address for one Service port; identity is the pod's own SA. Slotted, its
    five flags in one int: a 10k-Service cluster holds one per remote pod and port (a
    ``__dict__`` each was 15 MB at 100k pods, ten slots 11 MB). Immutable, compared by value;
    ``evolve`` makes a changed copy.

    ``always_ready``: publishNotReadyAddresses, ready whatever the pod says, terminating or
    not (as the EndpointSlice controller publishes it). ``preferred``: trafficDistribution,
    in the caller's zone / on its node (first priority of its tier)."""

    __slots__ = ("ip", "port", "sa_identity", "san", "pod", "_flags")

    ip: str
    port: int
    sa_identity: str
    san: str
    pod: str
    _flags: int

    def __init__(self, ip: str, port: int, sa_identity: str, ready: bool, draining: bool,
                 san: str = "", pod: str = "", local: bool = False, always_ready: bool = False,
                 preferred: bool = True) -> None:
        init = object.__setattr__
        init(self, "ip", ip)
        init(self, "port", port)
        init(self, "sa_identity", sa_identity)
        init(self, "san", san)
        init(self, "pod", pod)
        init(self, "_flags", (_READY if ready else 0) | (_DRAINING if draining else 0)
             | (_LOCAL if local else 0) | (_ALWAYS_READY if always_ready else 0)
             | (_PREFERRED if preferred else 0))

    ready = property(lambda self: bool(self._flags & _READY))
    draining = property(lambda self: bool(self._flags & _DRAINING))
    local = property(lambda self: bool(self._flags & _LOCAL))
    always_ready = property(lambda self: bool(self._flags & _ALWAYS_READY))
    preferred = property(lambda self: bool(self._flags & _PREFERRED))

    def _key(self) -> tuple[str, int, str, str, str, int]:
        return (self.ip, self.port, self.sa_identity, self.san, self.pod, self._flags)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Endpoint is immutable (set {name})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Endpoint):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (f"Endpoint(ip={self.ip!r}, port={self.port}, sa_identity={self.sa_identity!r}, "
                f"ready={self.ready}, draining={self.draining}, san={self.san!r}, "
                f"pod={self.pod!r}, local={self.local}, always_ready={self.always_ready}, "
                f"preferred={self.preferred})")

    def __reduce__(self) -> tuple[Any, ...]:  # copy and pickle through the constructor
        return (Endpoint, (self.ip, self.port, self.sa_identity, self.ready, self.draining,
                           self.san, self.pod, self.local, self.always_ready, self.preferred))

    def evolve(self, **changes: Any) -> Endpoint:
        """A copy with ``changes`` (the constructor's keywords)."""
        kw: dict[str, Any] = {
            "ip": self.ip, "port": self.port, "sa_identity": self.sa_identity,
            "ready": self.ready, "draining": self.draining, "san": self.san, "pod": self.pod,
            "local": self.local, "always_ready": self.always_ready,
            "preferred": self.preferred}
        kw.update(changes)
        return Endpoint(**kw)


@dataclass(frozen=True)
class ServiceView:
    """What the xDS builder needs for one in-scope Service.

    ``routes`` non-empty: a route target, its vhost uses these routes (no identity of its
    own). Empty: an identity route to its own ``endpoints``. ``endpoints`` are the Service as
    a backend cluster (per Service port, targetPorts resolved per pod).
    """

    key: str
    namespace: str
    name: str
    cluster_ips: tuple[str, ...]
    ports: tuple[ServicePort, ...]
    names: tuple[str, ...]
    endpoints: dict[int, tuple[Endpoint, ...]] = field(default_factory=dict)
    routes: tuple[Route, ...] = ()
    traffic: TrafficPolicy = field(default_factory=TrafficPolicy)

    @property
    def is_route_target(self) -> bool:
        return bool(self.routes)

    @property
    def backends(self) -> frozenset[str]:
        out: set[str] = set()
        for r in self.routes:
            out |= r.backend_keys
        return frozenset(out)
