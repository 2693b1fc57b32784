"""``GET /api/v1/peers/events``: our local agents as a peer may see them (docs/peers.md#events).

An async Django view streaming server-sent events to an authenticated peer
(``peers.auth.peer_authenticate``). Scope: only the link user's (``peer.owner``'s)
**local** agents — never shadows, so mirrors cannot loop — in the shape of
``peer_agent_data``. Order of work on connect: join the owner's live-events group
(``user_events_group``) first, so every change from then on is buffered in the channel;
build and send the ``snapshot`` frame ``{"agents": [...]}`` (archived agents left out);
then forward the buffered and live changes as ``agent.upsert`` frames. A change made
while the snapshot was being built therefore arrives after it: a reconnect can never
roll a shadow back.

Frames: ``snapshot`` and ``agent.upsert`` only. Archiving an agent announces an
``agent.upsert`` with status ``archived`` (forwarded as is); the ``agent.deleted`` that
follows it is not forwarded, nor are ``agent.event``, ``run.*`` and ``message.*`` frames
(the latest event travels inside ``agent.upsert``). If the snapshot cannot be built the
stream is closed, so the peer reconnects. Every frame has an ``id:``; a keep-alive
comment goes out after ``KEEPALIVE_SECONDS`` of silence, and at that moment the link is
re-checked (a revoked link ends the stream). No database connection is held while
streaming: database work happens in short ``database_sync_to_async`` calls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from channels.db import database_sync_to_async
from django.contrib.auth.decorators import login_not_required
from django.http import HttpRequest, HttpResponseBase, StreamingHttpResponse
from django.urls import URLPattern, path
from django.utils.dateparse import parse_datetime
from django.views.decorators.csrf import csrf_exempt

from agents.models import Agent
from agents.protocol import UserEventMessage
from agents.services import user_events_group
from core.openapi import Operation, documented
from core.protocol import CredentialEndedMessage
from core.realtime import Subscription
from core.revocation import StreamCredential, stream_closed, stream_opened
from dispatch.sse import KEEP_ALIVE, sse_event, sse_json
from peers.auth import (
    PEER_SECURITY,
    PeerAuthError,
    announce_features,
    method_refusal,
    peer_authenticate,
    peer_error_response,
)
from peers.models import Peer

logger = logging.getLogger(__name__)

KEEPALIVE_SECONDS = 20.0
AGENT_FIELDS = ("id", "name", "type", "status", "parent_id", "launched_by", "updated_at")


def _iso(value: Any) -> str | None:
    return value.isoformat().replace("+00:00", "Z") if value is not None else None


def peer_agent_data(agent: Agent, *, allow_events: bool) -> dict[str, Any]:
    """One local agent as a peer sees it: ``{id, name, type, status, parent_id,
    launched_by, updated_at}`` (ids are ours; ``launched_by`` is the id of the local agent
    that launched it or null; ``updated_at`` ISO 8601), plus ``latest_event: {type,
    message, created_at} | null`` only when ``allow_events`` (the key is absent otherwise)."""
    data: dict[str, Any] = {
        "id": agent.pk,
        "name": agent.name,
        "type": agent.type,
        "status": agent.status,
        "parent_id": agent.parent_id,
        "launched_by": agent.launched_by_id,
        "updated_at": _iso(agent.updated_at),
    }
    if allow_events:
        data["latest_event"] = (
            {
                "type": agent.latest_event_type,
                "message": agent.latest_event_message,
                "created_at": _iso(agent.latest_event_at),
            }
            if agent.latest_event_type and agent.latest_event_at is not None
            else None
        )
    return data


def peer_upsert_from_local(data: dict[str, Any], *, allow_events: bool) -> dict[str, Any] | None:
    """Convert a local ``agent.upsert`` payload (``agents.serializers.agent_data``)
    to the scoped shape of ``peer_agent_data``; ``None`` for a shadow agent's (never shown)."""
    if data.get("peer") is not None or data.get("peer_agent_id"):
        return None
    scoped: dict[str, Any] = {
        "id": data.get("id"),
        "name": data.get("name"),
        "type": data.get("type"),
        "status": data.get("status"),
        "parent_id": data.get("parent"),
        "launched_by": data.get("launched_by"),
        "updated_at": data.get("updated_at"),
    }
    if allow_events:
        created_at = data.get("latest_event_at")
        if data.get("latest_event_type") and created_at:
            parsed = parse_datetime(str(created_at))
            scoped["latest_event"] = {
                "type": data.get("latest_event_type"),
                "message": data.get("latest_event_message") or "",
                "created_at": _iso(parsed) if parsed is not None else created_at,
            }
        else:
            scoped["latest_event"] = None
    return scoped


