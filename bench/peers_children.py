"""The child modes of bench/peers.py (``peers.py <mode> --out PATH …``, started by
``peers_common.run_child``): Django set up with one instance's settings, one step each
(the bare signed POST loop, queueing and draining outbox rows, reading both databases);
each writes its JSON to ``--out``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from peers_common import BENCH

# --- child modes: run with an instance's environment ------------------------------------------


def _django() -> None:
    # bench/machines.py would shadow the `machines` package of the project.
    sys.path[:] = [entry for entry in sys.path if entry and Path(entry).resolve() != BENCH]
    import django

    django.setup()


def signed_loop(output: Path, *, label: str, agent_id: str, count: int, prefix: str) -> None:
    """The B8 baseline, in a child with A's settings: ``count`` sequential signed
    ``POST /api/v1/peers/messages`` to agent ``agent_id`` on peer ``label`` over one
    keep-alive ``httpx.Client`` (a fresh ``Idempotency-Key`` each, signed with A's key by
    ``peers.auth.sign_request_with_key``). Writes ``{count, seconds, statuses}`` to ``output``.
    """
    _django()
    import httpx

    from core import secrets_at_rest
    from peers.auth import sign_request_with_key
    from peers.models import Peer
    from peers.services.identity import identity_get

    peer = Peer.objects.get(label=label, revoked_at__isnull=True)
    identity = identity_get()
    token = secrets_at_rest.decrypt(peer.outbound_token_encrypted).decode()
    url = peer.url.rstrip("/") + "/api/v1/peers/messages"
    sender = {"instance_id": identity.instance_id, "agent_id": None, "name": "bench"}
    statuses: Counter[int] = Counter()
    with httpx.Client(timeout=30) as client:
        started = time.perf_counter()
        for index in range(count):
            body = {"to_agent_id": agent_id, "content": f"{prefix}{index:05d}", "from": sender}
            request = client.build_request(
                "POST",
                url,
                content=json.dumps(body, separators=(",", ":")).encode(),
                headers={
                    "Content-Type": "application/json",
                    "Authorization": f"Bearer {token}",
                    "Idempotency-Key": str(uuid.uuid4()),
                },
            )
            sign_request_with_key(request, private_key=identity.private_key, keyid=identity.fingerprint)
            statuses[client.send(request).status_code] += 1
        seconds = time.perf_counter() - started
    output.write_text(json.dumps({"count": count, "seconds": seconds, "statuses": dict(statuses)}))


def dump_received(output: Path, *, prefix: str) -> None:
    """In a child with B's settings: every ``AgentMessage`` whose content starts with
    ``prefix``, by id: ``[[id, idempotency_key, content, created_at epoch seconds], ...]``."""
    _django()
    from agents.models import AgentMessage

    rows = AgentMessage.objects.filter(content__startswith=prefix).order_by("id")
    output.write_text(
        json.dumps([[m.pk, m.idempotency_key, m.content, m.created_at.timestamp()] for m in rows.iterator()])
    )


def dump_outbox(output: Path, *, prefix: str) -> None:
    """In a child with A's settings: the outbox rows whose payload content starts with
    ``prefix``, in drain order (``created_at``, id): ``[[peer label, idempotency_key,
    content, status, attempts, last_error], ...]``."""
    _django()
    from peers.models import OutboxMessage

    rows = OutboxMessage.objects.select_related("peer").order_by("created_at", "id")
    out = []
    for row in rows.iterator():
        content = str(row.payload.get("content", ""))
        if content.startswith(prefix):
            out.append([row.peer.label, row.idempotency_key, content, row.status, row.attempts, row.last_error])
    output.write_text(json.dumps(out))


def enqueue(output: Path, *, label: str, agent_id: str, count: int, prefix: str, holder: str = "") -> None:
    """In a child with A's settings: ``count`` messages from A's admin to agent ``agent_id``
    on peer ``label`` through the service (``peers.services.outgoing.peer_message_send``: message
    and outbox row in one transaction). The doorbell rings in this process only, so A's
    server is not woken. With ``holder``, the peer's drain lease is first taken for 10
    minutes in that name (waiting up to 60 s for A's server to release it), so A's own drain
    loop, which also polls every 30 s, stays off these rows. Writes ``{count, seconds}``."""
    _django()
    from datetime import timedelta

    from peers.models import Peer
    from peers.services.leases import drain_lease_claim
    from peers.services.outgoing import peer_message_send

    peer = Peer.objects.select_related("owner").get(label=label, revoked_at__isnull=True)
    if holder:
        deadline = time.monotonic() + 60
        while not drain_lease_claim(peer_id=peer.pk, holder=holder, ttl=timedelta(minutes=10)):
            if time.monotonic() > deadline:
                raise SystemExit(f"the drain lease of {label} stayed held elsewhere for 60 s")
            time.sleep(0.1)
    started = time.perf_counter()
    for index in range(count):
        peer_message_send(user=peer.owner, sender_agent=None, peer=peer, to_agent_id=agent_id,
                          content=f"{prefix}0-{index:05d}")  # fmt: skip
    output.write_text(json.dumps({"count": count, "seconds": time.perf_counter() - started}))


def drain(output: Path, *, label: str, holder: str) -> None:
    """In a child with A's settings: ``peers.outbox_drain.outbox_drain_peer`` passes for peer
    ``label``, back to back, until a pass delivers nothing; no REST load, no doorbell. The
    passes hold the drain lease ``enqueue`` took as ``holder`` until the end (a pass would
    release it, and A's own drain loop could take it between two passes).
    Each step of a row is timed by wrapping the outbox module's functions (the database
    steps run through ``database_sync_to_async``, so their time includes the thread hop).
    Writes ``{delivered, seconds, passes, skipped, steps: {name: {calls, seconds}}}``."""
    _django()
    import peers.outbox_drain as outbox
    from peers.client import PeerClient
    from peers.models import Peer

    steps: dict[str, dict[str, float]] = {}

    def timed(name: str, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                entry = steps.setdefault(name, {"calls": 0, "seconds": 0.0})
                entry["calls"] += 1
                entry["seconds"] += time.perf_counter() - began

        return wrapper

    release_lease = outbox.drain_lease_release
    outbox.drain_lease_release = lambda **kwargs: None  # kept until every pass is done
    for name in (
        "drain_lease_claim",
        "drain_lease_release",
        "_due_rows",
        "_live_peer",
        "outbox_mark_delivered",
        "outbox_mark_delivered_many",  # a batch's delivered rows, one transaction (messages.batch)
    ):
        if hasattr(outbox, name):
            setattr(outbox, name, timed(name, getattr(outbox, name)))
    original_db = outbox._db

    def db_hop(function: Any) -> Any:  # the whole database_sync_to_async call, thread hop included
        wrapped = original_db(function)

        async def call(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return await wrapped(*args, **kwargs)
            finally:
                entry = steps.setdefault("database_sync_to_async (all, incl. hop)", {"calls": 0, "seconds": 0.0})
                entry["calls"] += 1
                entry["seconds"] += time.perf_counter() - began

        return call

    outbox._db = db_hop
    original_post = PeerClient.post

    async def post(self: Any, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return await original_post(self, *args, **kwargs)
        finally:
            entry = steps.setdefault("PeerClient.post (signed POST: one row, or a batch)", {"calls": 0, "seconds": 0.0})
            entry["calls"] += 1
            entry["seconds"] += time.perf_counter() - began

    PeerClient.post = post  # type: ignore[method-assign]
    peer = Peer.objects.get(label=label, revoked_at__isnull=True)

    async def passes() -> dict[str, Any]:
        delivered, count, skipped = 0, 0, Counter[str]()
        began = time.perf_counter()
        while True:
            report = await outbox.outbox_drain_peer(peer.pk, holder=holder)
            count += 1
            if report.skipped:
                skipped[report.skipped] += 1
            delivered += len(report.delivered)
            if not report.delivered and not report.skipped:
                break
            if report.skipped:
                if count > 10_000:
                    break
                await asyncio.sleep(0.01)
        return {"delivered": delivered, "seconds": time.perf_counter() - began, "passes": count,
                "skipped": dict(skipped)}  # fmt: skip

    result = asyncio.run(passes())
    release_lease(peer_id=peer.pk, holder=holder)
    output.write_text(json.dumps({**result, "steps": steps}))


def due_now(output: Path, *, label: str) -> None:
    """In a child with A's settings: make peer ``label``'s queued outbox rows due now with
    their backoff forgotten (as a reconnect does, ``peers.services.outbox.outbox_backoff_reset``).
    Writes ``{"reset": n}``."""
    _django()
    from django.utils import timezone

    from peers.models import OutboxMessage

    reset = OutboxMessage.objects.filter(peer__label=label, status=OutboxMessage.Status.QUEUED).update(
        attempts=0, next_attempt_at=timezone.now()
    )
    output.write_text(json.dumps({"reset": reset}))


def discard_queued(output: Path, *, label: str) -> None:
    """In a child with A's settings: peer ``label``'s still-queued outbox rows become
    ``discarded`` (the leftovers of an incomplete phase, so the next phase starts with an
    empty queue). Writes ``{"discarded": n}``."""
    _django()
    from peers.models import OutboxMessage

    discarded = OutboxMessage.objects.filter(peer__label=label, status=OutboxMessage.Status.QUEUED).update(
        status=OutboxMessage.Status.DISCARDED
    )
    output.write_text(json.dumps({"discarded": discarded}))
