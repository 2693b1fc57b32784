"""The one request/reply over the channel layer (``core.realtime.request_reply``), as remote
calls (docs/ws-protocol.md#remote-call) and machine operations
(docs/shim-protocol.md#errors) use it: the reply comes back, and each failure keeps the
error code and message its caller had before it was shared.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

import pytest
from channels.exceptions import ChannelFull
from channels.layers import get_channel_layer

from core import realtime
from core.errors import DispatchError
from core.protocol import ChannelMessage, ChannelRequest
from core.realtime import replies
from machines.protocol import MachineReplyMessage
from machines.services import transport as operations
from machines.services.errors import MachineError
from machines.services.router import Candidate
from machines.services.transport import send_to_machine
from remotes import services as remotes
from remotes.protocol import RemoteCallReply, RemoteProbeMessage, RemoteProbeReply
from remotes.services import RemoteError, RemoteRoute


class CountRequest(ChannelRequest):
    type: Literal["test.request"] = "test.request"
    n: int


class CountReply(ChannelMessage):
    type: Literal["test.reply"] = "test.reply"
    n: int


def _candidate(channel_name: str) -> Candidate:
    return Candidate(
        machine_id="m_1",
        hostname="laptop",
        display_name="",
        channel_name=channel_name,
        connection_id="conn_1",
        server_process_id="proc_1",
        granted_capabilities=("files",),
        allowed_roots=("/",),
        limits={},
    )


def _route(channel_name: str) -> RemoteRoute:
    return RemoteRoute(remote_id=1, channel_name=channel_name, server_process_id="proc_1", tools=[])


async def _answer(channel: str, reply: Any, *, after: float = 0.0) -> dict[str, Any]:
    """Play the consumer: take one request from ``channel``, answer on its reply channel."""
    layer = get_channel_layer()
    request: dict[str, Any] = await layer.receive(channel)
    await asyncio.sleep(after)
    await layer.send(request["reply_channel"], reply(request) if callable(reply) else reply)
    return request


async def _deliver(channel: str, timeout: float) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + timeout
    return await remotes._deliver(_route(channel), "clock", "now", {"tz": "UTC"}, timeout, deadline)


class FullLayer:
    """A layer whose every channel is full (or that cannot serialize the message)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def new_channel(self) -> str:
        return "specific.test!reply"

    async def send(self, channel: str, message: dict[str, Any]) -> None:
        raise self.error


async def test_the_reply_arrives_and_the_request_carries_its_fields_and_a_reply_channel() -> None:
    channel = await get_channel_layer().new_channel()
    answering = asyncio.ensure_future(_answer(channel, lambda request: {"type": "test.reply", "n": request["n"] + 1}))
    reply = await realtime.request_reply(
        channel, CountRequest(n=41), reply=CountReply, timeout=5, timed_out=DispatchError("TIMEOUT", "late")
    )
    request = await answering
    assert reply == CountReply(n=42)
    assert set(request) == {"type", "n", "reply_channel"} and request["reply_channel"] != channel


async def test_a_malformed_reply_is_logged_and_dropped_and_the_wait_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    channel = await get_channel_layer().new_channel()

    async def answer_twice() -> None:
        request = await get_channel_layer().receive(channel)
        await get_channel_layer().send(request["reply_channel"], {"type": "test.reply", "n": "many"})
        await get_channel_layer().send(request["reply_channel"], {"type": "test.reply", "n": 7})

    answering = asyncio.ensure_future(answer_twice())
    with caplog.at_level(logging.WARNING, logger="core.realtime"):
        reply = await realtime.request_reply(
            channel, CountRequest(n=1), reply=CountReply, timeout=5, timed_out=DispatchError("TIMEOUT", "late")
        )
    await answering
    assert reply == CountReply(n=7)
    assert any("dropped a malformed message of type 'test.reply': invalid n" in r.getMessage() for r in caplog.records)


