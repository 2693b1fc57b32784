"""Generated frames thrown at ``/ws`` (docs/ws-protocol.md#frames).

The consumer never crashes, and every frame gets an answer (an ``error`` or a valid
reply) or the close the protocol prescribes. One connection per example; every wait is
bounded, so a silent consumer fails the example instead of hanging the run.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest
from channels.layers import channel_layers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core import wire

pytestmark = pytest.mark.django_db(transaction=True)

PROPERTY_SETTINGS = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
EXAMPLE_TIMEOUT = 10.0  # seconds; an example normally takes a few milliseconds

ACTIONS = ["ping", "remote-connect", "remote-disconnect", "remote-list", "remote-call", "remote-call-result", "auth"]

# Text that may hold lone surrogates, as a client can send with "\udXXX" escapes.
# (``st.text`` over a mix of alphabets drops the surrogates: build the strings from lists.)
texts = st.lists(
    st.one_of(st.characters(), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, exclude_categories=())),
    max_size=20,
).map("".join)
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | texts
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(texts, children, max_size=4),
    max_leaves=12,
)
function_specs = st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "get_forecast", "", "bad name"]) | texts},
    optional={"description": json_values, "parameters": json_values | st.just({"type": "object", "properties": {}})},
)
bodies = json_values | st.fixed_dictionaries(
    {},
    optional={
        "remotename": st.sampled_from(["weather-service", "", ".x", "a" * 65]) | json_values,
        "tools": st.lists(function_specs, max_size=3) | json_values,
        "functions": st.lists(function_specs, max_size=3),
        "function": st.sampled_from(["get_forecast", "f"]) | json_values,
        "args": json_values,
        "timeout": st.sampled_from([0, 0.05, -1, 301, "1"]) | json_values,
        "requestId": st.sampled_from(["weather-service#0", "x#1"]) | json_values,
        "result": json_values,
        "error": json_values,
    },
)
requests = st.fixed_dictionaries(
    {"action": st.sampled_from(ACTIONS) | texts | json_values},
    optional={
        "nonce": st.text(max_size=8) | st.integers() | json_values,
        "body": bodies,
        "requestId": json_values,
        "result": json_values,
        "token": json_values,
    },
)
credentials = st.fixed_dictionaries(
    {},
    optional={
        "token": st.text(max_size=50) | json_values,
        "username": st.sampled_from(["alice", "bob", "nobody", ""]) | json_values,
        "password": st.text(max_size=30) | json_values,
    },
)


def as_text(value: Any) -> str:
    return json.dumps(value)


frames = st.one_of(
    requests.map(as_text),
    json_values.map(as_text),
    st.text(min_size=1, max_size=200),
    st.binary(min_size=1, max_size=200),
)
first_frames = st.one_of(credentials.map(as_text), frames)


async def output(ws, timeout: float = 3) -> dict[str, Any]:
    """The next thing the server sent: ``{"close": code}`` or the parsed JSON frame.

    Every text frame must be valid UTF-8 as a real server sends it (a lone surrogate
    cannot be), and a JSON object.
    """
    message = await ws.communicator.receive_output(timeout)
    if message["type"] == "websocket.close":
        return {"close": message.get("code")}
    assert message["type"] == "websocket.send" and message.get("text") is not None, message
    message["text"].encode("utf-8")
    frame = json.loads(message["text"])
    assert isinstance(frame, dict), frame
    return frame


async def send(ws, frame: str | bytes) -> None:
    if isinstance(frame, bytes):
        await ws.communicator.send_to(bytes_data=frame)
    else:
        await ws.communicator.send_to(text_data=frame)


def parsed_request(frame: str | bytes) -> dict[str, Any] | None:
    if isinstance(frame, bytes):
        return None
    try:
        value = wire.loads(frame)  # the consumer's own strict reading
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def readable_nonce(request: dict[str, Any] | None) -> tuple[bool, Any]:
    """(the nonce is valid, the nonce) as the envelope reads it (docs/ws-protocol.md#frames)."""
    if request is None or request.get("nonce") is None:
        return True, None
    nonce = request["nonce"]
    if isinstance(nonce, bool) or not isinstance(nonce, (str, int, float)):
        return False, None
    return True, nonce


def same_nonce(sent: Any, received: Any) -> bool:
    if isinstance(sent, float) and isinstance(received, (int, float)):
        return sent == received or (math.isinf(sent) and sent == received)
    return bool(sent == received and type(sent) is type(received))


def is_valid_reply(frame: dict[str, Any]) -> bool:
    if "error" in frame:
        return isinstance(frame["error"], str) and frame["error"] != "internal error"
    return (
        frame.get("pong") is True
        or "remotes" in frame
        or frame.get("message") in ("remote connected", "remote disconnected")
    )


@PROPERTY_SETTINGS
@given(frame=frames)
async def test_an_authenticated_session_answers_every_generated_frame(ws_connect, owner_token, frame):
    async def example() -> None:
        # Hypothesis seeds ``random`` alike for every example, so channel names repeat:
        # a fresh layer keeps one example's leftovers from reaching the next.
        channel_layers.backends.clear()
        async with ws_connect(token=owner_token) as ws:
            await send(ws, frame)
            await ws.send({"action": "ping", "nonce": "probe-4c1d"})
            request = parsed_request(frame)
            nonce_ok, nonce = readable_nonce(request)
            silent = request is not None and nonce_ok and request.get("action") == "remote-call-result"
            answers: list[dict[str, Any]] = []
            probed = False
            while not probed or len(answers) < (0 if silent else 1):
                received = await output(ws)
                assert "close" not in received, f"closed with {received['close']} after {frame!r}"
                if received.get("nonce") == "probe-4c1d":
                    assert received == {"pong": True, "nonce": "probe-4c1d"}
                    probed = True
                else:
                    answers.append(received)
            assert len(answers) == (0 if silent else 1), answers
            if answers:
                answer = answers[0]
                assert is_valid_reply(answer), answer
                if request is None and isinstance(frame, str):
                    # Refused by the strict reading: the nonce is echoed when a lenient
                    # reading finds one the layer can carry (docs/ws-protocol.md#frames).
                    echoed = wire.lenient_field(wire.lenient_object(frame), "nonce", nested=False)
                    if isinstance(echoed, str | int | float) and not isinstance(echoed, bool):
                        if wire.problem(echoed) is None:
                            nonce_ok, nonce = True, echoed
                if nonce_ok and nonce is not None:
                    assert "nonce" in answer and same_nonce(nonce, answer["nonce"]), (nonce, answer)
                elif "nonce" in answer:
                    raise AssertionError(f"a nonce appeared from nowhere: {answer}")
            assert await ws.nothing_received(0.01)

    await asyncio.wait_for(example(), EXAMPLE_TIMEOUT)


@PROPERTY_SETTINGS
@given(frame=first_frames)
async def test_an_unauthenticated_session_answers_every_generated_frame_then_closes(ws_connect, owner, frame):
    async def example() -> None:
        # Hypothesis seeds ``random`` alike for every example, so channel names repeat:
        # a fresh layer keeps one example's leftovers from reaching the next.
        channel_layers.backends.clear()
        async with ws_connect() as ws:
            await send(ws, frame)
            answer = await output(ws)
            request = parsed_request(frame)
            if request is not None and ("token" in request or "username" in request):
                assert answer in (
                    {"error": "authentication failed"},
                    {"error": "too many failed attempts; try again later"},
                ), answer
            else:
                assert answer == {"error": "not authenticated"}
            assert await output(ws) == {"close": 4401}

    await asyncio.wait_for(example(), EXAMPLE_TIMEOUT)


@PROPERTY_SETTINGS
@given(batch=st.lists(frames, min_size=1, max_size=15))
async def test_a_session_survives_a_burst_of_generated_frames(ws_connect, owner_token, batch):
    async def example() -> None:
        # Hypothesis seeds ``random`` alike for every example, so channel names repeat:
        # a fresh layer keeps one example's leftovers from reaching the next.
        channel_layers.backends.clear()
        async with ws_connect(token=owner_token) as ws:
            for frame in batch:
                await send(ws, frame)
            await ws.send({"action": "ping", "nonce": "probe-77"})
            while True:
                received = await output(ws)
                assert "close" not in received, f"closed with {received['close']}"
                assert is_valid_reply(received), received
                if received.get("nonce") == "probe-77":
                    break

    await asyncio.wait_for(example(), EXAMPLE_TIMEOUT)
