"""The action envelope and its robustness rules (docs/ws-protocol.md#frames)."""

from __future__ import annotations

import json

import pytest

from remotes.models import Remote, WsSession

pytestmark = pytest.mark.django_db(transaction=True)

WEATHER = "weather-service"


async def assert_still_open(ws) -> None:
    """The connection stays open: the next valid request is answered."""
    reply = await ws.request("ping")
    assert reply == {"pong": True, "nonce": f"n{ws._nonce}"}


# --- bad frames after authentication ---------------------------------------------------

BAD_TEXT_FRAMES = [
    ("not json", "invalid JSON"),
    ('{"action": "ping", "nonce": 1', "invalid JSON"),
    ("[]", "a message must be a JSON object, got an array"),
    ('[{"action": "ping", "nonce": 1}]', "a message must be a JSON object, got an array"),
    ('"ping"', "a message must be a JSON object, got a string"),
    ("42", "a message must be a JSON object, got a number"),
    ("true", "a message must be a JSON object, got a boolean"),
    ("null", "a message must be a JSON object, got null"),
    ("{}", "missing 'action' (a non-empty string)"),
    ('{"body": {}}', "missing 'action' (a non-empty string)"),
    ('{"action": ""}', "missing 'action' (a non-empty string)"),
    ('{"action": 5}', "missing 'action' (a non-empty string)"),
    ('{"action": null}', "missing 'action' (a non-empty string)"),
    ('{"action": ["ping"]}', "missing 'action' (a non-empty string)"),
    ('{"action": {"name": "ping"}}', "missing 'action' (a non-empty string)"),
    ('{"action": "ping", "nonce": [1]}', "nonce must be a string or a number"),
    ('{"action": "ping", "nonce": true}', "nonce must be a string or a number"),
]


@pytest.mark.parametrize(("frame", "error"), BAD_TEXT_FRAMES, ids=[f"{i}" for i in range(len(BAD_TEXT_FRAMES))])
async def test_it_answers_a_bad_frame_and_stays_open(ws_connect, owner_token, frame, error):
    async with ws_connect(token=owner_token) as ws:
        await ws.send(frame)
        reply = await ws.recv()
        assert set(reply) == {"error"}
        assert reply["error"].startswith(error), reply["error"]
        await assert_still_open(ws)


async def test_it_echoes_a_readable_nonce_when_the_action_is_missing(ws_connect, owner_token):
    async with ws_connect(token=owner_token) as ws:
        await ws.send({"nonce": "a1", "body": {}})
        assert await ws.recv() == {"error": "missing 'action' (a non-empty string)", "nonce": "a1"}
        await assert_still_open(ws)


async def test_it_answers_a_binary_frame_and_stays_open(ws_connect, owner_token):
    async with ws_connect(token=owner_token) as ws:
        await ws.communicator.send_to(bytes_data=json.dumps({"action": "ping", "nonce": 1}).encode())
        reply = await ws.recv()
        assert set(reply) == {"error"}
        assert "binary" in reply["error"]
        await assert_still_open(ws)


@pytest.mark.parametrize("action", ["x", "remote-calls", "PING", "auth", "remote_call", "é" * 10])
async def test_it_refuses_an_unknown_action_with_the_nonce(ws_connect, owner_token, action):
    async with ws_connect(token=owner_token) as ws:
        await ws.send({"action": action, "nonce": 9, "body": {}})
        assert await ws.recv() == {"error": f"unknown action '{action}'", "nonce": 9}
        await assert_still_open(ws)


async def test_a_body_that_is_not_an_object_is_answered_with_an_error(ws_connect, owner_token):
    async with ws_connect(token=owner_token) as ws:
        for body in [[], "x", 5]:
            reply = await ws.request("remote-connect", body)
            assert reply["error"].startswith("invalid body"), reply
        await assert_still_open(ws)


async def test_every_reply_echoes_the_nonce_unchanged(ws_connect, owner_token):
    async with ws_connect(token=owner_token) as ws:
        for nonce in ["x", "", 0, -3, 1.5, 2**63 - 1, "ünï ✓"]:
            await ws.send({"action": "remote-list", "nonce": nonce})
            assert await ws.recv() == {"remotes": [], "nonce": nonce}
        # An integer the channel layer cannot carry is refused at the edge, naming the field.
        await ws.send({"action": "remote-list", "nonce": 10**20})
        assert await ws.recv() == {
            "error": "invalid JSON: nonce: integer 100000000000000000000 is outside the signed 64-bit range"
        }


