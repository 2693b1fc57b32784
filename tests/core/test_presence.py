"""Server-process presence: heartbeats, the reaper, and callers of remotes in dead processes.

Docs: docs/deployment.md#what-runs-where. Tests run with
DISPATCH_PROCESS_TTL=4 s and DISPATCH_REMOTE_LIVENESS_INTERVAL=0.5 s (tests/settings.py).
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

import pytest
from channels.db import database_sync_to_async
from django.conf import settings
from django.utils import timezone

from core.models import ServerProcess
from core.presence import current_process_id
from core.services import server_process_heartbeat, server_process_reap, server_process_register
from remotes import services
from remotes.models import Remote, WsSession
from tests.infra import eventually

GHOST = "proc_ghost0000000000"
WEATHER = "weather-service"


def ghost_process(*, age: float, process_id: str = GHOST) -> ServerProcess:
    """Another process's row whose last heartbeat was ``age`` seconds ago."""
    return ServerProcess.objects.create(
        id=process_id,
        kind="serve",
        hostname="elsewhere",
        pid=4242,
        heartbeat_at=timezone.now() - timedelta(seconds=age),
    )


def ghost_remote(*, user: Any, process: ServerProcess, tools: list[dict[str, Any]], name: str = WEATHER) -> Remote:
    """A remote served by a session of ``process`` on a channel nobody reads."""
    channel = f"specific.{process.pk}!{name.replace('-', '')}"
    session = WsSession.objects.create(user=user, channel_name=channel, server_process=process, auth_method="header")
    return Remote.objects.create(
        user=user, name=name, ws_session=session, channel_name=channel, server_process=process, tools=tools
    )


# --- the reaper --------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_reaper_deletes_dead_processes_with_their_sessions_and_remotes(owner, weather_tools):
    dead = ghost_process(age=settings.PROCESS_TTL + 1)
    ghost_remote(user=owner, process=dead, tools=weather_tools)
    alive = ghost_process(age=0, process_id="proc_alive0000000000")
    ghost_remote(user=owner, process=alive, tools=weather_tools, name="clock")

    assert server_process_reap() == [GHOST]

    assert not ServerProcess.objects.filter(pk=GHOST).exists()
    assert not WsSession.objects.filter(server_process_id=GHOST).exists()
    assert not Remote.objects.filter(name=WEATHER).exists()
    assert Remote.objects.filter(name="clock").exists()
    assert WsSession.objects.filter(server_process_id="proc_alive0000000000").count() == 1


@pytest.mark.django_db
def test_the_reaper_keeps_a_process_younger_than_the_ttl(owner, weather_tools):
    ghost_process(age=settings.PROCESS_TTL - 1)
    assert server_process_reap() == []
    assert ServerProcess.objects.filter(pk=GHOST).exists()


@pytest.mark.django_db
def test_the_reaper_never_reaps_its_own_process():
    server_process_register(kind="serve")
    ServerProcess.objects.filter(pk=current_process_id()).update(heartbeat_at=timezone.now() - timedelta(hours=1))
    assert server_process_reap() == []
    assert ServerProcess.objects.filter(pk=current_process_id()).exists()


@pytest.mark.django_db
def test_a_heartbeat_stamps_the_row():
    server_process_register(kind="serve")
    ServerProcess.objects.filter(pk=current_process_id()).update(heartbeat_at=timezone.now() - timedelta(seconds=3))
    assert server_process_heartbeat(kind="serve") is True
    stamped = ServerProcess.objects.get(pk=current_process_id()).heartbeat_at
    assert timezone.now() - stamped < timedelta(seconds=1)


@pytest.mark.django_db
def test_a_heartbeat_after_being_reaped_reregisters_and_says_so():
    server_process_register(kind="serve")
    ServerProcess.objects.filter(pk=current_process_id()).delete()
    assert server_process_heartbeat(kind="serve") is False
    assert ServerProcess.objects.filter(pk=current_process_id(), kind="serve").exists()
    assert server_process_heartbeat(kind="serve") is True


# --- callers of a remote whose process died ---------------------------------------------


async def expect_disconnected(call: Any) -> float:
    """Await ``call``; it must fail as disconnected. Returns the seconds it took."""
    started = time.monotonic()
    with pytest.raises(services.RemoteError) as raised:
        await asyncio.wait_for(call, 10)
    assert raised.value.message == f"remote '{WEATHER}' disconnected"
    assert raised.value.code == "REMOTE_DISCONNECTED"
    return time.monotonic() - started


