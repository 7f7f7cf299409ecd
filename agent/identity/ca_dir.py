"""The standalone identity provider: the agent signs short-lived SVIDs with a CA it reads
from a directory (``ca.crt``, ``ca.key``). For standalone nodes, the demo and tests; a
production cluster uses SPIRE (``agent.identity.spire``), where no node holds a signing key."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent.identity.svid import IdentityError, Svid

DEFAULT_TTL_S = 3600.0
# Back-date certificates a little so a peer whose clock lags still accepts them.
CLOCK_SKEW_S = 60.0


@dataclass
class CaDirProvider:
    """Signs EC P-256 SVIDs (URI SAN = the SPIFFE ID) with ``<dir>/ca.key``."""

    ca_dir: str
    ttl_s: float = DEFAULT_TTL_S
    name: str = "ca-dir"

    def __post_init__(self) -> None:
        try:
            with open(os.path.join(self.ca_dir, "ca.crt"), "rb") as f:
                self._ca_pem = f.read()
            with open(os.path.join(self.ca_dir, "ca.key"), "rb") as f:
                key = serialization.load_pem_private_key(f.read(), password=None)
            self._ca = x509.load_pem_x509_certificate(self._ca_pem)
        except (OSError, ValueError) as e:
            raise IdentityError(f"identity CA directory {self.ca_dir}: {e}") from e
        if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
            raise IdentityError(f"{self.ca_dir}/ca.key: unsupported key type (EC or RSA)")
        self._key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey = key

    def bundle_pem(self) -> str:
        return self._ca_pem.decode()

    def issue(self, spiffe_id: str, now: float) -> Svid:
        key = ec.generate_private_key(ec.SECP256R1())
        start = datetime.datetime.fromtimestamp(now - CLOCK_SKEW_S, datetime.UTC)
        end = datetime.datetime.fromtimestamp(now + self.ttl_s, datetime.UTC)
        if end > self._ca.not_valid_after_utc:
            end = self._ca.not_valid_after_utc
        if end <= start:
            raise IdentityError(f"the identity CA in {self.ca_dir} has expired")
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "aether")]))
            .issuer_name(self._ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(spiffe_id)]), critical=True)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, key_encipherment=True, content_commitment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=False,
                crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        key_pem = key.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()).decode()
        # the validity the certificate really carries: X.509 times have whole seconds, so
        # ``end`` rounds down there; recording the unrounded ``end`` renewed up to a second
        # late and, for a short TTL, handed out a certificate with less life than recorded
        return Svid(spiffe_id, cert.public_bytes(serialization.Encoding.PEM).decode(), key_pem,
                    cert.not_valid_before_utc.timestamp(), cert.not_valid_after_utc.timestamp(),
                    issued_at=now)


def make_ca(ca_dir: str, trust_domain: str = "cluster.local", days: int = 365) -> None:
    """Write a fresh self-signed CA (``ca.crt``, ``ca.key`` 0600) into ``ca_dir``: what
    ``aether-agent init-ca`` and the tests use."""
    os.makedirs(ca_dir, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "aether"),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"aether CA {trust_domain}")])
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_encipherment=False, content_commitment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectAlternativeName(
            [x509.UniformResourceIdentifier(f"spiffe://{trust_domain}")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_path = os.path.join(ca_dir, "ca.key")
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    with open(os.path.join(ca_dir, "ca.crt"), "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
