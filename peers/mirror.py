"""The mirroring subscriber: one event stream per live peer, kept as shadows (docs/peers.md#shadow-agents).

``mirror_loop`` is a background service (``dispatch.background``). It scans the live
peers every ``RESCAN_SECONDS`` and whenever its doorbell group ``peers.mirror`` rings
(``mirror_rescan``, ``mirror_resnapshot``), and runs one subscriber task per peer whose
``PeerLease`` of kind ``subscribe`` this process holds (so only one process subscribes to
a given peer; the lease, ``peers.services.leases.subscribe_lease_claim``, lasts three
minutes and is renewed on every scan). A subscriber is restarted when the peer's url or
outbound token changes, and stopped when the peer is revoked.

A subscriber (``subscribe_peer``) opens ``GET /api/v1/peers/events`` with
``peers.client.PeerClient.stream_events`` (read timeout ``READ_TIMEOUT`` seconds, so a
peer that vanished without closing the connection is noticed) and applies each frame
through ``peers.services.shadows``: ``snapshot`` → clear ``stale`` (with a "contact
restored with <peer>" event on each shadow that lost contact), upsert every agent, reap the
unlisted; ``agent.upsert`` → upsert one. On the first snapshot of a connection it
stamps ``last_seen_at`` and tells the outbox the peer is back
(``peers.services.links.peer_reconnected``, which also rings the drain doorbell); while
connected ``last_seen_at`` is stamped at most once per ``LAST_SEEN_INTERVAL``. When the
stream drops, the peer's shadows become stale (``shadows_mark_stale``) and it reconnects
after ``BACKOFF_BASE`` × 2^n seconds (max ``BACKOFF_MAX``, ±20 % jitter). ``DISPATCH_PEER_BACKOFF_SCALE``
(environment, a float, default 1) scales these waits — for tests only.

Every write is a service (``peers.services``: shadows, links, leases, pairing); this module
holds the loop, the stream's parsing and the HTTP connection (``peers.client``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from channels.db import database_sync_to_async
from django.conf import settings
from django.db import transaction
from django.db.models import Count, Max, Q
from django.utils import timezone

from core.presence import current_process_id
from core.realtime import (
    PEERS_MIRROR_GROUP,
    LoopHealth,
    Subscription,
    ring_on_commit,
)
from peers.models import Peer
from peers.protocol import MirrorRescanMessage, MirrorResnapshotMessage
from peers.services import shadows
from peers.services.leases import subscribe_lease_claim, subscribe_lease_release
from peers.services.links import peer_reconnected, peer_seen_stamp
from peers.services.pairing import peer_mark_unlinked_by_peer

logger = logging.getLogger(__name__)

DOORBELL_GROUP = PEERS_MIRROR_GROUP  # defined in core.realtime: pairing rings it too
RESCAN_SECONDS = 60.0
READ_TIMEOUT = 45.0
BACKOFF_BASE = 5.0
BACKOFF_MAX = 60.0
LAST_SEEN_INTERVAL = 60.0
EVENTS_PATH = "/api/v1/peers/events"


def backoff_scale() -> float:
    """``settings.PEER_BACKOFF_SCALE`` (``DISPATCH_PEER_BACKOFF_SCALE``, a test knob, default 1.0)."""
    return float(settings.PEER_BACKOFF_SCALE)


def reconnect_delay(failures: int) -> float:
    """Seconds to wait before reconnect attempt ``failures`` (0-based): ``BACKOFF_BASE`` ×
    2^failures capped at ``BACKOFF_MAX``, times a ±20 % jitter (the cap holds after it), scaled."""
    delay = min(BACKOFF_BASE * 2 ** min(failures, 16), BACKOFF_MAX)
    jitter = random.uniform(0.8, 1.2)  # noqa: S311  (jitter, not a secret)
    return min(delay * jitter, BACKOFF_MAX) * backoff_scale()


# --- doorbell ----------------------------------------------------------------------------


def mirror_rescan() -> None:
    """Ask every process's subscriber to rescan the peer list now (after commit; sync code).

    Call it after a link is created, changed or revoked.
    """
    ring_on_commit(DOORBELL_GROUP, MirrorRescanMessage())


def mirror_resnapshot(peer_id: int) -> None:
    """Ask the process subscribed to peer ``peer_id`` to reconnect now, which brings a fresh
    snapshot (after commit; sync code). Used after launching an agent on the peer (docs/peers.md#using-a-link)."""
    ring_on_commit(DOORBELL_GROUP, MirrorResnapshotMessage(peer_id=int(peer_id)))


# --- one peer ----------------------------------------------------------------------------


class StreamRefused(Exception):
    """The peer answered the events request with another status than 200."""

    def __init__(self, status: int, body: str, *, invalid_token: bool = False) -> None:
        super().__init__(f"events stream refused with HTTP {status}: {body}")
        self.status = status
        # 401 with ``WWW-Authenticate: Bearer error="invalid_token"``: the peer does not know
        # our token any more (it unlinked us) — not a signature or clock problem.
        self.invalid_token = invalid_token


def _live_peer(peer_id: int) -> Peer | None:
    return Peer.objects.select_related("owner").filter(pk=peer_id, revoked_at__isnull=True).first()


def apply_event(peer: Peer, event: str, data: str) -> bool:
    """Apply one server-sent event of a peer's stream; True for a ``snapshot``.

    ``snapshot`` → ``shadows.shadows_apply_snapshot``; ``agent.upsert`` →
    ``shadows.shadow_apply_frame``. Malformed frames are logged and skipped; other event
    names are ignored. This is the stream's parser (like a consumer's): the writes are
    those services'.
    """
    seen_at = timezone.now()
    try:
        payload = json.loads(data)
    except ValueError:
        logger.warning("peer %s: %s frame is not JSON", peer.label, event)
        return False
    if event == "snapshot":
        agents = payload.get("agents") if isinstance(payload, dict) else None
        if not isinstance(agents, list):
            logger.warning("peer %s: snapshot frame without an agents list", peer.label)
            return False
        shadows.shadows_apply_snapshot(peer=peer, agents=agents, seen_at=seen_at)
        return True
    if event == "agent.upsert":
        try:
            shadows.shadow_apply_frame(peer=peer, data=payload, seen_at=seen_at)
        except ValueError as exc:
            logger.warning("peer %s: agent frame rejected: %s", peer.label, exc)
    return False


def _client_for(peer: Peer) -> Any:
    from peers.client import PeerClient

    return PeerClient(peer)


async def _stream_once(peer: Peer, on_snapshot: Callable[[], Awaitable[None]]) -> None:
    """Read one connection of the peer's stream until it ends (raises when it fails)."""
    from peers.client import PeerUnreachable

    loop = asyncio.get_running_loop()
    last_stamp = loop.time()
    async with _client_for(peer).stream_events(EVENTS_PATH, read_timeout=READ_TIMEOUT) as events:
        response: httpx.Response = events.response
        if response.status_code != 200:
            body = (await response.aread())[:300].decode("utf-8", "replace")
            challenge = response.headers.get("www-authenticate", "")
            raise StreamRefused(
                response.status_code, body, invalid_token=response.status_code == 401 and "invalid_token" in challenge
            )
        async for sse in events.aiter_sse():
            if not sse.data:  # httpx-sse hands keep-alive comments on as empty "message" events
                continue
            is_snapshot = await database_sync_to_async(apply_event)(peer, sse.event, sse.data)
            if is_snapshot:
                last_stamp = loop.time()
                await on_snapshot()
            elif loop.time() - last_stamp >= LAST_SEEN_INTERVAL:
                last_stamp = loop.time()
                await database_sync_to_async(peer_seen_stamp)(peer_id=peer.pk)
    raise PeerUnreachable(f"peer {peer.label} closed its events stream")


async def subscribe_peer(peer_id: int) -> None:
    """Keep peer ``peer_id``'s event stream open and its shadows in step, until cancelled or
    the peer is revoked. Each drop marks its shadows stale, then reconnects with
    ``reconnect_delay``; a snapshot resets the backoff."""
    failures = 0
    while True:
        peer = await database_sync_to_async(_live_peer)(peer_id)
        if peer is None:
            return
        connected = False

        async def snapshot_arrived(peer: Peer = peer) -> None:
            nonlocal connected, failures
            if not connected:
                connected = True
                failures = 0
                await database_sync_to_async(peer_reconnected)(peer=peer)

        try:
            await _stream_once(peer, snapshot_arrived)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if isinstance(exc, StreamRefused) and exc.invalid_token:
                # A peer that cannot present a live credential any more — here, one
                # that no longer accepts ours — shows as "unlinked by the other side" (its
                # unlink notice may never have arrived; docs/peers.md#unlinking).
                logger.warning("peer %s no longer knows our token: marking it unlinked by the other side", peer.label)
                await database_sync_to_async(transaction.atomic(peer_mark_unlinked_by_peer))(peer=peer)
                return
            if isinstance(exc, StreamRefused) and exc.status in (401, 403):
                logger.warning("peer %s refused our credential: %s", peer.label, exc)
            else:
                logger.info("peer %s events stream failed: %s", peer.label, exc)
        if await database_sync_to_async(_live_peer)(peer_id) is None:
            return  # unlinked meanwhile: its shadows were stopped, they are not "lost"
        try:
            await database_sync_to_async(shadows.shadows_mark_stale)(peer=peer)
        except Exception:
            logger.exception("could not mark the shadows of peer %s stale", peer.label)
        await asyncio.sleep(reconnect_delay(failures))
        failures += 1


# --- the service -------------------------------------------------------------------------


# Seconds between two cheap looks at the peers table between scans: a link made by another
# process whose doorbell never reaches us (``manage.py peer_link`` with the in-memory
# channel layer) is picked up within this time instead of at the next rescan.
PEEK_SECONDS = 5.0


def _peers_marker() -> tuple[int, Any]:
    """``(live links, newest updated_at)``: changes when a link is made, changed or removed."""
    marker = Peer.objects.aggregate(live=Count("pk", filter=Q(revoked_at__isnull=True)), newest=Max("updated_at"))
    return int(marker["live"]), marker["newest"]


def _live_peer_signatures() -> dict[int, tuple[str, str]]:
    return {
        pk: (url, token)
        for pk, url, token in Peer.objects.filter(revoked_at__isnull=True).values_list(
            "pk", "url", "outbound_token_encrypted"
        )
    }


class _Subscriptions:
    """This process's subscriber tasks, by peer id, with the (url, token) each started with."""

    def __init__(self, holder: str) -> None:
        self.holder = holder
        self.tasks: dict[int, tuple[asyncio.Task[None], tuple[str, str]]] = {}

    async def stop(self, peer_id: int, *, release: bool = True) -> None:
        entry = self.tasks.pop(peer_id, None)
        if entry is not None:
            entry[0].cancel()
            await asyncio.gather(entry[0], return_exceptions=True)
        if release:
            await database_sync_to_async(subscribe_lease_release)(peer_id=peer_id, holder=self.holder)

    async def scan(self, *, restart: int | None = None) -> None:
        live = await database_sync_to_async(_live_peer_signatures)()
        for peer_id in [pk for pk in self.tasks if pk not in live]:
            await self.stop(peer_id)
        for peer_id, signature in live.items():
            entry = self.tasks.get(peer_id)
            claimed = await database_sync_to_async(subscribe_lease_claim)(peer_id=peer_id, holder=self.holder)
            if not claimed:
                if entry is not None:
                    await self.stop(peer_id, release=False)
                continue
            if entry is not None and (entry[1] != signature or entry[0].done() or peer_id == restart):
                await self.stop(peer_id, release=False)
                entry = None
            if entry is None:
                task = asyncio.create_task(subscribe_peer(peer_id), name=f"mirror-peer-{peer_id}")
                self.tasks[peer_id] = (task, signature)

    async def close(self) -> None:
        for peer_id in list(self.tasks):
            await self.stop(peer_id)


async def mirror_loop() -> None:
    """Background service: subscribe to every live peer whose lease this process gets.

    Rescans every ``RESCAN_SECONDS`` and when ``peers.mirror`` rings; a ``mirror.resnapshot``
    message restarts that peer's stream. On cancellation every stream is closed and every
    lease released so another process takes over.
    """
    subscriptions = _Subscriptions(current_process_id())
    # One health per step: a scan that works and a doorbell that fails (Redis down) must
    # not log "recovered" and "failing" on every pass.
    scanning = LoopHealth("peer mirror scan", log=logger, cap=RESCAN_SECONDS)
    doorbell = Subscription(
        DOORBELL_GROUP,
        receives=[MirrorRescanMessage, MirrorResnapshotMessage],
        health=LoopHealth("peer mirror wait (doorbell)", log=logger, cap=RESCAN_SECONDS),
        rejoin_every=RESCAN_SECONDS,  # groups expire, and a restarted Redis forgets them
    )
    await doorbell.open()
    try:
        restart: int | None = None
        loop = asyncio.get_running_loop()
        while True:
            try:
                marker = await database_sync_to_async(_peers_marker)()
                await subscriptions.scan(restart=restart)
            except Exception as exc:
                await scanning.pause(exc)  # a failing scan never becomes a busy loop
                continue
            scanning.ok()
            restart = None
            deadline = loop.time() + RESCAN_SECONDS
            try:
                while True:
                    # Without its doorbell (layer down) this only times out: the loop
                    # still peeks and rescans.
                    message = await doorbell.wait(max(min(PEEK_SECONDS, deadline - loop.time()), 0.0))
                    if message is not None:
                        if isinstance(message, MirrorResnapshotMessage):
                            restart = message.peer_id
                        break
                    if loop.time() >= deadline:
                        break
                    if await database_sync_to_async(_peers_marker)() != marker:
                        break  # a link changed without a doorbell reaching this process
            except Exception as exc:
                await scanning.pause(exc)  # the peek is a database read
    finally:
        await doorbell.close()
        try:
            await asyncio.wait_for(subscriptions.close(), 5)
        except (Exception, asyncio.CancelledError):
            logger.info("could not release every mirror lease; they expire by themselves")
