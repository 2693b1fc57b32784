"""Every row of the remotes action table and its validation (docs/ws-protocol.md#actions)."""

from __future__ import annotations

from typing import Any

import pytest

from remotes.models import Remote

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]

WEATHER = "weather-service"


def call_frame(
    nonce: str, function: str = "get_forecast", args: Any = None, remotename: str = WEATHER
) -> dict[str, Any]:
    return {
        "action": "remote-call",
        "nonce": nonce,
        "body": {"remotename": remotename, "function": function, "args": {"city": "Rome"} if args is None else args},
    }


# --- remote-connect -------------------------------------------------------------------


async def test_it_connects_a_remote_and_echoes_the_name_and_nonce(ws_connect, owner_token, weather_tools, count_rows):
    async with ws_connect(token=owner_token) as server:
        await server.send(
            {"action": "remote-connect", "nonce": 41, "body": {"remotename": WEATHER, "tools": weather_tools}}
        )
        assert await server.reply(41) == {"message": "remote connected", "remotename": WEATHER, "nonce": 41}
        assert await count_rows(Remote, name=WEATHER) == 1


async def test_it_refuses_to_connect_a_name_already_connected_for_the_user(
    ws_connect, owner_token, weather_tools, count_rows
):
    async with ws_connect(token=owner_token) as first, ws_connect(token=owner_token) as second:
        await first.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        reply = await second.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        assert reply == {"error": f"remote '{WEATHER}' is already connected", "nonce": "n1"}
        again = await first.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        assert again == {"error": f"remote '{WEATHER}' is already connected", "nonce": "n2"}
        assert await count_rows(Remote, name=WEATHER) == 1


async def test_it_accepts_functions_as_an_alias_of_tools(ws_connect, owner_token, weather_tools):
    async with ws_connect(token=owner_token) as server:
        reply = await server.request("remote-connect", {"remotename": WEATHER, "functions": weather_tools})
        assert reply == {"message": "remote connected", "remotename": WEATHER, "nonce": "n1"}
        listed = await server.request("remote-list")
        assert [entry["name"] for entry in listed["remotes"]] == ["get_forecast"]


async def test_a_function_without_parameters_lists_an_empty_object_schema(ws_connect, owner_token):
    async with ws_connect(token=owner_token) as server:
        await server.request(
            "remote-connect", {"remotename": "clock", "tools": [{"name": "now", "description": "the time"}]}
        )
        listed = await server.request("remote-list")
        assert listed["remotes"] == [
            {
                "remotename": "clock",
                "name": "now",
                "description": "the time",
                "parameters": {"type": "object", "properties": {}},
            }
        ]


REMOTENAME_RULE = "must be 1-64 characters from letters, digits and '._/-', starting with a letter or digit"
FUNCTION_RULE = "must be 1-64 characters from letters, digits, '_' and '-'"


