"""Strict readers for settings taken from the environment.

Every Dispatch setting is read once, in ``dispatch/settings.py``, through these helpers
(docs/operating.md#settings). A value that cannot be parsed raises
``ImproperlyConfigured`` naming the variable; an unset variable yields the default.
Nothing falls back silently.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

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
