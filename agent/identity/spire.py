"""The production identity provider: the agent as an authorized delegate of the node's SPIRE
agent, over SPIRE's Delegated Identity API (the API Cilium's agent uses).

SPIRE keeps the signing keys and the registrations; no node secret is held here. The agent
asks for a ServiceAccount's SVID with the selectors SPIRE's k8s workload attestor gives that
ServiceAccount's pods (``k8s:ns:<ns>``, ``k8s:sa:<sa>``), so no pod PID is needed. The SPIRE
agent must list this agent's SPIFFE ID in ``authorized_delegates`` and have a registration
entry for each ServiceAccount. Each call opens a short-lived subscription and keeps only its
first answer: the manager already renews at half life, and a fresh channel per call never
inherits the reconnect backoff of a SPIRE agent that restarted."""

from __future__ import annotations

from typing import Any

import grpc
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from agent.identity import spire_proto as pb
from agent.identity.svid import IdentityError, Svid, parse_spiffe_id

_PEM = serialization.Encoding.PEM


class SpireDelegateProvider:
    """Gets X.509 SVIDs and the trust bundle from the SPIRE agent's admin socket."""

    name = "spire"

    def __init__(self, socket_path: str, timeout_s: float = 5.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._bundle = ""

    def issue(self, spiffe_id: str, now: float) -> Svid:
        parsed = parse_spiffe_id(spiffe_id)
        if parsed is None:
            raise IdentityError(f"not a workload SPIFFE ID: {spiffe_id!r}")
        trust_domain, ns, sa = parsed
        request = pb.SubscribeToX509SVIDsRequest(selectors=[
            pb.Selector(type="k8s", value=f"ns:{ns}"), pb.Selector(type="k8s", value=f"sa:{sa}")])
        response = self._first(pb.SUBSCRIBE_X509_SVIDS, request, pb.SubscribeToX509SVIDsResponse,
                               f"the SVID of {spiffe_id}")
        # SPIRE answers with every entry whose selectors are a subset of ours: pick ours
        match = [s for s in response.x509_svids if _id_string(s.x509_svid.id) == spiffe_id]
        if not match:
            raise IdentityError(f"SPIRE agent at {self.socket_path} has no SVID for {spiffe_id} "
                                f"(is the workload registered?)")
        svid = self._svid(spiffe_id, match[0], now)
        # refreshed with every SVID, so a rotated CA reaches Envoy by the next renewal at the latest
        self._bundle = self._fetch_bundle(trust_domain)
        return svid

    def bundle_pem(self) -> str:
        """The trust bundle fetched with the last SVID ('' before any: nothing to verify yet)."""
        return self._bundle

    # -- wire ------------------------------------------------------------------------------
    def _first(self, method: str, request: Any, response_type: Any, what: str) -> Any:
        """The first message of a server stream, then cancel it; every failure an IdentityError."""
        where = f"SPIRE agent at {self.socket_path}"
        with grpc.insecure_channel(f"unix:{self.socket_path}") as channel:
            call = channel.unary_stream(method, request_serializer=pb.serialize,
                                        response_deserializer=response_type.FromString)(
                request, timeout=self.timeout_s)
            try:
                return next(call)
            except StopIteration:
                raise IdentityError(f"{where} closed the stream without sending {what}") from None
            except grpc.RpcError as e:
                code = e.code() if isinstance(e, grpc.Call) else None
                details = e.details() if isinstance(e, grpc.Call) else str(e)
                if code == grpc.StatusCode.UNAVAILABLE:
                    msg = f"{where} is unavailable ({details}): is it running, is the socket mounted?"
                elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    msg = f"{where} did not send {what} within {self.timeout_s:g}s"
                elif code == grpc.StatusCode.PERMISSION_DENIED:
                    msg = (f"{where} refused {what} ({details}): is this agent's SPIFFE ID "
                           f"in its authorized_delegates?")
                else:
                    name = code.name if code is not None else "error"
                    msg = f"{where} failed to send {what}: {name}: {details}"
                raise IdentityError(msg) from e
            finally:
                call.cancel()

    def _svid(self, spiffe_id: str, item: Any, now: float) -> Svid:
        try:
            certs = [x509.load_der_x509_certificate(der) for der in item.x509_svid.cert_chain]
            key = serialization.load_der_private_key(item.x509_svid_key, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as e:
            raise IdentityError(f"SPIRE agent at {self.socket_path} sent an unreadable SVID for "
                                f"{spiffe_id}: {e}") from e
        if not certs:
            raise IdentityError(f"SPIRE agent at {self.socket_path} sent an SVID without a "
                                f"certificate for {spiffe_id}")
        key_pem = key.private_bytes(_PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()).decode()
        return Svid(spiffe_id, "".join(c.public_bytes(_PEM).decode() for c in certs), key_pem,
                    certs[0].not_valid_before_utc.timestamp(),
                    float(item.x509_svid.expires_at), issued_at=now)

    def _fetch_bundle(self, trust_domain: str) -> str:
        response = self._first(pb.SUBSCRIBE_X509_BUNDLES, pb.SubscribeToX509BundlesRequest(),
                               pb.SubscribeToX509BundlesResponse, "the X.509 bundles")
        bundles = response.ca_certificates
        # SPIRE keys the map by the trust domain's ID, "spiffe://<td>"; accept the bare name too
        der = next((bundles[k] for k in (f"spiffe://{trust_domain}", trust_domain)
                    if k in bundles), None)
        if not der:
            raise IdentityError(f"SPIRE agent at {self.socket_path} has no X.509 bundle for "
                                f"trust domain {trust_domain} (it has: "
                                f"{', '.join(sorted(bundles)) or 'none'})")
        try:
            return "".join(c.public_bytes(_PEM).decode() for c in split_der_certificates(der))
        except ValueError as e:
            raise IdentityError(f"SPIRE agent at {self.socket_path} sent an unreadable bundle "
                                f"for {trust_domain}: {e}") from e


def _id_string(spiffe_id: Any) -> str:
    """``spiffe://<td><path>`` of a ``spire.api.types.SPIFFEID`` (path leading slash optional)."""
    path = spiffe_id.path
    if path and not path.startswith("/"):
        path = "/" + path
    return f"spiffe://{spiffe_id.trust_domain}{path}"


def split_der_certificates(blob: bytes) -> list[x509.Certificate]:
    """The certificates of concatenated DER (how SPIRE sends a bundle): each is one ASN.1
    SEQUENCE whose header gives its length."""
    certs = []
    while blob:
        if len(blob) < 2 or blob[0] != 0x30:
            raise ValueError("not a DER certificate")
        size, start = blob[1], 2
        if size & 0x80:  # long form: the low bits count the length bytes that follow
            start += size & 0x7F
            if size == 0x80 or start > len(blob):
                raise ValueError("bad DER length")
            size = int.from_bytes(blob[2:start], "big")
        end = start + size
        if end > len(blob):
            raise ValueError("truncated DER certificate")
        certs.append(x509.load_der_x509_certificate(blob[:end]))
        blob = blob[end:]
    return certs
