"""Strict readers for settings taken from the environment, and the settings derived from
files or other settings.

Every Dispatch setting is read once, in ``dispatch/settings.py``, through the ``env_*``
helpers (docs/operating.md#settings). A value that cannot be parsed raises
``ImproperlyConfigured`` naming the variable; an unset variable yields the default. The
others say their fallbacks: ``recorded_public_url`` (the URL a running ``serve`` recorded,
"" when there is none), ``secret_key`` (made once into the data dir) and
``encryption_keys`` (derived from the secret key when none are given).
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import os
import secrets
from pathlib import Path

from cryptography.fernet import Fernet
from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    return None if value is None else value.strip()


def env_str(name: str, default: str) -> str:
    """The variable's value with surrounding whitespace removed, or ``default``."""
    value = _raw(name)
    return default if value is None or value == "" else value


def env_bool(name: str, default: bool) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off`` (any case); anything else is an error."""
    value = _raw(name)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name} must be a boolean (true/false), got {value!r}")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    """A base-10 integer, at least ``minimum`` when given."""
    value = _raw(name)
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, got {value!r}") from None
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, got {number}")
    return number


def env_float(name: str, default: float, *, minimum: float = 0.0) -> float:
    """A number (seconds, rates, …) strictly greater than ``minimum``."""
    value = _raw(name)
    if value is None or value == "":
        return default
    try:
        number = float(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number, got {value!r}") from None
    if not number > minimum:
        raise ImproperlyConfigured(f"{name} must be greater than {minimum:g}, got {value!r}")
    return number


def env_list(name: str, default: list[str]) -> list[str]:
    """A comma-separated list; blank items are dropped."""
    value = _raw(name)
    if value is None:
        return list(default)
    return [item.strip() for item in value.split(",") if item.strip()]


def env_networks(name: str, default: list[str]) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """A comma-separated list of IP addresses and CIDR networks (``10.0.0.0/8``, ``::1``);
    an empty value is an empty list. A bare address is a one-address network; a network
    with host bits set (``10.0.0.5/8``) is refused as the likely typo it is."""
    networks = []
    for item in env_list(name, default):
        try:
            networks.append(ipaddress.ip_network(item))
        except ValueError:
            raise ImproperlyConfigured(
                f"{name} must list IP addresses or networks such as 127.0.0.0/8 or ::1, got {item!r}"
            ) from None
    return networks


def env_secret(name: str) -> str | None:
    """A secret from ``NAME`` or from the file named by ``NAME_FILE`` (not both).

    Returns ``None`` when neither is set. The file's content is stripped of surrounding
    whitespace; a missing or empty file is an error.
    """
    direct = _raw(name)
    file_name = _raw(f"{name}_FILE")
    if direct and file_name:
        raise ImproperlyConfigured(f"set {name} or {name}_FILE, not both")
    if direct:
        return direct
    if file_name:
        path = Path(file_name)
        try:
            content = path.read_text().strip()
        except OSError as exc:
            raise ImproperlyConfigured(f"{name}_FILE: cannot read {path}: {exc}") from None
        if not content:
            raise ImproperlyConfigured(f"{name}_FILE: {path} is empty")
        return content
    return None


def recorded_public_url(record: Path) -> str:
    """The ``url`` of ``record`` (``{"url", "pid"}``, written by ``serve``) while the
    process ``pid`` runs on this host; ``""`` when the file is missing, unreadable or its
    process is gone (a ``serve`` that was killed leaves it behind) or is this one (a
    restarted container's ``serve`` may get the dead one's pid)."""
    try:
        data = json.loads(record.read_text())
        url, pid = data["url"], data["pid"]
    except (OSError, ValueError, TypeError, KeyError):
        return ""
    if not isinstance(url, str) or not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return ""
    if pid == os.getpid():
        return ""
    try:
        os.kill(pid, 0)
    except PermissionError:
        pass  # alive, owned by another user
    except OSError:
        return ""
    return url


def secret_key(given: str | None, data_dir: Path) -> tuple[str, bool]:
    """``given`` (``SECRET_KEY``), else the key in ``data_dir/secret_key`` (made on first
    use, mode 0600), and whether it came from that file. Raises ``ImproperlyConfigured``
    when the file is empty."""
    if given:
        return given, False
    key_file = data_dir / "secret_key"
    if not key_file.exists():
        # Written whole to a file of its own, then linked into place (which fails when the
        # name exists): two processes starting at once keep one key, and neither reads a
        # key file the other has created but not yet written.
        partial = data_dir / f".secret_key.{os.getpid()}"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(50))
        try:
            os.link(partial, key_file)
        except FileExistsError:
            pass
        finally:
            partial.unlink(missing_ok=True)
    key = key_file.read_text().strip()
    if not key:
        raise ImproperlyConfigured(f"{key_file} is empty; delete it or set SECRET_KEY")
    return key, True


def encryption_keys(keys: list[str], secret_key: str) -> list[str]:
    """``keys`` (``DISPATCH_ENCRYPTION_KEYS``: Fernet keys, newest first), else one key
    derived from ``secret_key``. Raises ``ImproperlyConfigured`` naming a key that is not
    a Fernet key."""
    if not keys:
        digest = hashlib.sha256(b"dispatch-encryption:" + secret_key.encode()).digest()
        return [base64.urlsafe_b64encode(digest).decode()]
    for index, key in enumerate(keys):
        try:
            Fernet(key)
        except (ValueError, TypeError):
            raise ImproperlyConfigured(
                f"DISPATCH_ENCRYPTION_KEYS: key #{index + 1} is not a valid Fernet key"
            ) from None
    return keys
