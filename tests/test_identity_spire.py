"""The SPIRE delegate provider against the Delegated Identity API double, over a real unix
socket, and the hand-built messages against hand-encoded protobuf wire bytes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from agent.identity import spire_proto as pb
from agent.identity.ca_dir import make_ca
from agent.identity.spire import SpireDelegateProvider, split_der_certificates
from agent.identity.svid import IdentityError
from agent.testing.spire_double import SpireDouble

TD = "cluster.local"
WEB = f"spiffe://{TD}/ns/shop/sa/web"


@pytest.fixture
def ca_dir(tmp_path: Path) -> str:
    make_ca(str(tmp_path / "ca"), TD)
    return str(tmp_path / "ca")


@pytest.fixture
def sock(tmp_path: Path) -> str:
    return str(tmp_path / "admin.sock")


@pytest.fixture
def double(sock: str, ca_dir: str) -> Iterator[SpireDouble]:
    with SpireDouble(sock, ca_dir, TD) as d:
        d.register("shop", "web")
        yield d


@pytest.fixture
def provider(sock: str) -> SpireDelegateProvider:
    return SpireDelegateProvider(sock, timeout_s=2.0)


def _ca(ca_dir: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(Path(ca_dir, "ca.crt").read_bytes())


def _leaf(chain_pem: str) -> x509.Certificate:
    return x509.load_pem_x509_certificates(chain_pem.encode())[0]


# ---- issuing over the Delegated Identity API ------------------------------------------------

def test_issue_returns_an_svid_signed_by_the_spire_ca(double: SpireDouble, ca_dir: str,
                                                      provider: SpireDelegateProvider) -> None:
    now = time.time()
    svid = provider.issue(WEB, now)
    leaf = _leaf(svid.cert_chain_pem)
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [WEB]
    leaf.verify_directly_issued_by(_ca(ca_dir))  # raises if not signed by the double's CA
    key = serialization.load_pem_private_key(svid.key_pem.encode(), password=None)
    assert key.public_key() == leaf.public_key()
    assert svid.key_pem.startswith("-----BEGIN PRIVATE KEY-----")  # PKCS#8
    assert svid.spiffe_id == WEB
    assert svid.not_before == leaf.not_valid_before_utc.timestamp()
    assert svid.not_after == int(leaf.not_valid_after_utc.timestamp())  # expires_at
    assert svid.issued_at == now and svid.not_before < now < svid.not_after


def test_asks_with_the_k8s_selectors_of_the_service_account(double: SpireDouble,
                                                            provider: SpireDelegateProvider) -> None:
    provider.issue(WEB, time.time())
    assert double.requests == [[("k8s", "ns:shop"), ("k8s", "sa:web")]]
    assert double.calls == {"SubscribeToX509SVIDs": 1, "SubscribeToX509Bundles": 1}


def test_picks_the_requested_svid_among_several(double: SpireDouble,
                                                provider: SpireDelegateProvider) -> None:
    # an entry selecting the whole namespace matches the request too; SPIRE returns both
    double.add_entry(f"spiffe://{TD}/ns/shop/any", [("k8s", "ns:shop")])
    svid = provider.issue(WEB, time.time())
    sans = _leaf(svid.cert_chain_pem).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [WEB]


def test_streams_are_cancelled_after_the_first_answer(double: SpireDouble, sock: str) -> None:
    # a deadline far beyond the wait below, so only the client's cancel can end the streams
    # (and the provider kept alive: dropping a call object cancels it too)
    provider = SpireDelegateProvider(sock, timeout_s=30.0)
    provider.issue(WEB, time.time())
    deadline = time.monotonic() + 2.0
    while double.open_streams and time.monotonic() < deadline:
        time.sleep(0.02)
    assert double.open_streams == 0, provider


def test_unregistered_identity_names_the_socket(double: SpireDouble, sock: str,
                                                provider: SpireDelegateProvider) -> None:
    double.unregister("shop", "web")
    with pytest.raises(IdentityError) as e:
        provider.issue(WEB, time.time())
    assert str(e.value) == (f"SPIRE agent at {sock} has no SVID for {WEB} "
                            "(is the workload registered?)")


def test_other_trust_domain_is_not_taken(double: SpireDouble,
                                         provider: SpireDelegateProvider) -> None:
    with pytest.raises(IdentityError, match="has no SVID for spiffe://other.td/ns/shop/sa/web"):
        provider.issue("spiffe://other.td/ns/shop/sa/web", time.time())


def test_unavailable_agent_is_an_identity_error(double: SpireDouble, sock: str,
                                                provider: SpireDelegateProvider) -> None:
    double.unavailable = True
    with pytest.raises(IdentityError) as e:
        provider.issue(WEB, time.time())
    assert f"SPIRE agent at {sock} is unavailable" in str(e.value)
    assert "told to be unavailable" in str(e.value)  # the agent's own details are kept


def test_stopped_agent_is_an_identity_error(double: SpireDouble, sock: str,
                                            provider: SpireDelegateProvider) -> None:
    double.stop()
    with pytest.raises(IdentityError, match=f"SPIRE agent at {sock} is unavailable"):
        provider.issue(WEB, time.time())


def test_no_answer_within_the_timeout(double: SpireDouble, sock: str) -> None:
    double.stall = True
    started = time.monotonic()
    with pytest.raises(IdentityError) as e:
        SpireDelegateProvider(sock, timeout_s=0.3).issue(WEB, time.time())
    assert time.monotonic() - started < 2.0
    assert str(e.value) == f"SPIRE agent at {sock} did not send the SVID of {WEB} within 0.3s"


def test_not_a_workload_id(provider: SpireDelegateProvider) -> None:
    with pytest.raises(IdentityError, match="not a workload SPIFFE ID"):
        provider.issue(f"spiffe://{TD}/web", time.time())


def test_bundle_is_the_ca_of_the_trust_domain(double: SpireDouble, ca_dir: str,
                                              provider: SpireDelegateProvider) -> None:
    assert provider.bundle_pem() == ""  # nothing issued, nothing fetched
    provider.issue(WEB, time.time())
    assert provider.bundle_pem() == Path(ca_dir, "ca.crt").read_text()


def test_renewal_gets_a_new_certificate_and_refreshes_the_bundle(
        double: SpireDouble, ca_dir: str, provider: SpireDelegateProvider) -> None:
    first = provider.issue(WEB, time.time())
    second = provider.issue(WEB, time.time() + 1)
    assert _leaf(first.cert_chain_pem).serial_number != _leaf(second.cert_chain_pem).serial_number
    assert first.key_pem != second.key_pem
    assert double.calls == {"SubscribeToX509SVIDs": 2, "SubscribeToX509Bundles": 2}
    assert provider.bundle_pem() == Path(ca_dir, "ca.crt").read_text()


def test_split_der_certificates(ca_dir: str) -> None:
    der = _ca(ca_dir).public_bytes(serialization.Encoding.DER)
    assert len(der) > 0x7F  # long-form length, the case real certificates always hit
    assert [c.public_bytes(serialization.Encoding.DER)
            for c in split_der_certificates(der + der)] == [der, der]
    with pytest.raises(ValueError):
        split_der_certificates(der[:-1])


# ---- the wire: field numbers as in spire-api-sdk's .proto files ----------------------------

def _len(field: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2), short payloads only."""
    assert len(payload) < 0x80
    return bytes([field << 3 | 2, len(payload)]) + payload


