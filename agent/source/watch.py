"""List+watch of the mesh's object kinds into an ObjectStore, from the API or a directory.

Kubernetes: one thread per kind runs the informer protocol by hand — LIST (which gives a
resourceVersion) → ``store.replace_kind`` → WATCH from that version with bookmarks. A 410
Gone (in-stream ERROR or HTTP status) means our version was compacted away: relist, and the
store's diff turns the relist into the DELETED/MODIFIED events we missed. Any other failure
(connection cut, API restart, 5xx) backs off exponentially with jitter (capped) and
re-watches from the last version seen, which bookmarks keep fresh so a quiet kind does not
fall behind compaction. Requests are raw (``_preload_content=False``) JSON so both backends
store identical plain dicts.

Scaling: by default the Pod watch carries ``fieldSelector=spec.nodeName=<node>`` and the
other nodes' managed pods arrive as MeshPod records (``agent.meshpods``: the slim Pod their
own agent published, ~700 bytes each instead of a ~4.4 KB Pod); ``--remote-pods pods``
lists every Pod of the cluster instead. Every LIST is paged (``limit``/``continue``,
``LIST_PAGE`` objects a request, as client-go's pager does; an expired continue token is a
410 like any other and restarts the list), and every Pod is slimmed on receipt
(``agent.source.model.slim_pod``: the dozen fields the agent reads), so memory per pod
follows what the mesh needs rather than the size of a Pod spec; EndpointSlices, Nodes and
Services are slimmed too (``slim_endpoint_slice``, ``slim_node``, ``slim_service``).

Directory: ``ManifestWatcher`` polls the manifest directory (mtime stamp) through the shared
``ManifestLoader`` (which re-parses only changed files, big ones on a thread of their own)
and feeds the diff of each new snapshot, so ``--manifests`` and the API produce the same
events. A file that fails to parse (or is caught mid-rewrite) keeps its last good objects in
the store rather than turning into DELETED events (see ``agent.source.manifests``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import orjson
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from agent.authz.policy import API_VERSION as AUTHZ_API_VERSION
from agent.authz.policy import KIND as AUTHZ_KIND
from agent.common.backoff import backoff_delay
from agent.common.heap import listing
from agent.kube import KubeConfigError, abandon, api_client, done
from agent.meshpods.record import API_VERSION as MESHPOD_API_VERSION
from agent.meshpods.record import KIND as MESHPOD_KIND
from agent.meshpods.record import PLURAL, pod_of
from agent.source.base import SourceError, WatchEvent
from agent.source.events import CLUSTER_SCOPED, ObjectStore, object_key
from agent.source.events import _same as same_object
from agent.source.manifests import ManifestLoader, shared_loader
from agent.source.model import slim_endpoint_slice, slim_node, slim_pod, slim_service
from agent.source.objects import EndpointSliceObject, NodeObject, PodObject, ServiceObject
from agent.source.pace import background_slice
from agent.source.packed import pack

log = logging.getLogger("aether.source.watch")

_GW = "gateway.networking.k8s.io/v1"
#: Objects per LIST request (the API server's pages; client-go's pager asks for 500).
LIST_PAGE = 500


@dataclass(frozen=True)
class KindSpec:
    """Where a kind lives in the API (cluster-wide collection path)."""

    kind: str
    api_version: str
    path: str


KIND_SPECS: dict[str, KindSpec] = {
    s.kind: s
    for s in (
        KindSpec("Namespace", "v1", "/api/v1/namespaces"),
        KindSpec("Node", "v1", "/api/v1/nodes"),  # zones (trafficDistribution), slimmed
        KindSpec("Pod", "v1", "/api/v1/pods"),
        KindSpec("Service", "v1", "/api/v1/services"),
        KindSpec(
            "EndpointSlice", "discovery.k8s.io/v1", "/apis/discovery.k8s.io/v1/endpointslices"
        ),
        KindSpec("HTTPRoute", _GW, f"/apis/{_GW}/httproutes"),
        KindSpec("GRPCRoute", _GW, f"/apis/{_GW}/grpcroutes"),
        KindSpec("XBackendTrafficPolicy", "gateway.networking.x-k8s.io/v1alpha1",
                 "/apis/gateway.networking.x-k8s.io/v1alpha1/xbackendtrafficpolicies"),
        KindSpec("BackendLBPolicy", "gateway.networking.k8s.io/v1alpha2",
                 "/apis/gateway.networking.k8s.io/v1alpha2/backendlbpolicies"),
        # who may call whom (agent.authz): enforced at this node's inbound listeners
        KindSpec(AUTHZ_KIND, AUTHZ_API_VERSION,
                 f"/apis/{AUTHZ_API_VERSION}/authorizationpolicies"),
        # remote nodes' pods, as their agents publish them (agent.meshpods)
        KindSpec(MESHPOD_KIND, MESHPOD_API_VERSION, f"/apis/{MESHPOD_API_VERSION}/{PLURAL}"),
    )
}
#: Every Pod of the cluster from the Pod API (``--remote-pods pods``).
MESH_KINDS: tuple[str, ...] = tuple(k for k in KIND_SPECS if k != MESHPOD_KIND)
#: This node's Pods from the Pod API, the others from their MeshPod records (the default).
MESH_KINDS_RECORDS: tuple[str, ...] = tuple(KIND_SPECS)


def node_pods_selector(node_name: str) -> dict[str, str]:
    """The field selectors that make the Pod watch this node's only."""
    return {"Pod": f"spec.nodeName={node_name}"}


