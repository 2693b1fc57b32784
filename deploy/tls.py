"""A self-signed certificate for a local topology (``make cluster CLUSTER_TLS=1``, the cluster
tests): nginx serves it and clients trust it as their CA (docs/deploy.md#tls).

Apart from nginx's config because it is the only code that needs ``cryptography``
(imported when called). Nothing here imports Django or Dispatch.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certificate:
    """A PEM certificate and its private key on disk; ``cert`` is also the CA file clients
    trust (``SSL_CERT_FILE``, ``NODE_EXTRA_CA_CERTS``): it is self-signed."""

    cert: Path
    key: Path


def self_signed_certificate(directory: Path, hosts: Iterable[str] = ("127.0.0.1", "localhost")) -> Certificate:
    """Write ``cert.pem`` and ``key.pem`` (EC P-256, valid 30 days) into ``directory``.

    The certificate is its own CA (``basicConstraints CA:true``) and names every entry of
    ``hosts`` in its subject alternative names (IP addresses as IP entries), so Python's
    ``ssl`` and Node accept it for those hosts once told to trust it.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Dispatch test cluster")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_path.chmod(0o600)
    return Certificate(cert=cert_path, key=key_path)
