"""This instance's identity for peers (docs/peers.md#before-you-pair): its key pair, created on first
use, and its display name; and who may change them or pair (staff).

The pair is kept in the ``InstanceIdentity`` row: the raw public key as base64url without
padding, the raw private key encrypted at rest (``core.secrets_at_rest``).
"""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat
from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction

from core import secrets_at_rest
from core.errors import DispatchError, InvalidRequest
from core.models import InstanceIdentity
from core.services import instance_identity_get
from peers.keys import Identity, b64url, fingerprint_of
from peers.selectors import label_taken
from peers.services.links import label_from_name


@transaction.atomic
def _key_pair_ensure() -> InstanceIdentity:
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
    row = _key_pair_ensure()
    private = Ed25519PrivateKey.from_private_bytes(secrets_at_rest.decrypt(row.private_key_encrypted))
    return Identity(
        instance_id=row.instance_id,
        name=row.display_name,
        url=settings.PUBLIC_URL,
        public_key=row.public_key,
        fingerprint=fingerprint_of(row.public_key),
        private_key=private,
    )


def staff_require(*, user: User) -> None:
    """Refuse unless ``user`` is an active staff user: pairing, linking and renaming this
    instance are admin actions (docs/peers.md#pairing). Raises
    ``DispatchError("PERMISSION_DENIED")`` (403) "pairing is for staff users only"."""
    if not (user.is_active and user.is_staff):
        raise DispatchError("PERMISSION_DENIED", "pairing is for staff users only")


@transaction.atomic
def instance_rename(*, user: User, name: str) -> str:
    """Set this instance's display name (editable; it seeds the label peers give
    this instance). Staff only (403); 1–100 characters (400); ``CONFLICT`` (409) when a
    live link here is labelled so, ignoring case (its agents would be badged with this
    instance's own name). Returns the stored name."""
    staff_require(user=user)
    text = name.strip() if isinstance(name, str) else ""
    if not 1 <= len(text) <= 100:
        raise InvalidRequest("the instance name is 1 to 100 characters")
    for taken in {text, label_from_name(text)}:
        if label_taken(label=taken):
            raise DispatchError(
                "CONFLICT",
                f"a linked instance is called '{taken}' here; rename that link first, or pick another name",
                {"name": text},
            )
    row = InstanceIdentity.objects.select_for_update().get(pk=instance_identity_get().pk)
    row.display_name = text
    row.save(update_fields=["display_name"])
    return text
