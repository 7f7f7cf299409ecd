"""Minimal ADS server (SotW and delta) for the node-shared Envoy, over a unix socket.

Only LDS and CDS are served, both as wildcard subscriptions. Versions are a global
monotonically increasing integer; each type remembers the version at which it last
changed so ``wait_acked`` knows what Envoy must have ACKed. ACK/NACK is matched by
nonce, never by ``version_info`` alone, and stale nonces are ignored, as the xDS
protocol requires. A NACK is logged and kept for status; the rejected config is not
pushed again (Envoy keeps serving its last good config).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import socket
import stat
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf.message import Message

from agent.envoy.resources import (
    CLUSTER_TYPE,
    LISTENER_TYPE,
    NodeXdsState,
    build_resources,
    resource_hash,
)

# Clusters must reach Envoy before the listeners that reference them.
TYPE_ORDER = (CLUSTER_TYPE, LISTENER_TYPE)

Resources = dict[str, dict[str, Message]]


@dataclass
class _Snapshot:
    version: int
    resources: Resources
    hashes: dict[str, dict[str, str]]


@dataclass
class _Stream:
    """Per-connection state; guarded by the server lock."""

    sid: int
    delta: bool
    peer: str
    out: queue.Queue[Any] = field(default_factory=queue.Queue)
    node_id: str = ""
    subscribed: set[str] = field(default_factory=set)
    # nonce -> (type_url, version) for responses still awaiting ACK/NACK.
    last_nonce: dict[str, str] = field(default_factory=dict)
    nonce_version: dict[str, int] = field(default_factory=dict)
    # delta only: what the client holds, name -> version hash, per type.
    have: dict[str, dict[str, str]] = field(default_factory=dict)
    acked: dict[str, int] = field(default_factory=dict)
    connected_at: float = field(default_factory=time.time)


class XdsServer:
    """ADS over ``unix:<socket_path>``; ``set_state`` pushes to every connected Envoy."""

    def __init__(self, socket_path: str, log: logging.Logger | None = None) -> None:
        self.socket_path = socket_path
        self.log = log or logging.getLogger("agent.envoy.xds")
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
        self._server: grpc.Server | None = None

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

    def start(self) -> None:
        self._clear_stale_socket()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="xds"))
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(_Servicer(self), server)
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

    # ---- state -----------------------------------------------------------------------

    def set_state(
        self, state: NodeXdsState, extra_listeners: Iterable[Message] = ()
    ) -> str:
        """Rebuild resources, bump the version and push the changes; returns the version.

        ``extra_listeners`` are added verbatim (tests use it to inject a bad listener).
        """
        res = build_resources(state)
        for lis in extra_listeners:
            res[LISTENER_TYPE][lis.name] = lis
        return self.set_raw_resources(res)

    def set_raw_resources(self, resources: Resources) -> str:
        """Publish an arbitrary {type_url: {name: proto}} snapshot (LDS/CDS only)."""
        hashes = {
            t: {n: resource_hash(m) for n, m in resources.get(t, {}).items()} for t in TYPE_ORDER
        }
        with self._cv:
            self._version += 1
            v = self._version
            for t in TYPE_ORDER:
                if hashes[t] != self._snap.hashes[t]:
                    self._changed_at[t] = v
            self._required[v] = dict(self._changed_at)
            self._required.pop(v - 10000, None)
            self._snap = _Snapshot(v, {t: dict(resources.get(t, {})) for t in TYPE_ORDER}, hashes)
            for st in self._streams.values():
                for t in TYPE_ORDER:
                    if t in st.subscribed and self._changed_at[t] == v:
                        self._push(st, t)
            self._cv.notify_all()
        self.log.info("xDS state version %d published", v)
        return str(v)

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
                if all(self._acked.get(t, -1) >= rv for t, rv in req.items()):
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

    def _push(self, st: _Stream, type_url: str) -> None:
        """Queue the current snapshot of ``type_url`` for ``st``. Caller holds the lock."""
        snap = self._snap
        nonce = uuid.uuid4().hex
        resp: Message
        if st.delta:
            have = st.have.setdefault(type_url, {})
            cur = snap.hashes[type_url]
            changed = [n for n in sorted(cur) if have.get(n) != cur[n]]
            removed = sorted(n for n in have if n not in cur)
            first = type_url not in st.last_nonce
            if not changed and not removed and not first:
                return
            d = discovery_pb2.DeltaDiscoveryResponse(
                type_url=type_url,
                system_version_info=str(snap.version),
                nonce=nonce,
                removed_resources=removed,
            )
            for n in changed:
                r = d.resources.add(name=n, version=cur[n])
                r.resource.Pack(snap.resources[type_url][n])
            st.have[type_url] = dict(cur)
            resp = d
            self.log.debug("stream %d delta %s v%d: +%d -%d", st.sid, type_url,
                           snap.version, len(changed), len(removed))
        else:
            s = discovery_pb2.DiscoveryResponse(
                type_url=type_url, version_info=str(snap.version), nonce=nonce
            )
            for n in sorted(snap.resources[type_url]):
                s.resources.add().Pack(snap.resources[type_url][n])
            resp = s
        st.last_nonce[type_url] = nonce
        st.nonce_version[nonce] = snap.version
        st.out.put(resp)

    def _on_request(
        self,
        st: _Stream,
        type_url: str,
        nonce: str,
        node_id: str,
        error: Any,
        initial_versions: dict[str, str] | None,
    ) -> None:
        with self._cv:
            if node_id and not st.node_id:
                st.node_id = node_id
            if type_url not in TYPE_ORDER:
                self.log.debug("stream %d: ignoring unsupported type %s", st.sid, type_url)
                return
            if not nonce:
                # (Re)subscription. Delta clients tell us what they already hold.
                if st.delta:
                    st.have[type_url] = dict(initial_versions or {})
                st.subscribed.add(type_url)
                st.last_nonce.pop(type_url, None)
                self._push(st, type_url)
                return
            if nonce != st.last_nonce.get(type_url):
                self.log.debug("stream %d: stale nonce for %s ignored", st.sid, type_url)
                return
            version = st.nonce_version.pop(nonce, 0)
            if error is not None and error.code != 0:
                self._nack_count += 1
                self._last_nack = {
                    "type_url": type_url,
                    "version": str(version),
                    "error_detail": error.message,
                    "stream": st.sid,
                    "time": time.time(),
                }
                self.log.warning("Envoy NACKed %s version %d: %s", type_url, version,
                                 error.message)
            else:
                st.acked[type_url] = version
                if version > self._acked.get(type_url, -1):
                    self._acked[type_url] = version
                self.log.debug("stream %d ACKed %s v%d", st.sid, type_url, version)
            self._cv.notify_all()

    def _serve(self, st: _Stream, requests: Iterator[Any], context: grpc.ServicerContext
               ) -> Iterator[Any]:
        def reader() -> None:
            try:
                for req in requests:
                    err = req.error_detail if req.HasField("error_detail") else None
                    init = dict(req.initial_resource_versions) if st.delta else None
                    self._on_request(st, req.type_url, req.response_nonce, req.node.id,
                                     err, init)
            except Exception as e:  # client went away / server stopping
                self.log.debug("stream %d reader ended: %s", st.sid, e)
            finally:
                st.out.put(None)

        context.add_callback(lambda: st.out.put(None))
        t = threading.Thread(target=reader, name=f"xds-reader-{st.sid}", daemon=True)
        t.start()
        try:
            while True:
                item = st.out.get()
                if item is None or not context.is_active():
                    return
                yield item
        finally:
            self._unregister(st)


class _Servicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self, server: XdsServer) -> None:
        self._s = server

    def StreamAggregatedResources(  # noqa: N802 - grpc naming
        self, request_iterator: Iterator[Any], context: grpc.ServicerContext
    ) -> Iterator[Any]:
        st = self._s._register(False, context.peer())
        return self._s._serve(st, request_iterator, context)

    def DeltaAggregatedResources(  # noqa: N802 - grpc naming
        self, request_iterator: Iterator[Any], context: grpc.ServicerContext
    ) -> Iterator[Any]:
        st = self._s._register(True, context.peer())
        return self._s._serve(st, request_iterator, context)
