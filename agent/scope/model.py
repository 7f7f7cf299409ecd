"""The mesh model: one in-memory view of registry, Service catalog, route targets and scope.

``MeshModel.apply`` takes the WatchEvents both sources emit and returns the Service keys whose
served view changed, so the xDS builder rebuilds only those (one pod or one Service changing
touches only the Services that depend on it). Reads (``resolve``, ``in_scope_services``,
``lookup_cluster_ip``) are what capture, xDS and traffic learning need. All of it is pure
bookkeeping under one lock; no I/O, so every rule here is unit-testable.

The pieces it is made of live next to it: the served types (``Endpoint``, ``ServiceView``)
in ``views``, a Service's endpoints and their topology preference in ``endpoints``, the
EndpointSlice digest in ``endpoint_slices``, the Service policies' traffic fields in
``backend_policies``; the names this module held stay importable from here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

from agent.common.config import NodeConfig
from agent.common.ids import pod_key
from agent.scope.backend_policies import BACKEND_POLICY_KINDS, policy_traffic
from agent.scope.deps import DEFAULT_LEARN_TTL, DEPENDENCIES_ANNOTATION, DependencySet
from agent.scope.endpoint_slices import SERVICE_NAME_LABEL, Hint, _Slice, slice_digest
from agent.scope.endpoints import hint_mode, service_endpoints
from agent.scope.registry import PodRecord, Registry
from agent.scope.routes import ROUTE_KINDS, RouteCatalog, route_from_object
from agent.scope.services import (
    DEFAULT_MESH_DOMAIN,
    ZONE_LABEL,
    Service,
    ServiceCatalog,
    TrafficPolicy,
    policy_targets,
    service_from_object,
)
from agent.scope.small_sets import Bucket, add_to, discard_from
from agent.scope.views import Endpoint, ServiceView
from agent.source.base import WatchEvent
from agent.source.model import shared
from agent.source.objects import (
    BackendTrafficPolicyObject,
    EndpointSliceObject,
    PodObject,
    RouteObject,
    ServiceObject,
)

# the names this module held before the split, importable from here as before
__all__ = ["BACKEND_POLICY_KINDS", "NAMESPACE_CHUNK", "REMOTE_POD_KIND", "SCOPE_CHANGED",
           "SERVICE_NAME_LABEL", "Endpoint", "Hint", "MeshModel", "ServiceView", "hint_mode"]

#: ``agent.meshpods.record.KIND``: another node's pod as its agent published it (the source
#: stores it as the slim Pod it holds, under this kind).
REMOTE_POD_KIND = "MeshPod"


SCOPE_CHANGED = "*scope*"  # in a deferred result: the served set may have moved
#: Pods re-evaluated per chunk when a Namespace changes (``MeshModel.breathe``): about a
#: millisecond or two of work on a 2-CPU machine.
NAMESPACE_CHUNK = 50


class MeshModel:
    """Registry + catalogs + dependency set, fed by WatchEvents (see module docstring)."""

    def __init__(
        self,
        mesh_domain: str = DEFAULT_MESH_DOMAIN,
        trust_domain: str = "cluster.local",
        node_name: str = "",
        *,
        node: NodeConfig | None = None,
        scope_all: bool = False,
        learn_ttl: float = DEFAULT_LEARN_TTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.mesh_domain = mesh_domain
        self.trust_domain = trust_domain
        self.node = node or NodeConfig(node_name=node_name or "localhost")
        self.node_name = self.node.node_name
        self._lock = threading.RLock()
        self.services = ServiceCatalog()
        self.registry = Registry(self.node)
        self.routes = RouteCatalog()
        self.deps = DependencySet(ttl=learn_ttl, clock=clock, scope_all=scope_all)
        self._slices: dict[str, _Slice] = {}  # "<ns>/<slice>" → refs
        self._slices_by_svc: dict[str, Bucket] = {}  # most Services have one slice
        self._slice_ports: dict[str, dict[str, int]] = {}
        # Service → address → hints, for the Services whose slices carry any
        self._slice_hints: dict[str, dict[str, Hint]] = {}
        self._in_mesh: set[str] = set()
        self._scope: set[str] = set()
        self._scope_dirty = False
        self._views: dict[str, ServiceView] = {}
        # node name → its topology.kubernetes.io/zone (trafficDistribution: PreferSameZone)
        self._zones: dict[str, str] = {}
        # XBackendTrafficPolicy objects by "<ns>/<name>", BackendLBPolicy objects by
        # "<ns>/<name>:BackendLBPolicy" (their targets' retry budgets, session persistence)
        self._backend_policies: dict[str, BackendTrafficPolicyObject] = {}
        # Set by a long-running owner that reads the scope on a debounce (MeshRuntime): scope
        # recomputation then happens once per read instead of once per event.
        self.defer_scope = False
        # Set by that owner once serving (agent.source.pace.breathe): a Namespace change is
        # then applied to its pods NAMESPACE_CHUNK at a time, the lock released and the
        # thread pausing between chunks, so pod registrations and CNI threads are not held
        # behind seconds of re-evaluation. None: one piece (tests, the first sync).
        self.breathe: Callable[[float], None] | None = None

    # ---- inputs ----------------------------------------------------------------------------

    def apply(self, event: WatchEvent) -> set[str]:
        """Apply one event; returns the Service keys whose served view changed."""
        if event.kind == "Namespace" and self.breathe is not None:
            return self._apply_namespace_chunked(event, self.breathe)
        with self._lock:
            affected = self._apply(event)
            return self._finish(affected)

    def _apply_namespace_chunked(self, event: WatchEvent, breathe: Callable[[float], None]
                                 ) -> set[str]:
        """A Namespace change re-evaluates every pod of it: in chunks, each under the lock,
        pausing between them. Meanwhile pods not yet re-evaluated keep their old verdict
        (as they would have for the seconds a one-piece pass takes)."""
        meta = event.obj.get("metadata") or {}
        name = str(meta.get("name") or "")
        with self._lock:
            keys = self.registry.set_namespace_meta(
                None if event.type == "DELETED" else event.obj, name)
        out: set[str] = set()
        for i in range(0, len(keys), NAMESPACE_CHUNK):
            started = time.monotonic()
            with self._lock:
                svcs, pods = self.registry.refresh_pods(keys[i:i + NAMESPACE_CHUNK])
                out |= self._finish(svcs | self._after_pods(pods))
            if i + NAMESPACE_CHUNK < len(keys):
                breathe(time.monotonic() - started)
        return out

    def register_local(
        self,
        uid: str,
        namespace: str,
        name: str,
        service_account: str,
        ips: tuple[str, ...] | list[str],
        **kw: Any,
    ) -> set[str]:
        """CNI ADD succeeded: register the pod now (labels/annotations/ready via kw)."""
        with self._lock:
            svcs, pods = self.registry.register_local(
                uid, namespace, name, service_account, ips, **kw
            )
            return self._finish(svcs | self._after_pods(pods))

    def local_pod_labels(self) -> list[tuple[str, str, dict[str, str]]]:
        """(pod key, namespace, labels) of this node's pods: what selects their policies."""
        with self._lock:
            return [(r.key, r.namespace, r.labels) for r in self.registry.local()]

    def try_lock(self, timeout: float) -> bool:
        """Hold the model (re-entrant) if it is free within `timeout`: the CNI path registers
        a pod only when that does not mean waiting behind a big re-evaluation."""
        return self._lock.acquire(timeout=timeout)

    def unlock(self) -> None:
        self._lock.release()

    def unregister_local(self, namespace: str, name: str, uid: str = "") -> set[str]:
        with self._lock:
            svcs, pods = self.registry.unregister_local(namespace, name, uid)
            return self._finish(svcs | self._after_pods(pods))

    def learn(self, ip: str, port: int) -> set[str]:
        """Access log: a local pod dialled ip:port. An in-mesh Service joins the set (TTL)."""
        with self._lock:
            key = self.lookup_cluster_ip(ip, port)
            if key is None:
                return set()
            if self.deps.learn(key):
                self._scope_dirty = True
            return self._finish(set())

    def learn_service(self, key: str) -> bool:
        """A local pod asked DNS for this in-mesh Service's name (it is about to dial it):
        the Service joins the set (TTL), as if learned from traffic. False: not in mesh."""
        with self._lock:
            if key not in self._in_mesh:
                return False
            if self.deps.learn(key):
                self._scope_dirty = True
            self._finish(set())
            return True

    def expire(self) -> set[str]:
        """Drop lapsed learned entries (call on a timer; see deps.next_expiry)."""
        with self._lock:
            if self.deps.expire():
                self._scope_dirty = True
            return self._finish(set())

    # ---- reads -----------------------------------------------------------------------------

    def lookup_cluster_ip(self, ip: str, port: int) -> str | None:
        """The in-mesh Service with ClusterIP ``ip`` serving ``port``, else None."""
        with self._lock:
            key = self.services.by_cluster_ip(ip, port)
            return key if key is not None and key in self._in_mesh else None

    def is_in_mesh(self, key: str) -> bool:
        with self._lock:
            return key in self._in_mesh

    def resolve(self, service_key: str) -> dict[int, list[Endpoint]]:
        """Service port → endpoints (targetPort resolved per pod; both IP families)."""
        with self._lock:
            view = self._view(service_key)
            return {} if view is None else {p: list(e) for p, e in view.endpoints.items()}

    def view(self, service_key: str) -> ServiceView | None:
        with self._lock:
            return self._view(service_key)

    def in_scope_keys(self) -> set[str]:
        with self._lock:
            self._settle(set())
            return set(self._scope)

    def in_scope_services(self) -> list[ServiceView]:
        with self._lock:
            self._settle(set())
            views = (self._view(k) for k in sorted(self._scope))
            return [v for v in views if v is not None]

    def learnable_targets(self) -> tuple[tuple[str, int], ...]:
        """(ClusterIP, TCP port) of every in-mesh Service not in scope, sorted: the only
        passthrough destinations learning can act on, so the only ones Envoy reports."""
        with self._lock:
            self._settle(set())
            out: set[tuple[str, int]] = set()
            for key in self._in_mesh - self._scope:
                svc = self.services.get(key)
                if svc is None or svc.headless:
                    continue
                out.update((ip, p.port) for ip in svc.cluster_ips
                           for p in svc.ports if p.protocol.upper() == "TCP")
            return tuple(sorted(out))

    def endpoints_for_identity(self, identity: str) -> list[PodRecord]:
        with self._lock:
            return self.registry.by_identity(identity)

    def explain(self) -> dict[str, list[str]]:
        """Why each Service is (or, when named but not servable, is not) in scope."""
        with self._lock:
            why = self._explain()
            served = self._served(why)
            out: dict[str, list[str]] = {}
            for k, reasons in sorted(why.items()):
                out[k] = list(reasons)
                if k not in served:
                    out[k].append(
                        "not served: unknown Service" if k not in self.services
                        else "not served: no managed endpoints and no route"
                    )
            return out

    # ---- internals -------------------------------------------------------------------------

    def _apply(self, event: WatchEvent) -> set[str]:
        kind, obj = event.kind, event.obj
        meta = obj.get("metadata") or {}
        name = str(meta.get("name") or "")
        ns = str(meta.get("namespace") or "default")
        deleted = event.type == "DELETED"
        if kind == "Namespace":
            svcs, pods = self.registry.set_namespace(None if deleted else obj, name)
            return svcs | self._after_pods(pods)
        if kind == "Pod":  # the Pod itself: its record (if any) gives way (upsert replaces it)
            if deleted:
                svcs, pods = self.registry.remove_pod(ns, name)
            else:
                svcs, pods = self.registry.upsert_pod(cast(PodObject, obj))
            return svcs | self._after_pods(pods)
        if kind == REMOTE_POD_KIND:
            return self._apply_remote_pod(ns, name, None if deleted else obj)
        if kind == "Service":
            return self._apply_service(
                ns, name, None if deleted else service_from_object(cast(ServiceObject, obj)))
        if kind == "EndpointSlice":
            return self._apply_slice(ns, name, None if deleted else cast(EndpointSliceObject, obj))
        if kind == "Node":
            return self._apply_node(name, None if deleted else obj)
        if kind in BACKEND_POLICY_KINDS:
            key = f"{ns}/{name}" if kind == "XBackendTrafficPolicy" else f"{ns}/{name}:{kind}"
            before = set(policy_targets(self._backend_policies.get(key) or {}))
            policy = cast(BackendTrafficPolicyObject, obj)
            if deleted:
                self._backend_policies.pop(key, None)
            else:
                self._backend_policies[key] = policy
            return before | set(policy_targets(policy))
        if kind in ROUTE_KINDS:
            if deleted:
                targets = self.routes.remove(kind, ns, name)
            else:
                targets = self.routes.upsert(route_from_object(kind, cast(RouteObject, obj)))
            if targets:
                self._scope_dirty = True  # backendRefs (the closure) may have changed
            return targets
        return set()

    def _apply_remote_pod(self, ns: str, name: str, obj: dict[str, Any] | None) -> set[str]:
        """A MeshPod record: the registry takes it as a Pod unless this node knows the pod
        itself (its own Pod watch or a CNI ADD) or the record says it is ours."""
        key = pod_key(ns, name)  # interned: the registry's own key object, held once
        node = str(((obj or {}).get("spec") or {}).get("nodeName") or "")
        # (the registry's record says where it came from: a set of 100k keys was 4 MB)
        remote = self.registry.is_remote(key)
        ours = self.registry.is_local(key) or (
            not remote and self.registry.api_pod(key) is not None)
        if ours or obj is None or "spec" not in obj or node == self.node_name:
            if not remote:
                return set()  # nothing of the record's in the registry (or ours wins)
            # gone, or a CNI ADD here took the pod over
            svcs, pods = self.registry.remove_pod(ns, name)
        else:
            svcs, pods = self.registry.upsert_pod(cast(PodObject, obj), remote=True)
        return svcs | self._after_pods(pods)

    def service_with_policies(self, key: str) -> Service | None:
        """A Service with the Gateway API policies on it folded into its traffic fields
        (what a route's backendRef to it is given: its session persistence)."""
        with self._lock:
            svc = self.services.get(key)
            return None if svc is None else replace(svc, traffic=self._traffic(svc))

    def _traffic(self, svc: Service) -> TrafficPolicy:
        """The Service's traffic fields with the policies on it (``policy_traffic``)."""
        return policy_traffic(svc, self._backend_policies)

    def _apply_node(self, name: str, obj: dict[str, Any] | None) -> set[str]:
        """A node's zone changed: every Service preferring its zone recomputes."""
        labels = ((obj or {}).get("metadata") or {}).get("labels") or {}
        zone = str(labels.get(ZONE_LABEL) or "")
        if self._zones.get(name, "") == zone:
            return set()
        if zone:
            self._zones[name] = zone
        else:
            self._zones.pop(name, None)
        keys = self.services.keys()
        hinted = set(self._slice_hints) if name == self.node_name else set()
        return hinted | {k for k in keys if (svc := self.services.get(k)) is not None
                         and svc.traffic.prefer == "zone"}
    def _apply_service(self, ns: str, name: str, svc: Service | None) -> set[str]:
        key = f"{ns}/{name}"
        if svc is None:
            if self.services.remove(key) is None:
                return set()
            self.registry.remove_service(key)
            self._scope_dirty = True
            return {key}
        old = self.services.upsert(svc)
        members_changed = self.registry.set_service(key, ns, svc.selector)
        if svc.selector is None and (old is None or old.selector is not None):
            # the registry holds slice refs only for a Service without a selector
            members_changed = self._slice_refs(key) or members_changed
        if old is None:
            self._scope_dirty = True  # a new Service may match an ns/* or a declared name
        return {key} if (old != svc or members_changed) else set()

    def _slice_refs(self, svc: str, slices: list[_Slice] | None = None) -> bool:
        """Hand the registry the union of a Service's slices' pod refs and addresses."""
        if slices is None:
            slices = [self._slices[k] for k in self._slices_by_svc.get(svc, ())]
        return self.registry.set_slice_refs(
            svc,
            set().union(*(s.pods for s in slices)) if slices else set(),
            set().union(*(s.ips for s in slices)) if slices else set(),
        )

    def _apply_slice(self, ns: str, name: str, obj: EndpointSliceObject | None) -> set[str]:
        skey = f"{ns}/{name}"
        old = self._slices.pop(skey, None)
        if old is not None:
            discard_from(self._slices_by_svc, old.service, skey)
        if obj is not None:
            sl = slice_digest(ns, obj)
            if sl is not None:
                self._slices[skey] = sl
                add_to(self._slices_by_svc, sl.service, skey)
        affected: set[str] = set()
        for svc in {s.service for s in (old, self._slices.get(skey)) if s is not None}:
            slices = [self._slices[k] for k in self._slices_by_svc.get(svc, ())]
            ports: dict[str, int] = {}
            for s in slices:
                ports.update(s.ports)
            changed = self._slice_refs(svc, slices)
            if ports != self._slice_ports.get(svc, {}):
                self._slice_ports[svc] = shared(ports) or {}
                svc_obj = self.services.get(svc)
                changed = changed or (svc_obj is not None and svc_obj.selector is None)
            hints: dict[str, Hint] = {}
            for s in slices:
                hints.update(s.hints)
            if hints != self._slice_hints.get(svc, {}):
                if hints:
                    self._slice_hints[svc] = hints
                else:
                    self._slice_hints.pop(svc, None)
                changed = True
            if changed:
                affected.add(svc)
        return affected

    def _after_pods(self, pods: set[str]) -> set[str]:
        """Local managed pods' declarations feed the dependency set; others leave it."""
        for key in pods:
            rec = self.registry.get(key)
            if rec is not None and rec.local:
                changed = self.deps.set_declared(
                    key, rec.annotations.get(DEPENDENCIES_ANNOTATION), rec.namespace
                )
            else:
                changed = self.deps.remove_pod(key)
            self._scope_dirty |= changed
        return set()

    def _finish(self, affected: set[str]) -> set[str]:
        """Invalidate views, track in-mesh status, recompute the scope if anything moved it."""
        for key in affected:
            self._views.pop(key, None)
            now_in = key in self.services and (
                bool(self.registry.members(key)) or self.routes.is_target(key)
            )
            if now_in != (key in self._in_mesh):
                self._scope_dirty = True
                if now_in:
                    self._in_mesh.add(key)
                else:
                    self._in_mesh.discard(key)
        if self._scope_dirty and self.defer_scope:
            # A relist of 10k Services is 10k events: recomputing the scope after each is
            # quadratic. Deferred, the next read (the debounced publish) recomputes it once.
            return affected | {SCOPE_CHANGED}
        return self._settle(affected)

    def _settle(self, affected: set[str]) -> set[str]:
        if self._scope_dirty:
            self._scope_dirty = False
            new = self._served(self._explain())
            affected = affected | (new ^ self._scope)
            self._scope = new
        return affected

    def _explain(self) -> dict[str, list[str]]:
        return self.deps.explain(
            self.services.in_namespace,
            self.routes.backends_of,
            lambda: sorted(self._in_mesh),
        )

    def _served(self, why: dict[str, list[str]]) -> set[str]:
        """In the set and servable: in-mesh, or a backend of a served route target."""
        backends: set[str] = set()
        for k in why:
            if self.routes.is_target(k):
                backends |= self.routes.backends_of(k)
        return {k for k in why if k in self.services and (k in self._in_mesh or k in backends)}

    def _view(self, key: str) -> ServiceView | None:
        cached = self._views.get(key)
        if cached is not None:
            return cached
        svc = self.services.get(key)
        if svc is None or svc.type == "ExternalName":
            # DNS only: no endpoints whatever its selector (the EndpointSlice controller
            # publishes none), not a route parent or backend: nothing for Envoy, and its
            # traffic goes to whatever the client resolved, through the passthrough
            return None
        members = self.registry.members(key)
        slice_ports = self._slice_ports.get(key, {}) if svc.selector is None else {}
        endpoints = service_endpoints(
            svc, members, slice_ports, self._slice_hints.get(key), self.trust_domain,
            self.node_name, self._zones)
        view = ServiceView(
            key=key,
            namespace=svc.namespace,
            name=svc.name,
            cluster_ips=svc.cluster_ips,
            ports=svc.ports,
            names=svc.names(self.mesh_domain),
            endpoints=endpoints,
            routes=tuple(self.routes.routes_for(key)),
            traffic=self._traffic(svc),
        )
        self._views[key] = view
        return view
