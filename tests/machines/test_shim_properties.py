"""Generated frames thrown at ``/ws/shim/`` (docs/shim-protocol.md#the-envelope,
docs/shim-protocol.md#the-handshake).

Before HELLO every frame that is not a valid HELLO gets an ``ERROR`` and close 4400.
After HELLO the consumer never crashes and never closes: a frame that is not a response
to a pending operation gets an ``ERROR`` (``INVALID_REQUEST``), a ``PING`` a ``PONG``, an
``ERROR`` nothing. One connection per example; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from channels.layers import channel_layers
from channels.testing import WebsocketCommunicator
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.machines.conftest import SHIM_PATH, frame, hello_payload

pytestmark = pytest.mark.django_db(transaction=True)

PROPERTY_SETTINGS = settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
EXAMPLE_TIMEOUT = 10.0  # seconds; an example normally takes a few milliseconds
PROBE_ID = "probe-7f3a"

MESSAGE_TYPES = [
    "HELLO",
    "HELLO_ACK",
    "PING",
    "PONG",
    "ERROR",
    "ACK",
    "FILE_READ",
    "FILE_CONTENTS",
    "FILE_STAT_RESPONSE",
    "COMMAND_RESULT",
    "MACHINE_LIST_RESPONSE",
    "SESSION_REVOKED",
]

# Strings may hold lone surrogates: a JSON "\ud800" escape decodes to one.
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
envelopes = st.fixed_dictionaries(
    {"type": st.sampled_from(MESSAGE_TYPES) | texts},
    optional={
        "id": st.uuids().map(str) | json_values,
        "ts": json_values,
        "version": st.sampled_from(["2.0", "3.0", "x"]) | json_values,
        "session_id": json_values,
        "target_machine": json_values,
        "payload": json_values,
    },
)
# HELLO payloads with one required field missing or of a wrong type.
REQUIRED = [
    "shim_version",
    "protocol_version",
    "machine_id",
    "hostname",
    "platform",
    "arch",
    "capabilities",
    "allowed_roots",
    "sessions",
]
wrong_values = st.none() | st.booleans() | st.integers() | st.dictionaries(texts, scalars, max_size=2)


@st.composite
def broken_hellos(draw: Any) -> dict[str, Any]:
    payload = hello_payload(machine_id=str(uuid.uuid4()))
    field = draw(st.sampled_from(REQUIRED))
    if draw(st.booleans()):
        del payload[field]
    else:
        payload[field] = draw(wrong_values)
    return frame("HELLO", payload)


def as_text(value: Any) -> str:
    return json.dumps(value)


any_frames = st.one_of(
    envelopes.map(as_text),
    json_values.map(as_text),
    st.text(min_size=1, max_size=200),
    st.binary(min_size=1, max_size=200),
)
first_frames = st.one_of(
    envelopes.filter(lambda e: e.get("type") != "HELLO").map(as_text),
    broken_hellos().map(as_text),
    json_values.filter(lambda v: not isinstance(v, dict)).map(as_text),
    st.text(min_size=1, max_size=200),
    st.binary(min_size=1, max_size=200),
)


@asynccontextmanager
async def shim_socket(token: str) -> AsyncIterator[WebsocketCommunicator]:
    from dispatch.asgi import application

    # Hypothesis seeds ``random`` alike for every example, so channel names repeat:
    # a fresh layer keeps one example's leftovers from reaching the next.
    channel_layers.backends.clear()
    communicator = WebsocketCommunicator(
        application, SHIM_PATH, headers=[(b"authorization", f"Bearer {token}".encode())]
    )
    connected, _ = await communicator.connect(timeout=5)
    assert connected
    try:
        yield communicator
    finally:
        await communicator.disconnect(timeout=3)


async def output(communicator: WebsocketCommunicator, timeout: float = 3) -> dict[str, Any]:
    """The next thing the server sent: ``{"close": code}`` or the parsed JSON frame, which
    must be valid UTF-8 (as a real server sends it) and a protocol envelope."""
    message = await communicator.receive_output(timeout)
    if message["type"] == "websocket.close":
        return {"close": message.get("code")}
    assert message["type"] == "websocket.send" and message.get("text") is not None, message
    message["text"].encode("utf-8")
    received = json.loads(message["text"])
    assert isinstance(received, dict) and isinstance(received.get("type"), str), received
    assert {"id", "ts", "version", "payload"} <= set(received), received
    return received


async def send(communicator: WebsocketCommunicator, message: str | bytes) -> None:
    if isinstance(message, bytes):
        await communicator.send_to(bytes_data=message)
    else:
        await communicator.send_to(text_data=message)


@PROPERTY_SETTINGS
@given(first=first_frames)
async def test_anything_but_a_valid_hello_first_gets_an_error_and_close_4400(owner_token, first):
    async def example() -> None:
        async with shim_socket(owner_token) as communicator:
            await send(communicator, first)
            error = await output(communicator)
            assert error["type"] == "ERROR", error
            assert error["payload"]["code"] == "INVALID_HELLO"
            assert error["payload"]["fatal"] is True
            assert await output(communicator) == {"close": 4400}

    await asyncio.wait_for(example(), EXAMPLE_TIMEOUT)


@PROPERTY_SETTINGS
@given(message=any_frames)
async def test_after_hello_every_frame_is_answered_or_ignored_and_the_socket_stays_open(owner_token, message):
    async def example() -> None:
        async with shim_socket(owner_token) as communicator:
            await send(communicator, as_text(frame("HELLO", hello_payload())))
            assert (await output(communicator))["type"] == "HELLO_ACK"
            await send(communicator, message)
            await send(communicator, as_text(frame("PING", {}, message_id=PROBE_ID)))
            answers = []
            while True:
                received = await output(communicator)
                assert "close" not in received, f"closed with {received['close']} after {message!r}"
                if received["type"] == "PONG" and received["id"] == PROBE_ID:
                    break
                answers.append(received)
            assert len(answers) <= 1, answers
            for answer in answers:
                if answer["type"] == "ERROR":
                    assert answer["payload"]["code"] == "INVALID_REQUEST", answer
                    assert answer["payload"]["fatal"] is False
                else:
                    assert answer["type"] == "PONG", answer  # the generated frame was a PING
            assert not communicator.future.done()

    await asyncio.wait_for(example(), EXAMPLE_TIMEOUT)


@pytest.mark.parametrize("before_hello", [True, False], ids=["before-hello", "after-hello"])
async def test_a_deeply_nested_frame_does_not_crash_the_consumer(owner_token, before_hello):
    async with shim_socket(owner_token) as communicator:
        if not before_hello:
            await send(communicator, as_text(frame("HELLO", hello_payload())))
            assert (await output(communicator))["type"] == "HELLO_ACK"
        await send(communicator, "[" * 100_000 + "]" * 100_000)
        error = await output(communicator)
        assert error["type"] == "ERROR"
        if before_hello:
            assert await output(communicator) == {"close": 4400}
        else:
            await send(communicator, as_text(frame("PING", {}, message_id=PROBE_ID)))
            assert (await output(communicator))["id"] == PROBE_ID
