"""``notifications/tools/list_changed`` over ``subscriptions/listen`` (2026-07-28), against
a real ``manage.py serve`` with the SDK's own client (docs/mcp.md#tool-list-changes): a
remote connecting or disconnecting and a machine attaching reach the user's listen streams,
and nobody else's; both protocol versions are told ``listChanged: true`` (2025-11-25 gets
its push on ``GET /mcp``, tests/mcp/test_mcp_event_stream.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import mcp_types
import pytest
from mcp import ClientSession
from mcp.client.session import IncomingMessage
from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client
from mcp.client.subscriptions import ListenNotSupportedError, Subscription, ToolsListChanged

from tests.infra import PYTHON, Instance, Server, instance, wait_until
from tests.mcp.test_mcp_endpoint import mcp_client

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

_SETUP = """
import json
from django.contrib.auth import get_user_model
from core.services import api_token_create
User = get_user_model()
print(json.dumps({name: api_token_create(user=User.objects.create_user(name, password="pw-secret-123")).raw
                  for name in ("bob", "eve")}))
"""


@dataclass
class Live:
    instance: Instance
    server: Server
    bob: str
    eve: str

    @property
    def mcp_url(self) -> str:
        return f"{self.server.url}/mcp"


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    with instance() as inst:
        tokens = json.loads(inst.manage("shell", "-c", _SETUP).stdout.strip().splitlines()[-1])
        yield Live(instance=inst, server=inst.serve(), **tokens)


async def next_change(subscription: Subscription, timeout: float = 10) -> object:
    return await asyncio.wait_for(anext(subscription), timeout)


async def test_both_protocol_versions_are_told_tools_list_changed(live: Live) -> None:
    async with mcp_client(live.mcp_url, live.bob, "legacy") as legacy:
        assert legacy.server_capabilities.tools is not None
        assert legacy.server_capabilities.tools.list_changed is True  # delivered on GET /mcp
        with pytest.raises(ListenNotSupportedError):
            async with legacy.listen(tools_list_changed=True):
                pass
    async with mcp_client(live.mcp_url, live.bob, "auto") as modern:
        assert modern.server_capabilities.tools is not None
        assert modern.server_capabilities.tools.list_changed is True


async def test_a_remote_and_a_machine_coming_and_going_reach_the_users_listen_stream(
    live: Live, tmp_path: Path
) -> None:
    async with (
        mcp_client(live.mcp_url, live.bob, "auto") as bob,
        mcp_client(live.mcp_url, live.eve, "auto") as eve,
        bob.listen(tools_list_changed=True) as bobs,
        eve.listen(tools_list_changed=True) as eves,
    ):
        assert bobs.honored.tools_list_changed is True
        eve_saw: list[object] = []

        async def watch_eve() -> None:
            async for event in eves:
                eve_saw.append(event)

        watcher = asyncio.create_task(watch_eve())
        try:
            remote = live.instance.spawn(
                [
                    PYTHON,
                    "-m",
                    "remotes.client",
                    "serve",
                    "examples/weather_service.py:remote",
                    "--url",
                    live.server.ws_url,
                    "--token",
                    live.bob,
                ],
                name="weather-service",
            )
            assert isinstance(await next_change(bobs, 20), ToolsListChanged)
            names = {tool.name for tool in (await bob.list_tools()).tools}
            assert "remote__weather-service__get_forecast" in names

            remote.stop()
            assert isinstance(await next_change(bobs), ToolsListChanged)
            wait_until(lambda: live.server.remote_names(live.bob) == [], timeout=10, what="the remote to go")

            shim = live.instance.shim("box", tmp_path, token=live.bob, state_dir=tmp_path / "s")
            try:
                assert isinstance(await next_change(bobs), ToolsListChanged)
            finally:
                shim.stop()
            assert isinstance(await next_change(bobs), ToolsListChanged)

            assert eve_saw == []  # none of it was eve's
            eves_shim = live.instance.shim("eves", tmp_path, token=live.eve, state_dir=tmp_path / "e")
            try:
                await asyncio.wait_for(_until(lambda: len(eve_saw) >= 1), 10)
            finally:
                eves_shim.stop()
            assert all(isinstance(event, ToolsListChanged) for event in eve_saw)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)


async def test_the_python_sdk_in_its_default_streamable_http_mode_hears_a_remote_connect(live: Live) -> None:
    """The README's Python example (``ClientSession`` over ``streamable_http_client``,
    protocol 2025-11-25): the SDK opens ``GET /mcp`` only when ``initialize`` gave it an
    ``Mcp-Session-Id``, and hears ``notifications/tools/list_changed`` there."""
    token = live.instance.admin_token
    changes: asyncio.Queue[object] = asyncio.Queue()

    async def on_message(message: IncomingMessage) -> None:
        if isinstance(message, mcp_types.ToolListChangedNotification):
            changes.put_nowait(message)

    http = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
    async with (
        http,
        streamable_http_client(live.mcp_url, http_client=http) as (read, write, *_),
        ClientSession(read, write, message_handler=on_message) as session,
    ):
        initialized = await session.initialize()
        assert initialized.protocol_version == "2025-11-25"
        await asyncio.wait_for(changes.get(), 10)  # the one every (re)connect of the stream brings
        remote = live.instance.spawn(
            [
                PYTHON,
                "-m",
                "remotes.client",
                "serve",
                "examples/weather_service.py:remote",
                "--url",
                live.server.ws_url,
                "--token",
                token,
            ],
            name="admins-weather-service",
        )
        try:
            await asyncio.wait_for(changes.get(), 20)
            names = {tool.name for tool in (await session.list_tools()).tools}
            assert "remote__weather-service__get_forecast" in names
        finally:
            remote.stop()


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.05)
