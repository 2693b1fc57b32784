"""Per-peer leases (``PeerLease``): one process at a time subscribes to a peer's stream
(``subscribe``, spec/peers.md §7) or drains its outbox (``drain``, §8)."""

from __future__ import annotations

from datetime import timedelta

from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from peers.models import PeerLease


def peer_lease_claim(*, peer_id: int, kind: str, holder: str, ttl: timedelta) -> bool:
    """Take or renew the ``kind`` lease of peer ``peer_id`` for ``holder`` until now + ``ttl``.

    A conditional UPDATE (already ``holder``'s, or expired), else an INSERT; a concurrent
    insert by another holder loses on the unique ``(peer, kind)``. Returns whether
    ``holder`` holds the lease now.
    """
    now = timezone.now()
    expires = now + ttl
    taken = (
        PeerLease.objects.filter(peer_id=peer_id, kind=kind)
        .filter(Q(holder=holder) | Q(expires_at__lt=now))
        .update(holder=holder, expires_at=expires)
    )
    if taken:
        return True
    try:
        with transaction.atomic():
            PeerLease.objects.create(peer_id=peer_id, kind=kind, holder=holder, expires_at=expires)
    except IntegrityError:
        return False
    return True


def peer_lease_release(*, peer_id: int, kind: str, holder: str) -> None:
    """Give up ``holder``'s ``kind`` lease of peer ``peer_id`` (nothing if another holds it)."""
    PeerLease.objects.filter(peer_id=peer_id, kind=kind, holder=holder).delete()
