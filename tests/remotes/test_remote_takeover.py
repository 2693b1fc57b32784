"""Taking over a remote name whose holder is gone
(docs/operating.md#a-client-of-a-dead-process-registering-again): a client of the dead
process can register its remote again within 5 s.

A connect that finds the name held checks the holder's process at once
(``core.services.server_process_liveness``): a process of this host answers from its own
open connections, another a ``presence.ping`` within 1 s. The name is taken over when the
process missed two heartbeats and is silent (it is reaped), when the process lives but no
longer has the holder's session open (a consumer that died without its cleanup, e.g. in a
Redis outage), or when the consumer answers that it no longer serves the name; never from
a live process whose connection still holds it, however late its heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.utils import timezone

from core import presence
from core.models import ServerProcess
from core.services import (
    PRESENCE_PING_TIMEOUT,
    server_process_ensure,
    server_process_liveness,
    server_process_takeover_reap,
)
from dispatch.background import presence_loop
from remotes import services
from remotes.models import Remote, WsSession

pytestmark = [pytest.mark.django_db(transaction=True)]

WEATHER = "weather-service"
GHOST = "proc_ghost0000000000"


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


async def _other_process_registration(
    user: Any, tools: list[dict[str, Any]], *, heartbeat_age: float, hostname: str = "elsewhere", pid: int = 4242
) -> str:
    """Another process's row (``GHOST``, heartbeat ``heartbeat_age`` seconds old) holding a
    ws session that serves ``WEATHER`` and ``clock``. Returns the session's channel name."""
    channel = await get_channel_layer().new_channel()

    def create() -> None:
        process = ServerProcess.objects.create(
            id=GHOST,
            kind="serve",
            hostname=hostname,
            pid=pid,
            heartbeat_at=timezone.now() - timedelta(seconds=heartbeat_age),
        )
        session = WsSession.objects.create(
            user=user, channel_name=channel, server_process=process, auth_method="header"
        )
        for name in (WEATHER, "clock"):
            Remote.objects.create(
                user=user, name=name, ws_session=session, channel_name=channel, server_process=process, tools=tools
            )

    await database_sync_to_async(create)()
    return channel


class _OpenConnection:
    """Stands for a consumer of this process holding ``channel_name`` (``core.presence``)."""

    def __init__(self, channel_name: str) -> None:
        self.channel_name = channel_name


@contextlib.asynccontextmanager
async def answering_for(process_id: str) -> AsyncIterator[None]:
    """Run a presence loop answering pings to ``process_id`` (as that process would)."""
    task = asyncio.ensure_future(presence_loop(process_id=process_id))
    await asyncio.sleep(0.05)  # joined its group
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@contextlib.asynccontextmanager
async def heartbeating(process_id: str) -> AsyncIterator[None]:
    """Stamp ``process_id``'s heartbeat every 0.1 s meanwhile (a process that lives on, silent
    on the layer)."""

    async def beat() -> None:
        while True:
            await database_sync_to_async(ServerProcess.objects.filter(pk=process_id).update)(
                heartbeat_at=timezone.now()
            )
            await asyncio.sleep(0.1)

    task = asyncio.ensure_future(beat())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def missed_two_heartbeats() -> float:
    return 2 * settings.PROCESS_HEARTBEAT_INTERVAL + 0.5


async def test_a_name_held_by_a_session_of_this_process_that_is_not_open_is_taken_over_at_once(
    ws_connect: Any, owner: Any, owner_token: str, weather_tools: list[dict[str, Any]], count_rows: Any
) -> None:
    ghost = await _ghost_registration(owner, weather_tools)
    async with ws_connect(token=owner_token) as server:
        started = time.monotonic()
        reply = await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools}, timeout=5)
        assert reply["message"] == "remote connected"
        # This process knows its own connections: no probe to wait for.
        assert time.monotonic() - started < services.REMOTE_PROBE_TIMEOUT
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