@pytest.mark.parametrize(
    ("remotename", "tools", "error"),
    [
        ("", None, f"invalid remotename: {REMOTENAME_RULE}"),
        ("a" * 65, None, f"invalid remotename: {REMOTENAME_RULE}"),
        (".hidden", None, f"invalid remotename: {REMOTENAME_RULE}"),
        ("-dash", None, f"invalid remotename: {REMOTENAME_RULE}"),
        ("has space", None, f"invalid remotename: {REMOTENAME_RULE}"),
        ("semi;colon", None, f"invalid remotename: {REMOTENAME_RULE}"),
        ("ünïcode", None, f"invalid remotename: {REMOTENAME_RULE}"),
        (5, None, "invalid remotename: Input should be a valid string"),
        ("ok", [{"name": "bad name"}], f"invalid tools[0].name: {FUNCTION_RULE}"),
        ("ok", [{"name": ""}], f"invalid tools[0].name: {FUNCTION_RULE}"),
        ("ok", [{"name": "f" * 65}], f"invalid tools[0].name: {FUNCTION_RULE}"),
        ("ok", [{"name": "a"}, {"name": "dots.not.allowed"}], f"invalid tools[1].name: {FUNCTION_RULE}"),
        ("ok", [{"name": "twice"}, {"name": "twice"}], "invalid tools: duplicate function name 'twice'"),
        ("ok", [{"name": f"f{i}"} for i in range(129)], "invalid tools: a remote has 0 to 128 functions, got 129"),
        ("ok", [{"name": "f", "parameters": {"type": 5}}], "invalid tools[0].parameters: not a valid JSON Schema"),
        # jsonschema's validator_for raised TypeError for a $schema that is not text: an internal error.
        (
            "ok",
            [{"name": "f", "parameters": {"$schema": [], "type": "object"}}],
            'invalid tools[0].parameters: "$schema" must be a string',
        ),
        (
            "ok",
            [{"name": "f", "parameters": {"type": "string"}}],
            'invalid tools[0].parameters: the schema\'s "type" must be "object"',
        ),
        (
            "ok",
            [{"name": "f", "parameters": {"properties": {}}}],
            'invalid tools[0].parameters: the schema\'s "type" must be "object"',
        ),
        (
            "ok",
            [{"name": "f", "parameters": "object"}],
            "invalid tools[0].parameters: Input should be a valid dictionary",
        ),
        ("ok", "get_forecast", "invalid tools"),
    ],
    ids=[
        "empty-name",
        "65-char-name",
        "leading-dot",
        "leading-dash",
        "space",
        "semicolon",
        "non-ascii",
        "name-not-string",
        "function-space",
        "function-empty",
        "function-65",
        "function-dots",
        "duplicate",
        "129-functions",
        "schema-invalid",
        "schema-dialect-not-text",
        "schema-not-object-type",
        "schema-without-type",
        "schema-not-dict",
        "tools-not-list",
    ],
)
async def test_it_refuses_a_bad_remote_connect_naming_the_field(
    ws_connect, owner_token, count_rows, remotename, tools, error
):
    body = {"remotename": remotename, "tools": tools if tools is not None else [{"name": "f"}]}
    async with ws_connect(token=owner_token) as server:
        reply = await server.request("remote-connect", body)
        assert set(reply) == {"error", "nonce"}
        assert reply["nonce"] == "n1"
        assert reply["error"].startswith(error), reply["error"]
        assert await count_rows(Remote) == 0
        # The session stays usable.
        assert await server.request("ping") == {"pong": True, "nonce": "n2"}


async def test_it_accepts_the_longest_valid_names_and_128_functions(ws_connect, owner_token):
    remotename = "a" + "._/-9" * 12 + "bcd"  # 64 characters
    tools = [{"name": f"{'f' * 60}{i:03d}"[-64:]} for i in range(128)]
    async with ws_connect(token=owner_token) as server:
        reply = await server.request("remote-connect", {"remotename": remotename, "tools": tools})
        assert reply == {"message": "remote connected", "remotename": remotename, "nonce": "n1"}
        listed = await server.request("remote-list")
        assert len(listed["remotes"]) == 128


@pytest.mark.parametrize(
    ("body", "error"),
    [({"tools": [{"name": "f"}]}, "missing field 'remotename'"), ({"remotename": "x"}, "missing field 'tools'")],
)
async def test_it_names_a_missing_remote_connect_field(ws_connect, owner_token, body, error):
    async with ws_connect(token=owner_token) as server:
        assert await server.request("remote-connect", body) == {"error": error, "nonce": "n1"}


# --- remote-disconnect ------------------------------------------------------------------


async def test_it_disconnects_a_remote(ws_connect, owner_token, weather_tools, count_rows):
    async with ws_connect(token=owner_token) as server:
        await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        reply = await server.request("remote-disconnect", {"remotename": WEATHER})
        assert reply == {"message": "remote disconnected", "remotename": WEATHER, "nonce": "n2"}
        assert await count_rows(Remote) == 0
        assert (await server.request("remote-list"))["remotes"] == []
        # The name is free again.
        again = await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        assert again["message"] == "remote connected"


async def test_it_refuses_to_disconnect_a_remote_that_is_not_connected(ws_connect, owner_token):
    async with ws_connect(token=owner_token) as server:
        reply = await server.request("remote-disconnect", {"remotename": "x"})
        assert reply == {"error": "no connected remote named 'x'", "nonce": "n1"}
        assert await server.request("remote-disconnect", {}) == {"error": "missing field 'remotename'", "nonce": "n2"}


