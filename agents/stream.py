"""``GET /api/v1/events``: the live stream for the UI
(docs/agents.md#the-live-event-stream).

An async Django view (not DRF) streaming server-sent events: it subscribes to the
user's channel-layer group first, then builds the ``snapshot`` frame (so a change made
while the snapshot is built is not lost: it arrives after it), then forwards every
``agent.upsert``, ``agent.deleted``, ``agent.event``, ``run.updated``,
``message.created`` and ``message.updated`` frame. With ``?pane=<agent id>`` (one of the
caller's local CLI agents) the same stream also carries ``pane`` frames
``{"agent_id", "text"}``: the pane is captured about once a second (``cli.pane_text`` in a
worker thread) and sent when it changed. Every frame has an ``id:``; a keep-alive comment
goes out after ``KEEPALIVE_SECONDS`` of silence. Database work happens only in short
``database_sync_to_async`` calls, so no connection is held while streaming. One stream
per browser tab carries every live part of a page.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from django.contrib.auth.decorators import login_not_required
from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponseBase, StreamingHttpResponse
from django.views.decorators.http import require_GET

from agents import cli
from agents.models import Agent
from agents.protocol import UserEventMessage
from agents.selectors import agent_get_for, agents_for, is_shadow
from agents.serializers import agent_data
from agents.services import EXPERT, user_events_group
from agents.tokens import agent_token_id
from core.errors import DispatchError, InvalidRequest
from core.http import bearer_credentials, error_response, request_user
from core.models import ApiToken
from core.openapi import Operation, documented
from core.presence import HOSTNAME
from core.protocol import CredentialEndedMessage
from core.realtime import Subscription
from core.revocation import StreamCredential, stream_closed, stream_opened
from dispatch.sse import KEEP_ALIVE, sse_event, sse_json

logger = logging.getLogger(__name__)

KEEPALIVE_SECONDS = 20.0
PANE_INTERVAL_SECONDS = 1.0
PANE_LINES = 200


def _snapshot(user: User) -> dict[str, Any]:
    page = agents_for(user=user)
    return {"agents": [agent_data(agent) for agent in page.items], "next": page.next}


def pane_agent_for(*, user: User, agent_id: str) -> Agent:
    """The agent a ``?pane=`` parameter names: one of ``user``'s CLI agents on this host.

    Raises ``NotFound`` for an unknown agent or another user's, ``InvalidRequest`` for an
    expert agent, a shadow agent or a CLI agent on another host (its pane is not here).
    """
    agent = agent_get_for(user=user, agent_id=agent_id)
    if agent.type == EXPERT or is_shadow(agent):
        raise InvalidRequest(f"pane: agent '{agent.pk}' has no terminal pane here")
    if agent.host != HOSTNAME:
        raise InvalidRequest(f"pane: agent '{agent.pk}' runs on host '{agent.host}', not this one")
    return agent


async def _pane_text(agent: Agent) -> str | None:
    """The pane's text, or ``None`` when it could not be read (logged; tried again later)."""
    try:
        text: str = await sync_to_async(cli.pane_text, thread_sensitive=False)(agent=agent, lines=PANE_LINES)
    except Exception as exc:  # the stream outlives a failed capture
        logger.info("pane of agent %s not captured: %s", agent.pk, exc)
        return None
    return text


async def _frames(
    user: User, live: Subscription, pane: Agent | None = None, credential: StreamCredential | None = None
) -> AsyncIterator[str]:
    channel = live.channel
    assert channel is not None  # opened by the view
    # The stream ends when its token, user or session does (core.revocation).
    stream_opened(channel, credential or StreamCredential(user_id=user.pk))
    frame_id = 0
    loop = asyncio.get_running_loop()
    last_sent = loop.time()
    next_capture = loop.time()
    last_text: str | None = None
    try:
        snapshot = await database_sync_to_async(_snapshot)(user)
        yield sse_event(id=frame_id, event="snapshot", data=sse_json(snapshot))
        while True:
            # Keep-alives and pane captures never cancel the layer's receive (core.realtime).
            now = loop.time()
            wait = last_sent + KEEPALIVE_SECONDS - now
            if pane is not None:
                wait = min(wait, next_capture - now)
            message = await live.wait(max(wait, 0.0))
            if isinstance(message, CredentialEndedMessage):
                return
            if isinstance(message, UserEventMessage):
                frame_id += 1
                last_sent = loop.time()
                yield sse_event(id=frame_id, event=message.event, data=sse_json(message.data))
                continue
            if pane is not None and loop.time() >= next_capture:
                text = await _pane_text(pane)
                next_capture = loop.time() + PANE_INTERVAL_SECONDS
                if text is not None and text != last_text:
                    last_text = text
                    frame_id += 1
                    last_sent = loop.time()
                    yield sse_event(id=frame_id, event="pane", data=sse_json({"agent_id": pane.pk, "text": text}))
                    continue
            if loop.time() >= last_sent + KEEPALIVE_SECONDS:
                last_sent = loop.time()
                yield KEEP_ALIVE
    finally:
        stream_closed(channel)
        await live.close()


async def _credential(request: HttpRequest, user: User) -> StreamCredential:
    """What the stream stands on (``request_user`` already authenticated it): the API
    token, the agent token (the stream ends when the agent stops), or the Django session."""
    credential = getattr(request, "auth", None)
    if isinstance(credential, ApiToken):
        return StreamCredential(user_id=user.pk, api_token_id=credential.pk)
    if isinstance(credential, Agent):
        raw = bearer_credentials(request.headers.get("Authorization", "")) or ""
        token_id = await database_sync_to_async(agent_token_id)(raw)
        return StreamCredential(user_id=user.pk, agent_token_id=token_id if token_id is not None else -1)
    return StreamCredential(user_id=user.pk, session_key=request.session.session_key or "")


@documented(
    Operation(
        "get",
        "Server-sent events for the UI: a snapshot, then agent, run and message frames",
        "agents",
        query=(
            {
                "name": "pane",
                "in": "query",
                "required": False,
                "schema": {"type": "string"},
                "description": "a local CLI agent's id: also send its terminal pane as `pane` frames",
            },
        ),
        responses={
            "200": "text/event-stream: snapshot, agent.upsert, agent.deleted, agent.event, run.updated, "
            "message.created, message.updated (and pane) frames, each with an id"
        },
    )
)
@login_not_required  # answers 401 itself (bearer token or session)
@require_GET
async def events_stream(request: HttpRequest) -> HttpResponseBase:
    """``GET /api/v1/events[?pane=<agent id>]``: ``snapshot``, then live frames, as
    ``text/event-stream``; with ``pane``, ``pane`` frames ``{agent_id, text}`` too.

    A ``pane`` naming another user's or an unknown agent is 404, one without a local
    pane (expert, shadow, another host) 400 — both before streaming.
    """
    try:
        user = await request_user(request)
        pane_id = request.GET.get("pane")
        pane = await database_sync_to_async(pane_agent_for)(user=user, agent_id=pane_id) if pane_id else None
        credential = await _credential(request, user)
    except DispatchError as exc:
        return error_response(exc)
    # Subscribe before the snapshot is read: nothing that happens in between is lost.
    live = await Subscription(user_events_group(user.pk), receives=[UserEventMessage, CredentialEndedMessage]).open()
    response = StreamingHttpResponse(_frames(user, live, pane, credential), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    return response