async def test_a_frame_refused_at_the_edge_gets_its_error_with_the_nonce_when_one_can_be_read(ws_connect, owner_token):
    # The error carries the nonce when one can be read (docs/ws-protocol.md#frames): a
    # request whose body holds a value the channel layer cannot carry still gets a reply its
    # client can match.
    async with ws_connect(token=owner_token) as ws:
        await ws.send('{"action": "remote-list", "nonce": "n7", "body": {"n": 18446744073709551616}}')
        assert await ws.recv() == {
            "error": "invalid JSON: body.n: integer 18446744073709551616 is outside the signed 64-bit range",
            "nonce": "n7",
        }
        await ws.send('{"action": "remote-list", "nonce": 3, "body": {"x": NaN}}')
        assert await ws.recv() == {"error": "invalid JSON: NaN is not valid JSON", "nonce": 3}
        # A nonce only inside the body is not the request's nonce.
        await ws.send('{"action": "remote-list", "body": {"nonce": "b", "x": NaN}}')
        assert await ws.recv() == {"error": "invalid JSON: NaN is not valid JSON"}
        await assert_still_open(ws)


async def test_a_request_without_nonce_gets_a_reply_without_nonce(ws_connect, owner_token):
    async with ws_connect(token=owner_token) as ws:
        await ws.send({"action": "ping"})
        assert await ws.recv() == {"pong": True}


# --- size limit ------------------------------------------------------------------------


async def test_it_closes_with_1009_on_a_frame_over_the_size_limit(ws_connect, owner_token, settings):
    settings.WS_MAX_MESSAGE_BYTES = 2048
    async with ws_connect(token=owner_token) as ws:
        await ws.send({"action": "ping", "nonce": 1, "body": {"pad": "x" * 1900}})
        assert await ws.recv() == {"pong": True, "nonce": 1}
        await ws.send({"action": "ping", "nonce": 2, "body": {"pad": "x" * 2100}})
        assert await ws.closed_with() == 1009


async def test_the_size_limit_counts_utf8_bytes(ws_connect, owner_token, settings):
    settings.WS_MAX_MESSAGE_BYTES = 2048
    async with ws_connect(token=owner_token) as ws:
        # 800 characters, 2400 bytes.
        await ws.send(json.dumps({"action": "ping", "nonce": 1, "pad": "€" * 800}, ensure_ascii=False))
        assert await ws.closed_with() == 1009


async def test_it_closes_with_1009_on_a_binary_frame_over_the_size_limit(ws_connect, owner_token, settings):
    settings.WS_MAX_MESSAGE_BYTES = 2048
    async with ws_connect(token=owner_token) as ws:
        await ws.communicator.send_to(bytes_data=b"x" * 3000)
        assert await ws.closed_with() == 1009


async def test_it_closes_with_1009_on_an_oversized_first_frame(ws_connect, owner_token, settings):
    settings.WS_MAX_MESSAGE_BYTES = 2048
    async with ws_connect() as ws:
        await ws.send({"token": owner_token, "pad": "x" * 3000})
        assert await ws.closed_with() == 1009


# --- rate limit ------------------------------------------------------------------------


async def test_it_answers_rate_limited_instead_of_disconnecting(ws_connect, owner_token, settings):
    settings.WS_RATE = 0.01
    settings.WS_BURST = 5
    async with ws_connect(token=owner_token) as ws:
        replies = []
        for index in range(12):
            await ws.send({"action": "remote-list", "nonce": index})
            replies.append(await ws.recv())
        assert replies[:5] == [{"remotes": [], "nonce": index} for index in range(5)]
        assert replies[5:] == [{"error": "rate limited", "nonce": index} for index in range(5, 12)]
        # Bad frames are limited too, and the connection stays open.
        await ws.send("not json")
        assert await ws.recv() == {"error": "rate limited"}
        await ws.send({"action": "nope", "nonce": "u"})
        assert await ws.recv() == {"error": "rate limited", "nonce": "u"}
        # ping is never limited.
        for index in range(20):
            await ws.send({"action": "ping", "nonce": f"p{index}"})
            assert await ws.recv() == {"pong": True, "nonce": f"p{index}"}


async def test_the_rate_limit_refills_over_time(ws_connect, owner_token, settings):
    settings.WS_RATE = 5.0
    settings.WS_BURST = 2
    # Unknown actions: limited like any request, answered without a database query, so
    # three of them arrive well within the 0.2 s one token takes to refill.
    expected = ["unknown action 'nope'", "unknown action 'nope'", "rate limited"]
    async with ws_connect(token=owner_token) as ws:
        for index in range(3):
            await ws.send({"action": "nope", "nonce": index})
        assert [(await ws.recv())["error"] for _ in range(3)] == expected
        await ws.nothing_received(0.5)  # 2.5 tokens' worth of time, capped at the burst of 2
        for index in range(3):
            await ws.send({"action": "nope", "nonce": index})
        assert [(await ws.recv())["error"] for _ in range(3)] == expected


