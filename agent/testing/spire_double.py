"""A SPIRE agent's Delegated Identity API on a unix socket, for tests and the demo.

It speaks the real gRPC protocol (the messages of ``agent.identity.spire_proto``), so tests
drive the production client end to end. What it keeps of SPIRE's behaviour: an entry matches
when all its selectors are among the request's (so several SVIDs may come back), selectors
and PID are mutually exclusive, an unmatched request gets an answer with no SVIDs (not an
error), bundles are keyed by ``spiffe://<td>`` and hold concatenated DER certificates, and
streams stay open until the client cancels. What it leaves out: caller attestation
(``authorized_delegates``), SVID caching and rotation (each subscription gets a fresh SVID),
federation and the JWT methods."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from agent.identity import spire_proto as pb
from agent.identity.ca_dir import DEFAULT_TTL_S, CaDirProvider
from agent.identity.svid import spiffe_id

_DER = serialization.Encoding.DER


@dataclass(frozen=True)
class Entry:
    """A registration entry: the SPIFFE ID issued to workloads with all these selectors."""

    spiffe_id: str
    selectors: frozenset[tuple[str, str]]


class SpireDouble:
    def __init__(self, socket_path: str, ca_dir: str, trust_domain: str,
                 ttl_s: float = DEFAULT_TTL_S) -> None:
        self.socket_path = socket_path
        self.trust_domain = trust_domain
        self._ca = CaDirProvider(ca_dir, ttl_s=ttl_s)
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._server: grpc.Server | None = None
        self._stopping = threading.Event()
        # fault injection
        self.unavailable = False  # abort every call with UNAVAILABLE
        self.stall = False  # never send the first answer (SPIRE waiting for an SVID)
        # what was asked: calls per method name, the selectors of each SVID request
        self.calls: Counter[str] = Counter()
        self.requests: list[list[tuple[str, str]]] = []
        self.open_streams = 0  # streams held open now (a client that never cancels leaks them)

    # -- registrations ---------------------------------------------------------------------
    def add_entry(self, spiffe_id: str, selectors: Iterable[tuple[str, str]]) -> Entry:
        entry = Entry(spiffe_id, frozenset(selectors))
        with self._lock:
            self._entries[spiffe_id] = entry
        return entry

    def register(self, namespace: str, service_account: str) -> Entry:
        """What a cluster's registration (e.g. SPIRE's controller manager) gives a ServiceAccount."""
        return self.add_entry(spiffe_id(self.trust_domain, namespace, service_account),
                              [("k8s", f"ns:{namespace}"), ("k8s", f"sa:{service_account}")])

    def unregister(self, namespace: str, service_account: str) -> None:
        with self._lock:
            self._entries.pop(spiffe_id(self.trust_domain, namespace, service_account), None)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> SpireDouble:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        self._stopping.clear()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16,
                                                        thread_name_prefix="spire-double"))
        handlers = {
            "SubscribeToX509SVIDs": grpc.unary_stream_rpc_method_handler(
                self._subscribe_svids, request_deserializer=pb.SubscribeToX509SVIDsRequest.FromString,
                response_serializer=pb.serialize),
            "SubscribeToX509Bundles": grpc.unary_stream_rpc_method_handler(
                self._subscribe_bundles,
                request_deserializer=pb.SubscribeToX509BundlesRequest.FromString,
                response_serializer=pb.serialize),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(pb.SERVICE, handlers),))
        if server.add_insecure_port(f"unix:{self.socket_path}") == 0:
            raise RuntimeError(f"cannot listen on unix:{self.socket_path}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.stop(0).wait(2.0)
            self._server = None

    def __enter__(self) -> SpireDouble:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the two RPCs ----------------------------------------------------------------------
    def _subscribe_svids(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        selectors = [(s.type, s.value) for s in request.selectors]
        with self._lock:
            self.calls["SubscribeToX509SVIDs"] += 1
            self.requests.append(selectors)
            matching = [e for e in self._entries.values() if e.selectors <= set(selectors)]
        if self._faulty(context):
            return
        if bool(selectors) == bool(request.pid):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "must provide either selectors or non-zero PID, but not both")
        yield pb.SubscribeToX509SVIDsResponse(
            x509_svids=[self._mint(e) for e in sorted(matching, key=lambda e: e.spiffe_id)])
        self._hold(context)

    def _subscribe_bundles(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        with self._lock:
            self.calls["SubscribeToX509Bundles"] += 1
        if self._faulty(context):
            return
        cas = x509.load_pem_x509_certificates(self._ca.bundle_pem().encode())
        yield pb.SubscribeToX509BundlesResponse(ca_certificates={
            f"spiffe://{self.trust_domain}": b"".join(c.public_bytes(_DER) for c in cas)})
        self._hold(context)

    def _faulty(self, context: grpc.ServicerContext) -> bool:
        """Apply the injected fault; True when the call must end without an answer."""
        if self.unavailable:
            context.abort(grpc.StatusCode.UNAVAILABLE, "spire double told to be unavailable")
        if self.stall:
            self._hold(context)
            return True
        return False

    def _hold(self, context: grpc.ServicerContext) -> None:
        """Keep the stream open, as a subscription is, until the client or stop() ends it."""
        with self._lock:
            self.open_streams += 1
        try:
            while context.is_active() and not self._stopping.wait(0.05):
                pass
        finally:
            with self._lock:
                self.open_streams -= 1

    def _mint(self, entry: Entry) -> Any:
        """An SVID signed by the CA directory, in the wire form (DER chain, PKCS#8 DER key)."""
        svid = self._ca.issue(entry.spiffe_id, time.time())
        chain = x509.load_pem_x509_certificates(svid.cert_chain_pem.encode())
        key = serialization.load_pem_private_key(svid.key_pem.encode(), password=None)
        td, _, path = entry.spiffe_id.removeprefix("spiffe://").partition("/")
        return pb.X509SVIDWithKey(
            x509_svid=pb.X509SVID(cert_chain=[c.public_bytes(_DER) for c in chain],
                                  id=pb.SPIFFEID(trust_domain=td, path=f"/{path}"),
                                  expires_at=int(svid.not_after)),
            x509_svid_key=key.private_bytes(_DER, serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()))
