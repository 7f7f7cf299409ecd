"""The xDS protocol side of one ADS stream, SotW and delta: what a stream subscribes to and
the response that brings it up to a snapshot.

Split from ``agent.envoy.xds`` so the server there keeps the versions, the locks and the
gRPC plumbing, while this module holds the per-stream wire rules (subscription increments,
wildcard, delta diffs against what the client holds): plain functions over a ``_Stream``
and a ``_Snapshot``, importing no I/O library. The caller holds the server lock.
"""

from __future__ import annotations

import logging
import queue
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf.message import Message

from agent.envoy.mtls import SECRET_TYPE
from agent.envoy.resources import CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, RawResource

# xDS ordering: secrets (SDS), clusters, then their endpoints, then the listeners that
# reference them.
TYPE_ORDER = (SECRET_TYPE, CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE)
# Types Envoy subscribes to by resource name (never wildcard).
NAMED_TYPES = frozenset({ENDPOINT_TYPE, SECRET_TYPE})

Resources = dict[str, dict[str, Message]]


def _pack(dst: Any, type_url: str, msg: Message | RawResource,
          patch: Callable[[bytes], bytes] | None = None) -> None:
    """Pack into an ``Any``; pre-serialized resources are copied in as they are. ``patch``:
    the rewrite an older Envoy needs (agent.envoy.compat.wire_patch)."""
    if isinstance(msg, RawResource):
        dst.type_url = type_url
        dst.value = msg.data if patch is None else patch(msg.data)
    else:
        dst.Pack(msg)
        if patch is not None:
            dst.value = patch(dst.value)


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
    # type -> subscribed resource names; absent means wildcard.
    names: dict[str, set[str]] = field(default_factory=dict)
    # nonce -> (type_url, version) for responses still awaiting ACK/NACK.
    last_nonce: dict[str, str] = field(default_factory=dict)
    nonce_version: dict[str, int] = field(default_factory=dict)
    # what the client holds (delta) or was last sent (SotW): name -> version hash, per type.
    have: dict[str, dict[str, str]] = field(default_factory=dict)
    acked: dict[str, int] = field(default_factory=dict)
    connected_at: float = field(default_factory=time.time)


def queue_response(st: _Stream, snap: _Snapshot, type_url: str, force: bool,
                   patch: Callable[[bytes], bytes] | None, log: logging.Logger) -> bool:
    """Queue ``snap``'s ``type_url`` (the subscribed part) for ``st``: a delta of what it
    holds, or the full set (SotW); False if the stream already holds it. ``patch``: the
    server's ``wire_patch``."""
    nonce = uuid.uuid4().hex
    resp: Message
    names = st.names.get(type_url)
    cur = snap.hashes[type_url]
    if names is not None:
        cur = {n: h for n, h in cur.items() if n in names}
    have = st.have.setdefault(type_url, {})
    force = force or type_url not in st.last_nonce
    if st.delta:
        # set operations on the dict views run in C: a push after one ADD costs what
        # changed, not a Python pass over every pod's listeners
        changed = sorted(n for n, _h in cur.items() - have.items())
        removed = sorted(have.keys() - cur.keys())
        if not changed and not removed and not force:
            return False
        d = discovery_pb2.DeltaDiscoveryResponse(
            type_url=type_url,
            system_version_info=str(snap.version),
            nonce=nonce,
            removed_resources=removed,
        )
        for n in changed:
            r = d.resources.add(name=n, version=cur[n])
            _pack(r.resource, type_url, snap.resources[type_url][n], patch)
        st.have[type_url] = dict(cur)
        resp = d
        log.debug("stream %d delta %s v%d: +%d -%d", st.sid, type_url,
                  snap.version, len(changed), len(removed))
    else:
        if cur == have and not force:
            return False
        s = discovery_pb2.DiscoveryResponse(
            type_url=type_url, version_info=str(snap.version), nonce=nonce
        )
        for n in sorted(cur):
            _pack(s.resources.add(), type_url, snap.resources[type_url][n], patch)
        st.have[type_url] = dict(cur)
        resp = s
    st.last_nonce[type_url] = nonce
    st.nonce_version[nonce] = snap.version
    st.out.put(resp)
    return True


def subscribe(st: _Stream, type_url: str, req: Any) -> bool:
    """Apply the request's resource names; True if the subscription changed.

    Delta: ``resource_names_subscribe``/``unsubscribe`` are increments, ``*`` is the
    wildcard; an initial request without names is wildcard for LDS/CDS. SotW: the
    names replace the set; empty is wildcard except for named types (EDS).
    """
    old = st.names.get(type_url)
    new: set[str] | None
    if st.delta:
        sub, unsub = set(req.resource_names_subscribe), set(req.resource_names_unsubscribe)
        initial = type_url not in st.subscribed
        if initial and not sub and type_url not in NAMED_TYPES:
            new = None
        elif old is None and not initial:
            new = None if "*" not in unsub else (sub - {"*"})
        else:
            new = ((old or set()) | sub) - unsub
        if new is not None and "*" in new:
            new = None
        have = st.have.get(type_url)
        if have is not None and new is not None:
            for n in unsub:
                have.pop(n, None)
    else:
        names = set(req.resource_names)
        new = None if ((not names and type_url not in NAMED_TYPES) or "*" in names) else names
    if new is None:
        st.names.pop(type_url, None)
    else:
        st.names[type_url] = new
    return new != old