class Gone(Exception):
    """Our resourceVersion is too old (HTTP 410): only a relist recovers."""


class NotServed(Exception):
    """The API does not serve this kind (HTTP 404 on the collection: its CRD is not
    installed, e.g. Gateway API's experimental policies)."""


#: How often a kind the API does not serve is looked for again (its CRD may be installed).
NOT_SERVED_RECHECK_S = 60.0


@dataclass
class KindStatus:
    """Per-kind watch health for logs and `aether-agent status`."""

    kind: str
    resource_version: str | None = None
    synced: bool = False
    not_served: bool = False  # the API answered 404: the kind's CRD is not installed
    lists: int = 0
    watches: int = 0
    relists_410: int = 0
    errors: int = 0
    last_error: str = ""
    events: int = 0
    synced_event: threading.Event = field(default_factory=threading.Event, repr=False)


def _load_api_client(source: client.ApiClient | str | None) -> client.ApiClient:
    if isinstance(source, client.ApiClient):
        return source
    try:
        return api_client(source, streaming=True)
    except KubeConfigError as exc:
        raise SourceError(str(exc)) from exc


class KubeWatcher:
    """Keeps ``store`` equal to the API server's view of ``kinds`` (see module docstring)."""

    def __init__(
        self,
        api: client.ApiClient | str | None,
        kinds: Iterable[str],
        node_name: str,
        store: ObjectStore,
        stop_event: threading.Event | None = None,
        *,
        watch_timeout: int = 300,
        request_timeout: float = 10.0,
        backoff_base: float = 0.2,
        backoff_cap: float = 5.0,
        list_page: int = LIST_PAGE,
        field_selectors: dict[str, str] | None = None,
    ) -> None:
        self.api = _load_api_client(api)
        self.list_page = list_page
        self.field_selectors = dict(field_selectors or {})  # kind → fieldSelector
        self.kinds = tuple(kinds)
        unknown = [k for k in self.kinds if k not in KIND_SPECS]
        if unknown:
            raise ValueError(f"cannot watch unknown kinds {unknown}")
        self.node_name = node_name
        self.store = store
        self.stop_event = stop_event or threading.Event()
        self.watch_timeout = watch_timeout
        self.request_timeout = request_timeout
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self.status: dict[str, KindStatus] = {k: KindStatus(k) for k in self.kinds}
        self._threads: list[threading.Thread] = []
        self._open: dict[str, Any] = {}
        self._open_lock = threading.Lock()

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> KubeWatcher:
        for kind in self.kinds:
            t = threading.Thread(target=self._run, args=(kind,), name=f"watch-{kind}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every kind: set the stop event and cut open streams so reads return now."""
        self.stop_event.set()
        with self._open_lock:
            streams = list(self._open.values())
        for resp in streams:
            with contextlib.suppress(Exception):
                resp.shutdown()
            with contextlib.suppress(Exception):
                resp.close()
        for t in self._threads:
            t.join(timeout)

    def wait_synced(self, timeout: float | None = None) -> bool:
        """True once every kind has completed its first LIST into the store."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for st in self.status.values():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not st.synced_event.wait(left):
                return False
        return True

    def describe(self) -> str:
        return f"kubernetes watch {self.api.configuration.host} ({', '.join(self.kinds)})"

    # ---- the per-kind loop -----------------------------------------------------------------

    def _run(self, kind: str) -> None:
        spec, st = KIND_SPECS[kind], self.status[kind]
        failures = 0
        while not self.stop_event.is_set():
            try:
                if st.resource_version is None:
                    with listing():  # no cycle collection over what the list decodes
                        self._list(spec, st)
                self._watch(spec, st)
                failures = 0  # a watch that ran to its timeout is healthy; re-watch at once
            except Gone as exc:
                st.relists_410 += 1
                st.resource_version = None
                log.info("watch %s: %s; relisting", kind, exc)
            except NotServed:
                # no such kind: nothing of it exists, so the (empty) list is complete
                if not st.not_served:
                    log.info("the API does not serve %s (CRD not installed?); looking again "
                             "every %.0fs", kind, NOT_SERVED_RECHECK_S)
                st.not_served = True
                self.store.replace_kind(kind, [])
                st.resource_version = None
                if not st.synced:
                    st.synced = True
                    st.synced_event.set()
                self.stop_event.wait(NOT_SERVED_RECHECK_S)
            except Exception as exc:  # cut streams, refused connections, 5xx, bad JSON
                if self.stop_event.is_set():
                    break
                failures += 1
                st.errors += 1
                st.last_error = _describe(exc)
                delay = backoff_delay(failures, self.backoff_base, self.backoff_cap)
                log.warning(
                    "watch %s failed (%s); retrying in %.2fs from resourceVersion %s",
                    kind, st.last_error, delay, st.resource_version,
                )
                self.stop_event.wait(delay)

    def _request(self, spec: KindSpec, query: dict[str, str], read_timeout: float) -> Any:
        selector = self.field_selectors.get(spec.kind)
        if selector:
            query = {**query, "fieldSelector": selector}
        req = self.api.param_serialize(
            method="GET",
            resource_path=spec.path,
            query_params=list(query.items()),
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        rest = self.api.call_api(*req, _request_timeout=(self.request_timeout, read_timeout))
        resp = rest.response
        if resp.status == 404 and "watch" not in query:
            rest.read()
            resp.release_conn()
            raise NotServed(f"HTTP 404 on {spec.path}")
        if resp.status == 410:
            done(resp)
            raise Gone("HTTP 410 Gone")
        if not 200 <= resp.status <= 299:
            rest.read()
            resp.release_conn()
            raise ApiException.from_response(http_resp=rest, body=None, data=None)
        return resp

    def _normalise(self, spec: KindSpec, obj: dict[str, Any], packed: bool = True
                   ) -> dict[str, Any]:
        if spec.kind == "Pod":
            return slim_pod(cast(PodObject, obj))  # sets kind and apiVersion too
        if spec.kind == "Node":
            return slim_node(cast(NodeObject, obj))
        if spec.kind == "EndpointSlice":
            return slim_endpoint_slice(cast(EndpointSliceObject, obj))
        if spec.kind == "Service":
            return slim_service(cast(ServiceObject, obj))
        if spec.kind == MESHPOD_KIND:
            return meshpod_object(obj, packed)
        obj.setdefault("kind", spec.kind)  # list items come without kind/apiVersion
        obj.setdefault("apiVersion", spec.api_version)
        return obj

    def _list(self, spec: KindSpec, st: KindStatus) -> None:
        """One consistent LIST in pages (each page normalised, i.e. Pods slimmed, before
        the next is read); a 410 on a later page (token expired) raises ``Gone``.

        A kind the store holds nothing of (the first list) is applied page by page, each
        object as it is read: there is nothing to diff against, and holding a 100k-object
        list whole until its last page cost memory (which MeshPods were packed to save) and
        a sorted diff. A list that fails midway leaves what it applied; the relist after it
        replaces the kind whole, as every later list does."""
        items: list[dict[str, Any]] = []
        stream = not self.store.counts().get(spec.kind)
        applied = 0
        token = ""
        while True:
            query = {"limit": str(self.list_page)} if self.list_page > 0 else {}
            if token:
                query["continue"] = token
            resp = self._request(spec, query, self.request_timeout)
            try:
                body = orjson.loads(resp.data)  # ~2x the stdlib's decode: 200 pages at 100k
            finally:
                resp.release_conn()
            if stream:
                for o in body.get("items") or []:
                    if self.store.apply(WatchEvent("ADDED", spec.kind,
                                                   self._normalise(spec, o, packed=False))):
                        applied += 1
            else:
                items.extend(self._normalise(spec, o) for o in body.get("items") or [])
            meta = body.get("metadata") or {}
            token = str(meta.get("continue") or "")
            if not token:
                break
            if self.stop_event.is_set():
                return
        rv = str(meta.get("resourceVersion") or "")
        changes = applied if stream else len(self.store.replace_kind(spec.kind, items))
        st.lists += 1
        st.not_served = False
        st.events += changes
        st.resource_version = rv or None
        if not st.synced:
            st.synced = True
            st.synced_event.set()
        log.debug("listed %s at resourceVersion %s (%d changes)", spec.kind, rv, changes)
        if not rv:  # no version to watch from: we can only poll by relisting
            raise RuntimeError(f"LIST {spec.kind} returned no resourceVersion")

    def _watch(self, spec: KindSpec, st: KindStatus) -> None:
        query = {
            "watch": "true",
            "allowWatchBookmarks": "true",
            "resourceVersion": st.resource_version or "",
            "timeoutSeconds": str(self.watch_timeout),
        }
        resp = self._request(spec, query, self.watch_timeout + self.request_timeout)
        st.watches += 1
        with self._open_lock:
            self._open[spec.kind] = resp
        try:
            for raw in _lines(resp):
                if self.stop_event.is_set():
                    return
                self._handle(spec, st, orjson.loads(raw))
        finally:
            with self._open_lock:
                self._open.pop(spec.kind, None)
            with contextlib.suppress(Exception):
                abandon(resp)  # a stream left mid-way must not be pooled

    def _handle(self, spec: KindSpec, st: KindStatus, ev: dict[str, Any]) -> None:
        etype, obj = ev.get("type"), ev.get("object") or {}
        if etype == "ERROR":
            code = obj.get("code")
            if code == 410:
                raise Gone(str(obj.get("message") or "resource version expired"))
            raise ApiException(status=code, reason=f"{obj.get('reason')}: {obj.get('message')}")
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if etype == "BOOKMARK":
            if rv:
                st.resource_version = str(rv)
            return
        if etype not in ("ADDED", "MODIFIED", "DELETED"):
            log.warning("watch %s: ignoring event type %r", spec.kind, etype)
            return
        if spec.kind not in CLUSTER_SCOPED and not (obj.get("metadata") or {}).get("name"):
            return
        if self.store.apply(WatchEvent(etype, spec.kind, self._normalise(spec, obj))):
            st.events += 1
        if rv:
            st.resource_version = str(rv)


def meshpod_object(record: dict[str, Any], packed: bool = True) -> dict[str, Any]:
    """A MeshPod record as the store keeps it: the slim Pod it holds, under kind MeshPod (so
    a relist of this node's Pods never touches it); a record holding no Pod keeps only its
    name, which the model ignores."""
    pod = pod_of(record)
    meta = record.get("metadata") or {}
    if pod is None:
        pod = {"metadata": {"name": str(meta.get("name") or ""),
                            "namespace": str(meta.get("namespace") or "default")}}
    pod["apiVersion"], pod["kind"] = MESHPOD_API_VERSION, MESHPOD_KIND  # a fresh dict
    if meta.get("resourceVersion"):  # the record's: what the store keeps (ObjectStore.thin)
        pod["metadata"]["resourceVersion"] = str(meta["resourceVersion"])
    if not packed:  # read at once and dropped (a first list's page)
        return pod
    # the cluster's remote pods: one packed object each instead of four dicts
    return pack(pod, ("metadata", "spec", "status"))  # type: ignore[return-value]


def _lines(resp: Any) -> Iterator[str]:
    for line in iter_resp_lines(resp):
        if line.strip():
            yield line


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason or ''}".strip()
    return f"{type(exc).__name__}: {exc}"


#: A new manifest snapshot is compared and applied this many objects at a time, each batch
#: a ``background_slice`` of a millisecond or two (a 50k-object file's first load is ~150 µs
#: of mesh-model work per object: seconds the CNI threads must not wait behind).
APPLY_BATCH = 10


class ManifestWatcher:
    """Feeds a manifest directory into ``store``: each new snapshot diffed into events.

    The directory is read through the process's shared ``ManifestLoader`` (the CNI lookups'
    source uses the same one, so a file is parsed once per change, and only a changed file);
    big files are parsed in the background (a child process). ``wait_synced`` holds until the
    first complete view, big files included, is in the store (the mesh runtime bounds that
    wait); until then objects are applied flat out, afterwards in ``background_slice``s.
    """

    def __init__(
        self,
        directory: str,
        store: ObjectStore,
        stop_event: threading.Event | None = None,
        interval: float = 0.5,
        kinds: Iterable[str] = MESH_KINDS,
        loader: ManifestLoader | None = None,
    ) -> None:
        self.directory = directory
        self.store = store
        self.stop_event = stop_event or threading.Event()
        self.interval = interval
        self.kinds = frozenset(kinds)
        self.reads = 0
        self.loader = loader or shared_loader(directory)
        self._generation = -1
        self._last: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._synced = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def problems(self) -> list[str]:
        snap = self.loader.snapshot
        return [*snap.problems, *snap.loading]

    def start(self) -> ManifestWatcher:
        self._thread = threading.Thread(target=self._run, name="watch-manifests", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self.stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def wait_synced(self, timeout: float | None = None) -> bool:
        return self._synced.wait(timeout)

    def describe(self) -> str:
        return f"manifest directory {self.directory}"

    def _run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.poll_once()
            except Exception as exc:  # an unreadable directory keeps the last good view
                log.warning("manifest directory %s: %s", self.directory, exc)
            self.stop_event.wait(self.interval)

    def poll_once(self) -> list[WatchEvent]:
        """Scan (parsing what changed); apply and return the events of a new snapshot.

        Only the objects of files that changed since the last snapshot applied are compared
        (all of them when that is not known); comparing and applying go in paced batches
        (``agent.source.pace``), so a 50k-object file's first load does not hold the GIL
        from the CNI threads. Additions
        and changes are applied before deletions (a rename never leaves a moment with
        neither)."""
        snap = self.loader.scan()
        if snap.generation == self._generation:
            if snap.complete:
                self._synced.set()
            return []
        started = time.monotonic()
        changed = self.loader.changed_between(self._generation, snap.generation)
        lookup: Callable[[tuple[str, str, str]], dict[str, Any] | None]
        if changed is None or self.kinds & (CLUSTER_SCOPED - {"Namespace"}):
            new = {object_key(k[0], o): o for k, o in snap.objects.items() if k[0] in self.kinds}
            keys: list[tuple[str, str, str]] = [*new, *(k for k in self._last if k not in new)]
            lookup = new.get
        else:  # manifest key == store key for these kinds
            keys = [k for k in changed if k[0] in self.kinds]
            lookup = snap.objects.get
        # Namespaces first: the mesh model re-evaluates every pod of a namespace when the
        # namespace changes (50k pods: seconds under its lock), so never after its pods
        keys = [k for k in keys if k[0] == "Namespace"] + [k for k in keys if k[0] != "Namespace"]
        events: list[WatchEvent] = []
        deleted: list[WatchEvent] = []
        asked = time.monotonic()
        # before the first sync the agent serves no CNI requests yet: no need to yield
        piece = background_slice if self._synced.is_set() else contextlib.nullcontext
        for i in range(0, len(keys), APPLY_BATCH):
            if self.stop_event.is_set():
                return events  # stopping: this snapshot is never marked applied
            if time.monotonic() - asked > self.interval:  # a long apply: keep the snapshot
                self.loader.request()  # (what lookups read) current all the same
                asked = time.monotonic()
            with piece():
                for key in keys[i:i + APPLY_BATCH]:
                    before, after = self._last.get(key), lookup(key)
                    if after is None:
                        if before is not None:
                            deleted.append(WatchEvent("DELETED", key[0], before))
                            del self._last[key]
                    elif before is None or not same_object(before, after):
                        ev = WatchEvent("ADDED" if before is None else "MODIFIED", key[0], after)
                        self._last[key] = after
                        self.store.apply(ev)
                        events.append(ev)
                    elif before is not after:
                        self._last[key] = after  # the same content, parsed again
        for i in range(0, len(deleted), APPLY_BATCH):
            with piece():
                for ev in deleted[i:i + APPLY_BATCH]:
                    self.store.apply(ev)
                    events.append(ev)
        self._generation = snap.generation
        self.reads += 1
        log.debug("manifest snapshot %d: %d of %d objects compared changed, applied in %.2fs",
                  snap.generation, len(events), len(keys), time.monotonic() - started)
        if snap.complete:
            self._synced.set()
        return events
