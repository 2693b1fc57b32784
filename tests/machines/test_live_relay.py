"""The shim consumer's relay of live operations (docs/shim-protocol.md#live-operations-21), driven from the
channel layer as a caller in any process would: ``MachineOpMessage(relay=True)`` in,
``MachineOutputMessage``/``MachineFlowMessage``/``MachineReplyMessage`` out; FLOW,
COMMAND_INPUT and CANCEL frames towards the shim."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer

from machines.models import MachineConnection
from machines.protocol import (
    MachineCancelMessage,
    MachineFlowMessage,
    MachineInputMessage,
    MachineOpMessage,
)
from tests.machines.conftest import frame

pytestmark = [pytest.mark.django_db(transaction=True)]


async def hold(request: dict[str, Any]) -> None:
    return None


async def relayed(shims: Any, owner: Any, *, relay: bool = True, pipe: bool = False) -> tuple[Any, str, str]:
    """A 2.1 fake shim holding a relayed EXECUTE_COMMAND ``r1``; returns it, the consumer's
    channel and the caller's reply channel."""
    shim = await shims.connect(owner, protocol_version="2.1")
    shim.handler = hold
    layer = get_channel_layer()
    reply = await layer.new_channel()
    channel = await database_sync_to_async(lambda: MachineConnection.objects.get().channel_name)()
    message = MachineOpMessage(
        op="EXECUTE_COMMAND",
        payload={"argv": ["ls"], "stream": relay, **({"pipe": True} if pipe else {})},
        request_id="r1",
        session_id="s1",
        timeout=30,
        relay=relay,
    )
    await layer.send(channel, message.model_copy(update={"reply_channel": reply}).for_layer())
    await shim.next_request("EXECUTE_COMMAND")
    return shim, channel, reply


async def receive(reply: str, timeout: float = 3) -> dict[str, Any]:
    return dict(await asyncio.wait_for(get_channel_layer().receive(reply), timeout))


async def test_output_and_stdin_grants_go_to_the_reply_channel_in_order_then_the_result(shims, owner):
    shim, _, reply = await relayed(shims, owner)
    await shim.send(
        frame("COMMAND_OUTPUT", {"stream": "stdout", "data": "a", "encoding": "utf-8", "seq": 0}, message_id="r1")
    )
    await shim.send(frame("FLOW", {"request_id": "r1", "stream": "stdin", "credit_total": 4096}))
    await shim.send(
        frame("COMMAND_OUTPUT", {"stream": "stderr", "data": "Yg==", "encoding": "base64", "seq": 1}, message_id="r1")
    )
    await shim.send(
        frame("COMMAND_RESULT", {"stdout": "", "stderr": "", "exit_code": 0, "cancelled": False}, message_id="r1")
    )
    assert await receive(reply) == {
        "type": "machine.output",
        "request_id": "r1",
        "stream": "stdout",
        "data": "a",
        "encoding": "utf-8",
        "seq": 0,
    }
    assert await receive(reply) == {"type": "machine.flow", "request_id": "r1", "stream": "stdin", "credit_total": 4096}
    assert (await receive(reply))["seq"] == 1
    final = await receive(reply)
    assert final["type"] == "machine.reply" and final["response_type"] == "COMMAND_RESULT"
    assert not [f for f in shim.frames if f["type"] == "ERROR"]


async def test_output_of_an_operation_not_relayed_is_dropped_quietly(shims, owner):
    shim, _, reply = await relayed(shims, owner, relay=False)
    await shim.send(
        frame("COMMAND_OUTPUT", {"stream": "stdout", "data": "a", "encoding": "utf-8", "seq": 0}, message_id="r1")
    )
    await shim.send(frame("COMMAND_RESULT", {"stdout": "a", "stderr": "", "exit_code": 0}, message_id="r1"))
    assert (await receive(reply))["type"] == "machine.reply"
    assert not [f for f in shim.frames if f["type"] == "ERROR"]


