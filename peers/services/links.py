"""A link's liveness (spec/peers.md §4, §7): ``last_seen_at``, stamped when the peer is seen."""

from __future__ import annotations

import datetime

from django.db.models import Q
from django.utils import timezone

from peers.models import Peer

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
