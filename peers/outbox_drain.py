"""The outbox drain: delivering messages to peers (docs/peers.md#the-outbox).

A message to an agent on a peer is written as an ``AgentMessage`` (status ``queued``) and
an ``OutboxMessage`` in **one transaction** (``peers.services.outbox.outbox_enqueue``); the
drain doorbell is rung after commit. ``outbox_drain_loop`` (a background service) drains
every 30 s and whenever rung: peers concurrently, each under a per-peer drain lease (``PeerLease`` kind
``drain``), that peer's rows in order, at most 50 per pass, stopping at the first
transient failure (so one closed laptop never holds another peer's mail).

To a peer that announced the feature ``messages.batch`` (``Peer.features``: from the
pairing claim or its answer, then the ``Dispatch-Peer-Features`` header of its every
request and answer) the rows go in batches: one signed ``POST
/api/v1/peers/messages/batch`` carries up to ``DISPATCH_PEER_BATCH_MESSAGES`` (default 50)
rows in order, each under its own key, bounded by ``batch_max_bytes``; its answer has a
receipt per row, and each receipt is judged exactly like the answer to that row's own
POST below. A whole batch answered 408/429/5xx or unreachable defers its first row; one
answered another 4xx (a peer that no longer serves the route) is sent again one by one.
A peer that did not announce it gets one POST per row.

Outcomes of one POST ``/api/v1/peers/messages`` (header ``Idempotency-Key``):

- 2xx → ``delivered`` (a repeated key answered ``{"duplicate": true}`` counts: the peer
  had it already, e.g. after a crash between sending and marking);
- 409 and every other 4xx except 408/429 → permanent: ``dead`` at once, the sending agent
  gets a ``system`` event saying why, and the drain goes on with the next row;
- anything else (unreachable, timeout, 408, 429, 5xx) → transient: ``attempts`` + 1 and
  ``next_attempt_at`` = now + 30 s × 2^(earlier attempts) ±20 % jitter, capped at 15 min;
  the peer's drain stops for this pass.

A row older than ``DISPATCH_OUTBOX_MAX_AGE`` seconds (default 7 days) is dead-lettered
instead of sent. The ``AgentMessage`` follows its row: ``queued`` / ``delivered`` /
``dead``. Retention (``outbox_purge``, run by the loop once an hour): delivered rows 7 days,
dead and discarded rows 30 days, ``PeerReceipt`` rows 30 days.

Every write — the rows' outcomes, the lease, retention — is a service
(``peers.services.outbox``, ``peers.services.leases``); this module holds the loop, the
reads that pick the rows, and the signed POSTs (``peers.client``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import httpx
from channels.db import database_sync_to_async
from django.conf import settings
from django.utils import timezone

from core.realtime import LoopHealth, Subscription
from peers.client import PeerClient, PeerUnreachable
from peers.keys import FEATURE_MESSAGES_BATCH
from peers.models import OutboxMessage, Peer
from peers.protocol import BATCH_MAX_MESSAGES, OutboxDoorbellMessage
from peers.services.leases import DRAIN_LEASE_TTL, drain_lease_claim, drain_lease_release
from peers.services.outbox import (
    DOORBELL_GROUP,
    outbox_defer,
    outbox_mark_dead,
    outbox_mark_delivered,
    outbox_mark_delivered_many,
    outbox_purge,
)

logger = logging.getLogger("peers.outbox")  # the name operators and log filters know it by

DRAIN_INTERVAL = 30.0  # seconds between drain passes when nobody rings
BATCH = 50  # rows per peer per pass
# Seconds for one POST /api/v1/peers/messages: half the drain lease (30 s of its 60 s).
SEND_TIMEOUT = DRAIN_LEASE_TTL.total_seconds() / 2
# Before a row is sent the lease is renewed if it was last claimed this long ago: a send
# starts at most 15 s after a claim and ends 30 s later at most, well inside the 60 s TTL.
LEASE_RENEW_AFTER = SEND_TIMEOUT / 2  # seconds
PURGE_INTERVAL = 3600.0  # seconds between retention purges of one drain loop
MESSAGES_PATH = "/api/v1/peers/messages"
BATCH_PATH = "/api/v1/peers/messages/batch"  # feature messages.batch
# Delivered rows of a batch marked per transaction (and per call on the shared sync thread):
# marking costs ~6 ms a row, so 10 keep each call near 60 ms instead of ~300 ms for 50.
MARK_GROUP = 10

Status = OutboxMessage.Status


# --- the peer's answers and the rows to send ----------------------------------------------------


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
        message = body["error"]["message"]
        if isinstance(message, str) and message:
            return f"{response.status_code}: {message}"
    except (ValueError, KeyError, TypeError):
        logger.debug("peer answered %s without an error body", response.status_code)
    return f"{response.status_code}: {response.text[:300] or response.reason_phrase}"


def is_permanent(status_code: int) -> bool:
    """Whether an answer of ``status_code`` must never be retried: 409 and every 4xx but 408 and 429."""
    return 400 <= status_code < 500 and status_code not in (408, 429)


def _due_rows(peer_id: int, limit: int = 0) -> list[OutboxMessage]:
    return list(
        OutboxMessage.objects.filter(peer_id=peer_id, status=Status.QUEUED).order_by("created_at", "id")[
            : limit or BATCH
        ]
    )


def _live_peer(peer_id: int) -> Peer | None:
    return Peer.objects.filter(pk=peer_id, revoked_at__isnull=True).first()


def _peers_with_mail(now: datetime | None = None) -> list[int]:
    now = now or timezone.now()
    return sorted(
        set(
            OutboxMessage.objects.filter(
                status=Status.QUEUED, peer__revoked_at__isnull=True, next_attempt_at__lte=now
            ).values_list("peer_id", flat=True)
        )
    )


# --- draining ----------------------------------------------------------------------------------


@dataclass
class PeerDrain:
    """What one drain pass did for one peer: row ids per outcome, and why it stopped early."""

    peer_id: int
    delivered: list[int] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)
    deferred: list[int] = field(default_factory=list)  # transient failure: retried later
    skipped: str = ""  # "lease held elsewhere", "not due", "revoked"


def _db(function: Callable[..., Any]) -> Callable[..., Any]:
    return database_sync_to_async(function)


async def outbox_drain_peer(peer_id: int, *, holder: str, now: datetime | None = None) -> PeerDrain:
    """One pass over ``peer_id``'s queued rows, in order, under its drain lease.

    Takes the lease (another holder's live lease → ``skipped = "lease held elsewhere"``,
    nothing sent), renews it before a row once ``LEASE_RENEW_AFTER`` seconds have passed
    since the last claim (lost → ``skipped = "lease lost"``, stop), sends at most ``BATCH``
    rows, stops at the first transient failure or at the first row not yet due
    (``next_attempt_at`` in the future: later rows never overtake it), releases the lease.
    ``now`` (tests) replaces the clock for the age and due checks.
    """
    report = PeerDrain(peer_id=peer_id)
    claimed_at = asyncio.get_running_loop().time()  # before the claim: the lease lasts at least that long
    if not await _db(drain_lease_claim)(peer_id=peer_id, holder=holder):
        report.skipped = "lease held elsewhere"
        return report
    try:
        peer = await _db(_live_peer)(peer_id)
        if peer is None:
            report.skipped = "revoked"
            return report
        async with PeerClient(peer, timeout=SEND_TIMEOUT).session() as client:  # one connection per pass
            await _send_due_rows(peer, client=client, holder=holder, claimed_at=claimed_at, now=now, report=report)
    finally:
        try:
            await _db(drain_lease_release)(peer_id=peer_id, holder=holder)
        except Exception:
            logger.exception("could not release the drain lease of peer %s; it expires by itself", peer_id)
    return report


def batch_size_for(peer: Peer) -> int:
    """Messages per signed POST to ``peer``: ``DISPATCH_PEER_BATCH_MESSAGES`` (at most the
    receiver's ``BATCH_MAX_MESSAGES``) when it announced ``messages.batch``, else 1 (one
    ``POST /api/v1/peers/messages`` a message, what every peer understands)."""
    if not peer.announces(FEATURE_MESSAGES_BATCH):
        return 1
    return max(1, min(int(settings.PEER_BATCH_MESSAGES), BATCH_MAX_MESSAGES))


def batch_max_bytes() -> int:
    """Bytes of message bodies one batch may carry: half the body cap
    (``DISPATCH_MAX_REQUEST_BYTES``, 16 MiB by default, which the peer's ``serve`` enforces
    too), so the JSON envelope and a peer with the default cap always fit. A single message
    larger than that still goes, alone."""
    return int(settings.MAX_REQUEST_BYTES) // 2


def _entry_bytes(row: OutboxMessage) -> int:
    return len(json.dumps(row.payload, separators=(",", ":"))) + len(row.idempotency_key) + 24


def _next_chunk(rows: list[OutboxMessage], start: int, size: int) -> list[OutboxMessage]:
    """Up to ``size`` rows from ``rows[start:]`` whose bodies fit ``batch_max_bytes()`` (the
    first always goes)."""
    budget = batch_max_bytes()
    chunk: list[OutboxMessage] = []
    used = 0
    for row in rows[start : start + size]:
        cost = _entry_bytes(row) if size > 1 else 0
        if chunk and used + cost > budget:
            break
        chunk.append(row)
        used += cost
    return chunk


def _receipt_error(status: int, body: Any) -> str:
    try:
        message = body["error"]["message"]
        if isinstance(message, str) and message:
            return f"{status}: {message}"
    except (KeyError, TypeError):
        pass
    return f"{status}: {json.dumps(body)[:300]}"


def _batch_receipts(response: httpx.Response, chunk: list[OutboxMessage]) -> list[tuple[int, Any]] | None:
    """``(status, body)`` per row of ``chunk`` that the batch answer has a receipt for, in
    order (the answer may end early, at its first 503); ``None`` when the answer is not
    one: not JSON, no receipt, more receipts than rows, or a receipt for another key."""
    try:
        answered = response.json()["receipts"]
        if not isinstance(answered, list) or not 0 < len(answered) <= len(chunk):
            return None
        out: list[tuple[int, Any]] = []
        for row, receipt in zip(chunk, answered, strict=False):
            if receipt["idempotency_key"] != row.idempotency_key or not isinstance(receipt["status"], int):
                return None
            out.append((receipt["status"], receipt.get("body")))
        return out
    except (ValueError, KeyError, TypeError):
        return None


class _Next:
    """What the drain does after a POST: go on, stop this pass, or resend these rows one by one."""

    GO_ON = "go on"
    STOP = "stop"
    SINGLES = "singles"


async def _send_single(client: PeerClient, row: OutboxMessage, report: PeerDrain) -> str:
    """One ``POST /api/v1/peers/messages`` for ``row``, its outcome recorded."""
    try:
        response = await client.post(MESSAGES_PATH, row.payload, idempotency_key=row.idempotency_key)
    except PeerUnreachable as exc:
        await _db(outbox_defer)(row=row, error=exc.message)
        report.deferred.append(row.pk)
        return _Next.STOP
    if 200 <= response.status_code < 300:
        if await _db(outbox_mark_delivered)(row=row):
            report.delivered.append(row.pk)
    elif is_permanent(response.status_code):
        if await _db(outbox_mark_dead)(row=row, error=_error_text(response)):
            report.dead.append(row.pk)
    else:
        await _db(outbox_defer)(row=row, error=_error_text(response))
        report.deferred.append(row.pk)
        return _Next.STOP
    return _Next.GO_ON


async def _send_batch(client: PeerClient, chunk: list[OutboxMessage], report: PeerDrain) -> tuple[str, int]:
    """One ``POST /api/v1/peers/messages/batch`` for ``chunk`` (its rows in order, each under
    its own key; the request under a fresh key) and each receipt's outcome recorded as a
    single POST's would be: 2xx → ``delivered`` (``MARK_GROUP`` rows a transaction),
    permanent → ``dead`` and on with the next, transient → deferred and stop.

    Returns (what next, rows settled). The whole request unreachable or answered 408, 429,
    5xx, or an unusable answer → the first row deferred, stop. Answered another 4xx (an
    instance that no longer serves the route, a body over its cap…) → ``SINGLES``: these
    rows go again one by one, where the single route's rules decide each.
    """
    body = {"messages": [{"idempotency_key": row.idempotency_key, **row.payload} for row in chunk]}
    try:
        response = await client.post(BATCH_PATH, body)
    except PeerUnreachable as exc:
        await _db(outbox_defer)(row=chunk[0], error=exc.message)
        report.deferred.append(chunk[0].pk)
        return _Next.STOP, 0
    if not 200 <= response.status_code < 300:
        if is_permanent(response.status_code):
            logger.info("peer %s refused a batch (%s): sending one by one", client.peer.label, _error_text(response))
            return _Next.SINGLES, 0
        await _db(outbox_defer)(row=chunk[0], error=_error_text(response))
        report.deferred.append(chunk[0].pk)
        return _Next.STOP, 0
    answered = _batch_receipts(response, chunk)
    if answered is None:
        await _db(outbox_defer)(row=chunk[0], error=f"{response.status_code}: an unusable batch answer")
        report.deferred.append(chunk[0].pk)
        return _Next.STOP, 0
    delivered: list[OutboxMessage] = []

    async def settle_delivered() -> None:
        # MARK_GROUP rows a call: each call holds Channels' one shared sync thread (and, on
        # SQLite, the write lock), and the REST requests that enqueue more mail wait for it.
        for start in range(0, len(delivered), MARK_GROUP):
            group = delivered[start : start + MARK_GROUP]
            report.delivered.extend(await _db(outbox_mark_delivered_many)(rows=group))
        delivered.clear()

    for row, (status, receipt_body) in zip(chunk, answered, strict=False):
        if 200 <= status < 300:
            delivered.append(row)
            continue
        await settle_delivered()
        error = _receipt_error(status, receipt_body)
        if is_permanent(status):
            if await _db(outbox_mark_dead)(row=row, error=error):
                report.dead.append(row.pk)
        else:
            await _db(outbox_defer)(row=row, error=error)
            report.deferred.append(row.pk)
            return _Next.STOP, 0
    await settle_delivered()
    return _Next.GO_ON, len(answered)


async def _send_due_rows(
    peer: Peer, *, client: PeerClient, holder: str, claimed_at: float, now: datetime | None, report: PeerDrain
) -> None:
    """The body of ``outbox_drain_peer``: send the due rows in order, recording outcomes —
    in batches of ``batch_size_for(peer)`` (bounded by ``batch_max_bytes``) to a peer that
    announced ``messages.batch``, one POST a row otherwise.

    ``claimed_at``: the event loop's clock (seconds) just before the pass claimed its lease.
    """
    max_age = timedelta(seconds=settings.OUTBOX_MAX_AGE)
    loop = asyncio.get_running_loop()
    size = batch_size_for(peer)
    ready: list[OutboxMessage] = []
    for row in await _db(_due_rows)(peer.pk, max(BATCH, size)):
        clock = now or timezone.now()
        if row.created_at < clock - max_age:
            why = f"not delivered within {_age_text(max_age)} (last error: {row.last_error or 'none'})"
            if await _db(outbox_mark_dead)(row=row, error=why):
                report.dead.append(row.pk)
            continue
        if row.next_attempt_at > clock:
            report.skipped = "not due"  # later rows never overtake it
            break
        ready.append(row)
    index = 0
    while index < len(ready):
        if loop.time() - claimed_at >= LEASE_RENEW_AFTER:
            if not await _db(drain_lease_claim)(peer_id=peer.pk, holder=holder):
                report.skipped = "lease lost"
                return
            claimed_at = loop.time()
        chunk = _next_chunk(ready, index, size)
        if len(chunk) == 1:
            step, settled = await _send_single(client, chunk[0], report), 1
        else:
            step, settled = await _send_batch(client, chunk, report)
        if step == _Next.STOP:
            return
        if step == _Next.SINGLES:
            size = 1
        index += settled


def _age_text(age: timedelta) -> str:
    seconds = int(age.total_seconds())
    if seconds % 86400 == 0:
        return f"{seconds // 86400} days"
    if seconds % 3600 == 0:
        return f"{seconds // 3600} hours"
    return f"{seconds} seconds"


async def outbox_drain_once(*, holder: str, now: datetime | None = None) -> list[PeerDrain]:
    """One drain pass: every live peer with a due queued row, drained **concurrently**
    (``outbox_drain_peer``); a peer whose drain crashes is logged and does not affect the
    others. Returns the per-peer reports, in peer id order."""
    peer_ids = await _db(_peers_with_mail)(now)

    async def one(peer_id: int) -> PeerDrain:
        try:
            return await outbox_drain_peer(peer_id, holder=holder, now=now)
        except Exception:
            logger.exception("draining the outbox of peer %s failed", peer_id)
            return PeerDrain(peer_id=peer_id, skipped="crashed")

    return list(await asyncio.gather(*(one(peer_id) for peer_id in peer_ids)))


async def _drain_until_idle(peer_id: int, *, holder: str, rung: set[int] | None = None) -> None:
    """Drain ``peer_id`` pass after pass while each pass sends a full ``BATCH`` (a backlog
    goes on at once instead of waiting for the next ring or ``DRAIN_INTERVAL``), or while
    the drain loop put ``peer_id`` in ``rung`` during the pass (new mail arrived after the
    pass had read its rows: without another pass it would wait for the next ring or
    ``DRAIN_INTERVAL``, up to 30 s). Stops at a short pass nobody rang for, a transient
    failure, a row not yet due or a lease held elsewhere."""
    while True:
        if rung is not None:
            rung.discard(peer_id)
        try:
            report = await outbox_drain_peer(peer_id, holder=holder)
        except Exception:
            logger.exception("draining the outbox of peer %s failed", peer_id)
            return
        if report.skipped or report.deferred:
            return
        full = len(report.delivered) + len(report.dead) >= BATCH
        if not full and (rung is None or peer_id not in rung):
            return


async def outbox_drain_loop() -> None:
    """Background service (``dispatch.background.background_services``): drain every
    ``DRAIN_INTERVAL`` seconds and whenever ``DOORBELL_GROUP`` rings; purge by retention
    once an hour. The lease holder id is this process's id plus a random suffix."""
    from core.presence import current_process_id

    holder = f"{current_process_id()}.{secrets.token_hex(3)}"
    last_purge = 0.0
    loop = asyncio.get_running_loop()
    drains: dict[int, asyncio.Task[None]] = {}
    rung: set[int] = set()  # peers with mail that arrived while their drain was running
    health = LoopHealth("outbox drain pass", log=logger, cap=DRAIN_INTERVAL)
    # Joined before the first pass, renewed every pass's length; while the layer is down
    # the doorbell retries with backoff up to the drain interval, the drain goes on polling.
    doorbell = Subscription(
        DOORBELL_GROUP,
        receives=[OutboxDoorbellMessage],
        health=LoopHealth("outbox doorbell", log=logger, cap=DRAIN_INTERVAL),
        rejoin_every=DRAIN_INTERVAL,
    )
    await doorbell.open()
    try:
        while True:
            try:
                # Each peer drains in a task of its own: a peer that times out (30 s) never
                # holds up another peer's mail, and a peer with a backlog goes on at once.
                for peer_id in await _db(_peers_with_mail)():
                    running = drains.get(peer_id)
                    if running is None or running.done():
                        drains[peer_id] = asyncio.create_task(_drain_until_idle(peer_id, holder=holder, rung=rung))
                    else:
                        rung.add(peer_id)  # the running drain makes one more pass
                for peer_id in [pk for pk, task in drains.items() if task.done()]:
                    del drains[peer_id]
                if loop.time() - last_purge >= PURGE_INTERVAL:
                    await _db(outbox_purge)()
                    last_purge = loop.time()
            except Exception as exc:
                await health.pause(exc)
                continue
            health.ok()
            await doorbell.wait(DRAIN_INTERVAL)
    finally:
        for task in drains.values():
            task.cancel()
        await asyncio.gather(*drains.values(), return_exceptions=True)
        await doorbell.close()