@pytest.mark.parametrize(
    "content, wrong",
    [
        ({"stream": "stdin", "data": "a", "encoding": "utf-8", "seq": 0}, "stream"),
        ({"stream": "stdout", "data": "a", "encoding": "utf-8", "seq": True}, "seq"),
        ({"stream": "stdout", "data": "a", "encoding": "utf-8", "seq": 0.0}, "seq"),
        ({"stream": "stdout", "data": "a", "encoding": "latin-1", "seq": 0}, "encoding"),
        ({"stream": "stdout", "data": "not base64!", "encoding": "base64", "seq": 0}, "base64"),
    ],
)
async def test_a_malformed_output_frame_is_refused_cancelled_and_fails_the_operation(shims, owner, content, wrong):
    shim, _, reply = await relayed(shims, owner)
    await shim.send(frame("COMMAND_OUTPUT", content, message_id="r1"))
    await shim.send(
        frame("COMMAND_OUTPUT", {"stream": "stdout", "data": "b", "encoding": "utf-8", "seq": 1}, message_id="r1")
    )
    error = await shim.next_frame("ERROR")
    assert error["payload"]["code"] == "INVALID_REQUEST" and "COMMAND_OUTPUT" in error["payload"]["message"]
    assert wrong in error["payload"]["message"]
    cancel = await shim.next_frame("CANCEL")
    assert cancel["payload"] == {"request_id": "r1"}
    final = await receive(reply)
    assert final["type"] == "machine.reply" and final["payload"]["code"] == "PROTOCOL_ERROR"
    assert "malformed COMMAND_OUTPUT" in final["payload"]["message"]
    # what the shim sends after (its frames, its cancelled result) is dropped quietly
    await shim.send(
        frame("COMMAND_RESULT", {"stdout": "", "stderr": "", "exit_code": -15, "cancelled": True}, message_id="r1")
    )
    await asyncio.sleep(0.1)
    assert len([f for f in shim.frames if f["type"] == "ERROR"]) == 1
    with pytest.raises(asyncio.TimeoutError):
        await receive(reply, timeout=0.2)


def _output(seq: int, size: int, stream: str = "stdout") -> dict[str, Any]:
    data = base64.b64encode(b"x" * size).decode()
    return frame("COMMAND_OUTPUT", {"stream": stream, "data": data, "encoding": "base64", "seq": seq}, message_id="r1")


async def _drain(reply: str) -> list[dict[str, Any]]:
    """Everything on the reply channel until the operation's reply."""
    messages = []
    while True:
        message = await receive(reply)
        messages.append(message)
        if message["type"] == "machine.reply":
            return messages


async def test_a_frame_over_64_kib_fails_the_operation_protocol_error(shims, owner):
    shim, _, reply = await relayed(shims, owner)
    await shim.send(_output(0, 100))
    await shim.send(_output(1, 65537))
    cancel = await shim.next_frame("CANCEL")
    assert cancel["payload"] == {"request_id": "r1"}
    messages = await _drain(reply)
    assert [m["type"] for m in messages] == ["machine.output", "machine.reply"]
    assert messages[-1]["payload"]["code"] == "PROTOCOL_ERROR" and "65536" in messages[-1]["payload"]["message"]


async def test_a_text_frame_may_carry_a_character_begun_in_the_frame_before(shims, owner):
    shim, _, reply = await relayed(shims, owner)
    text = "a" * 65535 + "€"  # 65 538 bytes: the shim's decoder held "€"'s first bytes back
    await shim.send(
        frame("COMMAND_OUTPUT", {"stream": "stdout", "data": text, "encoding": "utf-8", "seq": 0}, message_id="r1")
    )
    await shim.send(frame("COMMAND_RESULT", {"stdout": "", "stderr": "", "exit_code": 0}, message_id="r1"))
    assert [m["type"] for m in await _drain(reply)] == ["machine.output", "machine.reply"]


async def test_a_shim_ignoring_its_credit_is_cancelled_and_nothing_past_it_is_relayed(shims, owner):
    """A shim flooding COMMAND_OUTPUT past the window (1 MiB by default), granted nothing
    more: at most the window plus one frame is relayed, then CANCEL and PROTOCOL_ERROR."""
    shim, _, reply = await relayed(shims, owner)
    for seq in range(40):  # 40 × 64 KiB = 2.5 MiB against a 1 MiB window
        await shim.send(_output(seq, 65536))
    cancel = await shim.next_frame("CANCEL")
    assert cancel["payload"] == {"request_id": "r1"}
    messages = await _drain(reply)
    relayed_bytes = sum(len(base64.b64decode(m["data"])) for m in messages if m["type"] == "machine.output")
    assert relayed_bytes <= (1 << 20) + 65536
    final = messages[-1]["payload"]
    assert final["code"] == "PROTOCOL_ERROR" and "past the credit it was granted" in final["message"]
    with pytest.raises(asyncio.TimeoutError):
        await receive(reply, timeout=0.2)