def test_svids_request_wire_bytes() -> None:
    request = pb.SubscribeToX509SVIDsRequest(selectors=[pb.Selector(type="k8s", value="ns:a")])
    # selectors = 1 { type = 1, value = 2 }
    assert request.SerializeToString() == bytes.fromhex("0a0b" "0a036b3873" "1204" "6e733a61")
    # pid = 2, varint
    assert pb.SubscribeToX509SVIDsRequest(pid=7).SerializeToString() == b"\x10\x07"


def test_svids_response_decodes_hand_encoded_bytes() -> None:
    spiffe_id = _len(1, b"td") + _len(2, b"/p")  # SPIFFEID: trust_domain = 1, path = 2
    # X509SVID: cert_chain = 1, id = 2, expires_at = 3 (varint 2**32 + 300: needs int64), hint = 4
    expires = b"\x18" + bytes([0xAC, 0x82, 0x80, 0x80, 0x10])
    svid = _len(1, b"C1") + _len(1, b"C2") + _len(2, spiffe_id) + expires + _len(4, b"h")
    with_key = _len(1, svid) + _len(2, b"K")  # X509SVIDWithKey: x509_svid = 1, x509_svid_key = 2
    wire = _len(1, with_key) + _len(2, b"spiffe://o")  # x509_svids = 1, federates_with = 2
    got = pb.SubscribeToX509SVIDsResponse.FromString(wire)
    assert len(got.x509_svids) == 1
    item = got.x509_svids[0]
    assert list(item.x509_svid.cert_chain) == [b"C1", b"C2"]
    assert (item.x509_svid.id.trust_domain, item.x509_svid.id.path) == ("td", "/p")
    assert item.x509_svid.expires_at == 2**32 + 300
    assert item.x509_svid.hint == "h"
    assert item.x509_svid_key == b"K"
    assert list(got.federates_with) == ["spiffe://o"]
    assert got.SerializeToString() == wire


def test_bundles_response_map_wire_bytes() -> None:
    # map<string, bytes> ca_certificates = 1: entries { key = 1, value = 2 }
    wire = _len(1, _len(1, b"spiffe://td") + _len(2, b"\x30\x00"))
    got = pb.SubscribeToX509BundlesResponse.FromString(wire)
    assert dict(got.ca_certificates) == {"spiffe://td": b"\x30\x00"}
    assert pb.SubscribeToX509BundlesResponse(
        ca_certificates={"spiffe://td": b"\x30\x00"}).SerializeToString() == wire
    assert pb.SubscribeToX509BundlesRequest().SerializeToString() == b""


def test_service_descriptor_matches_the_method_paths() -> None:
    service = pb.POOL.FindServiceByName("spire.api.agent.delegatedidentity.v1.DelegatedIdentity")
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {"SubscribeToX509SVIDs", "SubscribeToX509Bundles"}
    for path, request, response in (
            (pb.SUBSCRIBE_X509_SVIDS, pb.SubscribeToX509SVIDsRequest,
             pb.SubscribeToX509SVIDsResponse),
            (pb.SUBSCRIBE_X509_BUNDLES, pb.SubscribeToX509BundlesRequest,
             pb.SubscribeToX509BundlesResponse)):
        method = methods[path.rsplit("/", 1)[1]]
        assert path == f"/{service.full_name}/{method.name}"
        assert method.server_streaming and not method.client_streaming
        assert method.input_type is request.DESCRIPTOR
        assert method.output_type is response.DESCRIPTOR
    # upb decodes map entries as key = 1, value = 2 whatever the descriptor says, so the wire
    # tests cannot catch a wrong entry: check the descriptor is what protoc generates
    entry = pb.SubscribeToX509BundlesResponse.DESCRIPTOR.fields_by_name["ca_certificates"].message_type
    assert entry.GetOptions().map_entry
    assert [(f.name, f.number) for f in entry.fields] == [("key", 1), ("value", 2)]
