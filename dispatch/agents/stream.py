"""``GET /api/v1/events``: the live stream for the UI (spec/agents.md §5, ui.md).

An async Django view (not DRF) streaming server-sent events: it subscribes to the
user's channel-layer group first, then builds the ``snapshot`` frame (so a change made
while the snapshot is built is not lost: it arrives after it), then forwards every
``agent.upsert``, ``agent.deleted``, ``agent.event``, ``run.updated`` (and, later,
``message.created``) frame. Every frame has an ``id:``; a keep-alive comment goes out
after ``KEEPALIVE_SECONDS`` of silence. Database work happens only in short
``database_sync_to_async`` calls, so no connection is held while streaming. One stream
per browser tab carries every live part of a page.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.contrib.auth.decorators import login_not_required
from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponseBase, StreamingHttpResponse
from django.views.decorators.http import require_GET

from dispatch.agents.selectors import agents_for
from dispatch.agents.serializers import agent_data
from dispatch.agents.services import user_events_group
from dispatch.errors import DispatchError
from dispatch.http import error_response, request_user

KEEPALIVE_SECONDS = 20.0


def sse_frame(*, frame_id: int, event: str, data: Any) -> str:
    """One server-sent event: ``id``, ``event`` and a single-line JSON ``data`` field."""
    return f"id: {frame_id}\nevent: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def _snapshot(user: User) -> dict[str, Any]:
    page = agents_for(user=user)
    return {"agents": [agent_data(agent) for agent in page.items], "next": page.next}


async def _frames(user: User, channel: str) -> AsyncIterator[str]:
    layer = get_channel_layer()
    group = user_events_group(user.pk)
    frame_id = 0
    receive: asyncio.Future[dict[str, Any]] | None = None
    try:
        snapshot = await database_sync_to_async(_snapshot)(user)
        yield sse_frame(frame_id=frame_id, event="snapshot", data=snapshot)
        while True:
            # One pending receive at a time, kept across keep-alives: cancelling a
            # channel-layer receive repeatedly could drop a message.
            if receive is None:
                receive = asyncio.ensure_future(layer.receive(channel))
            done, _ = await asyncio.wait({receive}, timeout=KEEPALIVE_SECONDS)
            if not done:
                yield ": keep-alive\n\n"
                continue
            message = receive.result()
            receive = None
            frame_id += 1
            yield sse_frame(frame_id=frame_id, event=str(message.get("event")), data=message.get("data"))
    finally:
        if receive is not None:
            receive.cancel()
        await layer.group_discard(group, channel)


@login_not_required  # answers 401 itself (bearer token or session)
@require_GET
async def events_stream(request: HttpRequest) -> HttpResponseBase:
    """``GET /api/v1/events``: ``snapshot``, then live frames, as ``text/event-stream``."""
    try:
        user = await request_user(request)
    except DispatchError as exc:
        return error_response(exc)
    layer = get_channel_layer()
    channel = await layer.new_channel()
    # Subscribe before the snapshot is read: nothing that happens in between is lost.
    await layer.group_add(user_events_group(user.pk), channel)
    response = StreamingHttpResponse(_frames(user, channel), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response
