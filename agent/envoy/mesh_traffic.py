"""Mesh connections a node's pods accepted, by the pod's identity and the caller's SPIFFE ID.

Envoy reports every connection its ``inbound-<cid>`` listeners close over the access log
stream (``aether-inbound``): the pod's own URI SAN, the caller's (none when the handshake
failed) and the bytes each way. This module folds those reports into counters for
``/metrics``. Pure and thread-safe; the cardinality is capped: past ``max_series`` distinct
(identity, caller) pairs, new callers are counted under ``caller="other"`` and the fold is
itself counted, so a flood of distinct callers costs memory once, not per caller.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from agent.identity.svid import parse_spiffe_id

MAX_SERIES = 1000
OTHER = "other"
# no client certificate (the handshake failed or never happened)
UNAUTHENTICATED = "unauthenticated"


@dataclass(frozen=True)
class InboundConnection:
    """One connection an inbound listener closed, as the access log reports it."""

    local_uri: str  # the pod's own SPIFFE ID ("" if the handshake failed before it)
    peer_uri: str  # the caller's ("" if it presented none)
    received: int = 0
    sent: int = 0
    listener: str = ""  # inbound-<container id>


@dataclass(frozen=True)
class InboundRow:
    identity: str  # <ns>/<sa> of the pods that accepted
    caller: str  # the caller's SPIFFE ID, UNAUTHENTICATED or OTHER
    connections: int
    received_bytes: int
    sent_bytes: int


def identity_of(uri: str) -> str:
    """``spiffe://td/ns/<ns>/sa/<sa>`` → ``<ns>/<sa>``; anything else → "unknown"."""
    parsed = parse_spiffe_id(uri)
    return f"{parsed[1]}/{parsed[2]}" if parsed is not None else "unknown"


class InboundTally:
    """Counters per (identity, caller), at most ``max_series`` of them plus the fold.
    ``resolve`` names the identity of a listener's pod, for connections that ended before
    the pod's certificate was presented (no chain matched, no TLS)."""

    def __init__(self, max_series: int = MAX_SERIES,
                 resolve: Callable[[str], str | None] | None = None) -> None:
        self.max_series = max_series
        self.resolve = resolve
        self._lock = threading.Lock()
        self._rows: dict[tuple[str, str], list[int]] = {}
        self.folded = 0  # connections counted under OTHER because of the cap

    def add(self, c: InboundConnection) -> None:
        identity = identity_of(c.local_uri) if c.local_uri else None
        if identity is None and self.resolve is not None and c.listener:
            identity = self.resolve(c.listener)
        key = (identity or "unknown", c.peer_uri or UNAUTHENTICATED)
        with self._lock:
            row = self._rows.get(key)
            if row is None:
                if len(self._rows) >= self.max_series:
                    self.folded += 1
                    key = (key[0], OTHER)
                    row = self._rows.get(key)
                if row is None:
                    row = self._rows[key] = [0, 0, 0]
            row[0] += 1
            row[1] += max(0, c.received)
            row[2] += max(0, c.sent)

    def rows(self) -> list[InboundRow]:
        with self._lock:
            return [InboundRow(i, c, *v) for (i, c), v in sorted(self._rows.items())]

    def status(self) -> dict[str, object]:
        """For ``aether-agent status --json`` and the metrics collector."""
        return {"inbound": [r.__dict__ for r in self.rows()], "max_series": self.max_series,
                "folded": self.folded}
