"""``machine_op`` and its failures (docs/shim-protocol.md#errors,
docs/shim-protocol.md#presence-and-takeover)."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

import pytest
from channels.db import database_sync_to_async
from django.utils import timezone

from core.consumers import shutdown_local_connections
from core.errors import InvalidRequest
from core.models import ServerProcess
from machines.models import MachineConnection
from machines.services import transport
from machines.services.errors import MachineError
from machines.services.operations import machine_op
from tests.machines.conftest import ShimFailure, frame

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]


def start(user: Any, op: str = "FILE_STAT", payload: dict[str, Any] | None = None, **kwargs: Any) -> asyncio.Task:
    return asyncio.ensure_future(
        machine_op(
            user=user,
            session_id=kwargs.pop("session_id", "s1"),
            op=op,
            payload={"path": "/home/alice/a.txt"} if payload is None else payload,
            caller="test",
            **kwargs,
        )
    )


async def failure_of(task: asyncio.Future, timeout: float = 3) -> MachineError:
    with pytest.raises(MachineError) as failure:
        await asyncio.wait_for(task, timeout)
    return failure.value


async def hold(request: dict[str, Any]) -> None:
    """A handler that never answers."""
    return None


# --- success -----------------------------------------------------------------------------


async def test_an_operation_returns_the_shims_response_and_the_machine(shims, owner):
    shim = await shims.connect(owner, machine_id="m1")
    shim.files["/home/alice/a.txt"] = b"hello"
    response = await machine_op(
        user=owner,
        session_id="s1",
        op="FILE_READ",
        payload={"path": "/home/alice/a.txt", "encoding": "utf-8"},
        caller="test",
    )
    assert response == {
        "machine_id": "m1",
        "type": "FILE_CONTENTS",
        "payload": {"content": "hello", "encoding": "utf-8", "size_bytes": 5, "offset": 0, "truncated": False},
    }


async def test_concurrent_operations_are_correlated_by_id(shims, owner):
    shim = await shims.connect(owner, machine_id="m1")
    for index in range(8):
        shim.files[f"/home/alice/{index}"] = str(index).encode()
    responses = await asyncio.gather(
        *(start(owner, "FILE_READ", {"path": f"/home/alice/{i}", "encoding": "utf-8"}) for i in range(8))
    )
    assert [r["payload"]["content"] for r in responses] == [str(i) for i in range(8)]


async def test_a_payload_with_a_lone_surrogate_is_refused_before_routing(shims, owner):
    shim = await shims.connect(owner)
    path = "/home/alice/\ud800.txt"  # what a JSON "\\ud800" escape decodes to: not Unicode
    with pytest.raises(InvalidRequest) as refused:
        await asyncio.wait_for(start(owner, "FILE_STAT", {"path": path}), 3)
    assert "lone surrogate" in refused.value.message
    assert shim.ops("FILE_STAT") == []
    assert shim.consumer_alive()


# --- refusals before anything is sent ------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"op": "FILE_COPY"}, "unknown operation"),
        ({"op": "PING"}, "unknown operation"),
        ({"op": "MACHINE_LIST_REQUEST"}, "unknown operation"),
        ({"payload": ["not", "an", "object"]}, "payload"),
        ({"session_id": "-starts-with-a-dash"}, "session_id"),
        ({"session_id": ""}, "session_id"),
        ({"session_id": "a/b"}, "session_id"),
        ({"target_machine": 42}, "target_machine"),
    ],
)
async def test_it_refuses_bad_input_before_routing(shims, owner, kwargs, fragment):
    shim = await shims.connect(owner)
    arguments: dict[str, Any] = {"session_id": "s1", "op": "FILE_STAT", "payload": {"path": "/home/alice"}}
    arguments.update(kwargs)
    with pytest.raises(InvalidRequest) as failure:
        await machine_op(user=owner, caller="test", **arguments)
    assert fragment in failure.value.message
    assert shim.ops("FILE_STAT") == []


# --- the shim's own errors -------------------------------------------------------------------


async def test_a_shim_error_becomes_a_machine_error_with_its_code_and_details(shims, owner):
    shim = await shims.connect(owner, machine_id="m1")

    async def outside(request: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "ERROR",
            "payload": {
                "code": "PATH_OUTSIDE_ALLOWED_ROOT",
                "message": "/etc/passwd is outside the allowed roots",
                "fatal": False,
                "details": {"path": "/etc/passwd"},
            },
        }

    shim.handler = outside
    failure = await failure_of(start(owner, "FILE_READ", {"path": "/etc/passwd"}))
    assert failure.code == "PATH_OUTSIDE_ALLOWED_ROOT"
    assert failure.message == "/etc/passwd is outside the allowed roots"
    assert failure.details == {"path": "/etc/passwd"}
    assert failure.http_status == 400


@pytest.mark.parametrize(
    ("code", "status"), [("PATH_NOT_FOUND", 404), ("SHIM_OVERLOADED", 503), ("FILE_TOO_LARGE", 413)]
)
async def test_shim_error_codes_keep_their_http_status(shims, owner, code, status):
    shim = await shims.connect(owner)

    async def failing(request: dict[str, Any]) -> None:
        raise ShimFailure(code, "no")

    shim.handler = failing
    failure = await failure_of(start(owner))
    assert (failure.code, failure.http_status) == (code, status)


# --- the machine goes away -------------------------------------------------------------------


async def test_a_disconnect_fails_the_pending_operation_at_once(shims, owner, settings):
    settings.REMOTE_LIVENESS_INTERVAL = 30  # the failure must come from the disconnect itself
    shim = await shims.connect(owner)
    shim.handler = hold
    task = start(owner, "EXECUTE_COMMAND", {"argv": ["sleep", "100"]})
    await shim.next_request("EXECUTE_COMMAND")
    started = time.monotonic()
    await shim.disconnect()
    failure = await failure_of(task)
    assert failure.code == "MACHINE_UNREACHABLE"
    assert failure.http_status == 502
    assert time.monotonic() - started < 1.0  # the operation's timeout is 30 s + 10 s


async def test_a_deleted_connection_row_fails_the_waiting_caller_within_two_liveness_intervals(shims, owner, settings):
    settings.REMOTE_LIVENESS_INTERVAL = 0.2
    shim = await shims.connect(owner)
    shim.handler = hold
    task = start(owner)
    await shim.next_request("FILE_STAT")
    await asyncio.sleep(0.3)  # a liveness check or two pass while the row exists
    assert not task.done()
    started = time.monotonic()
    await database_sync_to_async(MachineConnection.objects.all().delete)()
    failure = await failure_of(task)
    assert failure.code == "MACHINE_UNREACHABLE"
    assert time.monotonic() - started < 2 * 0.2 + 0.3


async def test_a_stale_holding_process_fails_the_waiting_caller(shims, owner, settings):
    settings.REMOTE_LIVENESS_INTERVAL = 0.2
    shim = await shims.connect(owner)
    shim.handler = hold

    def hand_over_to_another_process() -> None:
        ServerProcess.objects.create(id="proc_elsewhere", kind="serve", hostname="other", pid=1)
        MachineConnection.objects.update(server_process_id="proc_elsewhere")

    await database_sync_to_async(hand_over_to_another_process)()
    task = start(owner)
    await shim.next_request("FILE_STAT")
    await asyncio.sleep(0.3)
    assert not task.done()  # the other process is alive
    started = time.monotonic()
    await database_sync_to_async(ServerProcess.objects.filter(pk="proc_elsewhere").update)(
        heartbeat_at=timezone.now() - timedelta(hours=1)
    )
    failure = await failure_of(task)
    assert failure.code == "MACHINE_UNREACHABLE"
    assert time.monotonic() - started < 2 * 0.2 + 0.3


async def test_a_server_shutdown_fails_pending_operations_and_closes_1012(shims, owner):
    shim = await shims.connect(owner)
    shim.handler = hold
    task = start(owner)
    await shim.next_request("FILE_STAT")
    assert await shutdown_local_connections() >= 1
    assert (await failure_of(task)).code == "MACHINE_UNREACHABLE"
    assert await shim.closed_with() == 1012


# --- timeouts ---------------------------------------------------------------------------------


async def test_no_answer_is_a_timeout_after_the_operations_own_timeout_plus_the_margin(shims, owner, monkeypatch):
    monkeypatch.setattr(transport, "TIMEOUT_MARGIN", 0.3)
    shim = await shims.connect(owner)
    shim.handler = hold
    started = time.monotonic()
    failure = await failure_of(start(owner, "EXECUTE_COMMAND", {"argv": ["sleep", "9"], "timeout_seconds": 0.2}))
    elapsed = time.monotonic() - started
    assert failure.code == "TIMEOUT"
    assert failure.http_status == 504
    assert "may have run" in failure.message
    assert 0.45 <= elapsed < 2


def test_the_operation_timeout_is_the_command_timeout_or_the_default_plus_ten_seconds():
    limits = {"command_timeout_seconds": 30, "max_command_timeout_seconds": 600}
    assert transport.operation_timeout("FILE_READ", {}, limits) == 40
    assert transport.operation_timeout("EXECUTE_COMMAND", {}, limits) == 40
    assert transport.operation_timeout("EXECUTE_COMMAND", {"timeout_seconds": 5}, limits) == 15
    assert transport.operation_timeout("EXECUTE_COMMAND", {"timeout_seconds": 9999}, limits) == 610


# --- malformed responses ----------------------------------------------------------------------


async def test_malformed_responses_are_refused_and_leave_the_operations_pending(shims, owner):
    shim = await shims.connect(owner)
    shim.handler = hold
    stat = start(owner, "FILE_STAT", {"path": "/home/alice/a"})
    command = start(owner, "EXECUTE_COMMAND", {"argv": ["true"]})
    stat_request = await shim.next_request("FILE_STAT")
    command_request = await shim.next_request("EXECUTE_COMMAND")

    bad = [
        frame("FILE_STAT_RESPONSE", {"exists": True}, message_id="unknown-id"),
        frame("COMMAND_RESULT", {"exit_code": 0}, message_id=stat_request["id"]),  # wrong type for FILE_STAT
        frame("FILE_STAT_RESPONSE", ["not", "an", "object"], message_id=stat_request["id"]),
        frame("FILE_STAT_RESPONSE", "text", message_id=stat_request["id"]),
        {"type": "FILE_STAT_RESPONSE", "payload": {"exists": True}},  # no id at all
        frame("FILE_STAT_RESPONSE", {"exists": True}, message_id=[stat_request["id"]]),  # type: ignore[arg-type]
    ]
    for message in bad:
        await shim.send(message)
    errors = [f for f in await _frames(shim, "ERROR", len(bad))]
    assert all(e["payload"]["code"] == "INVALID_REQUEST" for e in errors)
    await asyncio.sleep(0.1)
    assert not stat.done() and not command.done()
    assert shim.consumer_alive()

    await shim.send(frame("COMMAND_RESULT", {"stdout": "ok", "exit_code": 0}, message_id=command_request["id"]))
    await shim.send(frame("FILE_STAT_RESPONSE", {"exists": False}, message_id=stat_request["id"]))
    assert (await asyncio.wait_for(command, 2))["payload"] == {"stdout": "ok", "exit_code": 0}
    assert (await asyncio.wait_for(stat, 2))["payload"] == {"exists": False}


async def test_the_error_for_a_wrong_response_type_is_sendable_whatever_the_type(shims, owner):
    shim = await shims.connect(owner)
    shim.handler = hold
    task = start(owner)
    request = await shim.next_request("FILE_STAT")
    # A long, odd but carriable type: the ERROR names it cut short, and the operation may
    # still be answered (a type holding a lone surrogate cannot be carried at all and fails
    # the operation at once: tests/machines/test_shim_uncarriable_values.py).
    await shim.send(frame("ACK\u2028\U0001f680" + "x" * 5000, {}, message_id=request["id"]))
    error = await shim.next_frame("ERROR")
    assert error["payload"]["code"] == "INVALID_REQUEST"
    assert len(error["payload"]["message"]) < 300
    assert not task.done()
    await shim.send(frame("FILE_STAT_RESPONSE", {"exists": True}, message_id=request["id"]))
    assert (await asyncio.wait_for(task, 2))["payload"] == {"exists": True}


async def test_an_error_frame_for_an_unknown_id_is_ignored(shims, owner):
    shim = await shims.connect(owner)
    await shim.send(frame("ERROR", {"code": "INTERNAL_ERROR", "message": "?", "fatal": False}))
    await asyncio.sleep(0.1)
    assert shim.frames == []
    assert not shim.closed


async def test_an_answered_operation_cannot_be_answered_twice(shims, owner):
    shim = await shims.connect(owner)
    response = await asyncio.wait_for(start(owner), 2)
    assert response["type"] == "FILE_STAT_RESPONSE"
    request = shim.ops("FILE_STAT")[0]
    await shim.send(frame("FILE_STAT_RESPONSE", {"exists": True}, message_id=request["id"]))
    error = await shim.next_frame("ERROR")
    assert error["payload"]["code"] == "INVALID_REQUEST"


async def _frames(shim: Any, message_type: str, count: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        found = [f for f in shim.frames if f["type"] == message_type]
        if len(found) >= count:
            return found
        await asyncio.sleep(0.01)
    raise AssertionError(f"expected {count} {message_type} frames, got {shim.frames}")


# --- frame size ----------------------------------------------------------------------------------


async def test_a_request_over_16_mib_is_refused_before_it_reaches_the_shim(shims, owner):
    shim = await shims.connect(owner)
    content = "x" * (16 * 1024 * 1024)
    failure = await failure_of(start(owner, "FILE_WRITE", {"path": "/home/alice/big", "content": content}))
    assert (failure.code, failure.http_status) == ("FILE_TOO_LARGE", 413)
    assert shim.ops("FILE_WRITE") == []


async def test_a_frame_over_16_mib_from_the_shim_closes_1009(shims, owner):
    shim = await shims.connect(owner)
    await shim.send("x" * (16 * 1024 * 1024 + 1))
    assert await shim.closed_with() == 1009
