"""Input built to crash parsers gets a clear error, never a crash or a ghost."""

from __future__ import annotations

import pytest

from remotes.models import Remote, WsSession

pytestmark = pytest.mark.django_db(transaction=True)

DEEP = "[" * 100_000


async def test_a_deeply_nested_frame_is_invalid_json_and_the_session_stays(ws_connect, owner_token, weather_tools):
    async with ws_connect(token=owner_token) as ws:
        await ws.request("remote-connect", {"remotename": "kept", "tools": weather_tools})
        await ws.send(DEEP)
        reply = await ws.recv()
        assert reply["error"].startswith("invalid JSON")
        assert (await ws.request("ping"))["pong"] is True


async def test_a_deeply_nested_first_frame_is_refused_as_unauthenticated(ws_connect):
    async with ws_connect() as ws:
        await ws.send(DEEP)
        assert (await ws.recv()) == {"error": "not authenticated"}
        assert await ws.closed_with() == 4401


@pytest.mark.parametrize("frame", ['{"action": "ping", "nonce": NaN}', '{"action": "ping", "nonce": 1e400}'])
async def test_non_finite_numbers_are_not_json(ws_connect, owner_token, frame):
    async with ws_connect(token=owner_token) as ws:
        await ws.send(frame)
        reply = await ws.recv()
        assert reply["error"].startswith("invalid JSON")


@pytest.mark.parametrize("first", ['{"token": "\\ud800"}', '{"username": "\\ud800", "password": "x"}'])
async def test_a_lone_surrogate_in_credentials_is_refused_like_invalid_json(ws_connect, first):
    async with ws_connect() as ws:
        await ws.send(first)
        assert (await ws.recv()) == {"error": "not authenticated"}
        assert await ws.closed_with() == 4401


def test_lone_surrogates_are_refused_by_the_password_check_itself():
    from core.services import AuthenticationFailed, password_authenticate

    with pytest.raises(AuthenticationFailed):
        password_authenticate(username="\ud800", password="x", client_address="127.0.0.1")


async def test_a_failing_handler_closes_the_socket_and_leaves_no_ghost(
    ws_connect, owner_token, weather_tools, count_rows, monkeypatch
):
    from core.consumers import receives
    from dispatch.ws.consumer import SessionConsumer
    from remotes.protocol import RemoteCallMessage

    async with ws_connect(token=owner_token) as ws:
        await ws.request("remote-connect", {"remotename": "ghost", "tools": weather_tools})
        assert await count_rows(Remote, name="ghost") == 1

        @receives(RemoteCallMessage)
        async def remote_call(self, call):
            raise RuntimeError("boom")

        monkeypatch.setattr(SessionConsumer, "remote_call", remote_call)
        async with ws_connect(token=owner_token) as caller:
            await caller.send(
                {
                    "action": "remote-call",
                    "nonce": 1,
                    "body": {"remotename": "ghost", "function": "get_forecast", "args": {"city": "x"}},
                }
            )
            assert await ws.closed_with() == 1011
            assert await count_rows(Remote, name="ghost") == 0
            assert await count_rows(WsSession) == 1  # only the caller's
            reply = await caller.reply(1, timeout=5)
            # The call never reached the remote, so it is re-routed: there is none left.
            assert reply["error"] == "no connected remote named 'ghost'"


def test_api_errors_keep_the_error_shape(client, owner_token):
    auth = {"HTTP_AUTHORIZATION": f"Bearer {owner_token}"}
    response = client.post("/api/v1/auth/token", DEEP, content_type="application/json")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "INVALID_REQUEST"
    response = client.post("/api/v1/sessions/demo/ops", DEEP, content_type="application/json", **auth)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "INVALID_REQUEST"
    response = client.get("/api/v1/no/such/route", **auth)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "NOT_FOUND"


async def test_nesting_that_parses_but_is_deeper_than_the_limit_is_invalid_json(ws_connect, owner_token):
    # 500 levels parse fine, but copying such a value (the channel layer deep-copies every
    # message) would recurse past Python's limit far from the edge.
    nested = "[" * 500 + "]" * 500
    frame = '{"action": "send-agent-prompt", "nonce": "n", "body": {"agentId": "agt_0", "input": ' + nested + "}}"
    async with ws_connect(token=owner_token) as ws:
        await ws.send(frame)
        reply = await ws.recv()
        assert reply["error"].startswith("invalid JSON") and "nested too deeply" in reply["error"]
        assert (await ws.request("ping"))["pong"] is True


def test_the_wire_accepts_the_limit_and_refuses_one_more_level():
    from core import wire

    assert wire.loads("[" * wire.MAX_DEPTH + "]" * wire.MAX_DEPTH) is not None
    with pytest.raises(ValueError, match="nested too deeply"):
        wire.loads("[" * (wire.MAX_DEPTH + 1) + "]" * (wire.MAX_DEPTH + 1))
    with pytest.raises(ValueError, match="nested too deeply"):
        wire.loads('{"a": ' * (wire.MAX_DEPTH + 1) + "1" + "}" * (wire.MAX_DEPTH + 1))


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("body", "named"),
    [
        ('{"username": "alice", "password": "x", "n": 18446744073709551616}', "n: integer 18446744073709551616"),
        ('{"username": "alice", "password": "x", "n": [-9223372036854775809]}', "n[0]: integer"),
        ('{"username": "\\ud800", "password": "x"}', "username: a string holds a lone surrogate"),
        ('{"username": "alice", "password": 1e400}', "1e400"),
        ('{"username": "alice", "password": NaN}', "NaN"),
    ],
)
def test_rest_refuses_values_the_channel_layer_cannot_carry_with_400_naming_the_field(body, named):
    from django.test import Client

    response = Client().post("/api/v1/auth/token", body, content_type="application/json")
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "INVALID_REQUEST"
    assert named in error["message"]