def peer_snapshot(peer: Peer) -> dict[str, Any]:
    """The ``snapshot`` frame for ``peer``: ``{"agents": [...]}`` — the link user's local,
    non-archived agents, oldest first, each as ``peer_agent_data``."""
    rows = (
        Agent.objects.filter(owner_id=peer.owner_id, peer__isnull=True, peer_agent_id="")
        .exclude(status=Agent.Status.ARCHIVED)
        .order_by("created_at", "id")
    )
    return {"agents": [peer_agent_data(agent, allow_events=peer.allow_events) for agent in rows]}


def _link_is_live(peer_id: int) -> bool:
    return Peer.objects.filter(pk=peer_id, revoked_at__isnull=True).exists()


# Seconds between two re-reads of the link while frames flow: a flag switched off or an
# unlink takes effect on a busy stream within this time, not only at the next keep-alive.
LINK_RECHECK_SECONDS = 1.0


def _link_now(peer_id: int) -> tuple[bool, bool, int] | None:
    """``(live, allow_events, owner_id)`` of the link, or ``None`` when it was deleted."""
    row = Peer.objects.filter(pk=peer_id).values_list("revoked_at", "allow_events", "owner_id").first()
    return None if row is None else (row[0] is None, bool(row[1]), int(row[2]))


async def peer_frames(peer: Peer, live: Subscription) -> AsyncIterator[str]:
    """The frames of one peer's stream, read from ``live`` (already in the owner's group).

    Yields the ``snapshot`` frame (id 0), then ``agent.upsert`` frames and keep-alives.
    Ends (closing the stream) if the snapshot cannot be built or the link is revoked.
    Leaves the group when done.
    """
    channel = live.channel
    assert channel is not None  # opened by peer_events_open
    loop = asyncio.get_running_loop()
    # An unlink ends the stream within seconds even while it is idle (core.revocation).
    stream_opened(channel, StreamCredential(peer_id=peer.pk))
    try:
        try:
            snapshot = await database_sync_to_async(peer_snapshot)(peer)
        except Exception:
            logger.exception("snapshot for peer %s failed; closing its stream", peer.pk)
            return
        frame_id = 0
        yield sse_event(id=frame_id, event="snapshot", data=sse_json(snapshot))
        last_sent = loop.time()
        allow_events, owner_id = peer.allow_events, peer.owner_id
        checked = loop.time()
        while True:
            # Keep-alives never cancel the layer's receive (core.realtime).
            message = await live.wait(max(last_sent + KEEPALIVE_SECONDS - loop.time(), 0.0))
            if message is not None:
                if isinstance(message, CredentialEndedMessage):
                    return
                if not isinstance(message, UserEventMessage) or message.event != "agent.upsert":
                    continue
                if loop.time() - checked >= LINK_RECHECK_SECONDS:
                    # A changed flag takes effect on the next request — the stream is
                    # one long request, so it re-reads the link; an unlink or a new link user
                    # (re-pairing) ends it (the peer reconnects and is judged afresh).
                    link = await database_sync_to_async(_link_now)(peer.pk)
                    checked = loop.time()
                    if link is None or not link[0] or link[2] != owner_id:
                        return
                    allow_events = link[1]
                scoped = peer_upsert_from_local(message.data, allow_events=allow_events)
                if scoped is None:
                    continue
                frame_id += 1
                last_sent = loop.time()
                yield sse_event(id=frame_id, event="agent.upsert", data=sse_json(scoped))
                continue
            if not await database_sync_to_async(_link_is_live)(peer.pk):
                return
            last_sent = loop.time()
            yield KEEP_ALIVE
    finally:
        stream_closed(channel)
        await live.close()


async def peer_events_open(peer: Peer) -> AsyncIterator[str]:
    """Subscribe to ``peer.owner``'s live events, then return ``peer_frames`` (subscribing
    before the snapshot is read, so nothing in between is lost)."""
    live = await Subscription(
        user_events_group(peer.owner_id), receives=[UserEventMessage, CredentialEndedMessage]
    ).open()
    return peer_frames(peer, live)


@documented(
    Operation(
        "get",
        "Server-sent events mirroring the link user's local agents",
        "peer API",
        security=PEER_SECURITY,
        responses={"200": "text/event-stream: snapshot, then agent.upsert frames"},
    )
)
@announce_features
@csrf_exempt
@login_not_required  # peers authenticate with their bearer token and a signature
async def peer_events(request: HttpRequest) -> HttpResponseBase:
    """``GET /api/v1/peers/events`` (docs/peers.md#events): ``text/event-stream`` of
    ``snapshot`` then ``agent.upsert`` frames for an authenticated peer.

    Authentication failures answer before streaming (``peers.auth``: 401 for a missing,
    unknown or revoked token or a bad signature, 403 for a foreign ``keyid``).
    """
    if request.method != "GET":
        return method_refusal("GET")
    try:
        peer = await peer_authenticate(request)
    except PeerAuthError as exc:
        return peer_error_response(exc)
    frames = await peer_events_open(peer)
    response = StreamingHttpResponse(frames, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    return response


api_urlpatterns: list[URLPattern] = [path("peers/events", peer_events, name="peer-events")]
