"""What the peers app registers with the kernel: how the revocation sweep checks event
streams a linked instance opened (``core.revocation``)."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from peers.models import Peer


def live_peers(ids: set[int], now: Any) -> QuerySet[Any]:
    """The peer links among ``ids`` not revoked (a deleted link is not listed, so it ends too)."""
    return Peer.objects.filter(pk__in=ids, revoked_at__isnull=True)
