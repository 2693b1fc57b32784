"""A ``remote-call-result`` the channel layer cannot carry fails its call at once, naming
why (docs/ws-protocol.md#remote-call)."""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]

WEATHER = "weather-service"
CALL = {"remotename": WEATHER, "function": "get_forecast", "args": {"city": "Rome"}, "timeout": 30}


@pytest.mark.parametrize(
    ("result", "reason"),
    [
        ("18446744073709551616", "result: integer 18446744073709551616 is outside the signed 64-bit range"),
        ("-9223372036854775809", "result: integer -9223372036854775809 is outside the signed 64-bit range"),
        ("NaN", "NaN is not valid JSON"),
        ("1e400", "number 1e400 is too large"),
        ('"\\ud800"', "result: a string holds a lone surrogate"),
        ("[" * 70 + "]" * 70, "nested too deeply (more than 64 levels)"),
    ],
    ids=["2**64", "-2**63-1", "nan", "1e400", "lone-surrogate", "too-deep"],
)
@pytest.mark.parametrize("form", ["top-level", "body"])
async def test_a_result_dispatch_cannot_carry_fails_the_call_at_once(
    ws_connect, owner_token, weather_tools, result, reason, form
):
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        assert (await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools}))["message"]
        await caller.send({"action": "remote-call", "nonce": "c", "body": CALL})
        event = await server.next_event()
        fields = f'"requestId": "{event["requestId"]}", "result": {result}'
        frame = (
            f'{{"action": "remote-call-result", {fields}}}'
            if form == "top-level"
            else f'{{"action": "remote-call-result", "body": {{{fields}}}}}'
        )
        started = time.monotonic()
        await server.send(frame)
        reply = await caller.reply("c", timeout=5)
        assert time.monotonic() - started < 2  # not the 30 s timeout
        assert reply["error"].startswith(f"remote '{WEATHER}' returned a result Dispatch cannot carry: ")
        assert reason in reply["error"]
        # The remote hears why, and both sessions carry on.
        assert (await server.recv())["error"].startswith("invalid JSON: ")
        assert (await caller.request("ping"))["pong"] is True
        assert (await server.request("ping"))["pong"] is True
