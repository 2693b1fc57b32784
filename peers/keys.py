"""Keys and what an instance announces to peers (docs/peers.md#before-you-pair): the ``Identity``
shape, base64url keys, fingerprints, the protocol version and the optional features.

``Identity`` is what ``peers.services.identity.identity_get`` returns (the key pair is
created there on first use and kept in the ``InstanceIdentity`` row: the raw public key as
base64url without padding, the raw private key encrypted at rest). The fingerprint is the
SHA-256 of the raw public key as 8 groups of 4 lowercase hex characters (the first 32 hex
digits), shown on both pairing cards so a person can compare them.
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PEER_PROTOCOL_VERSION = 2

# Optional abilities an instance announces to its peers (docs/peers.md#features): in the pairing
# claim and its answer (``features``) and in a ``Dispatch-Peer-Features`` header on every peer
# request and response. Not a protocol version — pairing needs an exact version match, so a
# bump would stop old and new instances from linking; a peer that does not announce a
# feature is simply not asked to use it.
FEATURE_MESSAGES_BATCH = "messages.batch"  # POST /api/v1/peers/messages/batch
PEER_FEATURES: tuple[str, ...] = (FEATURE_MESSAGES_BATCH,)
FEATURES_HEADER = "Dispatch-Peer-Features"
FEATURES_MAX = 20  # names kept from one announcement
_FEATURE = re.compile(r"[a-z0-9][a-z0-9._-]{0,39}")


def features_header_value() -> str:
    """This instance's features as the ``Dispatch-Peer-Features`` value: ``messages.batch``
    (comma-separated when there are several)."""
    return ", ".join(PEER_FEATURES)


def features_parse(value: object) -> list[str]:
    """The feature names a peer announced, sorted and unique: ``value`` is a header value
    (comma-separated) or a claim's ``features`` list. Anything that is not a name of 1–40
    characters from ``a-z0-9._-`` is left out, as is everything past ``FEATURES_MAX``
    names; ``None`` or another type → ``[]`` (an instance that announces nothing)."""
    if isinstance(value, str):
        items: list[object] = list(value.split(","))
    elif isinstance(value, list | tuple):
        items = list(value)
    else:
        return []
    names = {item.strip() for item in items if isinstance(item, str)}
    return sorted(name for name in names if _FEATURE.fullmatch(name))[:FEATURES_MAX]


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
