"""Users only ever see and call their own remotes (docs/ws-protocol.md)."""

from __future__ import annotations

from typing import Any

import pytest

from remotes import services
from remotes.models import Remote

pytestmark = pytest.mark.django_db(transaction=True)

WEATHER = "weather-service"


def call_frame(nonce: str, city: str = "Rome") -> dict[str, Any]:
    return {
        "action": "remote-call",
        "nonce": nonce,
        "body": {"remotename": WEATHER, "function": "get_forecast", "args": {"city": city}},
    }


async def test_bob_cannot_list_alices_remotes(ws_connect, owner_token, member_token, weather_tools):
    async with ws_connect(token=owner_token) as alice, ws_connect(token=member_token) as bob:
        await alice.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        assert await bob.request("remote-list") == {"remotes": [], "nonce": "n1"}
        assert len((await alice.request("remote-list"))["remotes"]) == 1


async def test_bob_cannot_call_alices_remote(ws_connect, owner_token, member_token, weather_tools, member):
    async with ws_connect(token=owner_token) as alice, ws_connect(token=member_token) as bob:
        await alice.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        await bob.send(call_frame("b1"))
        assert await bob.reply("b1") == {"error": f"no connected remote named '{WEATHER}'", "nonce": "b1"}
        with pytest.raises(services.RemoteError) as raised:
            await services.remote_call(user=member, remotename=WEATHER, function="get_forecast", args={"city": "Rome"})
        assert raised.value.code == "REMOTE_NOT_CONNECTED"
        assert await alice.nothing_received()


async def test_bob_cannot_disconnect_alices_remote(
    ws_connect, owner_token, member_token, weather_tools, count_rows, owner
):
    async with ws_connect(token=owner_token) as alice, ws_connect(token=member_token) as bob:
        await alice.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        reply = await bob.request("remote-disconnect", {"remotename": WEATHER})
        assert reply == {"error": f"no connected remote named '{WEATHER}'", "nonce": "n1"}
        assert await count_rows(Remote, user=owner, name=WEATHER) == 1
        assert await alice.nothing_received()


async def test_bob_cannot_resolve_alices_pending_call(ws_connect, owner_token, member_token, weather_tools):
    async with (
        ws_connect(token=owner_token) as alice,
        ws_connect(token=owner_token) as caller,
        ws_connect(token=member_token) as bob,
    ):
        await alice.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        await caller.send(call_frame("c1"))
        event = await alice.next_event()
        await bob.send({"action": "remote-call-result", "requestId": event["requestId"], "result": "from bob"})
        await bob.send({"action": "remote-call-result", "body": {"requestId": event["requestId"], "error": "from bob"}})
        assert await caller.nothing_received()
        await alice.send({"action": "remote-call-result", "requestId": event["requestId"], "result": "from alice"})
        assert await caller.reply("c1") == {"result": "from alice", "nonce": "c1"}


async def test_bob_can_connect_the_same_name_and_calls_route_per_user(
    ws_connect, owner_token, member_token, weather_tools
):
    async with (
        ws_connect(token=owner_token) as alice_server,
        ws_connect(token=member_token) as bob_server,
        ws_connect(token=owner_token) as alice_caller,
        ws_connect(token=member_token) as bob_caller,
    ):
        assert (await alice_server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools}))[
            "message"
        ] == "remote connected"
        assert (await bob_server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools}))[
            "message"
        ] == "remote connected"

        await bob_caller.send(call_frame("b1", "Oslo"))
        bob_event = await bob_server.next_event()
        assert bob_event["args"] == {"city": "Oslo"}
        await alice_caller.send(call_frame("a1", "Rome"))
        alice_event = await alice_server.next_event()
        assert alice_event["args"] == {"city": "Rome"}
        # Each call has its own request id (never issued twice), on its own user's serving session.
        assert alice_event["requestId"] != bob_event["requestId"]
        assert alice_event["requestId"].startswith(f"{WEATHER}#") and bob_event["requestId"].startswith(f"{WEATHER}#")

        await bob_server.send({"action": "remote-call-result", "requestId": bob_event["requestId"], "result": "bob's"})
        assert await bob_caller.reply("b1") == {"result": "bob's", "nonce": "b1"}
        assert await alice_caller.nothing_received()
        await alice_server.send(
            {"action": "remote-call-result", "requestId": alice_event["requestId"], "result": "alice's"}
        )
        assert await alice_caller.reply("a1") == {"result": "alice's", "nonce": "a1"}

        # Bob disconnecting his remote leaves alice's connected.
        await bob_caller.request("remote-disconnect", {"remotename": WEATHER})
        assert len((await alice_caller.request("remote-list"))["remotes"]) == 1
        assert (await bob_caller.request("remote-list"))["remotes"] == []


async def test_a_remote_listing_never_shows_another_users_functions(
    ws_connect, owner_token, outsider_token, weather_tools
):
    async with ws_connect(token=owner_token) as alice, ws_connect(token=outsider_token) as carol:
        await alice.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        await carol.request("remote-connect", {"remotename": "carols", "tools": [{"name": "secret"}]})
        assert [entry["remotename"] for entry in (await alice.request("remote-list"))["remotes"]] == [WEATHER]
        assert [entry["remotename"] for entry in (await carol.request("remote-list"))["remotes"]] == ["carols"]
