"""This instance's peer identity (docs/peers.md#before-you-pair): key pair, fingerprint, encryption at rest."""

from __future__ import annotations

import re

import pytest
from cryptography.fernet import Fernet
from django.test import override_settings

from core import secrets_at_rest
from core.models import InstanceIdentity
from peers.keys import b64url_decode, fingerprint_of, public_key_from
from peers.services.identity import identity_get


@pytest.mark.django_db
def test_the_key_pair_is_created_once_and_the_private_key_is_stored_encrypted() -> None:
    first = identity_get()
    again = identity_get()
    assert first.public_key == again.public_key and len(b64url_decode(first.public_key)) == 32
    row = InstanceIdentity.objects.get()
    assert row.instance_id == first.instance_id
    raw_private = first.private_key.private_bytes_raw()
    assert raw_private not in row.private_key_encrypted.encode()
    assert secrets_at_rest.decrypt(row.private_key_encrypted) == raw_private
    signature = first.private_key.sign(b"hello")
    public_key_from(first.public_key).verify(signature, b"hello")  # raises if it does not match


@pytest.mark.django_db
def test_the_fingerprint_is_eight_groups_of_four_hex() -> None:
    identity = identity_get()
    assert re.fullmatch(r"(?:[0-9a-f]{4} ){7}[0-9a-f]{4}", identity.fingerprint)
    assert fingerprint_of(identity.public_key) == identity.fingerprint


@pytest.mark.django_db
def test_a_new_key_first_still_opens_the_stored_private_key_and_a_lost_key_is_a_clear_error(settings) -> None:
    identity = identity_get()
    newer = Fernet.generate_key().decode()
    with override_settings(ENCRYPTION_KEYS=[newer, *settings.ENCRYPTION_KEYS]):
        assert identity_get().public_key == identity.public_key
    with override_settings(ENCRYPTION_KEYS=[newer]):
        with pytest.raises(secrets_at_rest.SecretUnreadable, match="DISPATCH_ENCRYPTION_KEYS"):
            identity_get()


def test_rotate_re_encrypts_under_the_newest_key(settings) -> None:
    old = secrets_at_rest.encrypt(b"token")
    newer = Fernet.generate_key().decode()
    with override_settings(ENCRYPTION_KEYS=[newer, *settings.ENCRYPTION_KEYS]):
        rotated = secrets_at_rest.rotate(old)
    with override_settings(ENCRYPTION_KEYS=[newer]):
        assert secrets_at_rest.decrypt(rotated) == b"token"


@pytest.mark.parametrize("bad", ["", "abc", "!!!!", "A" * 300])
def test_a_bad_public_key_is_a_value_error(bad: str) -> None:
    with pytest.raises(ValueError):
        public_key_from(bad)
