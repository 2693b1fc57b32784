"""This instance's identity for peers (spec/peers.md §1): its shape, keys and fingerprints.

``Identity`` is what ``peers.services.identity.identity_get`` returns (the key pair is
created there on first use and kept in the ``InstanceIdentity`` row: the raw public key as
base64url without padding, the raw private key encrypted at rest). The fingerprint is the
SHA-256 of the raw public key as 8 groups of 4 lowercase hex characters (the first 32 hex
digits), shown on both pairing cards so a person can compare them.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PEER_PROTOCOL_VERSION = 2


def b64url(raw: bytes) -> str:
    """base64url without padding."""
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def b64url_decode(text: str) -> bytes:
    """Inverse of ``b64url``; ``ValueError`` for text that is not base64url."""
    if not isinstance(text, str) or len(text) > 200:
        raise ValueError("not base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def fingerprint_of(public_key_b64: str) -> str:
    """The fingerprint of a raw Ed25519 public key given as base64url: ``xxxx xxxx …`` (8 groups)."""
    digest = hashlib.sha256(b64url_decode(public_key_b64)).hexdigest()[:32]
    return " ".join(digest[i : i + 4] for i in range(0, 32, 4))


def public_key_from(public_key_b64: str) -> Ed25519PublicKey:
    """An Ed25519 public key from base64url raw bytes; ``ValueError`` if it is not one."""
    raw = b64url_decode(public_key_b64)
    if len(raw) != 32:
        raise ValueError("an Ed25519 public key is 32 bytes")
    return Ed25519PublicKey.from_public_bytes(raw)


@dataclass(frozen=True)
class Identity:
    """This instance as peers see it."""

    instance_id: str
    name: str
    url: str
    public_key: str  # base64url raw
    fingerprint: str
    private_key: Ed25519PrivateKey
