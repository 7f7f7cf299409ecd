"""Holds the SVIDs of the identities this node hosts, and only those.

An identity (``<ns>/<sa>``) is held while at least one captured pod on this node runs as it;
its SVID is issued when its first pod arrives, renewed at half life, and dropped with its
last pod. Each change yields a new ``MeshTls`` object for the xDS publisher (SDS). A failed
issue or renewal is kept as that identity's error: the pods keep their SVID until it expires,
then fail closed (no SVID: their mesh connections are refused, never sent in plaintext)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from agent.envoy.mtls import INBOUND_PORT, MeshTls
from agent.identity.svid import IdentityError, Svid, spiffe_id

log = logging.getLogger("aether.identity")

# A failed issue is retried after this long (not in a tight loop against a provider that
# refuses, e.g. a workload SPIRE has no registration entry for yet).
RETRY_S = 2.0


class IdentityProvider(Protocol):
    name: str

    def issue(self, spiffe_id: str, now: float) -> Svid: ...

    def bundle_pem(self) -> str: ...


class IdentityManager:
    def __init__(self, provider: IdentityProvider, trust_domain: str,
                 clock: Callable[[], float] = time.time, inbound_port: int = INBOUND_PORT) -> None:
        self.provider = provider
        self.trust_domain = trust_domain
        self.inbound_port = inbound_port
        self._clock = clock
        self._lock = threading.Lock()
        self._svids: dict[str, Svid] = {}
        self._users: dict[str, set[str]] = {}  # identity -> pod keys on this node
        self._errors: dict[str, str] = {}
        self._failed_at: dict[str, float] = {}
        self._bundle = ""
        self._tls: MeshTls | None = None
        self.rotations = 0

    # -- who needs what ------------------------------------------------------------------
    def attach(self, identity: str, pod_key: str) -> bool:
        """A captured pod runs as ``identity``: make sure its SVID is held. True when the
        held set changed (publish). A provider failure is recorded, not raised."""
        with self._lock:
            self._users.setdefault(identity, set()).add(pod_key)
            if identity in self._svids:
                return False
            return self._issue(identity)

    def detach(self, identity: str, pod_key: str) -> bool:
        """The pod is gone: drop the SVID with the identity's last pod."""
        with self._lock:
            users = self._users.get(identity)
            if users is None:
                return False
            users.discard(pod_key)
            if users:
                return False
            del self._users[identity]
            self._errors.pop(identity, None)
            self._failed_at.pop(identity, None)
            if self._svids.pop(identity, None) is None:
                return False
            self._tls = None
            return True

    def _issue(self, identity: str) -> bool:
        ns, _, sa = identity.partition("/")
        now = self._clock()
        try:
            svid = self.provider.issue(spiffe_id(self.trust_domain, ns, sa), now)
            bundle = self.provider.bundle_pem()
        except IdentityError as e:
            if self._errors.get(identity) != str(e):
                log.error("cannot get an SVID for %s from %s: %s", identity, self.provider.name, e)
            self._errors[identity] = str(e)
            self._failed_at[identity] = now
            return self._expire(identity, now)
        self._errors.pop(identity, None)
        self._failed_at.pop(identity, None)
        old = self._svids.get(identity)
        self._svids[identity] = svid
        self._bundle = bundle
        self._tls = None
        if old is not None:
            self.rotations += 1
            log.info("rotated the SVID of %s (valid until %s)", identity,
                     time.strftime("%H:%M:%S", time.gmtime(svid.not_after)))
        return True

    def _expire(self, identity: str, now: float) -> bool:
        old = self._svids.get(identity)
        if old is not None and old.expired(now):
            del self._svids[identity]
            self._tls = None
            log.error("the SVID of %s expired; its pods' mesh connections now fail closed",
                      identity)
            return True
        return False

    # -- renewal -------------------------------------------------------------------------
    def renew_due(self) -> bool:
        """Renew SVIDs past half life and retry failed identities; drop expired ones. True
        when anything Envoy holds changed."""
        changed = False
        with self._lock:
            now = self._clock()
            for identity in sorted(self._users):
                svid = self._svids.get(identity)
                if now - self._failed_at.get(identity, -RETRY_S) < RETRY_S:
                    if svid is not None:
                        changed |= self._expire(identity, now)
                    continue
                if svid is None or now >= svid.renew_at():
                    changed |= self._issue(identity)
                else:
                    changed |= self._expire(identity, now)
        return changed

    def next_due(self) -> float:
        """Seconds until the next renewal (0: now, e.g. a failed identity to retry)."""
        with self._lock:
            now = self._clock()
            due = [s.renew_at() - now for i, s in self._svids.items() if i in self._users]
            due += [self._failed_at.get(i, -RETRY_S) + RETRY_S - now
                    for i in self._users if i not in self._svids or i in self._failed_at]
            return max(0.0, min(due)) if due else 3600.0

    # -- what Envoy gets -----------------------------------------------------------------
    def mesh_tls(self) -> MeshTls:
        """The same object while nothing changed (the builder compares by identity)."""
        with self._lock:
            if self._tls is None:
                self._tls = MeshTls(self.trust_domain, dict(self._svids),
                                    self._bundle or self.provider.bundle_pem(), self.inbound_port)
            return self._tls

    def held(self, identity: str) -> bool:
        with self._lock:
            return identity in self._svids

    def status(self) -> dict[str, Any]:
        with self._lock:
            now = self._clock()
            rows = []
            for identity in sorted(set(self._users) | set(self._svids)):
                svid = self._svids.get(identity)
                rows.append({
                    "identity": identity,
                    "spiffe_id": svid.spiffe_id if svid else None,
                    "not_after": svid.not_after if svid else None,
                    "seconds_left": round(svid.seconds_left(now), 1) if svid else None,
                    "renew_in": round(max(0.0, svid.renew_at() - now), 1) if svid else None,
                    "pods": sorted(self._users.get(identity, ())),
                    "error": self._errors.get(identity),
                })
            return {"provider": self.provider.name, "trust_domain": self.trust_domain,
                    "svids": rows, "rotations": self.rotations,
                    "problems": [f"{r['identity']}: {r['error'] or 'no SVID'}" for r in rows
                                 if r["spiffe_id"] is None or r["error"]]}
