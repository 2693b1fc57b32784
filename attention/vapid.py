"""This instance's VAPID key (RFC 8292), generated once and kept.

``DISPATCH_VAPID_PRIVATE_KEY`` (or ``…_FILE``) when set; otherwise
``DATA_DIR/vapid_private_key.pem``, created on first use with mode 0600. Two processes
starting at once write one key: each writes a private temporary file and links it into
place (``os.link`` fails when the name exists), so the loser reads the winner's key.
Browsers subscribe with the public key (``applicationServerKey``): a new key would
orphan every subscription, hence kept, never regenerated.
"""

from __future__ import annotations

import base64
import os
import tempfile
from functools import lru_cache
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from py_vapid import Vapid


def _key_file_pem(path: Path) -> bytes:
    if not path.exists():
        key = ec.generate_private_key(ec.SECP256R1())
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".vapid-")  # mode 0600
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(pem)
            try:
                os.link(temporary, path)
            except FileExistsError:
                pass  # another process won: its key is the key
        finally:
            os.unlink(temporary)
    return path.read_bytes()


@lru_cache(maxsize=1)
def vapid_key() -> Vapid:
    """The instance's VAPID signing key (a ``py_vapid.Vapid`` holding a P-256 private key).

    Raises ``ImproperlyConfigured`` when ``DISPATCH_VAPID_PRIVATE_KEY`` is not a P-256
    key py_vapid reads (PEM, DER or raw, base64url)."""
    given = settings.VAPID_PRIVATE_KEY
    try:
        if given:
            key = Vapid.from_pem(given.encode()) if "-----BEGIN" in given else Vapid.from_string(given)
        else:
            key = Vapid.from_pem(_key_file_pem(Path(settings.VAPID_KEY_FILE)))
    except Exception as exc:
        raise ImproperlyConfigured(f"DISPATCH_VAPID_PRIVATE_KEY: not a P-256 private key ({exc})") from None
    if not isinstance(key.private_key.curve, ec.SECP256R1):
        raise ImproperlyConfigured("DISPATCH_VAPID_PRIVATE_KEY: the key must be on the P-256 curve")
    return key


def vapid_public_key() -> str:
    """The public key browsers pass to ``PushManager.subscribe`` as
    ``applicationServerKey``: the uncompressed P-256 point (65 bytes), base64url without
    padding (RFC 8292 §3.2, the ``k`` parameter)."""
    raw = vapid_key().public_key.public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")
