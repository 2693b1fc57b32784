"""Request ids across reconnects, empty remotes, the ``remote-disconnected`` event and the
action-less auth reply (docs/ws-protocol.md)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from channels.db import database_sync_to_async

from remotes.models import Remote

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]

WEATHER = "weather-service"


def call_frame(nonce: str, remotename: str = WEATHER, function: str = "get_forecast") -> dict[str, Any]:
    return {
        "action": "remote-call",
        "nonce": nonce,
        "body": {"remotename": remotename, "function": function, "args": {"city": "Rome"}},
    }


async def connect(ws, remotename: str, tools: list[dict[str, Any]]) -> None:
    reply = await ws.request("remote-connect", {"remotename": remotename, "functions": tools})
    assert reply["message"] == "remote connected", reply


# --- request ids -----------------------------------------------------------------------


async def test_request_ids_never_restart_on_reconnect_and_a_late_result_does_not_resolve_a_newer_call(
    ws_connect, owner_token, weather_tools
):
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await connect(server, WEATHER, weather_tools)
        await caller.send(call_frame("old"))
        old = await server.next_event()
        # Disconnect then reconnect the same name on the same socket, the old call in flight.
        assert (await server.request("remote-disconnect", {"remotename": WEATHER}))["message"] == "remote disconnected"
        assert await caller.reply("old") == {"error": f"remote '{WEATHER}' disconnected", "nonce": "old"}
        await connect(server, WEATHER, weather_tools)
        await caller.send(call_frame("new"))
        new = await server.next_event()
        assert new["requestId"] != old["requestId"]  # never reused (docs/ws-protocol.md#request-ids)
        # The old call's late result arrives first: it is ignored.
        await server.send({"action": "remote-call-result", "requestId": old["requestId"], "result": "stale"})
        assert await caller.nothing_received(0.3)
        await server.send({"action": "remote-call-result", "requestId": new["requestId"], "result": "fresh"})
        assert await caller.reply("new") == {"result": "fresh", "nonce": "new"}


async def test_each_id_names_its_remote_and_none_repeats(ws_connect, owner_token, weather_tools):
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await connect(server, "a", weather_tools)
        await connect(server, "b", weather_tools)
        ids = []
        for nonce, name in [("1", "a"), ("2", "b"), ("3", "a")]:
            await caller.send(call_frame(nonce, remotename=name))
            ids.append((await server.next_event())["requestId"])
        assert [request_id.rsplit("#", 1)[0] for request_id in ids] == ["a", "b", "a"]
        assert len(set(ids)) == 3


# --- empty remotes ------------------------------------------------------------------------


async def test_a_remote_with_no_functions_connects_is_not_listed_and_has_no_function(ws_connect, owner_token):
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        reply = await server.request("remote-connect", {"remotename": "remote-center/fresh", "functions": []})
        assert reply["message"] == "remote connected"
        assert (await caller.request("remote-list"))["remotes"] == []
        called = await caller.request("remote-call", call_frame("x", "remote-center/fresh", "anything")["body"])
        assert called["error"] == "remote 'remote-center/fresh' has no function 'anything'"


async def test_129_functions_are_still_refused(ws_connect, owner_token, weather_tools):
    tools = [{**weather_tools[0], "name": f"f{i}"} for i in range(129)]
    async with ws_connect(token=owner_token) as server:
        reply = await server.request("remote-connect", {"remotename": "big", "tools": tools})
        assert "0 to 128 functions, got 129" in reply["error"]


# --- remote-disconnected -----------------------------------------------------------------


async def test_the_serving_session_hears_when_another_session_disconnects_its_remote(
    ws_connect, owner_token, weather_tools
):
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as other:
        await connect(server, WEATHER, weather_tools)
        started = time.monotonic()
        assert (await other.request("remote-disconnect", {"remotename": WEATHER}))["message"] == "remote disconnected"
        event = await server.next_event(timeout=5)
        delay = time.monotonic() - started
        assert event == {
            "action": "remote-disconnected",
            "remotename": WEATHER,
            "reason": "disconnected by another session of the user",
        }
        print(f"remote-disconnected push delay: {delay * 1000:.1f} ms")
        assert delay < 5
        assert await database_sync_to_async(Remote.objects.filter(name=WEATHER).exists)() is False
        # Its own disconnect of another remote sends it nothing.
        await connect(server, "mine", weather_tools)
        assert (await server.request("remote-disconnect", {"remotename": "mine"}))["message"] == "remote disconnected"
        assert await server.nothing_received(0.3)


# --- the first-frame auth reply -----------------------------------------------------------


async def test_the_first_frame_auth_reply_carries_no_action(ws_connect, owner, owner_token):
    async with ws_connect() as ws:
        await ws.send({"token": owner_token})
        assert await ws.recv() == {"ok": True, "user": owner.get_username()}
    async with ws_connect() as ws:
        await ws.send({"token": "nope"})
        assert await ws.recv() == {"error": "authentication failed"}
        assert await ws.closed_with() == 4401
