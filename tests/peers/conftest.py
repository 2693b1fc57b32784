"""Shared pieces of the peers tests: a peer row with known tokens and a remote key pair.

``make_peer(owner, label="Cloud", **fields)`` inserts a live ``Peer`` as if pairing had
happened, and returns a ``FakePeer`` holding what the other side would hold: its
private key (to sign requests to us), the raw token we issued to it (``inbound_token``:
it presents that here) and the raw token it issued to us (``outbound_token``).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from core import secrets_at_rest
from core.services import generate_token, token_digest
from peers.keys import b64url, fingerprint_of
from peers.models import Peer


@dataclass
class FakePeer:
    """The other side of a link, for tests: its row here and its secrets."""

    peer: Peer
    private_key: Ed25519PrivateKey
    public_key: str
    fingerprint: str
    instance_id: str
    inbound_token: str
    outbound_token: str


def new_key_pair() -> tuple[Ed25519PrivateKey, str]:
    """A fresh Ed25519 private key and its raw public key as base64url."""
    private = Ed25519PrivateKey.generate()
    return private, b64url(private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))


@pytest.fixture
def make_peer(db: None) -> Callable[..., FakePeer]:
    def make(owner: Any, label: str = "Cloud", **fields: Any) -> FakePeer:
        private, public = new_key_pair()
        instance_id = fields.pop("instance_id", "inst_" + secrets.token_hex(6))
        inbound, outbound = generate_token(), generate_token()
        peer = Peer.objects.create(
            owner=owner,
            instance_id=instance_id,
            label=label,
            reported_name=fields.pop("reported_name", label.lower()),
            url=fields.pop("url", "http://127.0.0.1:9"),
            public_key=public,
            fingerprint=fingerprint_of(public),
            inbound_digest=token_digest(inbound),
            inbound_prefix=inbound[:8],
            outbound_token_encrypted=secrets_at_rest.encrypt(outbound.encode()),
            **fields,
        )
        return FakePeer(
            peer=peer,
            private_key=private,
            public_key=public,
            fingerprint=peer.fingerprint,
            instance_id=instance_id,
            inbound_token=inbound,
            outbound_token=outbound,
        )

    return make