async def test_a_name_held_by_a_silent_process_that_missed_two_heartbeats_is_taken_over_within_the_ping(
    ws_connect: Any, owner: Any, owner_token: str, weather_tools: list[dict[str, Any]], count_rows: Any
) -> None:
    # Younger than DISPATCH_PROCESS_TTL: the reaper would not touch it yet.
    assert missed_two_heartbeats() < settings.PROCESS_TTL
    await _other_process_registration(owner, weather_tools, heartbeat_age=missed_two_heartbeats())
    async with ws_connect(token=owner_token) as server:
        started = time.monotonic()
        reply = await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools}, timeout=5)
        took = time.monotonic() - started
        assert reply["message"] == "remote connected"
        assert PRESENCE_PING_TIMEOUT <= took < PRESENCE_PING_TIMEOUT + 1  # waited for the ping, no more
        assert await count_rows(ServerProcess, pk=GHOST) == 0  # reaped, with all it held
        assert await count_rows(Remote, name="clock") == 0
        assert await count_rows(Remote, name=WEATHER, ws_session__server_process=GHOST) == 0


async def test_a_live_process_keeps_its_name_however_late_its_heartbeat(
    ws_connect: Any, owner: Any, owner_token: str, weather_tools: list[dict[str, Any]], count_rows: Any
) -> None:
    channel = await _other_process_registration(owner, weather_tools, heartbeat_age=settings.PROCESS_TTL - 0.5)
    holder = _OpenConnection(channel)  # the process has the session open; its consumer is slow to answer
    presence.connection_opened(holder)
    try:
        async with answering_for(GHOST), ws_connect(token=owner_token) as server:
            reply = await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools}, timeout=5)
            assert reply["error"] == f"remote '{WEATHER}' is already connected"
            assert await count_rows(ServerProcess, pk=GHOST) == 1
            assert await count_rows(Remote, ws_session__server_process=GHOST) == 2
    finally:
        presence.connection_closed(holder)


async def test_a_live_process_whose_session_is_closed_loses_that_session_s_names(
    ws_connect: Any, owner: Any, owner_token: str, weather_tools: list[dict[str, Any]], count_rows: Any
) -> None:
    # The consumer died without its cleanup (a Redis outage) while its process lives on.
    await _other_process_registration(owner, weather_tools, heartbeat_age=0)
    async with answering_for(GHOST), ws_connect(token=owner_token) as server:
        started = time.monotonic()
        reply = await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools}, timeout=5)
        assert reply["message"] == "remote connected"
        assert time.monotonic() - started < PRESENCE_PING_TIMEOUT  # the process answered at once
        assert await count_rows(ServerProcess, pk=GHOST) == 1  # the process lives on
        assert await count_rows(Remote, name="clock") == 0  # the closed session's other remote went too


async def test_a_silent_process_that_still_heartbeats_keeps_its_name(
    ws_connect: Any, owner: Any, owner_token: str, weather_tools: list[dict[str, Any]], count_rows: Any
) -> None:
    await _other_process_registration(owner, weather_tools, heartbeat_age=0)
    async with heartbeating(GHOST), ws_connect(token=owner_token) as server:
        reply = await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools}, timeout=5)
        assert reply["error"] == f"remote '{WEATHER}' is already connected"
        assert await count_rows(ServerProcess, pk=GHOST) == 1
        assert await count_rows(Remote, ws_session__server_process=GHOST) == 2


async def test_a_process_of_this_host_whose_pid_is_gone_is_taken_over_without_a_ping(
    ws_connect: Any, owner: Any, owner_token: str, weather_tools: list[dict[str, Any]], count_rows: Any
) -> None:
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    await _other_process_registration(
        owner, weather_tools, heartbeat_age=missed_two_heartbeats(), hostname=presence.HOSTNAME, pid=ended.pid
    )
    async with ws_connect(token=owner_token) as server:
        started = time.monotonic()
        reply = await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools}, timeout=5)
        assert reply["message"] == "remote connected"
        assert time.monotonic() - started < PRESENCE_PING_TIMEOUT
        assert await count_rows(ServerProcess, pk=GHOST) == 0


