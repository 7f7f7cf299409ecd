"""The Service tier of the xDS build (split out of ``agent.envoy.resources``): each in-scope
Service's chains, EDS clusters and endpoints, cached per Service and keyed by exactly what
each piece depends on, and the chain table rows the namespace listeners are made of. Pure:
``ResourceBuilder`` drives it."""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeAlias

from envoy.config.listener.v3 import listener_components_pb2
from google.protobuf.message import Message

from agent.envoy.clusters import Resilience, build_load_assignment, build_service_cluster
from agent.envoy.names import pod_cluster_name, service_cluster_name
from agent.envoy.pieces import tcp_proxy_filter
from agent.envoy.raw import RawResource, encode_chains, resource_hash
from agent.envoy.service_chains import (
    ChainResult,
    TrafficLogs,
    _cidr,
    chain_varies_by_caller,
    gamma_signature,
    tcp_traffic_logs,
)
from agent.scope.model import Endpoint, ServiceView
from agent.scope.route_tables import GammaResult
from agent.scope.services import ServicePort

log = logging.getLogger("agent.envoy.resources")

# (connect timeout, passthrough mark, tunnel, resilience, traffic logs): what every
# Service's cluster and chains are built with
ServiceOptions: TypeAlias = tuple[float, int, bool, Resilience, TrafficLogs]
# ``service_chains.chain_for``'s signature, passed positionally
# at most this many changed Services are patched into the last pass's tables; more, and
# one full pass is as cheap
PATCH_MAX = 64
ChainFor: TypeAlias = Callable[[ServiceView, ServicePort, str | None, GammaResult | None, int,
                                TrafficLogs | None], ChainResult]


def _as_chains(result: ChainResult) -> tuple[listener_components_pb2.FilterChain, ...]:
    if isinstance(result, listener_components_pb2.FilterChain):
        return (result,)
    return tuple(result)


MESH_PORT_ALIAS = "aether-mesh-port"


def mesh_http_port(ports: Sequence[ServicePort]) -> ServicePort | None:
    """The Service port the mesh port stands for: the one named ``http``, else the only one."""
    named = [p for p in ports if p.name == "http"]
    if named:
        return named[0]
    return ports[0] if len(ports) == 1 else None


def mesh_port_alias(view: ServiceView, tcp_ports: Sequence[ServicePort],
                    mesh_port: int | None) -> ServicePort | None:
    """The row that makes ClusterIP:mesh_port the Service's HTTP port, or None (no such
    port, or the Service has a port of that number of its own, which wins)."""
    if mesh_port is None or any(p.port == mesh_port for p in tcp_ports):
        return None
    http = mesh_http_port(tcp_ports)
    if http is None:
        return None
    return replace(http, name=MESH_PORT_ALIAS, port=mesh_port)


def _real_port(view: ServiceView, port: ServicePort) -> ServicePort:
    if port.name != MESH_PORT_ALIAS:
        return port
    tcp = [p for p in view.ports if p.protocol.upper() == "TCP"]
    real = mesh_http_port(tcp)
    assert real is not None, "an alias row exists only for a Service with an HTTP port"
    return real


@dataclass
class ServiceEntry:
    """Cached protos for one Service; each piece is keyed by exactly what it depends on."""

    view: ServiceView
    chain_key: tuple[Any, ...]
    # per TCP port: (ClusterIP:port claims, shared chain bytes or None when caller-specific)
    ports: tuple[tuple[ServicePort, tuple[tuple[str, int], ...], bytes | None], ...]
    cluster_key: tuple[Any, ...]
    # (name, resource) pairs, one per TCP port mostly: a 1-key dict each was 184 bytes
    clusters: tuple[tuple[str, RawResource], ...]
    eds: tuple[tuple[str, tuple[tuple[Endpoint, ...], RawResource]], ...]
    # caller namespace -> port -> chain bytes, for ports whose chains vary by caller
    per_caller: dict[str, dict[int, bytes]] = field(default_factory=dict)