async def test_a_remote_call_gets_its_reply_with_the_call_message_unchanged() -> None:
    channel = await get_channel_layer().new_channel()
    answering = asyncio.ensure_future(_answer(channel, {"type": "remote.reply", "result": {"hour": 9}}))
    assert await _deliver(channel, 5) == RemoteCallReply(result={"hour": 9})
    request = await answering
    assert request == {
        "type": "remote.call",
        "remote_id": 1,
        "remotename": "clock",
        "function": "now",
        "args": {"tz": "UTC"},
        "timeout": 5,
        "reply_channel": request["reply_channel"],
    }


async def test_a_machine_operation_gets_its_reply_with_the_op_message_unchanged() -> None:
    channel = await get_channel_layer().new_channel()
    answer = {"type": "machine.reply", "response_type": "READ_FILE_RESPONSE", "payload": {"content": "x"}}
    answering = asyncio.ensure_future(_answer(channel, answer))
    reply = await send_to_machine(
        _candidate(channel), op="READ_FILE", payload={"path": "/a"}, session_id="s1", timeout=5, request_id="req-1"
    )
    assert reply == MachineReplyMessage(response_type="READ_FILE_RESPONSE", payload={"content": "x"})
    request = await answering
    assert request == {
        "type": "machine.op",
        "op": "READ_FILE",
        "payload": {"path": "/a"},
        "request_id": "req-1",
        "session_id": "s1",
        "timeout": 5,
        "reply_channel": request["reply_channel"],
    }


async def _serving(route: RemoteRoute) -> str:
    return "served"


async def _alive(connection_id: str, server_process_id: str) -> bool:
    return True


async def test_a_remote_call_without_an_answer_times_out_as_before(monkeypatch: Any) -> None:
    monkeypatch.setattr(remotes, "_serving_state", _serving)  # the remote lives, it just does not answer
    channel = await get_channel_layer().new_channel()
    started = asyncio.get_running_loop().time()
    with pytest.raises(RemoteError) as failure:
        await _deliver(channel, 0.2)
    assert (failure.value.code, failure.value.message) == ("TIMEOUT", "remote call 'clock.now' timed out after 0.2s")
    assert 0.19 <= asyncio.get_running_loop().time() - started < 1.0


async def test_a_machine_operation_without_an_answer_times_out_as_before(monkeypatch: Any) -> None:
    monkeypatch.setattr(operations, "_connection_alive", _alive)
    channel = await get_channel_layer().new_channel()
    with pytest.raises(MachineError) as failure:
        await send_to_machine(_candidate(channel), op="READ_FILE", payload={}, session_id="s1", timeout=0.2)
    assert (failure.value.code, failure.value.message) == (
        "TIMEOUT",
        "no answer from machine 'laptop' within 0.2s; the operation may have run",
    )


async def test_a_full_channel_is_busy_for_a_remote_and_unreachable_for_a_machine(monkeypatch: Any) -> None:
    monkeypatch.setattr(replies, "get_channel_layer", lambda: FullLayer(ChannelFull()))
    with pytest.raises(RemoteError) as remote_failure:
        await _deliver("specific.x!y", 5)
    assert (remote_failure.value.code, remote_failure.value.message) == ("REMOTE_BUSY", "remote 'clock' is busy")
    with pytest.raises(MachineError) as machine_failure:
        await send_to_machine(_candidate("specific.x!y"), op="READ_FILE", payload={}, session_id="s1", timeout=5)
    assert (machine_failure.value.code, machine_failure.value.message) == (
        "MACHINE_UNREACHABLE",
        "machine 'laptop' is not taking requests",
    )
    with pytest.raises(ChannelFull):  # a probe has no error of its own: the layer's is raised
        await realtime.layer_request("specific.x!y", RemoteProbeMessage(remote_id=1), reply=RemoteProbeReply, timeout=1)


async def test_arguments_the_layer_cannot_send_are_an_invalid_request_of_the_remote_call(monkeypatch: Any) -> None:
    monkeypatch.setattr(replies, "get_channel_layer", lambda: FullLayer(TypeError("can not serialize 'set'")))
    with pytest.raises(RemoteError) as failure:
        await _deliver("specific.x!y", 5)
    assert (failure.value.code, failure.value.message) == (
        "INVALID_REQUEST",
        "arguments cannot be sent: can not serialize 'set'",
    )


