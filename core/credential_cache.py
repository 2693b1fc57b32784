"""This process's cache of bearer-token lookups, so that a REST or MCP request need not
query its token again; keyed by the token's SHA-256 digest, never the token.
``core.authentication`` reads and fills it; ``core.revocation`` and the services that
revoke empty it (``clear``). A module of its own
so that revocation need not import authentication (which imports the services, which import
revocation).
"""

from __future__ import annotations

import time
from typing import Any

BEARER_CACHE_SECONDS = 1.0
"""How long a process reuses a bearer token's lookup. Revoking a token, deactivating a user
or stopping an agent empties the cache of the process that did it (at once and when the
transaction commits), and every other process's at its next revocation sweep (rung at once
by the same commit, at most ``core.revocation.SWEEP_INTERVAL`` apart); this bounds it when
the ring is lost: a revoked token is refused everywhere within a second, before the sweep
closes the connections opened with it."""
BEARER_CACHE_MAX = 4096  # entries; emptied when full (only valid tokens enter it)

_entries: dict[str, tuple[float, Any, Any]] = {}


def cached(digest: str) -> tuple[Any, Any] | None:
    """The ``(user, credential)`` found for ``digest`` less than ``BEARER_CACHE_SECONDS``
    ago, or ``None``."""
    hit = _entries.get(digest)
    if hit is None or time.monotonic() - hit[0] >= BEARER_CACHE_SECONDS:
        return None
    return hit[1], hit[2]


def remember(digest: str, looked_up_at: float, user: Any, credential: Any) -> None:
    """Keep a lookup begun at ``looked_up_at`` (``time.monotonic()``, taken before the
    query: a clear that raced it leaves an entry at most a TTL old)."""
    if len(_entries) >= BEARER_CACHE_MAX:
        _entries.clear()
    _entries[digest] = (looked_up_at, user, credential)


def clear() -> None:
    """Forget every cached lookup (a credential ended)."""
    _entries.clear()
