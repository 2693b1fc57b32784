"""A remote name held by a dead session is taken over after an unanswered probe
(spec/sessions-and-remotes.md §2 "Lifetime", issue 11 item 1).

The holder's process being alive proves nothing: after a Redis outage a consumer may have
died without its cleanup while its process heartbeats on.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer

from core.services import server_process_ensure
from remotes import services
from remotes.models import Remote, WsSession

pytestmark = [pytest.mark.django_db(transaction=True)]

WEATHER = "weather-service"


async def _ghost_registration(user: Any, tools: list[dict[str, Any]]) -> str:
    """A ws session serving ``WEATHER`` and ``clock`` on this (live) process whose consumer
    is gone: its channel exists but nobody reads it. Returns the session id."""
    channel = await get_channel_layer().new_channel()

    def create() -> str:
        session = WsSession.objects.create(
            user=user, channel_name=channel, server_process_id=server_process_ensure(), auth_method="header"
        )
        for name in (WEATHER, "clock"):
            Remote.objects.create(
                user=user,
                name=name,
                ws_session=session,
                channel_name=channel,
                server_process_id=session.server_process_id,
                tools=tools,
            )
        return str(session.pk)

    return await database_sync_to_async(create)()


async def test_a_name_held_by_a_session_that_does_not_answer_the_probe_is_taken_over(
    ws_connect: Any, owner: Any, owner_token: str, weather_tools: list[dict[str, Any]], count_rows: Any
) -> None:
    ghost = await _ghost_registration(owner, weather_tools)
    async with ws_connect(token=owner_token) as server:
        started = time.monotonic()
        reply = await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools}, timeout=5)
        assert reply["message"] == "remote connected"
        assert time.monotonic() - started >= services.REMOTE_PROBE_TIMEOUT  # it waited for the probe
        assert await count_rows(WsSession, pk=ghost) == 0
        assert await count_rows(Remote, ws_session_id=ghost) == 0  # its other remote went with it
        assert await count_rows(Remote, name=WEATHER) == 1


async def test_a_name_held_by_a_live_session_is_refused_without_waiting_for_the_probe_timeout(
    ws_connect: Any, owner_token: str, weather_tools: list[dict[str, Any]], count_rows: Any
) -> None:
    async with ws_connect(token=owner_token) as first, ws_connect(token=owner_token) as second:
        await first.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        started = time.monotonic()
        reply = await second.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        assert reply["error"] == f"remote '{WEATHER}' is already connected"
        assert time.monotonic() - started < services.REMOTE_PROBE_TIMEOUT  # the holder answered
        assert await count_rows(WsSession) == 2
        # The holder still serves it.
        listed = await first.request("remote-list")
        assert [entry["remotename"] for entry in listed["remotes"]] == [WEATHER]