class CallProbe:
    """Where a pending remote call stands: ``waiting`` is set once it waits for its reply
    (``request_reply`` entered, the call sent); ``checks`` lists the liveness verdicts
    (``remotes.services._serving_state``) so far."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.waiting = asyncio.Event()
        self.checks: list[str] = []
        request_reply, serving_state = services.request_reply, services._serving_state

        async def waiting_for_reply(*args: Any, **kwargs: Any) -> Any:
            self.waiting.set()
            return await request_reply(*args, **kwargs)

        async def checked(route: Any) -> str:
            state = await serving_state(route)
            self.checks.append(state)
            return state

        monkeypatch.setattr(services, "request_reply", waiting_for_reply)
        monkeypatch.setattr(services, "_serving_state", checked)


def call(user: Any) -> Any:
    # A timeout far beyond the liveness checks: only they can end the call early.
    return services.remote_call(
        user=user, remotename=WEATHER, function="get_forecast", args={"city": "Rome"}, timeout=60
    )


@pytest.mark.django_db(transaction=True)
async def test_a_call_to_a_remote_of_a_stale_process_fails_within_two_liveness_intervals(owner, weather_tools):
    process = await database_sync_to_async(ghost_process)(age=settings.PROCESS_TTL + 1)
    await database_sync_to_async(ghost_remote)(user=owner, process=process, tools=weather_tools)
    elapsed = await expect_disconnected(call(owner))
    # Ended by the liveness check, not the 60 s call timeout; wide for a loaded machine.
    assert elapsed < 2 * settings.REMOTE_LIVENESS_INTERVAL + 8.0


@pytest.mark.django_db(transaction=True)
async def test_a_pending_call_fails_when_its_remotes_process_row_is_deleted(owner, weather_tools, monkeypatch):
    probe = CallProbe(monkeypatch)
    process = await database_sync_to_async(ghost_process)(age=0)
    await database_sync_to_async(ghost_remote)(user=owner, process=process, tools=weather_tools)
    pending = asyncio.ensure_future(call(owner))
    await asyncio.wait_for(probe.waiting.wait(), 10)
    assert not pending.done()  # the process is alive: the call waits
    await database_sync_to_async(ServerProcess.objects.filter(pk=GHOST).delete)()
    elapsed = await expect_disconnected(pending)
    # Ended by the liveness check, not the 60 s call timeout; wide for a loaded machine.
    assert elapsed < 2 * settings.REMOTE_LIVENESS_INTERVAL + 8.0
    assert await database_sync_to_async(Remote.objects.count)() == 0


@pytest.mark.django_db(transaction=True)
async def test_a_pending_call_fails_when_its_remotes_process_stops_heartbeating_and_is_reaped(
    owner, weather_tools, monkeypatch
):
    probe = CallProbe(monkeypatch)
    process = await database_sync_to_async(ghost_process)(age=0)
    await database_sync_to_async(ghost_remote)(user=owner, process=process, tools=weather_tools)
    pending = asyncio.ensure_future(call(owner))
    await eventually(lambda: probe.checks, timeout=10, interval=0.01, what="a first liveness check")
    assert probe.checks == ["served"]
    assert not pending.done()  # a liveness check has passed
    stale = timezone.now() - timedelta(seconds=settings.PROCESS_TTL + 1)
    await database_sync_to_async(ServerProcess.objects.filter(pk=GHOST).update)(heartbeat_at=stale)
    assert await database_sync_to_async(server_process_reap)() == [GHOST]
    elapsed = await expect_disconnected(pending)
    # Ended by the liveness check, not the 60 s call timeout; wide for a loaded machine.
    assert elapsed < 2 * settings.REMOTE_LIVENESS_INTERVAL + 8.0


async def test_the_cli_supervisor_stands_down_without_tmux(monkeypatch, caplog):
    import asyncio
    import shutil

    from dispatch import background

    monkeypatch.setattr(shutil, "which", lambda name: None)
    # Returns at once instead of failing every 2 s.
    await asyncio.wait_for(background.cli_supervisor_loop(), 2)
    assert "tmux is not installed" in caplog.text


@pytest.mark.django_db(transaction=True)
async def test_reaping_a_process_rings_the_tool_list_doorbell_of_its_remotes_users(owner, member, weather_tools):
    from channels.layers import get_channel_layer

    from core.tool_changes import tools_group

    dead = await database_sync_to_async(ghost_process)(age=settings.PROCESS_TTL + 1)
    await database_sync_to_async(ghost_remote)(user=owner, process=dead, tools=weather_tools)
    layer = get_channel_layer()
    owner_channel, member_channel = await layer.new_channel(), await layer.new_channel()
    await layer.group_add(tools_group(owner.pk), owner_channel)
    await layer.group_add(tools_group(member.pk), member_channel)

    assert await database_sync_to_async(server_process_reap)() == [GHOST]

    rung = await asyncio.wait_for(layer.receive(owner_channel), timeout=2)
    assert rung == {"type": "tools.changed"}
    with pytest.raises(asyncio.TimeoutError):  # nothing of the member's changed
        await asyncio.wait_for(layer.receive(member_channel), timeout=0.3)
