"""Live operations through the services, against fake shims (docs/live-operations.md):
``operation_stream``, ``machine_op(on_output, request_id, target_machines)``, cancel, the
in-flight rows, the consumer's relay."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer

from core.errors import InvalidRequest
from core.tools import TOOL_CALL, ToolCall
from machines.models import AuditRecord, OperationInFlight
from machines.protocol import MachineOpMessage
from machines.services import connections, live
from machines.services.errors import MachineError
from machines.services.live import Failed, Output, Result, Started, operation_stream
from machines.services.operations import machine_op
from tests.machines.conftest import settle, until
from tests.machines.live_shim import LiveMachine, endless, lines

pytestmark = [pytest.mark.django_db(transaction=True)]


async def live_shim(shims: Any, owner: Any, script: Any = None, **hello: Any) -> LiveMachine:
    shim = await shims.connect(owner, protocol_version="2.1", **hello)
    return LiveMachine(shim, script)


def stream(owner: Any, argv: list[str] | None = None, **kwargs: Any) -> Any:
    return operation_stream(
        user=owner,
        session_id=kwargs.pop("session_id", "s1"),
        op="EXECUTE_COMMAND",
        payload=kwargs.pop("payload", {"argv": argv or ["make", "test"]}),
        caller="test",
        **kwargs,
    )


async def collect(events: Any) -> list[Any]:
    return [event async for event in events]


def rows() -> int:
    return OperationInFlight.objects.count()


# --- streaming -------------------------------------------------------------------------------------


async def test_a_streamed_command_yields_started_its_output_in_order_then_its_result(shims, owner):
    machine = await live_shim(shims, owner, hostname="buildbox", machine_id="m1")
    request_id = str(uuid.uuid4())
    events = await collect(stream(owner, request_id=request_id))

    assert events[0] == Started(request_id=request_id, machine_id="m1", name="buildbox")
    outputs = [e for e in events if isinstance(e, Output)]
    assert [o.data for o in outputs] == ["line 0\n", "line 1\n", "line 2\n"]
    assert [o.seq for o in outputs] == [0, 1, 2]
    assert isinstance(events[-1], Result) and events[-1].payload["exit_code"] == 0
    assert events[-1].payload["stdout_bytes"] == 21 and events[-1].payload["cancelled"] is False
    sent = machine.shim.ops("EXECUTE_COMMAND")[0]
    assert sent["id"] == request_id and sent["payload"] == {"argv": ["make", "test"], "stream": True}
    assert events[1].as_json() == {
        "request_id": request_id,
        "machine_id": "m1",
        "name": "buildbox",
        "stream": "stdout",
        "data": "line 0\n",
        "encoding": "utf-8",
        "seq": 0,
    }
    assert (Started.event, Output.event, Result.event, Failed.event) == ("started", "output", "result", "error")
    await settle()
    record = await database_sync_to_async(AuditRecord.objects.get)(request_id=request_id)
    assert record.result["ok"] is True and record.result["exit_code"] == 0
    assert record.result["bytes"] == {"stdout": 21, "stderr": 0, "stdin": 0}
    assert await database_sync_to_async(rows)() == 0
    assert not [f for f in machine.shim.frames if f["type"] == "ERROR"]


async def test_a_binary_stream_carries_base64(shims, owner):
    async def raw(payload: dict[str, Any]) -> Any:
        yield "stdout", b"\xff\x00\xfe"

    await live_shim(shims, owner, raw)
    events = await collect(stream(owner, payload={"argv": ["cat", "x"], "binary": True}))
    output = next(e for e in events if isinstance(e, Output))
    assert (output.data, output.encoding, output.raw_bytes) == ("/wD+", "base64", 3)


async def test_the_in_flight_row_lives_while_the_command_runs(shims, owner):
    await live_shim(shims, owner, lambda payload: lines(5, pause=0.05), machine_id="m1", hostname="laptop")
    request_id = str(uuid.uuid4())
    events = stream(owner, ["pytest", "--token=abc123"], request_id=request_id)
    assert isinstance(await events.__anext__(), Started)
    listed = await database_sync_to_async(live.operations_in_flight)(user=owner, session_id="s1")
    assert len(listed) == 1
    entry = listed[0]
    assert entry["request_id"] == request_id and entry["kind"] == "command" and entry["op"] == "EXECUTE_COMMAND"
    assert entry["machine_ids"] == ["m1"] and entry["machines"] == ["laptop"] and entry["caller"] == "test"
    assert "abc123" not in entry["summary"] and entry["summary"].startswith("pytest")
    assert await database_sync_to_async(live.operations_in_flight)(user=owner, session_id="other") == []
    await collect(events)
    assert await database_sync_to_async(live.operations_in_flight)(user=owner) == []


async def test_a_2_0_shim_is_refused_naming_its_version_before_anything_is_sent(shims, owner):
    shim = await shims.connect(owner, hostname="old", shim_version="0.1.0")  # HELLO says protocol 2.0
    with pytest.raises(MachineError) as refused:
        await collect(stream(owner))
    assert refused.value.code == "UNSUPPORTED_OPERATION"
    assert "machine 'old' runs shim 0.1.0 (protocol 2.0)" in refused.value.message
    assert "needs protocol 2.1" in refused.value.message
    assert shim.ops("EXECUTE_COMMAND") == []
    assert await database_sync_to_async(rows)() == 0


async def test_the_consumer_itself_refuses_a_relay_on_a_2_0_connection(shims, owner):
    shim = await shims.connect(owner)
    layer = get_channel_layer()
    reply = await layer.new_channel()
    channel = await database_sync_to_async(lambda: connections.MachineConnection.objects.get().channel_name)()
    message = MachineOpMessage(
        op="EXECUTE_COMMAND", payload={"argv": ["ls"]}, request_id="r1", session_id="s1", timeout=5, relay=True
    )
    await layer.send(channel, message.model_copy(update={"reply_channel": reply}).for_layer())
    answer = await asyncio.wait_for(layer.receive(reply), 3)
    assert answer["response_type"] == "ERROR" and answer["payload"]["code"] == "UNSUPPORTED_OPERATION"
    assert shim.ops("EXECUTE_COMMAND") == []


async def test_routing_errors_raise_before_the_first_event(shims, owner):
    await live_shim(shims, owner)
    with pytest.raises(MachineError) as missing:
        await stream(owner, target_machine="ghost").__anext__()
    assert missing.value.code == "MACHINE_NOT_ATTACHED"
    with pytest.raises(InvalidRequest):
        await stream(owner, request_id="not-a-uuid").__anext__()
    with pytest.raises(InvalidRequest):
        await stream(owner, payload={"argv": ["ls"], "pipe": True}).__anext__()
    with pytest.raises(InvalidRequest):
        await stream(owner, target_machine="a", target_machines=["b"]).__anext__()


# --- credit ----------------------------------------------------------------------------------------


@pytest.fixture
def small_window(monkeypatch: pytest.MonkeyPatch) -> int:
    window = 64 * 1024
    monkeypatch.setattr(connections, "DEFAULT_LIMITS", {**connections.DEFAULT_LIMITS, "stream_window_bytes": window})
    return window


async def test_a_slow_consumer_holds_the_command_to_its_window(shims, owner, small_window):
    machine = await live_shim(shims, owner, lambda payload: endless(16 * 1024))
    request_id = str(uuid.uuid4())
    events = stream(owner, request_id=request_id)
    assert isinstance(await events.__anext__(), Started)
    await until(lambda: machine.sent.get(request_id, {}).get("stdout", 0) >= small_window, what="a window sent")
    await asyncio.sleep(0.2)  # the consumer takes nothing: the shim may send no more
    assert machine.sent[request_id]["stdout"] == small_window
    assert machine.flows(request_id) == []
    taken = 0
    while taken < 2 * small_window:  # consuming grants credit, a quarter window at a time
        event = await events.__anext__()
        assert isinstance(event, Output)
        taken += event.raw_bytes
        assert machine.sent[request_id]["stdout"] <= taken + small_window
    # The last event taken is granted when the consumer comes back for the next one.
    expected = taken - 16 * 1024 + small_window
    await until(lambda: max(f["credit_total"] for f in machine.flows(request_id)) == expected, what="the grant")
    credits = [flow["credit_total"] for flow in machine.flows(request_id)]
    assert credits == sorted(credits) and len(set(credits)) == len(credits)
    await events.aclose()
    await until(lambda: machine.cancels(request_id), what="the CANCEL of an abandoned stream")


# --- loss, cancel, disconnect ---------------------------------------------------------------------


async def test_a_seq_gap_cancels_the_command_and_fails_output_lost(shims, owner):
    machine = await live_shim(shims, owner, lambda payload: lines(4))
    machine.skip_seq = 1
    request_id = str(uuid.uuid4())
    events = await collect(stream(owner, request_id=request_id))
    assert [e.data for e in events if isinstance(e, Output)] == ["line 0\n"]
    failure = events[-1]
    assert isinstance(failure, Failed) and failure.code == "OUTPUT_LOST"
    assert failure.message == "frames of the command's output were lost; the command was cancelled"
    assert machine.cancels(request_id)


async def test_leaving_the_stream_early_cancels_the_command(shims, owner):
    machine = await live_shim(shims, owner, lambda payload: lines(1000, pause=0.01))
    request_id = str(uuid.uuid4())
    events = stream(owner, request_id=request_id)
    async for event in events:
        if isinstance(event, Output):
            break
    await events.aclose()
    await until(lambda: machine.cancels(request_id), what="a CANCEL")
    await until(lambda: request_id not in machine.running, what="the command to end")
    assert await database_sync_to_async(rows)() == 0
    await settle()
    record = await database_sync_to_async(AuditRecord.objects.get)(request_id=request_id)
    assert record.result["cancelled"] is True and record.result["ok"] is False


async def test_a_cancelled_consuming_task_cancels_the_command(shims, owner):
    machine = await live_shim(shims, owner, lambda payload: lines(1000, pause=0.01))
    request_id = str(uuid.uuid4())
    task = asyncio.ensure_future(collect(stream(owner, request_id=request_id)))
    await until(lambda: request_id in machine.running, what="the command to start")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: machine.cancels(request_id), what="a CANCEL")


async def test_cancel_operation_stops_a_command_which_ends_cancelled(shims, owner):
    machine = await live_shim(shims, owner, lambda payload: lines(1000, pause=0.01))
    request_id = str(uuid.uuid4())
    task = asyncio.ensure_future(collect(stream(owner, request_id=request_id)))
    await until(lambda: request_id in machine.running, what="the command to start")
    answer = await live.cancel_operation(user=owner, session_id="s1", request_id=request_id)
    assert answer == {"request_id": request_id, "cancelled": True}
    events = await asyncio.wait_for(task, 5)
    assert isinstance(events[-1], Result) and events[-1].payload["cancelled"] is True
    assert events[-1].payload["exit_code"] == -15
    await asyncio.sleep(0.1)
    # The shim's ACKs to the CANCELs were swallowed, not refused as unknown ids.
    assert machine.acked and not [f for f in machine.shim.frames if f["type"] == "ERROR"]


async def test_cancel_refuses_an_unknown_operation_and_another_users(shims, owner, outsider):
    machine = await live_shim(shims, owner, lambda payload: lines(1000, pause=0.01))
    request_id = str(uuid.uuid4())
    task = asyncio.ensure_future(collect(stream(owner, request_id=request_id)))
    await until(lambda: request_id in machine.running, what="the command to start")
    for user, session_id, rid in (
        (owner, "s1", str(uuid.uuid4())),
        (outsider, "s1", request_id),
        (owner, "s2", request_id),
    ):
        with pytest.raises(MachineError) as missing:
            await live.cancel_operation(user=user, session_id=session_id, request_id=rid)
        assert missing.value.code == "OPERATION_NOT_FOUND"
    assert not machine.cancels(request_id)
    task.cancel()


async def test_cancel_of_a_command_on_a_2_0_shim_is_unsupported(shims, owner):
    shim = await shims.connect(owner, hostname="old")

    async def hold(request: dict[str, Any]) -> None:
        return None

    shim.handler = hold
    request_id = str(uuid.uuid4())
    task = asyncio.ensure_future(
        machine_op(
            user=owner,
            session_id="s1",
            op="EXECUTE_COMMAND",
            payload={"argv": ["sleep", "9"]},
            caller="t",
            request_id=request_id,
        )
    )
    await shim.next_request("EXECUTE_COMMAND")
    with pytest.raises(MachineError) as refused:
        await live.cancel_operation(user=owner, session_id="s1", request_id=request_id)
    assert refused.value.code == "UNSUPPORTED_OPERATION"
    assert "machine 'old' runs shim 0.1.0 (protocol 2.0)" in refused.value.message
    task.cancel()


async def test_a_shim_that_drops_mid_stream_fails_the_stream_machine_unreachable(shims, owner):
    machine = await live_shim(shims, owner, lambda payload: lines(1000, pause=0.01))
    events = stream(owner)
    seen = []
    async for event in events:
        seen.append(event)
        if isinstance(event, Output) and event.seq == 2:
            await machine.shim.disconnect()
    assert isinstance(seen[-1], Failed) and seen[-1].code == "MACHINE_UNREACHABLE"
    assert await database_sync_to_async(rows)() == 0


# --- machine_op: request_id, on_output ------------------------------------------------------------


async def test_on_output_streams_and_assembles_a_2_0_shaped_result(shims, owner):
    async def mixed(payload: dict[str, Any]) -> Any:
        yield "stdout", b"hello "
        yield "stderr", "é warn\n".encode()
        yield "stdout", b"world\n"

    await live_shim(shims, owner, mixed, machine_id="m1")
    seen: list[Output] = []

    async def on_output(output: Output) -> None:
        seen.append(output)

    response = await machine_op(
        user=owner, session_id="s1", op="EXECUTE_COMMAND", payload={"argv": ["x"]}, caller="t", on_output=on_output
    )
    assert [o.data for o in seen] == ["hello ", "é warn\n", "world\n"]
    assert response["machine_id"] == "m1" and response["type"] == "COMMAND_RESULT"
    assert response["payload"] == {
        "stdout": "hello world\n",
        "stderr": "é warn\n",
        "exit_code": 0,
        "timed_out": False,
        "duration_seconds": 0.01,
        "output_truncated": False,
        "cancelled": False,
    }


async def test_assembled_output_is_capped_at_max_file_size_bytes(shims, owner, monkeypatch):
    monkeypatch.setattr(connections, "DEFAULT_LIMITS", {**connections.DEFAULT_LIMITS, "max_file_size_bytes": 10})
    await live_shim(shims, owner, lambda payload: lines(5))
    response = await machine_op(
        user=owner, session_id="s1", op="EXECUTE_COMMAND", payload={"argv": ["x"]}, caller="t", on_output=lambda o: None
    )
    assert response["payload"]["stdout"] == "line 0\nlin" and response["payload"]["output_truncated"] is True


async def test_on_output_on_a_2_0_shim_runs_unstreamed(shims, owner):
    shim = await shims.connect(owner)
    seen: list[Output] = []
    response = await machine_op(
        user=owner,
        session_id="s1",
        op="EXECUTE_COMMAND",
        payload={"argv": ["echo", "hi"]},
        caller="t",
        on_output=seen.append,
    )
    assert response["payload"]["stdout"] == "echo hi" and seen == []
    assert "stream" not in shim.ops("EXECUTE_COMMAND")[0]["payload"]


async def test_a_request_id_in_flight_is_refused_operation_exists(shims, owner):
    machine = await live_shim(shims, owner, lambda payload: lines(1000, pause=0.01))
    request_id = str(uuid.uuid4())
    task = asyncio.ensure_future(collect(stream(owner, request_id=request_id)))
    await until(lambda: request_id in machine.running, what="the command to start")
    with pytest.raises(MachineError) as exists:
        await machine_op(
            user=owner,
            session_id="s1",
            op="EXECUTE_COMMAND",
            payload={"argv": ["x"]},
            caller="t",
            request_id=request_id.upper(),  # the same UUID
        )
    assert exists.value.code == "OPERATION_EXISTS"
    assert len(machine.shim.ops("EXECUTE_COMMAND")) == 1
    await live.cancel_operation(user=owner, session_id="s1", request_id=request_id)
    await asyncio.wait_for(task, 5)
    with pytest.raises(InvalidRequest, match="request_id must be a UUID"):
        await machine_op(
            user=owner, session_id="s1", op="FILE_STAT", payload={"path": "/x"}, caller="t", request_id="7"
        )


async def test_a_payload_may_not_ask_for_a_stream_itself(shims, owner):
    await live_shim(shims, owner)
    with pytest.raises(InvalidRequest, match="set by the platform"):
        await machine_op(
            user=owner, session_id="s1", op="EXECUTE_COMMAND", payload={"argv": ["x"], "stream": True}, caller="t"
        )


async def test_cancel_calls_cancels_what_a_tool_call_started(shims, owner):
    machine = await live_shim(shims, owner, lambda payload: lines(1000, pause=0.01))
    request_id = str(uuid.uuid4())

    async def tool_call() -> dict[str, Any]:
        TOOL_CALL.set(ToolCall(call_key="mcp:abc:7"))
        return await machine_op(
            user=owner,
            session_id="s1",
            op="EXECUTE_COMMAND",
            payload={"argv": ["x"]},
            caller="mcp",
            request_id=request_id,
            on_output=lambda o: None,
        )

    task = asyncio.ensure_future(tool_call())
    await until(lambda: request_id in machine.running, what="the command to start")
    assert await live.cancel_calls(user=owner, call_key="mcp:abc:8") == 0
    assert await live.cancel_calls(user=owner, call_key="mcp:abc:7") == 1
    response = await asyncio.wait_for(task, 5)
    assert response["payload"]["cancelled"] is True


async def test_a_cancelled_caller_of_machine_op_cancels_its_command(shims, owner):
    machine = await live_shim(shims, owner, lambda payload: lines(1000, pause=0.01))
    request_id = str(uuid.uuid4())
    task = asyncio.ensure_future(
        machine_op(
            user=owner,
            session_id="s1",
            op="EXECUTE_COMMAND",
            payload={"argv": ["x"]},
            caller="t",
            request_id=request_id,
            on_output=lambda o: None,
        )
    )
    await until(lambda: request_id in machine.running, what="the command to start")
    task.cancel()
    await until(lambda: machine.cancels(request_id), what="a CANCEL")
    count = database_sync_to_async(rows)
    for _ in range(100):
        if not await count():
            break
        await asyncio.sleep(0.02)
    assert await count() == 0


# --- fan-out -----------------------------------------------------------------------------------------


def fan_out(owner: Any, target_machines: Any, **kwargs: Any) -> Any:
    return machine_op(
        user=owner,
        session_id="s1",
        op=kwargs.pop("op", "EXECUTE_COMMAND"),
        payload=kwargs.pop("payload", {"argv": ["uname"]}),
        caller="t",
        target_machines=target_machines,
        **kwargs,
    )


async def test_fan_out_answers_per_machine_and_an_unknown_name_is_one_failed_entry(shims, owner):
    await shims.connect(owner, machine_id="m1", hostname="laptop")
    await shims.connect(owner, machine_id="m2", hostname="buildbox")
    request_id = str(uuid.uuid4())
    answer = await fan_out(owner, ["laptop", "buildbox", "ghost", "m1"], request_id=request_id)
    results = answer["results"]
    assert [(r["machine_id"], r["name"], r["ok"]) for r in results] == [
        ("m1", "laptop", True),
        ("m2", "buildbox", True),
        (None, "ghost", False),
    ]
    assert results[0]["result"] == {
        "machine_id": "m1",
        "type": "COMMAND_RESULT",
        "payload": {
            "stdout": "uname",
            "stderr": "",
            "exit_code": 0,
            "timed_out": False,
            "duration_seconds": 0.01,
            "output_truncated": False,
        },
    }
    assert results[2]["error"]["code"] == "MACHINE_NOT_ATTACHED"
    await settle()
    audited = await database_sync_to_async(
        lambda: sorted(AuditRecord.objects.filter(request_id=request_id).values_list("machine_id", flat=True))
    )()
    assert audited == ["m1", "m2"]


async def test_fan_out_to_every_capable_machine(shims, owner, member):
    await shims.connect(owner, machine_id="m1", hostname="a")
    await shims.connect(owner, machine_id="m2", hostname="b", capabilities=["files"])
    await shims.connect(owner, machine_id="m3", hostname="c", sessions=["other"])
    answer = await fan_out(owner, "*")
    assert [r["machine_id"] for r in answer["results"]] == ["m1"]
    files = await fan_out(owner, "*", op="FILE_STAT", payload={"path": "/home/alice/x"})
    assert [r["machine_id"] for r in files["results"]] == ["m1", "m2"]
    with pytest.raises(MachineError) as none:
        await machine_op(
            user=member, session_id="s1", op="FILE_STAT", payload={"path": "/x"}, caller="t", target_machines="*"
        )
    assert none.value.code == "MACHINE_NOT_ATTACHED"


async def test_fan_out_with_one_machine_unreachable_is_one_failed_entry(shims, owner):
    await shims.connect(owner, machine_id="m1", hostname="a")
    gone = await shims.connect(owner, machine_id="m2", hostname="b")

    dropping: list[asyncio.Future[None]] = []

    async def drop(request: dict[str, Any]) -> None:
        dropping.append(asyncio.ensure_future(gone.disconnect()))
        return None

    gone.handler = drop
    answer = await asyncio.wait_for(fan_out(owner, ["a", "b"]), 5)
    entries = {r["name"]: r for r in answer["results"]}
    assert entries["a"]["ok"] is True
    assert entries["b"]["ok"] is False and entries["b"]["error"]["code"] == "MACHINE_UNREACHABLE"


async def test_fan_out_runs_in_parallel_under_one_in_flight_row(shims, owner):
    first = await live_shim(shims, owner, lambda payload: lines(1000, pause=0.01), machine_id="m1", hostname="a")
    second = await live_shim(shims, owner, lambda payload: lines(1000, pause=0.01), machine_id="m2", hostname="b")
    request_id = str(uuid.uuid4())
    task = asyncio.ensure_future(fan_out(owner, "*", request_id=request_id, on_output=lambda o: None))
    await until(lambda: request_id in first.running and request_id in second.running, what="both commands")
    listed = await database_sync_to_async(live.operations_in_flight)(user=owner)
    assert [(e["request_id"], e["machine_ids"]) for e in listed] == [(request_id, ["m1", "m2"])]
    await live.cancel_operation(user=owner, session_id="s1", request_id=request_id)
    answer = await asyncio.wait_for(task, 5)
    assert [r["result"]["payload"]["cancelled"] for r in answer["results"]] == [True, True]
    assert await database_sync_to_async(rows)() == 0


async def test_a_streamed_fan_out_names_each_machine_and_refuses_a_2_0_one(shims, owner):
    await live_shim(shims, owner, lambda payload: lines(2), machine_id="m1", hostname="a")
    await live_shim(shims, owner, lambda payload: lines(2), machine_id="m2", hostname="b")
    await shims.connect(owner, machine_id="m3", hostname="old")
    events = await collect(stream(owner, target_machines="*"))
    refused = [e for e in events if isinstance(e, Failed)]
    assert [(e.machine_id, e.code) for e in refused] == [("m3", "UNSUPPORTED_OPERATION")]
    for machine_id in ("m1", "m2"):
        mine = [e for e in events if getattr(e, "machine_id", None) == machine_id]
        assert isinstance(mine[0], Started) and isinstance(mine[-1], Result)
        assert [e.data for e in mine if isinstance(e, Output)] == ["line 0\n", "line 1\n"]


async def test_target_machine_and_target_machines_are_exclusive(shims, owner):
    await shims.connect(owner)
    with pytest.raises(InvalidRequest, match="exclusive"):
        await fan_out(owner, ["a"], target_machine="a")
    with pytest.raises(InvalidRequest, match="non-empty list"):
        await fan_out(owner, [])
