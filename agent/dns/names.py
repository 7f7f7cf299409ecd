"""Which names the pod's DNS answers itself, and with what: a pure function of the question
and the mesh's Services.

The mesh domain is the mesh's own (proposal 020): ``<svc>.<ns>.<meshDomain>`` is the
Service's ClusterIPs, any other name under the domain does not exist, and no cluster DNS is
asked about it (it knows nothing of it). ``<svc>.<ns>.svc.clusterset.local`` is a
ServiceImport's VIPs when the mesh knows the import. Every other name is forwarded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from agent.dns.wire import CLASS_IN, RCODE_NOERROR, RCODE_NXDOMAIN, TYPE_A, TYPE_AAAA, TYPE_ANY

CLUSTERSET_SUFFIX = "svc.clusterset.local"
#: the standard name: forwarded, but its Service is brought into scope first (the held
#: first call, agent.runtime.mesh.bring_into_scope)
CLUSTER_SUFFIX = "svc.cluster.local"

#: ``(namespace, name)`` → the ClusterIPs of a Service the mesh knows (() for a headless
#: one), None for no such Service.
Lookup = Callable[[str, str], "tuple[str, ...] | None"]


@dataclass(frozen=True)
class Verdict:
    """``forward`` the query as it came, or answer it with ``rcode`` and ``addresses``."""

    forward: bool
    rcode: int = RCODE_NOERROR
    addresses: tuple[str, ...] = ()
    kind: str = "forwarded"  # for the counters: mesh, clusterset, nxdomain, forwarded


FORWARD = Verdict(True)


def _family(qtype: int, addresses: tuple[str, ...]) -> tuple[str, ...]:
    if qtype == TYPE_A:
        return tuple(a for a in addresses if ":" not in a)
    if qtype == TYPE_AAAA:
        return tuple(a for a in addresses if ":" in a)
    if qtype == TYPE_ANY:
        return addresses
    return ()  # the name exists, the type has no records here: NODATA


def wanted(name: str, mesh_domain: str) -> tuple[str, str, str] | None:
    """The lookup to make for ``name`` before ``decide``: ("service" or "import",
    namespace, name) for the answer, ("hold", namespace, name) for a standard Service name
    (forwarded, its Service readied first), or None."""
    domain = mesh_domain.strip(".").lower()
    for kind, suffix in (("service", domain), ("import", CLUSTERSET_SUFFIX),
                         ("hold", CLUSTER_SUFFIX)):
        if suffix and name.endswith("." + suffix):
            labels = name[:-len(suffix) - 1].split(".")
            if len(labels) == 2 and all(labels):
                return kind, labels[1], labels[0]
    return None


def decide(name: str, qtype: int, qclass: int, mesh_domain: str, services: Lookup,
           imports: Lookup | None = None) -> Verdict:
    """What the pod's DNS does with one question (``name`` lower case, no trailing dot)."""
    domain = mesh_domain.strip(".").lower()
    if domain and (name == domain or name.endswith("." + domain)):
        labels = name[:-len(domain)].rstrip(".").split(".") if name != domain else []
        if qclass != CLASS_IN or len(labels) != 2:
            return Verdict(False, RCODE_NXDOMAIN, kind="nxdomain")
        ips = services(labels[1], labels[0])
        if ips is None:
            return Verdict(False, RCODE_NXDOMAIN, kind="nxdomain")
        return Verdict(False, RCODE_NOERROR, _family(qtype, ips), kind="mesh")
    if imports is not None and qclass == CLASS_IN and name.endswith("." + CLUSTERSET_SUFFIX):
        labels = name[:-len(CLUSTERSET_SUFFIX) - 1].split(".")
        if len(labels) == 2:
            ips = imports(labels[1], labels[0])
            if ips is not None:  # an import the mesh does not know: the cluster DNS may
                return Verdict(False, RCODE_NOERROR, _family(qtype, ips), kind="clusterset")
    return FORWARD
