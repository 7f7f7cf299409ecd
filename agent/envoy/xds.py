"""Minimal ADS server (SotW and delta) for the node-shared Envoy, over a unix socket.

LDS and CDS are wildcard subscriptions; EDS is subscribed by resource name (Envoy asks for
the ClusterLoadAssignment of each EDS cluster it holds), and only subscribed names are
sent. Versions are a global monotonically increasing integer; each type remembers the
version at which it last changed so ``wait_acked`` knows what Envoy must have ACKed. A
stream whose subscribed names are untouched by a change counts as in sync at the new
version without a push. ACK/NACK is matched by nonce, never by ``version_info`` alone,
and stale nonces are ignored, as the xDS protocol requires. A NACK is logged and kept for
status; the rejected config is not pushed again (Envoy keeps serving its last good config).

The same gRPC server hosts the access log service (``agent.envoy.als``) that the
passthrough chains stream to, so traffic learning needs no second socket.

This module holds the server: the snapshot, its versions and what each type requires, the
ACK/NACK bookkeeping and the hold. A stream's wire rules (subscriptions, SotW and delta
responses) are in ``agent.envoy.xds_wire``, the gRPC servicer in ``agent.envoy.xds_servicer``.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent import futures
from typing import Any

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf.message import Message

from agent.envoy.als import AccessCallback, AccessLogServicer, add_access_log_servicer
from agent.envoy.mesh_traffic import InboundTally
from agent.envoy.resources import (
    LISTENER_TYPE,
    NodeXdsState,
    RawResource,
    ResourceBuilder,
    resource_hash,
)
from agent.envoy.traffic import AccessRecorder, Report
from agent.envoy.xds_servicer import AdsServicer
from agent.envoy.xds_wire import (
    NAMED_TYPES,
    TYPE_ORDER,
    Resources,
    _pack,
    _Snapshot,
    _Stream,
    queue_response,
    subscribe,
)

__all__ = ["MOVE_NACK_WAIT_S", "NAMED_TYPES", "TYPE_ORDER", "Resources", "XdsServer", "_Snapshot",
           "_Stream", "_pack"]

# How long a publish that moves a namespace's cluster to a new internal listener waits for
# Envoy's verdict on that listener before it moves the cluster (only a NACK stops it).
MOVE_NACK_WAIT_S = 1.0


class XdsServer:
    """ADS over ``unix:<socket_path>``; ``set_state`` pushes to every connected Envoy."""

    def __init__(self, socket_path: str, log: logging.Logger | None = None,
                 on_access: AccessCallback | None = None) -> None:
        self.socket_path = socket_path
        self.log = log or logging.getLogger("agent.envoy.xds")
        # the mesh connections this node's pods accepted, by caller (the inbound access log)
        self.inbound = InboundTally()
        # --access-log: the records of captured connections and requests (set by the sink);
        # the golden metrics themselves are counted in Envoy (agent.envoy.golden)
        self.access_records: AccessRecorder | None = None
        self.als = AccessLogServicer(on_access, log=self.log, on_inbound=self.inbound.add,
                                     on_traffic=self._access_record)
        self._builder = ResourceBuilder()
        # set before start for an Envoy older than the config's (agent.envoy.compat)
        self.wire_patch: Callable[[bytes], bytes] | None = None
        self._publish_lock = threading.RLock()
        # type -> id(proto) -> (proto, hash): resources the builder reused are not
        # re-serialised; _built: the builder's last output dicts (identity = unchanged).
        self._hash_memo: dict[str, dict[int, tuple[Message, str]]] = {}
        self._built: dict[str, dict[str, Message]] = {}
        self._cv = threading.Condition()
        self._version = 0
        self._snap = _Snapshot(0, {t: {} for t in TYPE_ORDER}, {t: {} for t in TYPE_ORDER})
        self._changed_at: dict[str, int] = {t: 0 for t in TYPE_ORDER}
        self._required: dict[int, dict[str, int]] = {0: dict(self._changed_at)}
        self._acked: dict[str, int] = {}
        self._streams: dict[int, _Stream] = {}
        self._sid = itertools.count(1)
        self._nack_count = 0
        self._last_nack: dict[str, Any] | None = None
        self._nacked: dict[str, int] = {}  # type → newest NACKed version
        # told (type_url, Envoy's error message) of every NACK, on a thread of its own
        self.on_nack: Callable[[str, str], None] | None = None
        self._server: grpc.Server | None = None
        # a namespace cluster's move built while no Envoy was connected (an agent starting,
        # its adopted Envoy reconnecting): (the state, its extra listeners, the version
        # whose listeners must be ACKed first, the set_state count then)
        self._deferred: tuple[NodeXdsState, tuple[Message, ...], int, int] | None = None
        self._set_calls = 0
        # ``hold``: nothing is sent until ``release`` (an adopted Envoy must not be handed a
        # config built before the agent knows its Services); stream -> types it is owed
        self._gated = False
        self._owed: dict[int, set[str]] = {}

    # ---- lifecycle -------------------------------------------------------------------

    def _clear_stale_socket(self) -> None:
        """A socket left by a crashed agent blocks bind; remove it unless someone answers."""
        path = self.socket_path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:
            if not stat.S_ISSOCK(os.stat(path).st_mode):
                return
        except FileNotFoundError:
            return
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)
                return
        raise RuntimeError(f"xDS socket {path} is in use by another process")

    def _access_record(self, r: Report) -> None:
        recorder = self.access_records
        if recorder is not None:
            recorder.add(r)

    def start(self) -> None:
        self._clear_stale_socket()
        # Each open stream holds a worker: ADS streams plus one ALS stream per Envoy worker.
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="xds"))
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(AdsServicer(self), server)
        add_access_log_servicer(self.als, server)
        if server.add_insecure_port("unix:" + self.socket_path) == 0:
            raise RuntimeError(f"cannot listen on unix:{self.socket_path}")
        server.start()
        self._server = server
        self.log.info("xDS server listening on unix:%s", self.socket_path)

    def stop(self, grace: float = 1.0) -> None:
        with self._cv:
            for st in self._streams.values():
                st.out.put(None)
        if self._server is not None:
            self._server.stop(grace).wait(grace + 1.0)
            self._server = None

    def set_access_callback(self, on_access: AccessCallback | None) -> None:
        """``on_access(listener_name, dst_ip, dst_port)`` per passthrough connection logged."""
        self.als.set_callback(on_access)

    # ---- state -----------------------------------------------------------------------

    def set_state(
        self, state: NodeXdsState, extra_listeners: Iterable[Message] = ()
    ) -> str:
        """Rebuild resources, bump the version and push the changes; returns the version.

        ``extra_listeners`` are added verbatim (tests use it to inject a bad listener).
        """
        # Publishers are serialised (builder caches, version order) without holding the
        # stream lock, so ACKs keep flowing while a large snapshot is built and hashed.
        extra_listeners = tuple(extra_listeners)  # may be read twice below
        with self._publish_lock:
            self._set_calls += 1
            with self._cv:
                self._deferred = None  # this build carries any move still waiting
            for _ in range(2):
                res = self._builder.build(state)
                if extra_listeners:
                    res[LISTENER_TYPE] = dict(res[LISTENER_TYPE])
                    for lis in extra_listeners:
                        res[LISTENER_TYPE][lis.name] = lis
                # The builder returns the very same (never mutated) dict for a type whose
                # inputs did not change: its hashes are reused without touching 10k entries.
                same = {t for t in TYPE_ORDER if res.get(t) is self._built.get(t)}
                self._built = {t: res.get(t, {}) for t in TYPE_ORDER}
                version = self._publish(res, self._hashes(res, same))
                # a namespace cluster moving to an internal listener new in this push moves
                # in the next one, queued behind this one's LDS on every stream; unless
                # Envoy refuses that LDS (the cluster would reach a listener it lacks)
                if not self._builder.pending_switch:
                    break
                with self._cv:
                    # no Envoy to hand the listener to first (none connected, or held): the
                    # move waits for the first ACK of this version's listeners (built
                    # again then, see ``_ack``)
                    if not self._streams or self._gated:
                        self._deferred = (state, extra_listeners, int(version),
                                          self._set_calls)
                        break
                if self._refused(version, MOVE_NACK_WAIT_S):
                    self._builder.hold_moves()
                    break
            return version

    def seed(self, reach: Mapping[str, str], listeners: Iterable[str]) -> None:
        """What an adopted Envoy holds, before the first build (``ResourceBuilder.seed``)."""
        with self._publish_lock:
            self._builder.seed(reach, listeners)

    def _refused(self, version: str, within: float) -> bool:
        """Whether a connected Envoy NACKs ``version`` within ``within`` seconds (False at
        once with no Envoy connected, or when it ACKs)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            with self._cv:
                if not self._streams:
                    return False
                nack = self._last_nack
            if nack is not None and nack.get("version") == version:
                return True
            if self.wait_acked(version, 0.05):
                return False
        return False

    def _hashes(self, resources: Resources, same: Iterable[str] = ()
                ) -> dict[str, dict[str, str]]:
        """Per-resource hashes, memoised by proto identity (protos are never mutated);
        types in ``same`` keep the current snapshot's hashes wholesale."""
        out: dict[str, dict[str, str]] = {}
        same = set(same)
        for t in TYPE_ORDER:
            if t in same:
                out[t] = self._snap.hashes[t]
                continue
            pre = self._builder.prehashed.get(t)
            if pre is not None and pre[0] is resources.get(t):
                out[t] = pre[1]  # hashed by the builder as it built them
                self._hash_memo.pop(t, None)
                continue
            old = self._hash_memo.get(t, {})
            memo: dict[int, tuple[Message, str]] = {}
            hs = out[t] = {}
            for n, m in resources.get(t, {}).items():
                if type(m) is RawResource:  # its hash is its own
                    hs[n] = m.digest()
                    continue
                hit = old.get(id(m))
                h = hit[1] if hit is not None and hit[0] is m else resource_hash(m)
                memo[id(m)] = (m, h)
                hs[n] = h
            self._hash_memo[t] = memo
        return out

    def set_raw_resources(self, resources: Resources) -> str:
        """Publish an arbitrary {type_url: {name: proto}} snapshot (CDS, EDS, LDS)."""
        with self._publish_lock:
            self._built = {}
            return self._publish(resources, self._hashes(resources))

    def _publish(self, resources: Resources, hashes: dict[str, dict[str, str]]) -> str:
        with self._cv:
            self._version += 1
            v = self._version
            old = self._snap.hashes
            changed = {t for t in TYPE_ORDER if hashes[t] is not old[t] and hashes[t] != old[t]}
            for t in changed:
                self._changed_at[t] = v
            req = dict(self._changed_at)
            for t in NAMED_TYPES:
                if not hashes[t]:  # nothing any Envoy must hold (it drops them with clusters)
                    req[t] = 0
            self._required[v] = req
            self._required.pop(v - 10000, None)
            prev = self._snap.resources
            self._snap = _Snapshot(v, {t: prev[t] if hashes[t] is old[t] else dict(resources.get(t, {}))
                                       for t in TYPE_ORDER}, hashes)
            for st in self._streams.values():
                for t in TYPE_ORDER:
                    if t in changed and t in st.subscribed and not self._push(st, t):
                        self._in_sync(st, t, v)
            self._cv.notify_all()
        self.log.info("xDS state version %d published", v)
        return str(v)

    def _in_sync(self, st: _Stream, t: str, v: int) -> None:
        """Nothing ``st`` subscribes to changed at ``v``: it is in sync at ``v`` once its
        outstanding response (if any) is ACKed. Named subscriptions missing some resource
        that exists are not in sync: Envoy will subscribe to it and get it pushed."""
        names = st.names.get(t)
        if names is not None and not set(self._snap.hashes[t]) <= names:
            return
        pending = st.last_nonce.get(t)
        if pending is not None and pending in st.nonce_version:
            st.nonce_version[pending] = v
            return
        self._ack(st, t, v)

    def _ack(self, st: _Stream, t: str, v: int) -> None:
        st.acked[t] = max(v, st.acked.get(t, -1))
        if v > self._acked.get(t, -1):
            self._acked[t] = v
        deferred = self._deferred
        if deferred is not None and t == LISTENER_TYPE and v >= deferred[2]:
            self._deferred = None
            threading.Thread(target=self._finish_move, args=(deferred,), name="xds-move",
                             daemon=True).start()

    def _finish_move(self, deferred: tuple[NodeXdsState, tuple[Message, ...], int, int]
                     ) -> None:
        """The deferred move, once Envoy holds the listeners: built again from the same
        state, unless a later ``set_state`` came first (it carried the move itself, and
        this state is older than what Envoy has)."""
        state, extra, _version, calls = deferred
        with self._publish_lock:
            if self._set_calls != calls:
                return
            try:
                self.set_state(state, extra)
            except Exception:  # noqa: BLE001 - a thread of its own; the next publish retries
                self.log.exception("building the deferred listener move failed")

    def wait_acked(self, version: str, timeout: float) -> bool:
        """True once some Envoy has ACKed every type at least at the version it had in
        ``version`` (types untouched by that update only need their earlier version)."""
        v = int(version)
        deadline = time.monotonic() + timeout
        with self._cv:
            req = self._required.get(v)
            if req is None:
                raise ValueError(f"unknown version {version}")
            while True:
                # A type whose last change (older than v) Envoy rejected does not block v:
                # Envoy keeps its previous config for it, so a pod's ADD is not held hostage
                # by an unrelated NACKed mesh push. A NACK of v itself still fails the wait.
                if all(self._acked.get(t, -1) >= rv or (rv == 0 and t in NAMED_TYPES)
                       or (rv < v and self._nacked.get(t, -1) >= rv)
                       for t, rv in req.items()):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)

    def status(self) -> dict[str, Any]:
        with self._cv:
            return {
                "socket": self.socket_path,
                "version": str(self._version),
                "connected_streams": len(self._streams),
                "streams": [
                    {
                        "id": st.sid,
                        "mode": "delta" if st.delta else "sotw",
                        "node": st.node_id,
                        "peer": st.peer,
                        "subscribed": sorted(st.subscribed),
                        # named subscriptions (EDS): how many names, not the names
                        "named": {t: len(n) for t, n in st.names.items()},
                        "acked": {t: str(v) for t, v in st.acked.items()},
                    }
                    for st in self._streams.values()
                ],
                "last_pushed_version": str(self._version),
                "acked": {t: str(v) for t, v in self._acked.items()},
                "resources": {t: len(r) for t, r in self._snap.resources.items()},
                "nack_count": self._nack_count,
                "last_nack": dict(self._last_nack) if self._last_nack else None,
            }

    # ---- stream handling (called with or without lock as noted) ----------------------

    def _register(self, delta: bool, peer: str) -> _Stream:
        with self._cv:
            st = _Stream(sid=next(self._sid), delta=delta, peer=peer)
            self._streams[st.sid] = st
            self.log.info("xDS stream %d opened (%s) from %s", st.sid,
                          "delta" if delta else "sotw", peer)
            return st

    def _unregister(self, st: _Stream) -> None:
        with self._cv:
            if self._streams.pop(st.sid, None) is not None:
                self.log.info("xDS stream %d closed", st.sid)
            st.out.put(None)
            self._cv.notify_all()

    def hold(self) -> None:
        """Send nothing to any Envoy until ``release``: an adopted Envoy keeps serving what
        it has meanwhile. A restarted agent's first states hold its recorded pods but not
        yet its Services; pushed, they would take the Service chains out of the internal
        listeners, and Envoy closes the connections of a removed chain."""
        with self._cv:
            self._gated = True

    def release(self) -> None:
        """Send every stream what it was owed while held, in xDS order."""
        with self._cv:
            if not self._gated:
                return
            self._gated = False
            owed, self._owed = self._owed, {}
            for sid, types in owed.items():
                st = self._streams.get(sid)
                if st is None:
                    continue
                for t in TYPE_ORDER:
                    if t in types and not self._push(st, t, force=not st.delta):
                        self._in_sync(st, t, self._snap.version)
            self._cv.notify_all()
        self.log.info("xDS released: Envoy is sent the agent's state")

    @property
    def held(self) -> bool:
        return self._gated

    def _push(self, st: _Stream, type_url: str, force: bool = False) -> bool:
        """Queue the current snapshot of ``type_url`` (the subscribed part) for ``st``;
        False if the stream already holds it. Caller holds the lock. While held, it is
        only noted as owed (True: not in sync yet)."""
        if self._gated:
            self._owed.setdefault(st.sid, set()).add(type_url)
            return True
        return queue_response(st, self._snap, type_url, force, self.wire_patch, self.log)

    def _subscribe(self, st: _Stream, type_url: str, req: Any) -> bool:
        """Apply the request's resource names; True if the subscription changed
        (``agent.envoy.xds_wire.subscribe``)."""
        return subscribe(st, type_url, req)

    def _on_request(
        self,
        st: _Stream,
        type_url: str,
        nonce: str,
        node_id: str,
        error: Any,
        initial_versions: dict[str, str] | None,
        req: Any = None,
    ) -> None:
        with self._cv:
            if node_id and not st.node_id:
                st.node_id = node_id
            if type_url not in TYPE_ORDER:
                self.log.debug("stream %d: ignoring unsupported type %s", st.sid, type_url)
                return
            if req is None:
                req = (discovery_pb2.DeltaDiscoveryRequest() if st.delta
                       else discovery_pb2.DiscoveryRequest())
            if not nonce and (type_url not in st.subscribed or not st.delta
                              or initial_versions):
                # (Re)subscription. Delta clients tell us what they already hold.
                if st.delta:
                    st.have[type_url] = dict(initial_versions or {})
                else:
                    st.have.pop(type_url, None)
                st.subscribed.discard(type_url)
                self._subscribe(st, type_url, req)
                st.subscribed.add(type_url)
                st.last_nonce.pop(type_url, None)
                self._push(st, type_url, force=True)
                return
            resubscribed = self._subscribe(st, type_url, req)
            if not nonce:
                # Delta subscription change on an open type: send what was added.
                if resubscribed and not self._push(st, type_url):
                    self._in_sync(st, type_url, self._snap.version)
                    self._cv.notify_all()
                return
            if nonce != st.last_nonce.get(type_url):
                self.log.debug("stream %d: stale nonce for %s ignored", st.sid, type_url)
                if resubscribed:
                    self._push(st, type_url, force=not st.delta)
                return
            version = st.nonce_version.pop(nonce, 0)
            if error is not None and error.code != 0:
                self._nack_count += 1
                if version > self._nacked.get(type_url, -1):
                    self._nacked[type_url] = version
                self._last_nack = {
                    "type_url": type_url,
                    "version": str(version),
                    "error_detail": error.message,
                    "stream": st.sid,
                    "time": time.time(),
                }
                self.log.warning("Envoy NACKed %s version %d: %s", type_url, version,
                                 error.message)
                if self.on_nack is not None:  # off this stream's thread and its locks
                    threading.Thread(target=self.on_nack, args=(type_url, error.message),
                                     name="xds-nack", daemon=True).start()
            else:
                self._ack(st, type_url, version)
                self.log.debug("stream %d ACKed %s v%d", st.sid, type_url, version)
            if resubscribed and not self._push(st, type_url, force=not st.delta):
                self._in_sync(st, type_url, self._snap.version)
            self._cv.notify_all()