async def test_closing_the_serving_session_disconnects_its_remotes(ws_connect, owner_token, weather_tools, count_rows):
    async with ws_connect(token=owner_token) as watcher:
        async with ws_connect(token=owner_token) as server:
            await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
            await server.request("remote-connect", {"remotename": "clock", "tools": [{"name": "now"}]})
            assert len((await watcher.request("remote-list"))["remotes"]) == 2
        assert (await watcher.request("remote-list"))["remotes"] == []
        assert await count_rows(Remote) == 0


# --- remote-list ------------------------------------------------------------------------


async def test_it_lists_one_entry_per_function_with_its_remotename(ws_connect, owner_token, weather_tools):
    clock = [
        {
            "name": "now",
            "description": "the time",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
        },
        {"name": "sleep", "description": "", "parameters": {"type": "object", "properties": {}}},
    ]
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as other:
        assert await server.request("remote-list") == {"remotes": [], "nonce": "n1"}
        await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        await other.request("remote-connect", {"remotename": "clock", "tools": clock})
        listed = await server.request("remote-list")
        assert listed == {
            "remotes": [
                {"remotename": "clock", **clock[0]},
                {"remotename": "clock", **clock[1]},
                {"remotename": WEATHER, **weather_tools[0]},
            ],
            "nonce": "n3",
        }
        for entry in listed["remotes"]:
            assert set(entry) == {"remotename", "name", "description", "parameters"}


# --- remote-call and remote-call-result ------------------------------------------------


async def test_a_call_reaches_the_serving_session_as_an_event_without_nonce(ws_connect, owner_token, weather_tools):
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        await caller.send(call_frame("c1"))
        event = await server.next_event()
        assert event["requestId"].startswith(f"{WEATHER}#")
        assert event == {
            "action": "remote-call",
            "requestId": event["requestId"],
            "remotename": WEATHER,
            "function": "get_forecast",
            "args": {"city": "Rome"},
        }
        await server.send({"action": "remote-call-result", "requestId": event["requestId"], "result": [1, "two", None]})
        assert await caller.reply("c1") == {"result": [1, "two", None], "nonce": "c1"}


async def test_request_ids_are_never_reused_and_name_their_remote(ws_connect, owner_token, weather_tools):
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        await server.request("remote-connect", {"remotename": "clock", "tools": [{"name": "now"}]})
        seen = []
        for index, (remotename, function, args) in enumerate(
            [
                (WEATHER, "get_forecast", {"city": "a"}),
                (WEATHER, "get_forecast", {"city": "b"}),
                ("clock", "now", {}),
                (WEATHER, "get_forecast", {"city": "c"}),
            ]
        ):
            await caller.send(call_frame(f"c{index}", function, args, remotename))
            event = await server.next_event()
            seen.append(event["requestId"])
            await server.send({"action": "remote-call-result", "requestId": event["requestId"], "result": index})
            assert await caller.reply(f"c{index}") == {"result": index, "nonce": f"c{index}"}
        assert [request_id.rsplit("#", 1)[0] for request_id in seen] == [WEATHER, WEATHER, "clock", WEATHER]
        assert len(set(seen)) == len(seen)


async def test_remote_call_result_gets_no_reply_even_with_a_nonce(ws_connect, owner_token, weather_tools):
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        await caller.send(call_frame("c1"))
        event = await server.next_event()
        await server.send({"action": "remote-call-result", "nonce": "r1", "requestId": event["requestId"], "result": 1})
        assert await caller.reply("c1") == {"result": 1, "nonce": "c1"}
        # Nothing came back to the serving session: its next frame is the ping's reply.
        await server.send({"action": "ping", "nonce": "p"})
        assert await server.recv() == {"pong": True, "nonce": "p"}


async def test_remote_call_result_is_accepted_under_body(ws_connect, owner_token, weather_tools):
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        await caller.send(call_frame("c1"))
        event = await server.next_event()
        await server.send(
            {"action": "remote-call-result", "body": {"requestId": event["requestId"], "result": {"temp": 3}}}
        )
        assert await caller.reply("c1") == {"result": {"temp": 3}, "nonce": "c1"}


async def test_an_absent_result_means_null(ws_connect, owner_token, weather_tools):
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        await caller.send(call_frame("c1"))
        event = await server.next_event()
        await server.send({"action": "remote-call-result", "requestId": event["requestId"]})
        assert await caller.reply("c1") == {"result": None, "nonce": "c1"}