async def test_of_two_connects_taking_over_a_dead_process_s_name_at_once_one_wins(
    ws_connect: Any, owner: Any, owner_token: str, weather_tools: list[dict[str, Any]], count_rows: Any
) -> None:
    await _other_process_registration(owner, weather_tools, heartbeat_age=missed_two_heartbeats())
    body = {"remotename": WEATHER, "tools": weather_tools}
    async with ws_connect(token=owner_token) as first, ws_connect(token=owner_token) as second:
        replies = await asyncio.gather(first.request("remote-connect", body), second.request("remote-connect", body))
        outcomes = sorted(reply.get("message") or reply.get("error") for reply in replies)
        assert outcomes == sorted(["remote connected", f"remote '{WEATHER}' is already connected"])
        assert await count_rows(Remote, name=WEATHER) == 1
        assert await count_rows(ServerProcess, pk=GHOST) == 0


# --- the process checks themselves ------------------------------------------------------------


async def test_liveness_of_a_process_answering_pings_names_the_channels_it_holds(owner: Any) -> None:
    await _other_process_registration(owner, [], heartbeat_age=0)
    held, other = _OpenConnection("specific.x!held"), "specific.x!closed"
    presence.connection_opened(held)
    try:
        async with answering_for(GHOST):
            liveness = await server_process_liveness(process_id=GHOST, channel_names=[held.channel_name, other])
    finally:
        presence.connection_closed(held)
    assert liveness.answered and liveness.holding == {held.channel_name}


async def test_liveness_of_a_silent_process_says_whether_it_missed_two_heartbeats(owner: Any) -> None:
    await _other_process_registration(owner, [], heartbeat_age=0)
    async with heartbeating(GHOST):
        fresh = await server_process_liveness(process_id=GHOST)
    assert not fresh.answered and not fresh.stale
    await database_sync_to_async(ServerProcess.objects.filter(pk=GHOST).update)(
        heartbeat_at=timezone.now() - timedelta(seconds=missed_two_heartbeats())
    )
    late = await server_process_liveness(process_id=GHOST)
    assert not late.answered and late.stale and not late.absent


@pytest.mark.django_db
def test_the_takeover_reap_spares_a_process_that_heartbeats_and_this_process(owner: Any) -> None:
    ServerProcess.objects.create(id=GHOST, kind="serve", hostname="elsewhere", pid=1, heartbeat_at=timezone.now())
    assert server_process_takeover_reap(process_id=GHOST) is False
    assert ServerProcess.objects.filter(pk=GHOST).exists()
    mine = server_process_ensure()
    ServerProcess.objects.filter(pk=mine).update(heartbeat_at=timezone.now() - timedelta(hours=1))
    assert server_process_takeover_reap(process_id=mine) is False
    assert ServerProcess.objects.filter(pk=mine).exists()
    ServerProcess.objects.filter(pk=GHOST).update(
        heartbeat_at=timezone.now() - timedelta(seconds=missed_two_heartbeats())
    )
    assert server_process_takeover_reap(process_id=GHOST) is True
    assert server_process_takeover_reap(process_id=GHOST) is True  # already gone: still no holder
    assert not ServerProcess.objects.filter(pk=GHOST).exists()


def test_a_pid_is_known_absent_only_on_this_host_and_only_when_no_process_has_it() -> None:
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    assert presence.pid_absent(hostname=presence.HOSTNAME, pid=ended.pid)
    assert not presence.pid_absent(hostname="elsewhere", pid=ended.pid)
    assert not presence.pid_absent(hostname=presence.HOSTNAME, pid=presence.PID)
    assert not presence.pid_absent(hostname=presence.HOSTNAME, pid=1)  # exists (maybe not ours)
