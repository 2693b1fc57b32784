"""The outbox's rows (docs/peers.md#the-outbox): queueing a
message for a peer, the outcome of each try, operators' retry and discard, retention.

An ``OutboxMessage`` is ``queued`` until it is ``delivered`` (the peer answered 2xx),
``dead`` (a permanent refusal, or older than ``DISPATCH_OUTBOX_MAX_AGE``) or
``discarded`` (by an operator); its ``AgentMessage`` follows it (``queued`` /
``delivered`` / ``dead``). Every write that makes a row due rings the drain doorbell
(``DOORBELL_GROUP``) after commit. The drain itself — the loop, the per-peer lease, the
signed POSTs — is ``peers.outbox_drain``, which calls these.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from agents import services as agent_services
from agents.messages import message_mark_failed, messages_mark_delivered
from agents.models import Agent, AgentEvent, AgentMessage
from core.errors import DispatchError, NotFound
from core.realtime import ring_on_commit
from peers.models import OutboxMessage, Peer, PeerReceipt
from peers.protocol import OutboxDoorbellMessage

DOORBELL_GROUP = "peers.outbox"  # channel-layer group the drain loop listens on
BACKOFF_BASE = 30.0  # seconds
BACKOFF_CAP = 15 * 60.0  # seconds
BACKOFF_JITTER = 0.2  # ±20 %
DELIVERED_RETENTION = timedelta(days=7)
DEAD_RETENTION = timedelta(days=30)
RECEIPT_RETENTION = timedelta(days=30)
ERROR_MAX = 2000  # characters of ``last_error`` kept

Status = OutboxMessage.Status


# --- enqueueing and the doorbell ---------------------------------------------------------------


def outbox_ring() -> None:
    """Wake every drain loop (``OutboxDoorbellMessage`` to ``DOORBELL_GROUP``) once the
    current transaction commits, at once outside one.

    Best effort, at most once: a lost ring only delays delivery to the next 30 s pass.
    Sync code only; never raises, and never waits for the ring (``core.realtime.ring_on_commit``
    hands a ring made on the database thread to the event loop).
    """
    ring_on_commit(DOORBELL_GROUP, OutboxDoorbellMessage())


def outbox_enqueue(*, message: AgentMessage, peer: Peer, to_agent_id: str, payload: dict[str, Any]) -> OutboxMessage:
    """Queue ``message`` for delivery to agent ``to_agent_id`` on ``peer`` (docs/peers.md#the-outbox).

    Must run inside the transaction that created ``message`` (raises ``RuntimeError``
    otherwise: a message without its outbox row, or the reverse, must never commit).
    ``payload`` is the ``POST /api/v1/peers/messages`` body ``{to_agent_id, content, from}``.
    The row's ``idempotency_key`` is ``message.idempotency_key`` (a fresh UUID when empty,
    written back to the message). Rings the drain doorbell after commit.
    """
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("outbox_enqueue must run in the transaction that writes the message")
    fields: dict[str, Any] = {}
    if message.idempotency_key:
        fields["idempotency_key"] = message.idempotency_key
    row = OutboxMessage.objects.create(message=message, peer=peer, to_agent_id=to_agent_id, payload=payload, **fields)
    if not message.idempotency_key:
        message.idempotency_key = row.idempotency_key
        message.save(update_fields=["idempotency_key"])
    outbox_ring()  # after commit
    return row


def backoff_delay(attempts: int, *, rand: Callable[[], float] | None = None) -> float:
    """Seconds to wait before the next try of a row that failed ``attempts`` times before.

    30 s × 2^attempts, capped at 15 minutes, then ±20 % jitter (``rand()`` in [0, 1),
    default ``random.random``):
    0 → 24–36 s, 1 → 48–72 s, …, ≥ 5 → 720–1080 s.
    """
    base = min(BACKOFF_CAP, BACKOFF_BASE * 2 ** min(max(attempts, 0), 20))
    draw = (rand or random.random)()
    return base * (1 - BACKOFF_JITTER + 2 * BACKOFF_JITTER * draw)


def outbox_backoff_reset(*, peer: Peer | int) -> int:
    """Make ``peer``'s (a row or its id) queued rows due now with their backoff forgotten
    (``attempts`` = 0), then ring the drain doorbell. Called when the peer's stream
    (re)connects (``peers.services.links.peer_reconnected``).

    Returns the number of rows reset.
    """
    peer_id = peer.pk if isinstance(peer, Peer) else int(peer)
    reset = OutboxMessage.objects.filter(peer_id=peer_id, status=Status.QUEUED).update(
        attempts=0, next_attempt_at=timezone.now()
    )
    outbox_ring()  # after commit
    return reset


# --- one row's outcome (the drain's tries) ---------------------------------------------------


def outbox_mark_dead(*, row: OutboxMessage, error: str) -> bool:
    """``queued`` → ``dead`` for ``row`` and its message (``error``, at most 2,000 characters
    kept on the row), and a ``system`` event to the sending agent (unless archived) saying
    the message could not be delivered and why; in one transaction.

    Returns ``False`` (nothing written) when the row is no longer ``queued`` — another
    worker, an operator or an unlink settled it meanwhile.
    """
    now = timezone.now()
    with transaction.atomic():
        if not OutboxMessage.objects.filter(pk=row.pk, status=Status.QUEUED).update(
            status=Status.DEAD, dead_at=now, last_error=error[:ERROR_MAX]
        ):
            return False
        message = AgentMessage.objects.select_related("sender_agent").get(pk=row.message_id)
        message_mark_failed(message=message, error=error, dead=True)
        sender = message.sender_agent
        if sender is not None and sender.status != Agent.Status.ARCHIVED:
            peer = Peer.objects.get(pk=row.peer_id)
            agent_services.agent_event_record(
                agent=sender,
                type=AgentEvent.Type.SYSTEM,
                message=(f"message {message.pk} to {peer.label}:{row.to_agent_id} could not be delivered: {error}")[
                    : agent_services.MAX_EVENT_MESSAGE_LENGTH
                ],
                metadata={"message_id": message.pk, "peer": peer.label, "to_agent_id": row.to_agent_id},
            )
    return True


def outbox_mark_delivered(*, row: OutboxMessage) -> bool:
    """``queued`` → ``delivered`` for ``row`` (the peer answered 2xx) and its message, in one
    transaction. Returns ``False`` (nothing written) when the row is no longer ``queued``."""
    return bool(outbox_mark_delivered_many(rows=[row]))


def outbox_mark_delivered_many(*, rows: list[OutboxMessage]) -> list[int]:
    """``outbox_mark_delivered`` for each of ``rows`` (the peer's batch answer had a 2xx
    receipt for each), in **one** transaction of a fixed number of queries whatever the
    number of rows (not about 18 a row with the write lock held meanwhile):
    the rows still ``queued`` are read (locked), marked ``delivered`` in one UPDATE, and
    their messages marked by ``agents.messages.messages_mark_delivered``.
    Returns the ids of the rows marked, in the order given; a row no longer ``queued`` is
    left as it is."""
    wanted = [row.pk for row in rows]
    if not wanted:
        return []
    now = timezone.now()
    with transaction.atomic():
        queued = dict(
            OutboxMessage.objects.select_for_update()
            .filter(pk__in=wanted, status=Status.QUEUED)
            .values_list("pk", "message_id")
        )
        marked = [pk for pk in dict.fromkeys(wanted) if pk in queued]
        if not marked:
            return []
        OutboxMessage.objects.filter(pk__in=marked).update(status=Status.DELIVERED, delivered_at=now, last_error="")
        messages_mark_delivered(message_ids=[queued[pk] for pk in marked])
    return marked


def outbox_defer(*, row: OutboxMessage, error: str) -> None:
    """A transient failure (unreachable, timeout, 408, 429, 5xx): ``attempts`` + 1 and
    ``next_attempt_at`` = now + ``backoff_delay(row.attempts)`` seconds, ``error`` kept
    (2,000 characters). Nothing happens to a row that is no longer ``queued``."""
    delay = backoff_delay(row.attempts)
    OutboxMessage.objects.filter(pk=row.pk, status=Status.QUEUED).update(
        attempts=row.attempts + 1,
        next_attempt_at=timezone.now() + timedelta(seconds=delay),
        last_error=error[:ERROR_MAX],
    )


# --- retention ---------------------------------------------------------------------------------


def outbox_purge(*, now: datetime | None = None) -> dict[str, int]:
    """Delete what retention allows (docs/peers.md#the-outbox): delivered rows after 7 days, dead and
    discarded rows after 30, peer receipts after 30. Returns counts by kind."""
    clock = now or timezone.now()
    delivered, _ = OutboxMessage.objects.filter(
        status=Status.DELIVERED, delivered_at__lt=clock - DELIVERED_RETENTION
    ).delete()
    dead, _ = OutboxMessage.objects.filter(
        Q(status=Status.DEAD) | Q(status=Status.DISCARDED), dead_at__lt=clock - DEAD_RETENTION
    ).delete()
    receipts, _ = PeerReceipt.objects.filter(created_at__lt=clock - RECEIPT_RETENTION).delete()
    return {"delivered": delivered, "dead": dead, "receipts": receipts}


# --- operators: retry and discard --------------------------------------------------------------


def _row_for(user: User, outbox_id: Any) -> OutboxMessage:
    try:
        pk = int(outbox_id)
    except (TypeError, ValueError):
        raise NotFound("no such outbox row") from None
    rows = OutboxMessage.objects.select_for_update().filter(pk=pk)
    if not user.is_superuser:
        rows = rows.filter(peer__owner=user)
    row = rows.first()
    if row is None:
        raise NotFound(f"no outbox row {pk}")
    return row


@transaction.atomic
def outbox_retry(*, user: User, outbox_id: Any) -> OutboxMessage:
    """Queue a ``dead`` or ``discarded`` row again (UI and admin): ``queued``,
    attempts 0, due now, and a fresh age (``created_at`` = now, so it queues behind the
    peer's current mail and is not dead-lettered by age at once); its message goes back
    to ``queued``. Rings the doorbell after commit.

    ``user``: the link's user (or a superuser). Raises ``NotFound`` for another user's or
    an unknown row, ``DispatchError("CONFLICT")`` for a queued or delivered row or a
    revoked peer.
    """
    row = _row_for(user, outbox_id)
    if row.status not in (Status.DEAD, Status.DISCARDED):
        raise DispatchError("CONFLICT", f"outbox row {row.pk} is {row.status}: only dead or discarded rows are retried")
    if not Peer.objects.filter(pk=row.peer_id, revoked_at__isnull=True).exists():
        raise DispatchError("CONFLICT", f"outbox row {row.pk} is for a revoked link")
    now = timezone.now()
    row.status = Status.QUEUED
    row.attempts = 0
    row.next_attempt_at = now
    row.created_at = now
    row.dead_at = None
    row.last_error = ""
    row.save(update_fields=["status", "attempts", "next_attempt_at", "created_at", "dead_at", "last_error"])
    AgentMessage.objects.filter(pk=row.message_id).update(status=AgentMessage.Status.QUEUED, error="")
    outbox_ring()  # after commit
    return row


@transaction.atomic
def outbox_discard(*, user: User, outbox_id: Any) -> OutboxMessage:
    """Give up a ``queued`` or ``dead`` row for good (UI and admin): ``discarded``,
    never sent; a queued message becomes ``dead`` with the error "discarded by <user>".

    Raises ``NotFound`` for another user's or an unknown row, ``DispatchError("CONFLICT")``
    for a delivered or already discarded row.
    """
    row = _row_for(user, outbox_id)
    if row.status not in (Status.QUEUED, Status.DEAD):
        raise DispatchError("CONFLICT", f"outbox row {row.pk} is {row.status}: only queued or dead rows are discarded")
    error = f"discarded by {user.get_username()}"
    row.status = Status.DISCARDED
    row.dead_at = row.dead_at or timezone.now()
    row.last_error = (row.last_error + "; " if row.last_error else "") + error
    row.save(update_fields=["status", "dead_at", "last_error"])
    message = AgentMessage.objects.get(pk=row.message_id)
    if message.status == AgentMessage.Status.QUEUED:
        message_mark_failed(message=message, error=error, dead=True)
    return row
