"""Remote calls: routing, failures and load (docs/ws-protocol.md#remote-call)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.exceptions import ChannelFull

from core import realtime
from remotes import services
from remotes.models import Remote
from remotes.protocol import encode

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]

WEATHER = "weather-service"


def call_frame(
    nonce: str, args: Any = None, remotename: str = WEATHER, function: str = "get_forecast", **extra: Any
) -> dict[str, Any]:
    body = {"remotename": remotename, "function": function, "args": {"city": "Rome"} if args is None else args, **extra}
    return {"action": "remote-call", "nonce": nonce, "body": body}


async def replies(ws, *nonces: Any, timeout: float = 3) -> dict[Any, dict[str, Any]]:
    """The replies to ``nonces`` in whatever order they arrive, keyed by nonce."""
    found: dict[Any, dict[str, Any]] = {}
    for frame in [frame for frame in ws.events if frame.get("nonce") in nonces]:
        ws.events.remove(frame)
        found[frame["nonce"]] = frame
    while len(found) < len(nonces):
        frame = await ws.recv(timeout)
        assert frame.get("nonce") in nonces and frame["nonce"] not in found, f"unexpected frame {frame}"
        found[frame["nonce"]] = frame
    return found


async def connect_weather(ws, tools, remotename: str = WEATHER) -> None:
    reply = await ws.request("remote-connect", {"remotename": remotename, "tools": tools})
    assert reply["message"] == "remote connected", reply


# --- timeouts --------------------------------------------------------------------------


async def test_a_call_times_out_with_the_configured_timeout_and_a_late_result_is_ignored(
    ws_connect, owner_token, weather_tools
):
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await connect_weather(server, weather_tools)
        await caller.send(call_frame("c1", timeout=0.3))
        event = await server.next_event()
        assert await caller.reply("c1") == {
            "error": f"remote call '{WEATHER}.get_forecast' timed out after 0.3s",
            "nonce": "c1",
        }
        await server.send({"action": "remote-call-result", "requestId": event["requestId"], "result": "late"})
        assert await caller.nothing_received(0.3)
        assert await server.nothing_received()
        # Both sessions carry on.
        await caller.send(call_frame("c2"))
        event = await server.next_event()
        await server.send({"action": "remote-call-result", "requestId": event["requestId"], "result": "on time"})
        assert await caller.reply("c2") == {"result": "on time", "nonce": "c2"}


async def test_the_default_timeout_is_the_setting(ws_connect, owner_token, weather_tools, settings):
    settings.REMOTE_CALL_TIMEOUT = 0.25
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await connect_weather(server, weather_tools)
        await caller.send(call_frame("c1"))
        assert await caller.reply("c1") == {
            "error": f"remote call '{WEATHER}.get_forecast' timed out after 0.25s",
            "nonce": "c1",
        }


# --- disconnects -----------------------------------------------------------------------


async def test_closing_the_serving_session_fails_its_pending_call_at_once(
    ws_connect, owner_token, weather_tools, count_rows
):
    async with ws_connect(token=owner_token) as caller:
        async with ws_connect(token=owner_token) as server:
            await connect_weather(server, weather_tools)
            await caller.send(call_frame("c1"))
            await server.next_event()
            started = time.monotonic()
            await server.communicator.disconnect()
            reply = await caller.reply("c1")
            elapsed = time.monotonic() - started
        assert reply == {"error": f"remote '{WEATHER}' disconnected", "nonce": "c1"}
        assert elapsed < 1.0  # the call timeout is 5 s
        assert await count_rows(Remote) == 0


async def test_disconnecting_from_another_session_fails_the_pending_call_and_keeps_the_server_open(
    ws_connect, owner_token, weather_tools
):
    async with (
        ws_connect(token=owner_token) as server,
        ws_connect(token=owner_token) as caller,
        ws_connect(token=owner_token) as admin,
    ):
        await connect_weather(server, weather_tools)
        await caller.send(call_frame("c1"))
        event = await server.next_event()
        started = time.monotonic()
        assert await admin.request("remote-disconnect", {"remotename": WEATHER}) == {
            "message": "remote disconnected",
            "remotename": WEATHER,
            "nonce": "n1",
        }
        assert await caller.reply("c1") == {"error": f"remote '{WEATHER}' disconnected", "nonce": "c1"}
        assert time.monotonic() - started < 1.0
        # A result for the failed call is ignored; the serving session is still open.
        await server.send({"action": "remote-call-result", "requestId": event["requestId"], "result": "late"})
        assert await caller.nothing_received()
        assert await server.request("ping") == {"pong": True, "nonce": "n2"}
        # And it can connect the name again.
        await connect_weather(server, weather_tools)


async def test_a_reconnected_remote_serves_new_calls_after_the_old_ones_failed(ws_connect, owner_token, weather_tools):
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await connect_weather(server, weather_tools)
        await caller.send(call_frame("c1"))
        await server.next_event()
        await server.request("remote-disconnect", {"remotename": WEATHER})
        # The old call has failed before the name can be connected again (only
        # then may the request counter restart).
        assert await caller.reply("c1") == {"error": f"remote '{WEATHER}' disconnected", "nonce": "c1"}
        await connect_weather(server, weather_tools)
        await caller.send(call_frame("c2"))
        new = await server.next_event()
        await server.send({"action": "remote-call-result", "requestId": new["requestId"], "result": "fresh"})
        assert await caller.reply("c2") == {"result": "fresh", "nonce": "c2"}


# --- routing ---------------------------------------------------------------------------


async def test_the_same_function_name_in_two_remotes_routes_to_the_right_one(ws_connect, owner_token, weather_tools):
    async with (
        ws_connect(token=owner_token) as rome,
        ws_connect(token=owner_token) as oslo,
        ws_connect(token=owner_token) as caller,
    ):
        await connect_weather(rome, weather_tools, "weather-rome")
        await connect_weather(oslo, weather_tools, "weather-oslo")
        await caller.send(call_frame("to-oslo", remotename="weather-oslo"))
        event = await oslo.next_event()
        assert event["remotename"] == "weather-oslo" and event["requestId"].startswith("weather-oslo#")
        assert await rome.nothing_received()
        await caller.send(call_frame("to-rome", remotename="weather-rome"))
        rome_event = await rome.next_event()
        assert rome_event["remotename"] == "weather-rome"
        await rome.send({"action": "remote-call-result", "requestId": rome_event["requestId"], "result": "rome"})
        await oslo.send({"action": "remote-call-result", "requestId": event["requestId"], "result": "oslo"})
        assert await replies(caller, "to-rome", "to-oslo") == {
            "to-rome": {"result": "rome", "nonce": "to-rome"},
            "to-oslo": {"result": "oslo", "nonce": "to-oslo"},
        }


async def test_one_session_serves_several_remotes(ws_connect, owner_token, weather_tools):
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await connect_weather(server, weather_tools, "one")
        await connect_weather(server, weather_tools, "two")
        await caller.send(call_frame("c1", remotename="one"))
        await caller.send(call_frame("c2", remotename="two"))
        first, second = await server.next_event(), await server.next_event()
        assert {first["requestId"].rsplit("#", 1)[0], second["requestId"].rsplit("#", 1)[0]} == {"one", "two"}
        for event in (second, first):
            await server.send(
                {"action": "remote-call-result", "requestId": event["requestId"], "result": event["remotename"]}
            )
        assert await replies(caller, "c1", "c2") == {
            "c1": {"result": "one", "nonce": "c1"},
            "c2": {"result": "two", "nonce": "c2"},
        }


async def test_a_result_forged_by_another_session_of_the_same_user_does_not_resolve_the_call(
    ws_connect, owner_token, weather_tools
):
    async with (
        ws_connect(token=owner_token) as server,
        ws_connect(token=owner_token) as caller,
        ws_connect(token=owner_token) as forger,
    ):
        await connect_weather(server, weather_tools)
        await caller.send(call_frame("c1"))
        event = await server.next_event()
        await forger.send({"action": "remote-call-result", "requestId": event["requestId"], "result": "forged"})
        await forger.send(
            {"action": "remote-call-result", "body": {"requestId": event["requestId"], "result": "forged"}}
        )
        assert await caller.nothing_received()
        await server.send({"action": "remote-call-result", "requestId": event["requestId"], "result": "real"})
        assert await caller.reply("c1") == {"result": "real", "nonce": "c1"}


async def test_a_result_is_delivered_once(ws_connect, owner_token, weather_tools):
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await connect_weather(server, weather_tools)
        await caller.send(call_frame("c1"))
        event = await server.next_event()
        await server.send({"action": "remote-call-result", "requestId": event["requestId"], "result": 1})
        await server.send({"action": "remote-call-result", "requestId": event["requestId"], "result": 2})
        assert await caller.reply("c1") == {"result": 1, "nonce": "c1"}
        assert await caller.nothing_received()


async def test_a_session_can_call_a_remote_it_serves_itself(ws_connect, owner_token, weather_tools):
    async with ws_connect(token=owner_token) as ws:
        await connect_weather(ws, weather_tools)
        await ws.send(call_frame("self"))
        event = await ws.next_event()
        assert event["requestId"].startswith(f"{WEATHER}#")
        await ws.send({"action": "remote-call-result", "requestId": event["requestId"], "result": "me"})
        assert await ws.reply("self") == {"result": "me", "nonce": "self"}


# --- size and back-pressure ------------------------------------------------------------


async def test_it_refuses_arguments_too_large_for_the_serving_client(ws_connect, owner_token, weather_tools, settings):
    remotename = "w" * 64
    args = {"city": "x" * 1500}
    frame = encode(
        {
            "action": "remote-call",
            "nonce": 1,
            "body": {"remotename": remotename, "function": "get_forecast", "args": args},
        }
    )
    downstream = encode(
        {
            "action": "remote-call",
            "requestId": f"{remotename}#0",
            "remotename": remotename,
            "function": "get_forecast",
            "args": args,
        }
    )
    # The caller's frame fits the limit, the downstream event would not.
    settings.WS_MAX_MESSAGE_BYTES = len(frame)
    assert len(downstream) > settings.WS_MAX_MESSAGE_BYTES
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await connect_weather(server, weather_tools, remotename)
        await caller.send(frame)
        assert await caller.reply(1) == {"error": "arguments too large", "nonce": 1}
        assert await server.nothing_received()
        # A call that fits still goes through.
        await caller.send(call_frame("c2", remotename=remotename))
        event = await server.next_event()
        await server.send({"action": "remote-call-result", "requestId": event["requestId"], "result": "ok"})
        assert await caller.reply("c2") == {"result": "ok", "nonce": "c2"}


async def test_a_service_call_with_arguments_too_large_is_refused(
    ws_connect, owner, owner_token, weather_tools, settings
):
    settings.WS_MAX_MESSAGE_BYTES = 2048
    async with ws_connect(token=owner_token) as server:
        await connect_weather(server, weather_tools)
        with pytest.raises(services.RemoteError) as raised:
            await services.remote_call(
                user=owner, remotename=WEATHER, function="get_forecast", args={"city": "x" * 2048}
            )
        assert raised.value.message == "arguments too large"
        assert await server.nothing_received()


async def test_a_serving_session_whose_channel_is_full_fails_the_call_as_busy(
    ws_connect, owner_token, weather_tools, monkeypatch
):
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await connect_weather(server, weather_tools)
        serving_channel = await database_sync_to_async(lambda: Remote.objects.get(name=WEATHER).channel_name)()
        # Both sessions live in this process: the call goes into the serving consumer's
        # same-process inbox, not onto the layer (docs/operating.md#channel-layer).
        real_put = realtime.LocalChannel.put

        def put(inbox: realtime.LocalChannel, message: dict[str, Any]) -> None:
            if inbox.name == serving_channel:
                raise ChannelFull()
            real_put(inbox, message)

        monkeypatch.setattr(realtime.LocalChannel, "put", put)
        await caller.send(call_frame("c1"))
        assert await caller.reply("c1") == {"error": f"remote '{WEATHER}' is busy", "nonce": "c1"}
        assert await server.nothing_received()
        monkeypatch.undo()
        await caller.send(call_frame("c2"))
        event = await server.next_event()
        await server.send({"action": "remote-call-result", "requestId": event["requestId"], "result": "free"})
        assert await caller.reply("c2") == {"result": "free", "nonce": "c2"}


# --- load ------------------------------------------------------------------------------


async def test_200_concurrent_calls_to_one_serving_session_all_complete(
    ws_connect, owner_token, weather_tools, settings
):
    # Each session may send only 110 requests: the callers fit, the server's 200 results
    # would not if results were rate limited.
    settings.WS_RATE = 0.01
    settings.WS_BURST = 110
    settings.REMOTE_CALLS_PER_SESSION = 100  # 100 in flight per caller (default cap: 64)
    async with (
        ws_connect(token=owner_token) as server,
        ws_connect(token=owner_token) as left,
        ws_connect(token=owner_token) as right,
    ):
        await connect_weather(server, weather_tools)
        callers = {"l": left, "r": right}
        for index in range(100):
            for prefix, caller in callers.items():
                await caller.send(call_frame(f"{prefix}{index}", {"city": f"{prefix}{index}"}))
        events = [await server.next_event() for _ in range(200)]
        assert len({event["requestId"] for event in events}) == 200
        for event in reversed(events):
            await server.send(
                {
                    "action": "remote-call-result",
                    "requestId": event["requestId"],
                    "result": event["args"]["city"].upper(),
                }
            )
        for prefix, caller in callers.items():
            replies = [await caller.recv() for _ in range(100)]
            assert sorted(replies, key=lambda reply: int(reply["nonce"][1:])) == [
                {"result": f"{prefix}{index}".upper(), "nonce": f"{prefix}{index}"} for index in range(100)
            ]
            assert await caller.nothing_received(0.05)
        assert await server.nothing_received(0.05)


async def test_concurrent_service_calls_get_their_own_results(ws_connect, owner, owner_token, weather_tools):
    async with ws_connect(token=owner_token) as server:
        await connect_weather(server, weather_tools)

        async def serve(count: int) -> None:
            for _ in range(count):
                event = await server.next_event()
                await server.send(
                    {"action": "remote-call-result", "requestId": event["requestId"], "result": event["args"]["city"]}
                )

        calls = [
            services.remote_call(user=owner, remotename=WEATHER, function="get_forecast", args={"city": str(i)})
            for i in range(50)
        ]
        results, _ = await asyncio.gather(asyncio.gather(*calls), serve(50))
        assert results == [str(i) for i in range(50)]


async def test_arguments_and_results_with_lone_surrogates_are_refused_without_losing_the_call(
    ws_connect, owner_token, weather_tools
):
    # "\ud800" decodes to a lone surrogate, which no UTF-8 wire or channel layer carries.
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await connect_weather(server, weather_tools)
        await caller.send(
            '{"action": "remote-call", "nonce": "c1", "body": '
            '{"remotename": "weather-service", "function": "get_forecast", "args": {"city": "\\ud800"}}}'
        )
        refused = await caller.recv()
        assert refused == {
            "error": "invalid JSON: body.args.city: a string holds a lone surrogate (\\ud800-\\udfff), "
            "which is not Unicode text",
            "nonce": "c1",
        }
        assert await server.nothing_received()
        await caller.send(
            {
                "action": "remote-call",
                "nonce": "c2",
                "body": {"remotename": "weather-service", "function": "get_forecast", "args": {"city": "Rome"}},
            }
        )
        event = await server.next_event()
        await server.send(
            '{"action": "remote-call-result", "requestId": "' + event["requestId"] + '", "result": "\\udfff"}'
        )
        # The result frame is refused as well, and its requestId can be read: the call fails
        # at once, and a later answer for it is ignored.
        reply = await caller.reply("c2")
        assert reply["error"].startswith("remote 'weather-service' returned a result Dispatch cannot carry: result: ")
        await server.send({"action": "remote-call-result", "requestId": event["requestId"], "result": "ok"})
        assert await caller.nothing_received(0.3)
