"""Per-peer leases (``PeerLease``): one process at a time subscribes to a peer's stream
(``subscribe``, ``peers.mirror``) or drains its outbox (``drain``,
``peers.outbox_drain``). A holder is a process id (plus a suffix for the drain)."""

from __future__ import annotations

from datetime import timedelta

from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from peers.models import PeerLease

DRAIN = "drain"
SUBSCRIBE = "subscribe"
# A drain pass renews its lease before a row once half the send timeout has passed since
# its last claim, and a send lasts at most the send timeout (``peers.outbox_drain.SEND_TIMEOUT``,
# half of this): the lease never runs out under a live pass.
DRAIN_LEASE_TTL = timedelta(seconds=60)
# The mirror renews its leases on every scan (at most ``peers.mirror.RESCAN_SECONDS``, 60 s,
# apart): a process that died lets its peers go within three minutes.
SUBSCRIBE_LEASE_SECONDS = 180.0


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


def drain_lease_claim(*, peer_id: int, holder: str, ttl: timedelta = DRAIN_LEASE_TTL) -> bool:
    """Take or renew the drain lease of ``peer_id`` for ``holder`` until now + ``ttl``
    (``peer_lease_claim``). Returns whether ``holder`` holds the lease now."""
    return peer_lease_claim(peer_id=peer_id, kind=DRAIN, holder=holder, ttl=ttl)


def drain_lease_release(*, peer_id: int, holder: str) -> None:
    """Give up ``holder``'s drain lease of ``peer_id`` (nothing if another holds it)."""
    peer_lease_release(peer_id=peer_id, kind=DRAIN, holder=holder)


def subscribe_lease_claim(*, peer_id: int, holder: str, seconds: float = SUBSCRIBE_LEASE_SECONDS) -> bool:
    """Take or renew the ``subscribe`` lease of peer ``peer_id`` for ``holder`` (a process id)
    for ``seconds``. True when ``holder`` holds it now: it was free, expired or already its."""
    return peer_lease_claim(peer_id=peer_id, kind=SUBSCRIBE, holder=holder, ttl=timedelta(seconds=seconds))


def subscribe_lease_release(*, peer_id: int, holder: str) -> None:
    """Give up ``holder``'s ``subscribe`` lease of peer ``peer_id`` (nothing if it is not held)."""
    peer_lease_release(peer_id=peer_id, kind=SUBSCRIBE, holder=holder)
