"""Secrets at rest: MultiFernet over ``DISPATCH_ENCRYPTION_KEYS`` (docs/operating.md#encryption-keys).

The first key encrypts; every key decrypts, so keys rotate by putting a new one first
(``rotate`` re-encrypts a value under it).
"""

from __future__ import annotations

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings


class SecretUnreadable(Exception):
    """A stored secret that no configured key decrypts (keys changed without rotation)."""


def _fernet() -> MultiFernet:
    return MultiFernet([Fernet(key) for key in settings.ENCRYPTION_KEYS])


def encrypt(plain: bytes) -> str:
    """``plain`` encrypted under the newest key, as Fernet token text."""
    return _fernet().encrypt(plain).decode("ascii")


def decrypt(token: str) -> bytes:
    """The plaintext of ``token``; ``SecretUnreadable`` if no configured key opens it."""
    try:
        return _fernet().decrypt(token.encode("ascii"))
    except (InvalidToken, ValueError, UnicodeEncodeError):
        raise SecretUnreadable("a stored secret cannot be decrypted with DISPATCH_ENCRYPTION_KEYS") from None


def rotate(token: str) -> str:
    """``token`` re-encrypted under the newest key."""
    return _fernet().rotate(token.encode("ascii")).decode("ascii")
