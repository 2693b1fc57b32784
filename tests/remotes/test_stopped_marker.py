"""A call on a route cached from before its remote's process stopped
(docs/deploy.md#rolling-restart: calls that start after their client has reconnected never
fail).

Each process caches a remote's route for up to ``ROUTE_CACHE_SECONDS``. When the serving
process stops cleanly and the remote re-registers on another process within that second,
a call from a third process may still go to the stopped process's channel, where nobody
reads. The stopped process leaves a *stopped marker* (``server_process_unregister``): the
caller's liveness check sees that the process answered everything it had forwarded, so the
call never ran, and re-routes it to the remote's new session. A process that was reaped (it
died) leaves no marker: its unanswered call may have run, so it fails as before and is
never sent twice.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.utils import timezone

from core import services as core_services
from core.models import STOPPED_MARKER_SECONDS, ServerProcess
from core.selectors import alive_processes
from remotes import services
from remotes.models import Remote, WsSession

pytestmark = [pytest.mark.django_db(transaction=True)]

WEATHER = "weather-service"
ELSEWHERE = "proc_elsewhere00000000"


async def _served_elsewhere(user: Any, tools: list[dict[str, Any]]) -> str:
    """``WEATHER`` served by a session of another live process (``ELSEWHERE``) whose channel
    nobody reads here. Returns that channel."""
    channel = await get_channel_layer().new_channel()

    def create() -> None:
        process = ServerProcess.objects.create(id=ELSEWHERE, kind="serve", hostname="elsewhere", pid=4242)
        session = WsSession.objects.create(
            user=user, channel_name=channel, server_process=process, auth_method="header"
        )
        Remote.objects.create(
            user=user, name=WEATHER, ws_session=session, channel_name=channel, server_process=process, tools=tools
        )

    await database_sync_to_async(create)()
    return channel


async def _route_to_elsewhere(user: Any) -> services.RemoteRoute:
    services.forget_route(user.pk, WEATHER)
    route, _cached = await services._route(user.pk, WEATHER)
    assert route is not None and route.server_process_id == ELSEWHERE
    return route


def _cache(user: Any, route: services.RemoteRoute) -> None:
    """Hold ``route`` in this process's route cache, as a third process that called the
    remote just before its process stopped still does (a connect here forgets it here)."""
    services._ROUTES[(user.pk, WEATHER)] = (time.monotonic() + services.ROUTE_CACHE_SECONDS, route)


async def _answer_one_call(server: Any, result: str) -> dict[str, Any]:
    event: dict[str, Any] = await server.next_event()
    assert event["action"] == "remote-call"
    await server.send({"action": "remote-call-result", "requestId": event["requestId"], "result": result})
    return event


async def test_a_call_on_a_route_cached_before_a_clean_stop_goes_to_the_remote_s_new_session(
    ws_connect: Any, owner: Any, owner_token: str, weather_tools: list[dict[str, Any]], settings: Any
) -> None:
    settings.REMOTE_LIVENESS_INTERVAL = 0.1
    await _served_elsewhere(owner, weather_tools)
    stale = await _route_to_elsewhere(owner)
    # ELSEWHERE stops cleanly; its remote registers again here (a rolling restart).
    await database_sync_to_async(core_services.server_process_unregister)(process_id=ELSEWHERE)
    async with ws_connect(token=owner_token) as remote:
        await remote.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        _cache(owner, stale)
        assert (await services._route(owner.pk, WEATHER))[0] == stale
        answering = asyncio.ensure_future(_answer_one_call(remote, "sunny"))
        result = await services.remote_call(
            user=owner, remotename=WEATHER, function="get_forecast", args={"city": "Rome"}, timeout=5
        )
        assert result == "sunny"
        assert (await answering)["args"] == {"city": "Rome"}
        assert await remote.nothing_received()  # sent once


async def test_a_call_on_a_route_to_a_reaped_process_fails_and_is_never_sent_twice(
    ws_connect: Any, owner: Any, owner_token: str, weather_tools: list[dict[str, Any]], settings: Any
) -> None:
    settings.REMOTE_LIVENESS_INTERVAL = 0.1
    await _served_elsewhere(owner, weather_tools)
    stale = await _route_to_elsewhere(owner)
    # ELSEWHERE dies: the reaper removes it (no marker), and the remote registers here.
    await database_sync_to_async(ServerProcess.objects.filter(pk=ELSEWHERE).update)(
        heartbeat_at=timezone.now() - timedelta(hours=1)
    )
    assert await database_sync_to_async(core_services.server_process_reap)() == [ELSEWHERE]
    async with ws_connect(token=owner_token) as remote:
        await remote.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        _cache(owner, stale)
        with pytest.raises(services.RemoteError) as failure:
            await services.remote_call(
                user=owner, remotename=WEATHER, function="get_forecast", args={"city": "Rome"}, timeout=5
            )
        assert (failure.value.code, failure.value.message) == (
            "REMOTE_DISCONNECTED",
            f"remote '{WEATHER}' disconnected",
        )
        assert await remote.nothing_received()  # the new session never saw it


def test_a_clean_stop_leaves_a_marker_that_holds_nothing_is_never_alive_and_goes_after_its_time(
    owner: Any, weather_tools: list[dict[str, Any]]
) -> None:
    process = ServerProcess.objects.create(id=ELSEWHERE, kind="worker", hostname="elsewhere", pid=4242)
    session = WsSession.objects.create(user=owner, channel_name="x!y", server_process=process, auth_method="header")
    Remote.objects.create(
        user=owner, name=WEATHER, ws_session=session, channel_name="x!y", server_process=process, tools=weather_tools
    )
    core_services.server_process_unregister(process_id=ELSEWHERE)
    marker = ServerProcess.objects.get(pk=ELSEWHERE)
    assert marker.stopped_at is not None and (marker.kind, marker.pid) == ("worker", 4242)
    assert not WsSession.objects.filter(server_process_id=ELSEWHERE).exists()
    assert not Remote.objects.filter(server_process_id=ELSEWHERE).exists()
    assert ELSEWHERE not in set(alive_processes().values_list("pk", flat=True))
    core_services.server_process_reap()  # younger than STOPPED_MARKER_SECONDS: kept
    assert ServerProcess.objects.filter(pk=ELSEWHERE).exists()
    ServerProcess.objects.filter(pk=ELSEWHERE).update(
        stopped_at=timezone.now() - timedelta(seconds=STOPPED_MARKER_SECONDS + 1)
    )
    core_services.server_process_reap()
    assert not ServerProcess.objects.filter(pk=ELSEWHERE).exists()


def test_a_stop_that_could_not_answer_everything_leaves_no_marker(owner: Any) -> None:
    ServerProcess.objects.create(id=ELSEWHERE, kind="serve", hostname="elsewhere", pid=4242)
    core_services.server_process_unregister(process_id=ELSEWHERE, leave_marker=False)
    assert not ServerProcess.objects.filter(pk=ELSEWHERE).exists()


def test_this_process_s_heartbeat_never_revives_its_marker_but_registering_again_does(owner: Any) -> None:
    this = core_services.server_process_ensure()
    core_services.server_process_unregister()
    assert ServerProcess.objects.get(pk=this).heartbeat_at == core_services.STOPPED_HEARTBEAT
    assert core_services.server_process_heartbeat(kind="serve") is False  # it re-registers: a live row again
    row = ServerProcess.objects.get(pk=this)
    assert row.stopped_at is None and this in set(alive_processes().values_list("pk", flat=True))
    core_services.server_process_unregister()
    assert core_services.server_process_ensure() == this
    assert ServerProcess.objects.get(pk=this).stopped_at is None
