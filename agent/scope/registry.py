"""The endpoint registry: managed pods, indexed by identity and by the Services that pick them.

Endpoints are managed pods only (proposal 020: the registry is the source of truth, not
EndpointSlices). Each keeps its own ServiceAccount identity ``<ns>/<sa>`` (SAN
``spiffe://<td>/ns/<ns>/sa/<sa>``), so two Services whose pods all run as ``default`` stay two
backends with the same identity rather than one merged cluster. Two sources register pods:
the API (any node) and the CNI ADD on this node, which arrives before the API reports the
pod's IP; the record merges both so a local pod is an endpoint from its first instant.

Service membership is maintained incrementally: a pod change re-matches only the Services
of its namespace; a Service change re-matches only the pods of its namespace. Selectorless
Services take their members from their EndpointSlices (by targetRef, else by address).

The record itself (``PodRecord``, ``CniRegistration``, the reading of a Pod object) lives in
``agent.scope.pod_record``; its names stay importable from here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from agent.capture.policy import managed
from agent.common.config import NodeConfig
from agent.scope.pod_record import (
    _API_CNI,
    _CNI,
    _SHAPES,
    REMOTE,
    CniRegistration,
    PodRecord,
    _named_ports,
    _pod_ips,
    _ready,
)
from agent.scope.services import canonical_ip
from agent.scope.small_sets import Bucket, add_to, bucket, discard_from
from agent.source.model import NamespaceMeta, namespace_from_object
from agent.source.objects import PodObject

# the names this module held before the split, importable from here as before (the private
# ones for the tests that read them: test_slim_pod, test_pod_record)
__all__ = ["REMOTE", "CniRegistration", "PodRecord", "Registry", "_SHAPES", "_named_ports",
           "_pod_ips", "_ready"]

_UNSET: Any = object()  # Registry._own has no entry


def _selects(selector: dict[str, str] | None, labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in (selector or {}).items())


class Registry:
    """Managed pods + Service membership. Not thread-safe: the model serialises calls."""

    def __init__(self, node: NodeConfig) -> None:
        self.node = node
        self._api: dict[str, PodRecord] = {}  # the API half (PodRecord.of_api)
        self._cni: dict[str, CniRegistration] = {}
        self._namespaces: dict[str, NamespaceMeta] = {}
        # The records, where one is not the API half itself: a CNI ADD's (merged or alone),
        # or None where the API half is no record (unmanaged, finished). A managed pod known
        # only from the API (every remote pod) is its API half and has no entry here: a
        # second 100k-key dict was ~4 MB at 100k pods. Read through _rec and _items.
        self._own: dict[str, PodRecord | None] = {}
        # buckets (agent.scope.small_sets): tuples while small, sets beyond
        self._by_identity: dict[str, Bucket] = {}
        self._by_ip: dict[str, str] = {}
        # membership
        self._selectors: dict[str, tuple[str, dict[str, str] | None]] = {}
        self._svcs_by_ns: dict[str, set[str]] = {}
        # Inverted label indexes: selector matching costs O(matches), not O(pods × Services)
        # (a 10k-Service relist was quadratic without them).
        # (ns, k, v) → records, for the label keys some selector uses (_selector_keys: how
        # many selectors use each): the labels nothing selects on (pod-template-hash, a
        # version every pod of a namespace carries) were most of this index
        self._rec_by_label: dict[tuple[str, str, str], Bucket] = {}
        self._selector_keys: dict[str, int] = {}
        self._svc_by_label: dict[tuple[str, str, str], Bucket] = {}  # first selector pair
        # a Service's slices' pod refs and addresses (tuples: read whole, never probed)
        self._slice_pods: dict[str, tuple[str, ...]] = {}
        self._slice_ips: dict[str, tuple[str, ...]] = {}
        # pod key / IP → the selectorless Services whose slices name it (only those: a
        # selector Service's members come from labels, and indexing every endpoint of a
        # 10k-Service cluster cost two sets an endpoint)
        self._slice_by_pod: dict[str, set[str]] = {}
        self._slice_by_ip: dict[str, set[str]] = {}
        # Service → its member pods. A pod's Services are found from the pod (_member_of),
        # not kept per pod: a 100k-key dict was ~4 MB at 100k pods.
        self._members: dict[str, Bucket] = {}

    # ---- queries ---------------------------------------------------------------------------

    def get(self, pod_key: str) -> PodRecord | None:
        return self._rec(pod_key)

    def _rec(self, key: str) -> PodRecord | None:
        own = self._own.get(key, _UNSET)
        return self._api.get(key) if own is _UNSET else own

    def _items(self) -> Iterator[tuple[str, PodRecord]]:
        """Every (key, record), in no order."""
        own = self._own
        for key, api in self._api.items():
            if key not in own:
                yield key, api
        for key, rec in own.items():
            if rec is not None:
                yield key, rec

    def records(self) -> list[PodRecord]:
        return [r for _k, r in sorted(self._items(), key=lambda kr: kr[0])]

    def local(self) -> list[PodRecord]:
        return [r for r in self.records() if r.local]

    def by_identity(self, identity: str) -> list[PodRecord]:
        return [self._req(k) for k in sorted(self._by_identity.get(identity, ()))]

    def identities(self) -> list[str]:
        return sorted(self._by_identity)

    def by_ip(self, ip: str) -> PodRecord | None:
        c = canonical_ip(ip)
        key = self._by_ip.get(c) if c else None
        return self._rec(key) if key else None

    def members(self, svc_key: str) -> list[PodRecord]:
        """The managed pods a Service resolves to (selector, or its slices if selectorless)."""
        return [self._req(k) for k in sorted(self._members.get(svc_key, ()))]

    def _req(self, key: str) -> PodRecord:
        """The record of a key an index holds (so there is one)."""
        rec = self._rec(key)
        assert rec is not None, key
        return rec

    def services_of(self, pod_key: str) -> set[str]:
        rec = self._rec(pod_key)
        return self._member_of(rec) if rec is not None else set()

    def _member_of(self, rec: PodRecord) -> set[str]:
        """The Services whose members hold ``rec`` (the record the indexes hold for it).
        Those it matches now are a superset: a selector Service's members are the records
        its selector matches, re-matched whenever the selector changes; a selectorless
        one's are the records its slices name, by key or by an address (the address's one
        owner, where ``_match_pod`` takes every record holding it)."""
        return {s for s in self._match_pod(rec) if rec.key in self._members.get(s, ())}

    # ---- pod inputs (each returns the Service keys whose membership or endpoints changed) --

    def api_pod(self, pod_key: str) -> PodRecord | None:
        """The pod as the source reported it (None: only a CNI ADD, or unknown)."""
        return self._api.get(pod_key)

    def is_remote(self, pod_key: str) -> bool:
        """The pod's API half came from a MeshPod record (not from its Pod)."""
        api = self._api.get(pod_key)
        return api is not None and api.sources == REMOTE

    def is_local(self, pod_key: str) -> bool:
        """A CNI ADD on this node registered the pod."""
        return pod_key in self._cni

    def upsert_pod(self, obj: PodObject, remote: bool = False) -> tuple[set[str], set[str]]:
        """API ADDED/MODIFIED (``remote``: a MeshPod record). Returns (affected Service keys,
        pod keys whose record changed)."""
        api = PodRecord.of_api(obj, self.node.node_name, remote)
        key = api.key  # interned: the one key string of the pod
        if self._api.get(key) == api:  # an equal one stays: it may be the record too
            return self._refresh_pods({key})
        old = self._rec(key)  # before the API half changes: it may be the record
        self._api[key] = api
        return self._refresh_pods({key}, {key: old})

    def remove_pod(self, namespace: str, name: str) -> tuple[set[str], set[str]]:
        key = f"{namespace}/{name}"
        old = self._rec(key)
        self._api.pop(key, None)
        return self._refresh_pods({key}, {key: old})

    def register_local(
        self,
        uid: str,
        namespace: str,
        name: str,
        service_account: str,
        ips: tuple[str, ...] | list[str],
        *,
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        ready: bool = False,
    ) -> tuple[set[str], set[str]]:
        """CNI ADD succeeded: the pod is a (local, managed) endpoint now, API or not."""
        ips_c = tuple(c for c in (canonical_ip(str(i)) for i in ips) if c)
        reg = CniRegistration(uid, namespace, name, service_account or "default", ips_c,
                              dict(labels or {}), dict(annotations or {}), ready)
        key = f"{namespace}/{name}"
        self._cni[key] = reg
        return self._refresh_pods({key})

    def unregister_local(self, namespace: str, name: str, uid: str = ""
                         ) -> tuple[set[str], set[str]]:
        """CNI DEL: forget the CNI half; the API half (if any) keeps the pod until DELETED.
        With a uid, a late DEL of an old sandbox leaves a newer same-named pod alone."""
        key = f"{namespace}/{name}"
        reg = self._cni.get(key)
        if reg is not None and uid and reg.uid and reg.uid != uid:
            return set(), set()
        self._cni.pop(key, None)
        return self._refresh_pods({key})

    def set_namespace(self, obj: dict[str, Any] | None, name: str) -> tuple[set[str], set[str]]:
        """Namespace labels decide managed-ness of label-less pods: re-evaluate that ns only."""
        return self._refresh_pods(set(self.set_namespace_meta(obj, name)))

    def set_namespace_meta(self, obj: dict[str, Any] | None, name: str) -> list[str]:
        """Record a Namespace; the pods to re-evaluate with ``refresh_pods`` (none when it
        did not change). Split so a big namespace can be re-evaluated in chunks."""
        if obj is None:
            if self._namespaces.pop(name, None) is None:
                return []
        else:
            meta = namespace_from_object(obj)
            if self._namespaces.get(name) == meta:
                return []
            self._namespaces[name] = meta
        return self._keys_in(name)

    def _keys_in(self, namespace: str) -> list[str]:
        """Every known pod of a namespace, managed or not. Found by a pass over the pods, not
        kept as an index: a namespace changes rarely, and a set of its pods was 131 KB per
        2000 (at 100k pods a pass is a few milliseconds)."""
        prefix = namespace + "/"
        return sorted({k for k in self._api if k.startswith(prefix)}
                      | {k for k in self._cni if k.startswith(prefix)})

    def refresh_pods(self, keys: Iterable[str]) -> tuple[set[str], set[str]]:
        """Re-evaluate these pods against what is known now: (Services affected, pods changed)."""
        return self._refresh_pods(set(keys))

    # ---- service inputs --------------------------------------------------------------------

    def set_service(
        self, svc_key: str, namespace: str, selector: dict[str, str] | None
    ) -> bool:
        """Service ADDED/MODIFIED; True if its member set changed."""
        old = self._selectors.get(svc_key)
        if old == (namespace, selector):
            return False
        was_sliced = self._selectorless(svc_key)
        for lk in selector or ():  # before the old ones go: a key kept is not re-indexed
            self._use_selector_key(lk)
        if old is not None:
            self._unindex_selector(svc_key, *old)
        self._selectors[svc_key] = (namespace, selector)
        if was_sliced and selector is not None:
            self._unindex_slices(svc_key)
        if selector is not None:  # its members come from labels: its slices' refs are unused
            self._slice_pods.pop(svc_key, None)
            self._slice_ips.pop(svc_key, None)
        elif not was_sliced:
            self._index_slices(svc_key)
        self._svcs_by_ns.setdefault(namespace, set()).add(svc_key)
        if selector:
            k, v = min(selector.items())
            add_to(self._svc_by_label, (namespace, k, v), svc_key)
        return self._rematch_service(svc_key)

    def _use_selector_key(self, label: str) -> None:
        """One more selector uses ``label``: the first indexes every record's value of it."""
        n = self._selector_keys.get(label, 0)
        self._selector_keys[label] = n + 1
        if n == 0:
            for key, rec in self._items():
                value = rec.labels.get(label)
                if value is not None:
                    add_to(self._rec_by_label, (rec.namespace, label, value), key)

    def _drop_selector_key(self, label: str) -> None:
        """One selector less uses ``label``: the last drops its index."""
        n = self._selector_keys.get(label, 0) - 1
        if n > 0:
            self._selector_keys[label] = n
            return
        self._selector_keys.pop(label, None)
        for k in [k for k in self._rec_by_label if k[1] == label]:
            del self._rec_by_label[k]

    def _unindex_selector(self, svc_key: str, namespace: str, selector: dict[str, str] | None
                          ) -> None:
        if selector:
            k, v = min(selector.items())
            discard_from(self._svc_by_label, (namespace, k, v), svc_key)
            for lk in selector:
                self._drop_selector_key(lk)

    def remove_service(self, svc_key: str) -> bool:
        if self._selectorless(svc_key):
            self._unindex_slices(svc_key)
        entry = self._selectors.pop(svc_key, None)
        if entry is not None:
            keys = self._svcs_by_ns.get(entry[0], set())
            keys.discard(svc_key)
            self._unindex_selector(svc_key, *entry)
        changed = bool(self._members.get(svc_key))
        self._set_members(svc_key, set())
        self._members.pop(svc_key, None)
        return changed

    def set_slice_refs(self, svc_key: str, pod_keys: set[str], ips: set[str]) -> bool:
        """The union of a Service's EndpointSlices (pod targetRefs and addresses). Held only
        for a Service without a selector, or not known yet (a selector Service's members
        come from labels, and at 10k Services the unused refs were ~3 MB): the caller hands
        them again when a Service loses its selector."""
        entry = self._selectors.get(svc_key)
        if entry is not None and entry[1] is not None:
            return False
        ips = {c for c in (canonical_ip(i) for i in ips) if c}
        sliced = self._selectorless(svc_key)
        if sliced:
            self._unindex_slices(svc_key)
        if pod_keys or ips:
            self._slice_pods[svc_key], self._slice_ips[svc_key] = tuple(pod_keys), tuple(ips)
        else:
            self._slice_pods.pop(svc_key, None)
            self._slice_ips.pop(svc_key, None)
        if not sliced:
            return False  # a selector's members do not follow its slices: nothing to re-match
        self._index_slices(svc_key)
        return self._rematch_service(svc_key)

    def _selectorless(self, svc_key: str) -> bool:
        entry = self._selectors.get(svc_key)
        return entry is not None and entry[1] is None

    def _index_slices(self, svc_key: str) -> None:
        for p in self._slice_pods.get(svc_key, ()):
            self._slice_by_pod.setdefault(p, set()).add(svc_key)
        for ip in self._slice_ips.get(svc_key, ()):
            self._slice_by_ip.setdefault(ip, set()).add(svc_key)

    def _unindex_slices(self, svc_key: str) -> None:
        for index, keys in ((self._slice_by_pod, self._slice_pods.get(svc_key, ())),
                            (self._slice_by_ip, self._slice_ips.get(svc_key, ()))):
            for k in keys:
                svcs = index.get(k)
                if svcs is not None:
                    svcs.discard(svc_key)
                    if not svcs:
                        del index[k]

    # ---- internals -------------------------------------------------------------------------

    def _build(self, key: str) -> PodRecord | None:
        obj, reg = self._api.get(key), self._cni.get(key)
        if obj is None and reg is None:
            return None
        if obj is None:
            assert reg is not None
            return PodRecord(
                namespace=reg.namespace, name=reg.name, uid=reg.uid,
                service_account=reg.service_account, ips=reg.ips, node_name=self.node.node_name,
                ready=reg.ready, local=True, labels=reg.labels, annotations=reg.annotations,
                sources=_CNI,
            )
        if obj.finished:
            return None  # finished pods are no endpoints, even if the object lingers
        if reg is None:
            managed_now = managed(obj.meta(), self._namespaces.get(obj.namespace), self.node)[0]
            return obj if managed_now else None  # one object: the API half is the record
        # a CNI ADD here: the two halves merged
        ips = obj.ips
        if not ips or (reg.uid and obj.uid and reg.uid != obj.uid):
            ips = reg.ips  # the CNI saw the sandbox before the API reported it
        return obj.evolve(uid=obj.uid or reg.uid, ips=ips,
                          ready=obj.ready or (reg.ready and not obj.ips), local=True,
                          sources=_API_CNI)

    def _refresh_pods(self, keys: set[str], olds: dict[str, PodRecord | None] | None = None
                      ) -> tuple[set[str], set[str]]:
        """``olds``: the records of keys whose API half has just changed (read before)."""
        affected: set[str] = set()
        changed_pods: set[str] = set()
        for key in keys:
            old = olds[key] if olds is not None and key in olds else self._rec(key)
            new = self._build(key)
            api = self._api.get(key)
            if new is api and api is not None:
                self._own.pop(key, None)  # the API half is the record
            elif new is not None or api is not None:
                self._own[key] = new  # a CNI record, or None: the API half is no record
            else:
                self._own.pop(key, None)
            if old == new:
                continue
            changed_pods.add(key)
            old_svcs = self._member_of(old) if old is not None else set()
            if old is not None:
                self._unindex(old)
            if new is not None:
                indexed = self._selector_keys
                for lk, lv in new.labels.items():
                    if lk in indexed:
                        add_to(self._rec_by_label, (new.namespace, lk, lv), key)
                add_to(self._by_identity, new.identity, key)
                for ip in new.ips:
                    self._by_ip[ip] = key
            new_svcs = self._match_pod(new) if new is not None else set()
            for s in old_svcs - new_svcs:
                discard_from(self._members, s, key)
            for s in new_svcs - old_svcs:
                add_to(self._members, s, key)
            affected |= old_svcs | new_svcs
        return affected, changed_pods

    def _unindex(self, rec: PodRecord) -> None:
        for lk, lv in rec.labels.items():
            if lk in self._selector_keys:
                discard_from(self._rec_by_label, (rec.namespace, lk, lv), rec.key)
        discard_from(self._by_identity, rec.identity, rec.key)
        for ip in rec.ips:
            if self._by_ip.get(ip) == rec.key:
                del self._by_ip[ip]

    def _match_pod(self, rec: PodRecord) -> set[str]:
        out: set[str] = set()
        for lk, lv in rec.labels.items():
            for svc in self._svc_by_label.get((rec.namespace, lk, lv), ()):
                _ns, selector = self._selectors[svc]
                if selector is not None and _selects(selector, rec.labels):
                    out.add(svc)
        sliced = set(self._slice_by_pod.get(rec.key, ()))
        for ip in rec.ips:
            sliced |= self._slice_by_ip.get(ip, set())
        out |= {s for s in sliced if s in self._selectors and self._selectors[s][1] is None}
        return out

    def _rematch_service(self, svc_key: str) -> bool:
        entry = self._selectors.get(svc_key)
        members: set[str] = set()
        if entry is not None:
            ns, selector = entry
            if selector is not None:
                if selector:
                    sets = sorted((self._rec_by_label.get((ns, k, v), ())
                                   for k, v in selector.items()), key=len)
                    members = set(sets[0]).intersection(*sets[1:])
            else:
                members = {k for k in self._slice_pods.get(svc_key, ())
                           if self._rec(k) is not None}
                members |= {
                    self._by_ip[ip] for ip in self._slice_ips.get(svc_key, ()) if ip in self._by_ip
                }
        return self._set_members(svc_key, members)

    def _set_members(self, svc_key: str, members: set[str]) -> bool:
        if set(self._members.get(svc_key, ())) == members:
            return False
        self._members[svc_key] = bucket(members)
        return True