async def test_remote_call_results_are_never_rate_limited(ws_connect, owner_token, weather_tools, settings):
    settings.WS_RATE = 0.01
    settings.WS_BURST = 3
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        for index in range(3):
            await caller.send(
                {
                    "action": "remote-call",
                    "nonce": f"c{index}",
                    "body": {"remotename": WEATHER, "function": "get_forecast", "args": {"city": str(index)}},
                }
            )
        events = [await server.next_event() for _ in range(3)]
        # Exhaust the serving session's bucket.
        while (await server.request("remote-list")).get("error") != "rate limited":
            pass
        for event in events:
            await server.send(
                {"action": "remote-call-result", "requestId": event["requestId"], "result": event["args"]["city"]}
            )
        for index in range(3):
            assert await caller.reply(f"c{index}") == {"result": str(index), "nonce": f"c{index}"}
        # The results drew no error replies on the serving session.
        assert await server.nothing_received()


# --- stored state is unchanged by bad input ------------------------------------------


CONNECT = "remote-connect"
BAD_INPUT = [
    "not json",
    "[]",
    "{}",
    '{"action": "nope", "nonce": 1}',
    *(
        json.dumps({"action": action, "nonce": 1, "body": body})
        for action, body in [
            (CONNECT, {"remotename": "", "tools": [{"name": "f"}]}),
            (CONNECT, {"remotename": WEATHER, "tools": [{"name": "get_forecast"}]}),
            (CONNECT, {"remotename": "ok", "tools": [{"name": "f", "parameters": {"type": 5}}]}),
            (CONNECT, {"remotename": "ok", "tools": [{"name": f"f{i}"} for i in range(129)]}),
            (CONNECT, [1]),
            ("remote-disconnect", {"remotename": "nope"}),
            ("remote-disconnect", {"remotename": 7}),
            ("remote-call", {"remotename": WEATHER, "function": "nope"}),
            ("remote-call", {"remotename": WEATHER, "function": "get_forecast", "args": {}}),
        ]
    ),
    '{"action": "remote-call-result", "requestId": "weather-service#99", "result": 1}',
]


async def remote_rows() -> list[tuple[object, ...]]:
    rows = Remote.objects.order_by("pk").values_list("pk", "user_id", "name", "ws_session_id", "channel_name", "tools")
    return [row async for row in rows]


async def test_bad_input_leaves_stored_state_unchanged(ws_connect, owner_token, weather_tools, count_rows):
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as other:
        await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        before = (await remote_rows(), await count_rows(WsSession))
        assert len(before[0]) == 1 and before[1] == 2
        for frame in BAD_INPUT:
            await other.send(frame)
            await other.send({"action": "ping", "nonce": "probe"})
            expected = 0 if '"remote-call-result"' in frame else 1
            answers = []
            # The probe's pong may overtake the error (a remote-call is answered from a task).
            while sum(answer.get("nonce") != "probe" for answer in answers) < expected or not any(
                answer.get("nonce") == "probe" for answer in answers
            ):
                answers.append(await other.recv())
            errors = [answer for answer in answers if answer.get("nonce") != "probe"]
            assert len(errors) == expected and all("error" in answer for answer in errors), (frame, answers)
            assert (await remote_rows(), await count_rows(WsSession)) == before, frame
        assert await server.nothing_received()


# --- unicode ---------------------------------------------------------------------------


async def utf8_frame(ws) -> dict[str, object]:
    """The next frame, checked to be valid UTF-8 text as a real server must send it."""
    message = await ws.communicator.receive_output(3)
    assert message["type"] == "websocket.send", message
    message["text"].encode("utf-8")
    return json.loads(message["text"])


async def test_a_lone_surrogate_is_refused_as_not_unicode_and_the_session_stays(ws_connect, owner_token):
    # "\ud800" is valid JSON syntax but not Unicode text: no UTF-8 wire or channel layer
    # can carry it, so the frame is refused, while a proper pair ("\ud83d\ude80") is fine.
    async with ws_connect(token=owner_token) as ws:
        await ws.send('{"action": "\\ud800", "nonce": "\\udfff"}')
        reply = await utf8_frame(ws)
        assert reply["error"].startswith("invalid JSON: ") and "a string holds a lone surrogate" in reply["error"]
        await ws.send('{"action": "ping", "nonce": "x\\ud83d\\ude80"}')
        assert await utf8_frame(ws) == {"pong": True, "nonce": "x\U0001f680"}
        await assert_still_open(ws)


async def test_non_ascii_text_round_trips_unchanged(ws_connect, owner_token):
    async with ws_connect(token=owner_token) as ws:
        nonce = "naïve ☃ 🚀 日本"
        await ws.send(json.dumps({"action": "ping", "nonce": nonce}, ensure_ascii=False))
        assert await utf8_frame(ws) == {"pong": True, "nonce": nonce}