async def test_a_layer_outage_is_raised_as_the_layers_error(monkeypatch: Any) -> None:
    from redis.exceptions import ConnectionError as RedisConnectionError

    monkeypatch.setattr(replies, "get_channel_layer", lambda: FullLayer(RedisConnectionError("refused")))
    with pytest.raises(RedisConnectionError):  # the edges answer it 503 TEMPORARILY_UNAVAILABLE
        await _deliver("specific.x!y", 5)


async def test_a_machine_that_disconnects_fails_the_wait_at_its_next_liveness_check(
    monkeypatch: Any, settings: Any
) -> None:
    settings.REMOTE_LIVENESS_INTERVAL = 0.05

    async def gone(connection_id: str, server_process_id: str) -> bool:
        return False

    monkeypatch.setattr(operations, "_connection_alive", gone)
    channel = await get_channel_layer().new_channel()
    started = asyncio.get_running_loop().time()
    with pytest.raises(MachineError) as failure:
        await send_to_machine(_candidate(channel), op="READ_FILE", payload={}, session_id="s1", timeout=5)
    assert (failure.value.code, failure.value.message) == ("MACHINE_UNREACHABLE", "machine 'laptop' disconnected")
    assert asyncio.get_running_loop().time() - started < 1.0


@pytest.mark.parametrize("state", ["closed", "lost"])
async def test_a_remote_whose_session_went_away_is_disconnected_after_the_grace(
    state: str, monkeypatch: Any, settings: Any
) -> None:
    settings.REMOTE_LIVENESS_INTERVAL = 0.05

    async def serving_state(route: RemoteRoute) -> str:
        return state

    monkeypatch.setattr(remotes, "_serving_state", serving_state)
    channel = await get_channel_layer().new_channel()
    if state == "closed":  # never forwarded: the caller may re-route the call
        assert await _deliver(channel, 5) == RemoteCallReply(
            error="remote 'clock' disconnected", code="REMOTE_DISCONNECTED", delivered=False
        )
    else:
        with pytest.raises(RemoteError) as failure:
            await _deliver(channel, 5)
        assert (failure.value.code, failure.value.message) == ("REMOTE_DISCONNECTED", "remote 'clock' disconnected")


async def test_an_answer_sent_just_before_the_session_closed_is_still_taken(monkeypatch: Any, settings: Any) -> None:
    settings.REMOTE_LIVENESS_INTERVAL = 0.05

    async def serving_state(route: RemoteRoute) -> str:
        return "lost"

    monkeypatch.setattr(remotes, "_serving_state", serving_state)
    channel = await get_channel_layer().new_channel()
    # Answers 0.1 s in: after the first liveness check (0.05 s), inside its grace (0.2 s).
    answer = asyncio.ensure_future(_answer(channel, {"type": "remote.reply", "result": 1}, after=0.1))
    assert await _deliver(channel, 5) == RemoteCallReply(result=1)
    await answer


async def test_a_probe_without_an_answer_is_none_and_with_one_is_the_answer() -> None:
    silent, answering = await get_channel_layer().new_channel(), await get_channel_layer().new_channel()
    probe = RemoteProbeMessage(remote_id=1)
    assert await realtime.layer_request(silent, probe, reply=RemoteProbeReply, timeout=0.1) is None
    answer = asyncio.ensure_future(_answer(answering, {"type": "remote.reply", "serving": True}))
    assert await realtime.layer_request(answering, probe, reply=RemoteProbeReply, timeout=5) == RemoteProbeReply(
        serving=True
    )
    await answer


async def test_the_healthz_round_trip_sees_a_working_layer() -> None:
    assert await realtime.layer_round_trip(timeout=3) is True


async def test_a_request_takes_exactly_one_of_timeout_and_deadline() -> None:
    with pytest.raises(TypeError):
        await realtime.request_reply(
            "specific.x!y", CountRequest(n=1), reply=CountReply, timed_out=DispatchError("TIMEOUT", "late")
        )
