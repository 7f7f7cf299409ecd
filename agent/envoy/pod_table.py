"""The pod tier of the xDS build (split out of ``agent.envoy.resources``): every captured
pod's listeners (its capture listener and, with mesh identity, its inbound, detection and
judge listeners), kept up to date by difference with the last build, and the LDS dict
they make with the shared listeners. Pure: ``ResourceBuilder`` drives it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from envoy.config.cluster.v3 import cluster_pb2

from agent.authz.policy import needs_http
from agent.common.config import JUDGE_PORT
from agent.envoy import mtls
from agent.envoy.judge import build_judge_listener, judge_listener_name
from agent.envoy.names import DEFAULT_NAMESPACE
from agent.envoy.node_state import NodeXdsState
from agent.envoy.pod_listener import PodListener, build_listener
from agent.envoy.raw import resource_hash


class PodTable:
    """The pods' listeners by difference: an ADD or DEL touches its own pod's entries, not
    every pod's."""

    def __init__(self) -> None:
        # pod -> its (name, listener) pairs
        self._entries: dict[PodListener, tuple[tuple[str, Any], ...]] = {}
        self._set: frozenset[PodListener] | None = None
        self._key: tuple[Any, ...] = ()
        self._out: dict[str, Any] = {}  # every pod's listeners by name
        self._uids: set[str] = set()
        # uid -> (connect timeout, the cluster to the pod's own detection listener); kept
        # while the pod is on the node, so a listener still naming it never finds it gone
        self._detect_clusters: dict[str, tuple[float, cluster_pb2.Cluster]] = {}
        self.ns_count: Counter[str] = Counter()  # pods per caller namespace
        self.by_identity: dict[str, set[PodListener]] = {}  # pods per identity
        self._held: frozenset[str] = frozenset()  # identities with an SVID, last build
        # listener name -> resource_hash, for the xDS server (``prehashed``)
        self._hashes: dict[str, str] = {}
        self._listeners_out: dict[str, Any] | None = None
        self._shared_names: set[str] = set()
        #: (the last listener dict ``listeners`` made, its hashes by name)
        self.hashed: tuple[dict[str, Any], dict[str, str]] | None = None

    def update(self, state: NodeXdsState, held: Mapping[str, Any]) -> bool:
        """Bring the pod listeners up to ``state.pods`` by difference with the last build:
        only pods that came or went are built or dropped (a DEL or ADD is O(1) here, not
        O(pods)); a change of what every pod listener depends on (capture port, mTLS
        settings, the connection log) rebuilds them all, an identity's SVID coming or going
        the pods of that identity. True when anything changed."""
        tls = state.mesh_tls
        key = (state.capture_port, state.connection_log,
               (tls.inbound_port, tls.trust_domain) if tls is not None else None)
        pods = state.pods if isinstance(state.pods, frozenset) else frozenset(state.pods)
        if len(pods) != len(state.pods):
            self._set = None  # rebuilt in full next time
            raise ValueError("duplicate pods in the xDS state")
        now_held = frozenset(held)
        flipped = self._held ^ now_held
        self._held = now_held
        if key != self._key or self._set is None:
            gone, new = tuple(self._entries), pods
            self._key = key
        else:
            # the pods whose listeners name an SVID that came or went are built again
            again = frozenset(p for i in flipped for p in self.by_identity.get(i, ()))
            if pods == self._set and not again:
                return False
            gone = tuple((self._set - pods) | (again & pods))
            new = (pods - self._set) | (again & pods)
        for pod in gone:
            self._drop(pod)
        try:
            for pod in sorted(new, key=lambda p: p.uid):
                if pod.uid in self._uids:
                    raise ValueError(f"duplicate pod uid {pod.uid}")
                self._add(pod, state, held)
        except BaseException:
            self._set = None
            for pod in tuple(self._entries):
                self._drop(pod)
            raise
        self._set = pods
        return True

    def _add(self, pod: PodListener, state: NodeXdsState, held: Mapping[str, Any]) -> None:
        tls = state.mesh_tls
        has_id = pod.identity in held
        entries: list[tuple[str, Any]] = [
            (pod.listener_name, build_listener(pod, state.capture_port, has_id))]
        workload = f"{pod.namespace or DEFAULT_NAMESPACE}/{pod.workload or pod.uid}"
        # its policies name HTTP fields: its undeclared ports and plaintext callers are
        # judged past detection, in a listener of its own
        own_detect = tls is not None and has_id and bool(pod.ips) and needs_http(pod.authz)
        if tls is not None and has_id and pod.ips:
            entries.append((mtls.inbound_listener_name(pod.uid), mtls.build_inbound_listener(
                pod.uid, pod.netns_path, pod.identity, pod.ips, tls, pod.ipv4, pod.ipv6,
                forbidden_ports=(state.capture_port,), access_log=state.connection_log,
                workload=workload, policies=pod.authz)))
        if tls is not None and own_detect:
            entries.append((mtls.pod_detect_name(pod.uid), mtls.build_inbound_detect_listener(
                pod.uid, pod.authz, tls.trust_domain)))
            t = state.connect_timeout_s
            if self._detect_clusters.get(pod.uid, (None,))[0] != t:
                self._detect_clusters[pod.uid] = (
                    t, mtls.build_inbound_detect_cluster(t, pod.uid))
        if tls is not None and pod.authz and pod.ips:
            # its plaintext callers, steered here by its rules while a policy selects it
            entries.append((judge_listener_name(pod.uid), build_judge_listener(
                pod.uid, pod.netns_path, pod.ips, pod.authz, JUDGE_PORT, pod.ipv4, pod.ipv6,
                access_log=state.connection_log, detect=own_detect, workload=workload)))
        self._entries[pod] = tuple(entries)
        for name, lis in entries:
            self._out[name] = lis
            self._hashes[name] = resource_hash(lis)
        self._uids.add(pod.uid)
        self.ns_count[pod.namespace or DEFAULT_NAMESPACE] += 1
        self.by_identity.setdefault(pod.identity, set()).add(pod)

    def _drop(self, pod: PodListener) -> None:
        if pod not in self._entries:
            return
        for name, _lis in self._entries.pop(pod):
            self._out.pop(name, None)
            self._hashes.pop(name, None)
        self._uids.discard(pod.uid)
        ns = pod.namespace or DEFAULT_NAMESPACE
        self.ns_count[ns] -= 1
        if self.ns_count[ns] <= 0:
            del self.ns_count[ns]
        same = self.by_identity.get(pod.identity)
        if same is not None:
            same.discard(pod)
            if not same:
                del self.by_identity[pod.identity]

    def listeners(self, shared: dict[str, Any], pods_changed: bool) -> dict[str, Any]:
        """Every listener: the pods' and the shared ones (namespace listeners, mtls-out).
        The same dict (and hashes) as last time when none of them changed, so the xDS server
        skips the type; otherwise a copy, with hashes kept per listener as they are built."""
        prev = self._listeners_out
        if prev is not None and not pods_changed and len(prev) == len(self._out) + len(
                shared) and all(prev.get(n) is lis for n, lis in shared.items()):
            return prev
        for name in self._shared_names - shared.keys():
            self._hashes.pop(name, None)
        self._shared_names = set(shared)
        for name, lis in shared.items():
            if prev is None or prev.get(name) is not lis or name not in self._hashes:
                self._hashes[name] = resource_hash(lis)
        out = dict(self._out)
        out.update(shared)
        self._listeners_out = out
        self.hashed = (out, dict(self._hashes))
        return out

    def detect_clusters(self) -> list[cluster_pb2.Cluster]:
        """The clusters to the pods' own detection listeners, of the pods still on the node
        (the others are forgotten)."""
        self._detect_clusters = {u: tc for u, tc in self._detect_clusters.items()
                                 if u in self._uids}
        return [c for _t, c in self._detect_clusters.values()]