async def test_output_within_the_credit_granted_is_relayed(shims, owner):
    shim, channel, reply = await relayed(shims, owner)
    await get_channel_layer().send(
        channel, MachineFlowMessage(request_id="r1", stream="stdout", credit_total=3 << 20).for_layer()
    )
    await shim.next_frame("FLOW")
    for seq in range(48):  # 3 MiB, as granted
        await shim.send(_output(seq, 65536))
    await shim.send(frame("COMMAND_RESULT", {"stdout": "", "stderr": "", "exit_code": 0}, message_id="r1"))
    messages = await _drain(reply)
    assert len(messages) == 49 and messages[-1]["response_type"] == "COMMAND_RESULT"
    assert not [f for f in shim.frames if f["type"] in ("ERROR", "CANCEL")]


async def test_caller_messages_become_flow_input_and_cancel_frames(shims, owner):
    shim, channel, _ = await relayed(shims, owner)
    layer = get_channel_layer()
    await layer.send(channel, MachineFlowMessage(request_id="r1", stream="stdout", credit_total=2 << 20).for_layer())
    await layer.send(channel, MachineInputMessage(request_id="r1", data="aGk=", eof=True).for_layer())
    await layer.send(channel, MachineCancelMessage(request_id="r1").for_layer())
    flow = await shim.next_frame("FLOW")
    assert flow["payload"] == {"request_id": "r1", "stream": "stdout", "credit_total": 2 << 20}
    given = await shim.next_frame("COMMAND_INPUT")
    assert given["payload"] == {"request_id": "r1", "data": "aGk=", "encoding": "base64", "eof": True}
    cancel = await shim.next_frame("CANCEL")
    assert cancel["payload"] == {"request_id": "r1"} and cancel["id"] != "r1"
    await shim.send(frame("ACK", {}, message_id=cancel["id"]))  # swallowed: no "no pending request"
    await asyncio.sleep(0.1)
    assert not [f for f in shim.frames if f["type"] == "ERROR"]


async def test_live_messages_for_a_2_0_connection_are_dropped(shims, owner):
    shim = await shims.connect(owner)
    channel = await database_sync_to_async(lambda: MachineConnection.objects.get().channel_name)()
    layer = get_channel_layer()
    await layer.send(channel, MachineCancelMessage(request_id="r1").for_layer())
    await layer.send(channel, MachineInputMessage(request_id="r1", data="").for_layer())
    await asyncio.sleep(0.1)
    assert not [f for f in shim.frames if f["type"] in ("CANCEL", "COMMAND_INPUT")]
    assert shim.consumer_alive()


async def test_a_disconnecting_shim_fails_its_relayed_operation_machine_unreachable(shims, owner):
    shim, _, reply = await relayed(shims, owner)
    await shim.disconnect()
    final = await receive(reply)
    assert final["type"] == "machine.reply" and final["payload"]["code"] == "MACHINE_UNREACHABLE"


@pytest.mark.parametrize("pipe", [False, True])
async def test_output_past_max_stream_bytes_fails_the_operation_unless_it_is_a_pipe(shims, owner, monkeypatch, pipe):
    from machines.protocol import DEFAULT_LIMITS

    monkeypatch.setitem(DEFAULT_LIMITS, "max_stream_bytes", 200_000)
    shim, channel, reply = await relayed(shims, owner, pipe=pipe)
    await get_channel_layer().send(
        channel, MachineFlowMessage(request_id="r1", stream="stdout", credit_total=3 << 20).for_layer()
    )
    await shim.next_frame("FLOW")
    for seq in range(6):  # 384 KiB against 200 000 bytes
        await shim.send(_output(seq, 65536))
    if pipe:
        await shim.send(frame("COMMAND_RESULT", {"stdout": "", "stderr": "", "exit_code": 0}, message_id="r1"))
        messages = await _drain(reply)
        assert len(messages) == 7 and messages[-1]["response_type"] == "COMMAND_RESULT"
        return
    await shim.next_frame("CANCEL")
    final = (await _drain(reply))[-1]["payload"]
    assert final["code"] == "PROTOCOL_ERROR" and "max_stream_bytes" in final["message"]


async def test_a_frame_with_an_integer_outside_64_bits_is_refused_saying_so(shims, owner):
    shim, _, _ = await relayed(shims, owner)
    payload = '{"request_id": "r1", "stream": "stdin", "credit_total": 99999999999999999999999}'
    await shim.send('{"type": "FLOW", "id": "f1", "payload": ' + payload + "}")
    error = await shim.next_frame("ERROR")
    message = error["payload"]["message"]
    assert error["payload"]["code"] == "INVALID_REQUEST"
    assert "cannot carry" in message and "64-bit" in message, message
    assert shim.consumer_alive()
