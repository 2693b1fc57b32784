"""Every frame the ``/ws`` session sends is one of the types in ``dispatch.ws.frames``, and
its text is the one the session wrote before it had types, byte for byte
(docs/ws-protocol.md#frames, docs/ws-protocol.md#events)."""

from __future__ import annotations

import json
from typing import Any, get_args

import pytest
from pydantic import TypeAdapter, ValidationError

from agents.protocol import UserEventMessage
from agents.services import user_events_group
from core.realtime import ring
from dispatch.ws.frames import Frame
from tests.conftest import WsClient

pytestmark = pytest.mark.django_db(transaction=True)

WEATHER = "weather-service"
FRAME_TYPES: tuple[Any, ...] = get_args(Frame)


def frame_types(frame: dict[str, Any]) -> list[str]:
    """The names of the frame types ``frame`` is: its keys are the type's (every required
    one, no unknown one) and its values validate against the type's."""
    matched = []
    for frame_type in FRAME_TYPES:
        keys = set(frame)
        if not frame_type.__required_keys__ <= keys <= frame_type.__required_keys__ | frame_type.__optional_keys__:
            continue
        try:
            TypeAdapter(frame_type).validate_python(frame, strict=True)
        except ValidationError:
            continue
        matched.append(frame_type.__name__)
    return matched


async def raw(ws: WsClient) -> str:
    """The next frame's text, exactly as the server sent it."""
    message = await ws.communicator.receive_output(3)
    assert message["type"] == "websocket.send", message
    text: str = message["text"]
    frame = json.loads(text)
    assert len(frame_types(frame)) == 1, (frame, frame_types(frame))
    if "nonce" in frame:
        assert list(frame)[-1] == "nonce", frame  # the nonce always comes last
    return text


async def test_every_frame_of_a_session_is_typed_and_written_as_before(
    ws_connect: Any, owner: Any, owner_token: str, weather_tools: list[dict[str, Any]]
) -> None:
    async with ws_connect() as ws:
        await ws.send({"token": owner_token})
        assert await raw(ws) == '{"ok":true,"user":"alice"}'
        await ws.communicator.send_to(bytes_data=b"x")
        assert await raw(ws) == '{"error":"binary frames are not supported; send JSON text"}'
        await ws.send({"action": "ping", "nonce": "n1"})
        assert await raw(ws) == '{"pong":true,"nonce":"n1"}'
        await ws.send({"action": "ping"})
        assert await raw(ws) == '{"pong":true}'
        await ws.send({"action": "nope", "nonce": 7})
        assert await raw(ws) == '{"error":"unknown action \'nope\'","nonce":7}'
        await ws.send("[1]")
        assert await raw(ws) == '{"error":"a message must be a JSON object, got an array"}'
        await ws.send(
            {"action": "remote-connect", "nonce": 1.5, "body": {"remotename": WEATHER, "tools": weather_tools}}
        )
        assert await raw(ws) == '{"message":"remote connected","remotename":"weather-service","nonce":1.5}'
        await ws.send({"action": "remote-list", "nonce": "l"})
        listed = json.loads(await raw(ws))
        assert [entry["remotename"] for entry in listed["remotes"]] == [WEATHER]

        await ws.send(
            {
                "action": "remote-call",
                "nonce": "c",
                "body": {"remotename": WEATHER, "function": "get_forecast", "args": {"city": "Rome"}},
            },
        )
        event = await raw(ws)
        request_id = json.loads(event)["requestId"]
        assert event == (
            f'{{"action":"remote-call","requestId":"{request_id}","remotename":"weather-service",'
            '"function":"get_forecast","args":{"city":"Rome"}}'
        )
        await ws.send({"action": "remote-call-result", "requestId": request_id, "result": {"sky": "sunny é"}})
        assert await raw(ws) == '{"result":{"sky":"sunny é"},"nonce":"c"}'

        recorded: dict[str, Any] = {
            "agent_id": "agt_1",
            "run_id": None,
            "type": "system",
            "message": "m",
            "metadata": {},
            "created_at": "t",
        }
        group = user_events_group(owner.pk)
        await ring(group, UserEventMessage(event="agent.event", data=recorded))
        assert await raw(ws) == (
            '{"action":"agent-event","agentId":"agt_1","runId":null,'
            '"event":{"type":"system","message":"m","metadata":{},"created_at":"t"}}'
        )
        finished = {"id": "run_1", "agent_id": "agt_1", "status": "failed", "error": "boom"}
        await ring(group, UserEventMessage(event="run.updated", data=finished))
        assert await raw(ws) == (
            '{"action":"run-finished","agentId":"agt_1","runId":"run_1","status":"failed","error":"boom"}'
        )

        async with ws_connect(token=owner_token) as other:
            await other.send({"action": "remote-disconnect", "nonce": "d", "body": {"remotename": WEATHER}})
            assert await raw(other) == '{"message":"remote disconnected","remotename":"weather-service","nonce":"d"}'
        assert await raw(ws) == (
            '{"action":"remote-disconnected","remotename":"weather-service",'
            '"reason":"disconnected by another session of the user"}'
        )


async def test_a_refused_login_is_an_error_frame_without_a_nonce(ws_connect: Any, owner: Any) -> None:
    async with ws_connect() as ws:
        await ws.send({"token": "wrong"})
        assert await raw(ws) == '{"error":"authentication failed"}'
