"""SVIDs as plain data, and when to renew them (pure; no crypto, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass

from agent.common.ids import IdentityKey

# Renew at half life, as SPIRE agents do: a failing provider then has half the lifetime to
# recover before any pod fails closed.
RENEW_FRACTION = 0.5


def spiffe_id(trust_domain: str, namespace: str, service_account: str) -> str:
    """``spiffe://<td>/ns/<ns>/sa/<sa>``: the identity of every pod of that ServiceAccount."""
    return f"spiffe://{trust_domain}/ns/{namespace}/sa/{service_account}"


def parse_spiffe_id(uri: str) -> tuple[str, str, str] | None:
    """(trust domain, namespace, service account) of a workload SPIFFE ID, else None."""
    if not uri.startswith("spiffe://"):
        return None
    td, _, path = uri[len("spiffe://"):].partition("/")
    parts = path.split("/")
    if not td or len(parts) != 4 or parts[0] != "ns" or parts[2] != "sa" \
            or not parts[1] or not parts[3]:
        return None
    return td, parts[1], parts[3]


def identity_key(namespace: str, service_account: str) -> IdentityKey:
    """``<ns>/<sa>``: how the agent names an identity (the registry key of proposal 023)."""
    return IdentityKey(f"{namespace}/{service_account or 'default'}")


@dataclass(frozen=True)
class Svid:
    """One X.509 SVID: leaf (+ intermediates) and key in PEM, and its validity window."""

    spiffe_id: str
    cert_chain_pem: str
    key_pem: str
    not_before: float
    not_after: float
    # when it was obtained: certificates are back-dated for clock skew, so the lifetime the
    # renewal splits in half runs from here, not from not_before
    issued_at: float = 0.0

    def renew_at(self) -> float:
        start = self.issued_at or self.not_before
        return start + (self.not_after - start) * RENEW_FRACTION

    def expired(self, now: float) -> bool:
        return now >= self.not_after

    def seconds_left(self, now: float) -> float:
        return self.not_after - now


class IdentityError(Exception):
    """The provider could not issue an SVID (the affected pods fail closed)."""
