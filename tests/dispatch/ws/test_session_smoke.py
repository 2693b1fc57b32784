"""A first end-to-end exchange through the real router (docs/ws-protocol.md#a-worked-example)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]


async def test_the_spec_example_exchange(ws_connect, owner_token, weather_tools):
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        reply = await server.request("remote-connect", {"remotename": "weather-service", "tools": weather_tools})
        assert reply == {"message": "remote connected", "remotename": "weather-service", "nonce": "n1"}

        await caller.send(
            {
                "action": "remote-call",
                "nonce": "c1",
                "body": {"remotename": "weather-service", "function": "get_forecast", "args": {"city": "Rome"}},
            }
        )
        event = await server.next_event()
        request_id = event.pop("requestId")
        assert request_id.startswith("weather-service#")  # opaque (docs/ws-protocol.md#request-ids)
        assert event == {
            "action": "remote-call",
            "remotename": "weather-service",
            "function": "get_forecast",
            "args": {"city": "Rome"},
        }
        await server.send({"action": "remote-call-result", "requestId": request_id, "result": {"temp": 21}})
        assert await caller.reply("c1") == {"result": {"temp": 21}, "nonce": "c1"}
