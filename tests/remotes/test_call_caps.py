"""Caps on remote calls in flight, per session, per user and per process
(docs/operating.md#bounds): a call over a cap is refused at once with the cap's setting named, nothing queued."""

from __future__ import annotations

from typing import Any

import pytest

from remotes.inflight import CALLS_IN_FLIGHT, CallRefused, CallsInFlight
from tests.remotes.test_remote_calls import WEATHER, call_frame, connect_weather, replies

pytestmark = [pytest.mark.django_db(transaction=True)]


def session_cap_error(calls: int) -> str:
    return f"remote call refused: {calls} calls already in flight for this session (DISPATCH_REMOTE_CALLS_PER_SESSION)"


async def test_a_session_over_its_call_cap_is_refused_at_once_and_nothing_is_forwarded(
    ws_connect, owner_token, weather_tools, settings
):
    settings.REMOTE_CALLS_PER_SESSION = 3
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await connect_weather(server, weather_tools)
        for index in range(3):
            await caller.send(call_frame(f"c{index}", timeout=30))
        events = [await server.next_event() for _ in range(3)]
        await caller.send(call_frame("over", timeout=30))
        assert await caller.reply("over") == {"error": session_cap_error(3), "nonce": "over"}
        assert await server.nothing_received(0.2)  # the refused call never reached the remote
        # An answered call frees its place.
        await server.send({"action": "remote-call-result", "requestId": events[0]["requestId"], "result": "ok"})
        assert await caller.reply("c0") == {"result": "ok", "nonce": "c0"}
        await caller.send(call_frame("again", timeout=30))
        assert (await server.next_event())["action"] == "remote-call"


async def test_the_user_cap_counts_every_session_of_the_user(ws_connect, owner_token, weather_tools, settings):
    settings.REMOTE_CALLS_PER_USER = 2
    async with (
        ws_connect(token=owner_token) as server,
        ws_connect(token=owner_token) as left,
        ws_connect(token=owner_token) as right,
    ):
        await connect_weather(server, weather_tools)
        await left.send(call_frame("l1", timeout=30))
        await right.send(call_frame("r1", timeout=30))
        await server.next_event()
        await server.next_event()
        await right.send(call_frame("r2", timeout=30))
        assert await right.reply("r2") == {
            "error": "remote call refused: 2 calls already in flight for this user in this process "
            "(DISPATCH_REMOTE_CALLS_PER_USER)",
            "nonce": "r2",
        }
        assert await server.nothing_received(0.2)


async def test_the_bytes_cap_refuses_a_call_whose_arguments_would_pass_it(
    ws_connect, owner_token, weather_tools, settings
):
    settings.REMOTE_CALL_BYTES_PER_SESSION = 64 * 1024
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await connect_weather(server, weather_tools)
        await caller.send(call_frame("big1", {"city": "x" * 40_000}, timeout=30))
        await server.next_event()
        await caller.send(call_frame("big2", {"city": "y" * 40_000}, timeout=30))
        error = (await caller.reply("big2"))["error"]
        assert error.startswith("remote call refused: 39.2 KiB of arguments already in flight for this session")
        assert error.endswith("would pass 64.0 KiB (DISPATCH_REMOTE_CALL_BYTES_PER_SESSION)")
        assert await server.nothing_received(0.2)
        # A small call still fits.
        await caller.send(call_frame("small", timeout=30))
        assert (await server.next_event())["args"] == {"city": "Rome"}


async def test_every_count_returns_to_zero_when_the_calls_end(ws_connect, owner, owner_token, weather_tools, settings):
    settings.REMOTE_CALL_TIMEOUT = 0.3
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await connect_weather(server, weather_tools)
        for index in range(4):
            await caller.send(call_frame(f"c{index}"))
        found = await replies(caller, *[f"c{index}" for index in range(4)])
        assert {reply["error"] for reply in found.values()} == {
            f"remote call '{WEATHER}.get_forecast' timed out after 0.3s"
        }
    assert CALLS_IN_FLIGHT.counts(user_id=owner.pk) == (0, 0)
    assert CALLS_IN_FLIGHT.counts() == (0, 0)


def test_a_refused_admission_counts_nothing(settings):
    settings.REMOTE_CALLS_PER_SESSION = 1
    ledger = CallsInFlight()
    with ledger.admit(user_id=1, session="s", size=10):
        with pytest.raises(CallRefused) as refused:
            ledger.admit(user_id=1, session="s", size=10)
        assert refused.value.code == "RATE_LIMITED"
        assert ledger.counts(session="s") == (1, 10)
        assert ledger.counts(user_id=1) == (1, 10)
        # Another session of the same user is not held by this session's cap.
        with ledger.admit(user_id=1, session="t", size=5):
            assert ledger.counts(user_id=1) == (2, 15)
    assert ledger.counts() == (0, 0)
    assert ledger._sessions == {} and ledger._users == {}


def test_the_process_cap_counts_every_user(settings):
    settings.REMOTE_CALL_BYTES_PER_PROCESS = 100
    ledger = CallsInFlight()
    held: list[Any] = [ledger.admit(user_id=1, session=None, size=60)]
    message = (
        r"60 bytes of arguments already in flight in this process, and this call's 60 bytes would pass "
        r"100 bytes \(DISPATCH_REMOTE_CALL_BYTES_PER_PROCESS\)"
    )
    with pytest.raises(CallRefused, match=message):
        ledger.admit(user_id=2, session=None, size=60)
    held[0].release()
    held[0].release()  # twice: counted down once
    assert ledger.counts() == (0, 0)