@dataclass
class ServiceTables:
    """The outcome of one pass over the Services (reused while they are the same objects)."""

    views: tuple[ServiceView, ...]
    # (connect timeout, passthrough mark, tunnel, resilience, traffic metrics): what every
    # Service's cluster and chains are built with
    timeout: ServiceOptions
    clusters: dict[str, Message]
    assignments: dict[str, Message]
    # (entry, port, shared chain bytes or None) in table order, clash-free
    rows: list[tuple[ServiceEntry, ServicePort, bytes | None]]
    shared: bytes | None  # every row's chains; None: some rows are per caller
    gamma: GammaResult | None = None
    claimed: frozenset[tuple[str, int]] = frozenset()  # (ClusterIP, port) with a chain
    # Service key -> its rows' indices in ``rows`` (a patch replaces exactly those)
    row_at: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # name -> hash of ``assignments`` (``hashes()``), handed to the xDS server
    assignment_hashes: dict[str, str] | None = None


def _raw(msg: Message, name: str) -> RawResource:
    """Per-Service clusters and endpoints are kept serialized: 10k of them as upb protos
    cost ~80 MB, as bytes ~5 MB."""
    return RawResource(type(msg), name, msg.SerializeToString(deterministic=True))


def _same(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _same_dict(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(map(operator.is_, a.values(), b.values()))


class ServiceCache:
    """The Services' pieces, reused while their views are the same objects. ``chain_for``
    builds a Service port's chain(s) (``service_chains.chain_for``, passed in by the
    builder)."""

    def __init__(self, chain_for: ChainFor, mesh_port: int | None = None) -> None:
        self._chain_for = chain_for
        #: the single mesh port (proposal 022): ClusterIP:mesh_port is the Service's HTTP
        #: port, for the explicit ``<svc>.<ns>.<meshDomain>:18081`` name; None: no alias
        self.mesh_port = mesh_port
        self._services: dict[str, ServiceEntry] = {}
        self._tables: ServiceTables | None = None
        self._gamma: GammaResult | None = None
        self._kept: tuple[str, ...] | None = None  # the last ``drop_callers`` keep

    def _entry(self, view: ServiceView, timeout: ServiceOptions) -> ServiceEntry:
        old = self._services.get(view.key)
        sig = gamma_signature(self._gamma, view.key)
        if old is not None and old.view is view and old.cluster_key[-1] == timeout \
                and old.chain_key[-1] == sig:
            return old
        if not view.cluster_ips:
            return self._headless(view, timeout)
        tcp_ports = tuple(p for p in view.ports if p.protocol.upper() == "TCP")
        attempts, logs = timeout[3].connect_attempts, timeout[4]
        alias = mesh_port_alias(view, tcp_ports, self.mesh_port)
        chain_key = (view.namespace, view.name, view.cluster_ips, tcp_ports, view.traffic,
                     attempts, logs, alias, sig)
        per_caller: dict[str, dict[int, bytes]] = {}
        if old is not None and old.chain_key == chain_key and not old.per_caller \
                and all(c is not None for _, _, c in old.ports):
            ports = old.ports
        else:
            cidrs = [c for c in map(_cidr, view.cluster_ips) if c is not None]
            rows = []
            for p in (*tcp_ports, *((alias,) if alias else ())) if cidrs else ():
                claims = tuple((c.address_prefix, p.port) for c in cidrs)
                real = _real_port(view, p)
                shared = (None if chain_varies_by_caller(view, real, self._gamma)
                          else encode_chains(self._chains(view, p, None, attempts, logs)))
                rows.append((p, claims, shared))
            ports = tuple(rows)
        cluster_key = (view.namespace, view.name,
                       tuple((p.port, p.app_protocol) for p in tcp_ports),
                       view.traffic, timeout)
        if old is not None and old.cluster_key == cluster_key:
            clusters = old.clusters
        else:
            clusters = tuple((n, _raw(build_service_cluster(view, p.port, *timeout[:4]), n))
                             for p in tcp_ports
                             for n in [service_cluster_name(view.namespace, view.name, p.port)])
        eds = {}
        old_eds = dict(old.eds) if old is not None and old.cluster_key[-1] == timeout else {}
        for p in tcp_ports:
            name = service_cluster_name(view.namespace, view.name, p.port)
            eps = view.endpoints.get(p.port, ())
            prev = old_eds.get(name)
            eds[name] = prev if prev is not None and prev[0] == eps else (
                eps, _raw(build_load_assignment(name, eps, timeout[2]), name))
        entry = ServiceEntry(view, chain_key, ports, cluster_key, clusters, tuple(eds.items()),
                             per_caller)
        self._services[view.key] = entry
        return entry

    def _chains(self, view: ServiceView, port: ServicePort, ns: str | None, attempts: int,
                logs: TrafficLogs | None) -> tuple[listener_components_pb2.FilterChain, ...]:
        """A row's chains: the Service port's, or for the mesh-port alias its HTTP port's
        matched on the mesh port instead (the same routes, clusters and identity)."""
        real = _real_port(view, port)
        chains = _as_chains(self._chain_for(view, real, ns, self._gamma, attempts, logs))
        if real is port:
            return chains
        out = []
        for c in chains:
            moved = listener_components_pb2.FilterChain()
            moved.CopyFrom(c)
            moved.name = f"{c.name}|mesh-port"
            moved.filter_chain_match.destination_port.value = port.port
            out.append(moved)
        return tuple(out)

    def _headless(self, view: ServiceView, timeout: ServiceOptions) -> ServiceEntry:
        """A headless Service: clients dial its pods' addresses (from DNS) on the target
        port, so each endpoint address and port gets a chain of its own and a cluster of one
        host, a mesh hop to exactly that pod (mTLS when identity is on) instead of the
        passthrough. Readiness does not gate it: a pod dialled by address is reached as it
        would be without the mesh."""
        tcp_ports = tuple(p for p in view.ports if p.protocol.upper() == "TCP")
        rows = []
        clusters: dict[str, RawResource] = {}
        eds: dict[str, tuple[tuple[Endpoint, ...], RawResource]] = {}
        seen: set[tuple[str, int]] = set()
        for p in tcp_ports:
            # the Service as a whole stays a cluster too: a GAMMA route may name it a backend
            svc_name = service_cluster_name(view.namespace, view.name, p.port)
            clusters[svc_name] = _raw(build_service_cluster(view, p.port, *timeout[:4]), svc_name)
            all_eps = view.endpoints.get(p.port, ())
            eds[svc_name] = (all_eps, _raw(build_load_assignment(svc_name, all_eps, timeout[2]),
                                           svc_name))
            chains = []
            claims = []
            for ep in sorted(all_eps, key=lambda e: (e.ip, e.port)):
                cidr = _cidr(ep.ip)
                if cidr is None or (ep.ip, ep.port) in seen:
                    continue
                seen.add((ep.ip, ep.port))
                name = pod_cluster_name(view.namespace, view.name, ep.ip, ep.port)
                cluster = build_service_cluster(view, p.port, *timeout[:4])
                cluster.name = name
                cluster.eds_cluster_config.service_name = name
                cluster.ClearField("outlier_detection")  # one host: nothing to eject it for
                clusters[name] = _raw(cluster, name)
                one = (ep.evolve(always_ready=True, draining=False),)
                eds[name] = (one, _raw(build_load_assignment(name, one, timeout[2]), name))
                match = listener_components_pb2.FilterChainMatch(prefix_ranges=[cidr])
                match.destination_port.value = ep.port
                logs = tcp_traffic_logs(timeout[4])
                chains.append(listener_components_pb2.FilterChain(
                    name=name, filter_chain_match=match,
                    filters=[tcp_proxy_filter(name, name, *logs)]))
                claims.append((cidr.address_prefix, ep.port))
            if chains:
                rows.append((p, tuple(claims), encode_chains(chains)))
        key = ("headless", view.namespace, view.name, tuple(sorted(seen)), view.traffic,
               timeout)
        entry = ServiceEntry(view, (*key, gamma_signature(self._gamma, view.key)), tuple(rows),
                             key, tuple(clusters.items()), tuple(eds.items()))
        self._services[view.key] = entry
        return entry

    def tables(self, services: tuple[ServiceView, ...], opts: ServiceOptions,
               gamma: GammaResult | None) -> ServiceTables:
        """Every Service's pieces and the chain table rows, the same object while
        ``services`` are the same objects and ``opts`` and ``gamma`` unchanged."""
        self._gamma = gamma
        old = self._tables
        if old is not None and old.timeout == opts and old.gamma is gamma \
                and len(old.views) == len(services):
            changed = [i for i, same in enumerate(map(operator.is_, old.views, services))
                       if not same]
            if not changed:
                return old
            if len(changed) <= PATCH_MAX:
                patched = self._patch(old, services, changed)
                if patched is not None:
                    self._tables = patched
                    return patched
        clusters: dict[str, Message] = {}
        assignments: dict[str, Message] = {}
        rows: list[tuple[ServiceEntry, ServicePort, bytes | None]] = []
        claimed: dict[tuple[str, int], str] = {}
        row_at: dict[str, tuple[int, ...]] = {}
        live: set[str] = set()
        for view in sorted(services, key=lambda v: v.key):
            if view.key in live:
                raise ValueError(f"duplicate service {view.key}")
            live.add(view.key)
            entry = self._entry(view, opts)
            clusters.update(entry.clusters)
            assignments.update((n, cla) for n, (_, cla) in entry.eds)
            for port, claims, chains in entry.ports:
                clash = sorted({claimed[k] for k in claims if k in claimed})
                if clash:  # two Services claiming one ClusterIP:port would NACK the listener
                    log.warning("service %s: %s already served by %s; chain skipped", view.key,
                                service_cluster_name(view.namespace, view.name, port.port),
                                ",".join(clash))
                    continue
                claimed.update((k, view.key) for k in claims)
                row_at[view.key] = (*row_at.get(view.key, ()), len(rows))
                rows.append((entry, port, chains))
        for key in [k for k in self._services if k not in live]:
            del self._services[key]
        shared: bytes | None = None
        if all(c is not None for _, _, c in rows):
            flat = b"".join(c or b"" for _, _, c in rows)
            prev = old.shared if old is not None else None
            shared = prev if prev is not None and prev == flat else flat
        tables = ServiceTables(tuple(services), opts,
                               dict(sorted(clusters.items())), dict(sorted(assignments.items())),
                               rows, shared, gamma, frozenset(claimed), row_at)
        if old is not None:  # same objects: keep the dict identity too (cheap to publish)
            if _same_dict(old.assignments, tables.assignments):
                tables.assignments = old.assignments
            if _same_dict(old.clusters, tables.clusters):
                tables.clusters = old.clusters
        self._tables = tables
        return tables

    def _patch(self, old: ServiceTables, services: tuple[ServiceView, ...],
               changed: list[int]) -> ServiceTables | None:
        """``old`` with the Services at ``changed`` rebuilt, when each is the same Service
        claiming the same ClusterIP:ports under the same resource names (an endpoint or a
        traffic setting changed): its rows, clusters and endpoints replaced in place, so one
        Service's change costs the same at 10k Services as at 1k (issue #43). None: a full
        pass decides (a Service added or gone, a claim or a headless Service's hosts moved)."""
        swaps: list[tuple[ServiceEntry, ServiceEntry]] = []  # (old entry, new entry)
        for i in changed:
            view, was = services[i], old.views[i]
            prev = self._services.get(view.key)
            if view.key != was.key or prev is None or prev.view is not was:
                return None
            entry = self._entry(view, old.timeout)
            if [(p, c) for p, c, _ in entry.ports] != [(p, c) for p, c, _ in prev.ports] \
                    or [n for n, _ in entry.clusters] != [n for n, _ in prev.clusters] \
                    or [n for n, _ in entry.eds] != [n for n, _ in prev.eds]:
                self._services[view.key] = prev  # the full pass rebuilds it from scratch
                return None
            swaps.append((prev, entry))
        clusters, assignments = old.clusters, old.assignments
        hashes = old.assignment_hashes
        for prev, entry in swaps:
            if any(a[1] is not b[1] for a, b in zip(prev.clusters, entry.clusters, strict=True)):
                if clusters is old.clusters:
                    clusters = dict(old.clusters)
                clusters.update(entry.clusters)
            if any(a[1][1] is not b[1][1] for a, b in zip(prev.eds, entry.eds, strict=True)):
                if assignments is old.assignments:
                    assignments = dict(old.assignments)
                    if hashes is not None:
                        hashes = dict(hashes)
                assignments.update((n, cla) for n, (_, cla) in entry.eds)
                if hashes is not None:
                    hashes.update((n, resource_hash(cla)) for n, (_, cla) in entry.eds)
        rows = list(old.rows)
        chains_moved = False
        for prev, entry in swaps:
            for j in old.row_at.get(entry.view.key, ()):
                e, port, chains = rows[j]
                if e is not prev:  # not the rows this entry made: let a full pass decide
                    return None
                now = next(c for p, _, c in entry.ports if p == port)
                chains_moved |= now is not chains and now != chains
                rows[j] = (entry, port, now)
        shared = old.shared
        if chains_moved or shared is None:
            shared = (b"".join(c or b"" for _, _, c in rows)
                      if all(c is not None for _, _, c in rows) else None)
        return ServiceTables(tuple(services), old.timeout, clusters, assignments, rows, shared,
                             old.gamma, old.claimed, old.row_at, hashes)

    @staticmethod
    def hashes(tables: ServiceTables) -> dict[str, str]:
        """The hash of each of ``tables``' endpoint resources (what the xDS server would
        compute), kept with them and patched with them: a push after one Service's change
        hashes that Service's, not 10k."""
        if tables.assignment_hashes is None:
            tables.assignment_hashes = {n: resource_hash(m)
                                        for n, m in tables.assignments.items()}
        return tables.assignment_hashes

    def caller_table(self, tables: ServiceTables, ns: str, prev: bytes | None) -> bytes:
        """The chain table of caller namespace ``ns`` (``SHARED_CALLERS``: the shared one);
        ``prev``, the table its listener holds, is returned instead when equal."""
        if tables.shared is not None:
            return tables.shared
        out: list[bytes] = []
        for entry, port, chains in tables.rows:
            if chains is None:
                mine = entry.per_caller.setdefault(ns, {})
                got = mine.get(port.port)
                if got is None:
                    got = mine[port.port] = encode_chains(
                        self._chains(entry.view, port, ns,
                                     entry.cluster_key[-1][3].connect_attempts,
                                     entry.cluster_key[-1][4]))
                chains = got
            out.append(chains)
        table = b"".join(out)
        return prev if prev is not None and prev == table else table

    def drop_callers(self, keep: Sequence[str]) -> None:
        """Forget the per-caller chains of the caller namespaces not in ``keep``. Only
        ``keep``'s namespaces are ever added (``caller_table``), so the same ``keep`` as
        last time has nothing to drop: no pass over every Service."""
        kept = tuple(keep)
        if kept == self._kept:
            return
        self._kept = kept
        for e in self._services.values():
            for key in [k for k in e.per_caller if k not in keep]:
                del e.per_caller[key]
