"""A ``/ws`` session's cleanup runs on every exit, rows first (docs/operating.md#health): a
channel layer that fails under the consumer must not leave its ``WsSession`` and ``Remote``
rows behind, and its client is told to come back later.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator

from remotes.models import Remote, WsSession
from tests.outage import LayerOutage

pytestmark = [pytest.mark.django_db(transaction=True)]

WEATHER = "weather-service"


async def _wait_closed(communicator: WebsocketCommunicator, timeout: float = 3) -> int | None:
    """The close code the consumer sent (frames before it are skipped)."""
    while True:
        message = await communicator.receive_output(timeout)
        if message["type"] == "websocket.close":
            return message.get("code")


async def test_it_closes_1012_and_deletes_its_rows_when_the_channel_layer_receive_fails(
    ws_connect: Any, owner_token: str, weather_tools: list[dict[str, Any]], count_rows: Any
) -> None:
    outage = LayerOutage(get_channel_layer())
    async with ws_connect(token=owner_token) as server:
        reply = await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        assert reply["message"] == "remote connected"
        assert await count_rows(WsSession) == 1
        outage.start()  # Redis goes away under the consumer's receive
        assert await server.closed_with() == 1012
        assert await count_rows(WsSession) == 0
        assert await count_rows(Remote) == 0
    assert outage.failures >= 1


async def test_it_accepts_then_closes_a_new_socket_1013_while_the_channel_layer_is_down(
    owner_token: str, count_rows: Any
) -> None:
    from dispatch.asgi import application

    outage = LayerOutage(get_channel_layer())
    outage.start()
    communicator = WebsocketCommunicator(
        application, "/ws", headers=[(b"authorization", f"Bearer {owner_token}".encode())]
    )
    connected, _ = await communicator.connect(timeout=5)
    assert connected  # accepted first: a close code needs an accepted socket
    assert await _wait_closed(communicator) == 1013
    await communicator.wait(3)
    assert await count_rows(WsSession) == 0


async def test_it_deletes_its_rows_even_when_leaving_the_events_group_fails(
    ws_connect: Any, owner_token: str, weather_tools: list[dict[str, Any]], count_rows: Any
) -> None:
    outage = LayerOutage(get_channel_layer(), fail_only=["group_discard"])
    async with ws_connect(token=owner_token) as server:
        await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        outage.start()
    assert outage.failures == 1
    assert await count_rows(WsSession) == 0
    assert await count_rows(Remote) == 0


async def test_a_consumer_cancelled_by_the_server_still_deletes_its_rows(
    owner_token: str, weather_tools: list[dict[str, Any]], count_rows: Any
) -> None:
    """daphne cancels an application that takes too long to finish after a disconnect."""
    from dispatch.asgi import application

    communicator = WebsocketCommunicator(
        application, "/ws", headers=[(b"authorization", f"Bearer {owner_token}".encode())]
    )
    connected, _ = await communicator.connect(timeout=5)
    assert connected
    await communicator.send_json_to(
        {"action": "remote-connect", "nonce": 1, "body": {"remotename": WEATHER, "tools": weather_tools}}
    )
    assert (await communicator.receive_json_from(3))["message"] == "remote connected"
    communicator.future.cancel()
    with pytest.raises(asyncio.CancelledError):
        await communicator.future
    assert await count_rows(WsSession) == 0
    assert await count_rows(Remote) == 0
