"""This instance's identity for peers (spec/peers.md §1): the Ed25519 key pair and fingerprint.

The key pair is created on first use and kept in the ``InstanceIdentity`` row: the raw
public key as base64url without padding, the raw private key encrypted at rest
(``core.secrets_at_rest``). The fingerprint is the SHA-256 of the raw public key as
8 groups of 4 lowercase hex characters (the first 32 hex digits), shown on both pairing
cards so a person can compare them.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat
from django.conf import settings
from django.db import transaction

from core import secrets_at_rest
from core.models import InstanceIdentity
from core.services import instance_identity_get

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


@transaction.atomic
def _ensure_key_pair() -> InstanceIdentity:
    row = InstanceIdentity.objects.select_for_update().get(pk=instance_identity_get().pk)
    if not row.public_key or not row.private_key_encrypted:
        private = Ed25519PrivateKey.generate()
        raw_private = private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        raw_public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        row.public_key = b64url(raw_public)
        row.private_key_encrypted = secrets_at_rest.encrypt(raw_private)
        row.save(update_fields=["public_key", "private_key_encrypted"])
    return row


def identity_get() -> Identity:
    """This instance's identity, creating its key pair on first use.

    Raises ``secrets_at_rest.SecretUnreadable`` when the stored private key cannot be
    decrypted (``DISPATCH_ENCRYPTION_KEYS`` changed without keeping the old key).
    """
    row = _ensure_key_pair()
    private = Ed25519PrivateKey.from_private_bytes(secrets_at_rest.decrypt(row.private_key_encrypted))
    return Identity(
        instance_id=row.instance_id,
        name=row.display_name,
        url=settings.PUBLIC_URL,
        public_key=row.public_key,
        fingerprint=fingerprint_of(row.public_key),
        private_key=private,
    )
