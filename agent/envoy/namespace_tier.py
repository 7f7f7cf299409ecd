"""The namespace tier of the xDS build (split out of ``agent.envoy.resources``): the
internal listeners ``mesh`` (every caller namespace without consumer routes of its own)
and ``mesh-<ns>`` (one with some), and the clusters ``mesh-<ns>`` that reach them. Which
listener a namespace's cluster reaches moves one way, shared to own, and only to a
listener an earlier build emitted (see ``ResourceBuilder.build``). Pure."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_pb2

from agent.envoy.clusters import build_namespace_cluster
from agent.envoy.names import (
    NAMESPACE_LISTENER_PREFIX,
    SHARED_CALLERS,
    SHARED_MESH_LISTENER,
    namespace_listener_name,
)
from agent.envoy.node_state import NodeXdsState
from agent.envoy.raw import RawResource, encode_chains
from agent.envoy.service_chains import _namespace_head, learn_chains
from agent.envoy.service_tables import ServiceCache, ServiceTables


class NamespaceTier:
    """The caller namespaces' internal listeners and clusters, reused while their inputs
    are the same."""

    def __init__(self) -> None:
        # caller namespace -> (chain table bytes, learn flag, listener)
        self._ns_listeners: dict[str, tuple[bytes, tuple[bool, bool, tuple[int, ...]],
                                             RawResource, bytes]] = {}
        self._ns_clusters: dict[tuple[str, float, str], cluster_pb2.Cluster] = {}
        # (the tables it was computed from, namespaces with consumer routes of their own)
        self._own: tuple[ServiceTables | None, frozenset[str]] = (None, frozenset())
        # caller namespace -> the internal listener key its cluster reached in the last
        # build; the keys of the internal listeners that build emitted; the namespaces
        # with a listener of their own (kept while they have pods: see ``plan``)
        self._reach: dict[str, str] = {}
        self._emitted: frozenset[str] = frozenset()
        self._sticky: frozenset[str] = frozenset()
        # (targets, connection log, claimed) -> the learn chains' bytes
        self._learn: tuple[tuple[Any, ...], bytes] = ((), b"")

    def own_namespaces(self, tables: ServiceTables) -> frozenset[str]:
        """Caller namespaces whose chain table is not everyone's: those with a consumer
        route (GEP-1294) on a row of the table. Every other namespace reaches the shared
        listener, so the node holds (and Envoy parses) the table once, not per namespace."""
        if self._own[0] is tables:
            return self._own[1]
        own: frozenset[str] = frozenset()
        if tables.shared is None and tables.gamma is not None:
            varying = {(e.view.key, p.port) for e, p, c in tables.rows if c is None}
            own = frozenset(s for (t, p, s) in tables.gamma.tables
                            if s is not None and (t, p) in varying)
        self._own = (tables, own)
        return own

    def seed(self, reach: Mapping[str, str], listeners: Iterable[str]) -> None:
        """What an Envoy this builder did not build holds (an agent restarted, Envoy adopted):
        ``reach``, each caller namespace's cluster's internal listener (``mesh`` or
        ``mesh-<ns>``, from ``adopted.namespace_reach``), and the internal listeners it
        has. The first build then moves no cluster to a listener Envoy lacks and keeps
        every namespace's own listener it finds (removing one closes the connections it
        carries), exactly as if this builder had made them."""
        def key(listener: str) -> str | None:
            if listener == SHARED_MESH_LISTENER:
                return SHARED_CALLERS
            if listener.startswith(NAMESPACE_LISTENER_PREFIX):
                return listener.removeprefix(NAMESPACE_LISTENER_PREFIX)
            return None

        self._reach = {ns: k for ns, lis in reach.items()
                       if (k := key(lis)) in (SHARED_CALLERS, ns)}
        self._sticky = frozenset(ns for ns, k in self._reach.items() if k == ns)
        self._emitted = frozenset(k for lis in listeners if (k := key(lis)) is not None)

    def hold_moves(self) -> None:
        """Forget that the last push carried the listeners clusters were about to move to
        (Envoy refused it): the clusters stay where they are."""
        self._emitted = frozenset(self._reach.values())

    def _learn_bytes(self, state: NodeXdsState, tables: ServiceTables) -> bytes:
        """The learn chains (empty when learning is off or streams everything), cached."""
        if not state.learn_access_log or state.learn_targets is None:
            return b""
        key = (state.learn_targets, state.connection_log, tables.claimed)
        if self._learn[0] != key:
            targets = [t for t in state.learn_targets if t not in tables.claimed]
            self._learn = (key, encode_chains(learn_chains(targets, state.connection_log)))
        return self._learn[1]

    def _namespace_listener(self, ns: str, table: bytes, learn_all: bool, conn_log: bool,
                            learn: bytes, detect: tuple[int, ...]) -> RawResource:
        prev = self._ns_listeners.get(ns)
        flags = (learn_all, conn_log, detect)
        if prev is not None and prev[0] is table and prev[1] == flags and prev[3] is learn:
            return prev[2]
        lis = RawResource(listener_pb2.Listener, namespace_listener_name(ns),
                          _namespace_head(ns, learn_all, detect, conn_log) + table + learn)
        self._ns_listeners[ns] = (table, flags, lis, learn)
        return lis

    def plan(self, namespaces: Sequence[str], own: frozenset[str]
             ) -> tuple[dict[str, str], list[str], frozenset[str], bool]:
        """For the caller namespaces with pods on the node (sorted) and those with consumer
        routes of their own: (the listener key each one's cluster reaches, the keys of the
        internal listeners to emit, the namespaces keeping a listener of their own, whether
        some cluster still waits to move)."""
        # A namespace that got a listener of its own keeps it while it has pods on the node,
        # routes or not, and the shared one stays while any namespace does: removing a
        # listener closes the connections it carries (after Envoy's drain time), so a
        # route change must only ever change chains, as it did when every namespace had
        # its own. Moves therefore go one way, shared to own.
        sticky = frozenset(ns for ns in namespaces if ns in own or ns in self._sticky)
        # caller namespace -> the key of the internal listener its cluster reaches. A
        # cluster moves to a listener only once an earlier build emitted it: pushes go
        # out CDS before LDS, so a cluster and a listener new in the same push would leave
        # the namespace's connections without a listener until the LDS lands. Until then
        # it keeps the old one, and ``pending_switch`` asks for the next build.
        reach: dict[str, str] = {}
        pending = False
        for ns in namespaces:
            want = ns if ns in sticky else SHARED_CALLERS
            was = self._reach.get(ns)
            reach[ns] = want if was is None or want in self._emitted else was
            pending = pending or reach[ns] != want
        # every listener a cluster reaches is among these: a namespace only ever waits on
        # the shared one, and one that reached its own is still sticky
        keys = sorted({SHARED_CALLERS, *sticky}) if namespaces else []
        return reach, keys, sticky, pending

    def listeners(self, state: NodeXdsState, tables: ServiceTables, services: ServiceCache,
                  keys: Sequence[str], detect: tuple[int, ...]) -> dict[str, RawResource]:
        """The internal listeners of ``keys`` (from ``plan``) by name; the others are
        forgotten, with the Services' chains for them."""
        ns_listeners: dict[str, RawResource] = {}
        learn = self._learn_bytes(state, tables)
        learn_all = state.learn_access_log and state.learn_targets is None
        for key in keys:
            prev = self._ns_listeners.get(key)
            table = services.caller_table(tables, key, prev[0] if prev is not None else None)
            ns_listeners[namespace_listener_name(key)] = self._namespace_listener(
                key, table, learn_all, state.connection_log, learn, detect)
        for key in [k for k in self._ns_listeners if k not in keys]:
            del self._ns_listeners[key]
        services.drop_callers(keys)
        return ns_listeners

    def clusters(self, reach: Mapping[str, str], connect_timeout_s: float
                 ) -> dict[str, cluster_pb2.Cluster]:
        """The cluster ``mesh-<ns>`` of each caller namespace in ``reach`` (in its order),
        to the internal listener ``reach`` names; the same objects while unchanged."""
        ns_clusters = {}
        used = set()
        for ns in reach:
            ck = (ns, connect_timeout_s, namespace_listener_name(reach[ns]))
            c = self._ns_clusters.get(ck)
            if c is None:
                c = self._ns_clusters[ck] = build_namespace_cluster(ns, connect_timeout_s,
                                                                    ck[2])
            ns_clusters[c.name] = c
            used.add(ck)
        self._ns_clusters = {k: c for k, c in self._ns_clusters.items() if k in used}
        return ns_clusters

    def commit(self, reach: dict[str, str], keys: Sequence[str], sticky: frozenset[str]) -> None:
        """Record a complete build's plan (a build that raised left nothing behind for the
        next one to move a cluster to)."""
        self._reach, self._emitted, self._sticky = reach, frozenset(keys), sticky