async def test_an_error_result_reaches_the_caller_as_an_error(ws_connect, owner_token, weather_tools):
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        await caller.send(call_frame("c1"))
        event = await server.next_event()
        await server.send(
            {"action": "remote-call-result", "body": {"requestId": event["requestId"], "error": "no such city"}}
        )
        assert await caller.reply("c1") == {"error": "no such city", "nonce": "c1"}


async def test_a_result_for_an_unknown_request_id_is_ignored(ws_connect, owner_token, weather_tools):
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        for request_id in ["nope#0", f"{WEATHER}#7", 5, None]:
            await server.send({"action": "remote-call-result", "requestId": request_id, "result": "forged"})
        await caller.send(call_frame("c1"))
        event = await server.next_event()
        assert event["requestId"].startswith(f"{WEATHER}#")
        await server.send({"action": "remote-call-result", "requestId": event["requestId"], "result": "real"})
        assert await caller.reply("c1") == {"result": "real", "nonce": "c1"}
        assert await server.nothing_received()


async def test_it_refuses_a_call_to_a_remote_that_is_not_connected(ws_connect, owner_token):
    async with ws_connect(token=owner_token) as caller:
        await caller.send(call_frame("c1"))
        assert await caller.reply("c1") == {"error": f"no connected remote named '{WEATHER}'", "nonce": "c1"}


async def test_it_refuses_an_unknown_function_without_calling_the_remote(ws_connect, owner_token, weather_tools):
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        await caller.send(call_frame("c1", function="get_rain"))
        assert await caller.reply("c1") == {"error": f"remote '{WEATHER}' has no function 'get_rain'", "nonce": "c1"}
        assert await server.nothing_received()


@pytest.mark.parametrize(
    ("args", "mentions"),
    [({}, "'city' is a required property"), ({"city": 5}, "5 is not of type 'string'")],
    ids=["missing-required", "wrong-type"],
)
async def test_it_refuses_arguments_that_fail_the_schema_without_calling_the_remote(
    ws_connect, owner_token, weather_tools, args, mentions
):
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        await caller.send(call_frame("c1", args=args))
        reply = await caller.reply("c1")
        assert reply["error"].startswith(f"invalid arguments for '{WEATHER}.get_forecast': ")
        assert mentions in reply["error"]
        assert await server.nothing_received()


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"remotename": WEATHER}, "missing field 'function'"),
        ({"function": "get_forecast"}, "missing field 'remotename'"),
        (
            {"remotename": WEATHER, "function": "get_forecast", "args": [1]},
            "invalid args: Input should be a valid dictionary",
        ),
        ({"remotename": WEATHER, "function": "get_forecast", "args": {"city": "x"}, "timeout": 0}, "invalid timeout"),
        ({"remotename": WEATHER, "function": "get_forecast", "args": {"city": "x"}, "timeout": 301}, "invalid timeout"),
        (
            {"remotename": WEATHER, "function": "get_forecast", "args": {"city": "x"}, "timeout": "1"},
            "invalid timeout: Input should be a valid number",
        ),
        (
            {"remotename": WEATHER, "function": "get_forecast", "args": {"city": "x"}, "timeout": True},
            "invalid timeout: Input should be a valid number",
        ),
        ("get_forecast", "invalid body"),
    ],
    ids=[
        "no-function",
        "no-remotename",
        "args-array",
        "timeout-zero",
        "timeout-over-300",
        "timeout-string",
        "timeout-boolean",
        "body-string",
    ],
)
async def test_it_refuses_a_malformed_call_naming_the_field(ws_connect, owner_token, weather_tools, body, error):
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await server.request("remote-connect", {"remotename": WEATHER, "tools": weather_tools})
        reply = await caller.request("remote-call", body)
        assert set(reply) == {"error", "nonce"}
        assert reply["error"].startswith(error), reply["error"]
        assert await server.nothing_received()


async def test_ping_is_answered_with_pong_and_the_nonce(ws_connect, owner_token):
    async with ws_connect(token=owner_token) as ws:
        for nonce in ["a", 7, 2.5, ""]:
            await ws.send({"action": "ping", "nonce": nonce})
            assert await ws.recv() == {"pong": True, "nonce": nonce}
