"""A link's liveness (spec/peers.md §4, §7, §8): ``last_seen_at``, stamped when the peer is
seen, and what its stream reconnecting sets going."""

from __future__ import annotations

import datetime

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from peers.models import Peer
from peers.services.outbox import outbox_backoff_reset

# ``last_seen_at`` is stamped at most once per this interval (spec §4).
LAST_SEEN_RESOLUTION = datetime.timedelta(seconds=60)


def peer_seen(*, peer: Peer) -> None:
    """``peer`` just authenticated a request: stamp its ``last_seen_at`` now, at most once per
    ``LAST_SEEN_RESOLUTION`` (a conditional UPDATE, so concurrent requests stamp once); the
    object passed in is updated too."""
    now = timezone.now()
    if peer.last_seen_at is not None and now - peer.last_seen_at < LAST_SEEN_RESOLUTION:
        return
    Peer.objects.filter(pk=peer.pk).filter(
        Q(last_seen_at__isnull=True) | Q(last_seen_at__lte=now - LAST_SEEN_RESOLUTION)
    ).update(last_seen_at=now)
    peer.last_seen_at = now


def peer_seen_stamp(*, peer_id: int) -> None:
    """Stamp peer ``peer_id``'s ``last_seen_at`` now, unconditionally: its events stream is
    connected (spec §7 "a connected stream proves the peer alive"). The mirroring subscriber
    throttles its own calls (``peers.mirror.LAST_SEEN_INTERVAL``)."""
    Peer.objects.filter(pk=peer_id).update(last_seen_at=timezone.now())


@transaction.atomic
def peer_reconnected(*, peer: Peer) -> None:
    """``peer``'s events stream (re)connected (its first snapshot arrived): stamp
    ``last_seen_at``, make its queued outbox rows due now with their backoff forgotten and
    ring the drain doorbell after commit (``outbox_backoff_reset``; spec §8 "reset when the
    peer's stream reconnects")."""
    peer_seen_stamp(peer_id=peer.pk)
    outbox_backoff_reset(peer=peer)
