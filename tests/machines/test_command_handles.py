"""Long commands behind a handle (docs/live-operations.md#long-commands-handles):
``local_pc_command_start`` / ``_read`` / ``_wait`` / ``_cancel``, the ``CommandRun`` rows
behind them (``machines.services.command_runs``). In process against fake 2.1 shims, then
through the real MCP endpoint of a real ``serve`` with a real shim (the Python SDK client).
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from channels.db import database_sync_to_async
from django.db.utils import OperationalError
from django.utils import timezone

from core.errors import DispatchError
from core.models import ServerProcess
from core.presence import current_process_id
from dispatch.mcp.server import Caller
from dispatch.mcp.tools import tools_for as mcp_tools_for
from machines.models import AuditRecord, CommandRun, OperationInFlight
from machines.services import command_runs
from machines.services.live import Failed, Output, Result, Started
from machines.tools import COMMAND_HANDLE_TOOL_NAMES, MACHINE_TOOL_NAMES, machine_tools
from tests.machines.conftest import settle
from tests.machines.live_shim import LiveMachine, lines

SESSION = "s1"


async def tools_for(user: Any, session_id: str = SESSION) -> dict[str, Any]:
    return {tool.name: tool for tool in await machine_tools(user=user, session_id=session_id, caller="test")}


async def live_machine(shims: Any, owner: Any, script: Any, **hello: Any) -> LiveMachine:
    shim = await shims.connect(owner, protocol_version="2.1", **hello)
    return LiveMachine(shim, script)


def gated(gate: asyncio.Event, before: bytes = b"line 0\n", after: bytes = b"line 1\n") -> Any:
    """A command that writes ``before``, then waits for the test to open ``gate``, then
    writes ``after`` and exits."""

    async def script(payload: dict[str, Any]) -> AsyncIterator[tuple[str, bytes]]:
        yield "stdout", before
        await gate.wait()
        yield "stdout", after

    return script


async def read_until(tools: dict[str, Any], command_id: str, check: Any, timeout: float = 5.0) -> dict[str, Any]:
    """``local_pc_command_read`` every 50 ms until ``check(state)``; fail after ``timeout``."""
    state: dict[str, Any] = {}
    try:
        async with asyncio.timeout(timeout):
            while True:
                state = await tools["local_pc_command_read"]({"command_id": command_id})
                if check(state):
                    return state
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"the run never reached the expected state; last read: {state}") from None


def errors(exc: pytest.ExceptionInfo[DispatchError]) -> tuple[str, str]:
    return exc.value.code, exc.value.message


# --- in process, fake shims ------------------------------------------------------------------------

in_process = pytest.mark.django_db(transaction=True)


@in_process
async def test_the_four_tools_are_machine_tools(owner):
    assert COMMAND_HANDLE_TOOL_NAMES == {
        "local_pc_command_start",
        "local_pc_command_read",
        "local_pc_command_wait",
        "local_pc_command_cancel",
    }
    assert COMMAND_HANDLE_TOOL_NAMES <= MACHINE_TOOL_NAMES
    assert COMMAND_HANDLE_TOOL_NAMES <= set(await tools_for(owner))


@in_process
async def test_start_returns_while_the_command_still_runs_then_wait_returns_its_result(shims, owner):
    gate = asyncio.Event()
    machine = await live_machine(shims, owner, gated(gate), hostname="buildbox")
    tools = await tools_for(owner)

    started = await tools["local_pc_command_start"]({"argv": ["make", "test"]})

    assert started["status"] == "running" and started["machine"] == "buildbox"
    assert command_runs.COMMAND_ID_PATTERN.match(started["command_id"])
    assert len(machine.running) == 1  # the command has not ended: start did not wait for it
    gate.set()
    done = await tools["local_pc_command_wait"]({"command_id": started["command_id"], "timeout_seconds": 10})
    assert done["status"] == "finished" and done["exit_code"] == 0 and done["timed_out"] is False
    assert done["stdout"] == "line 0\nline 1\n" and done["stderr"] == ""
    assert done["next_offset"] == {"stdout": 14, "stderr": 0} and done["output_truncated"] is False
    assert done["duration_seconds"] is not None and done["finished_at"]
    # The same path as a streamed command: its audit record, and no in-flight row left.
    run = await database_sync_to_async(CommandRun.objects.get)(pk=started["command_id"])
    await settle()
    record = await database_sync_to_async(AuditRecord.objects.get)(request_id=str(run.request_id))
    assert record.result["ok"] is True and record.result["exit_code"] == 0
    assert await database_sync_to_async(OperationInFlight.objects.count)() == 0
    assert run.call_key == f"cmd:{run.id}" and run.server_process_id == current_process_id()


@in_process
async def test_an_oauth_callers_command_names_its_application_in_the_run_and_the_audit(shims, owner):
    gate = asyncio.Event()
    gate.set()
    await live_machine(shims, owner, gated(gate), hostname="buildbox")
    caller = Caller(user=owner, scopes=frozenset(["mcp"]), oauth_application_id=7, oauth_application_name="Claude")
    tools = await mcp_tools_for(
        user=owner,
        session_id=SESSION,
        scopes=caller.scopes,
        name="local_pc_command_start",
        audit_caller=caller.audit_caller,
    )

    started = await tools["local_pc_command_start"]({"argv": ["true"]})
    await tools["local_pc_command_wait"]({"command_id": started["command_id"], "timeout_seconds": 10})

    run = await database_sync_to_async(CommandRun.objects.get)(pk=started["command_id"])
    await settle()
    record = await database_sync_to_async(AuditRecord.objects.get)(request_id=str(run.request_id))
    assert run.caller == record.caller == "mcp oauth 7: Claude"


@in_process
async def test_read_shows_the_output_so_far_and_pages_by_offset(shims, owner):
    gate = asyncio.Event()
    await live_machine(shims, owner, gated(gate, before="héllo\n".encode(), after=b"world\n"))
    tools = await tools_for(owner)
    command_id = (await tools["local_pc_command_start"]({"command": "slow"}))["command_id"]

    partial = await read_until(tools, command_id, lambda s: s["stdout"])
    assert partial["status"] == "running" and partial["stdout"] == "héllo\n"
    assert partial["next_offset"] == {"stdout": 7, "stderr": 0}  # bytes of UTF-8, not characters
    assert "exit_code" not in partial
    gate.set()
    await tools["local_pc_command_wait"]({"command_id": command_id})
    rest = await tools["local_pc_command_read"]({"command_id": command_id, "offset": partial["next_offset"]})
    assert rest["status"] == "finished" and rest["stdout"] == "world\n"
    assert rest["next_offset"] == {"stdout": 13, "stderr": 0}
    # An offset inside a character starts at the next one (never a broken character).
    inside = await tools["local_pc_command_read"]({"command_id": command_id, "offset": {"stdout": 2}})
    assert inside["stdout"] == "llo\nworld\n"


@in_process
async def test_a_wait_that_runs_out_answers_running(shims, owner):
    gate = asyncio.Event()
    await live_machine(shims, owner, gated(gate))
    tools = await tools_for(owner)
    command_id = (await tools["local_pc_command_start"]({"argv": ["sleep", "30"]}))["command_id"]
    state = await tools["local_pc_command_wait"]({"command_id": command_id, "timeout_seconds": 0.4})
    assert state["status"] == "running"
    gate.set()
    assert (await tools["local_pc_command_wait"]({"command_id": command_id}))["status"] == "finished"


@in_process
async def test_cancel_stops_the_command_through_the_rows_not_the_starting_coroutine(shims, owner):
    machine = await live_machine(shims, owner, lambda payload: lines(600, pause=0.05))
    tools = await tools_for(owner)
    command_id = (await tools["local_pc_command_start"]({"argv": ["sleep", "30"]}))["command_id"]
    run = await database_sync_to_async(CommandRun.objects.get)(pk=command_id)
    inflight = await database_sync_to_async(OperationInFlight.objects.get)()
    assert inflight.call_key == run.call_key  # what cancel_calls finds, from any process

    # A cancel built from nothing but the user and the id, as another process would.
    other_tools = await tools_for(owner)
    state = await other_tools["local_pc_command_cancel"]({"command_id": command_id})

    assert state["cancel_sent"] is True
    assert state["status"] == "cancelled" and state["exit_code"] == -15
    assert machine.cancels(str(run.request_id)) and not machine.running
    assert await database_sync_to_async(OperationInFlight.objects.count)() == 0
    again = await other_tools["local_pc_command_cancel"]({"command_id": command_id})
    assert again["status"] == "cancelled" and again["cancel_sent"] is False


@in_process
async def test_another_users_or_sessions_command_is_not_found_as_an_unknown_one_is(shims, owner, outsider):
    gate = asyncio.Event()
    await live_machine(shims, owner, gated(gate))
    command_id = (await (await tools_for(owner))["local_pc_command_start"]({"argv": ["ls"]}))["command_id"]
    theirs = await tools_for(outsider)
    other_session = await tools_for(owner, session_id="s2")
    unknown = f"cmd_{uuid.uuid4().hex}"
    for tools, target in ((theirs, command_id), (other_session, command_id), (theirs, unknown)):
        for name, extra in (
            ("local_pc_command_read", {}),
            ("local_pc_command_wait", {"timeout_seconds": 1}),
            ("local_pc_command_cancel", {}),
        ):
            with pytest.raises(DispatchError) as refused:
                await tools[name]({"command_id": target, **extra})
            assert refused.value.code == "NOT_FOUND", (name, refused.value)
    state = await (await tools_for(owner))["local_pc_command_read"]({"command_id": command_id})
    assert state["status"] == "running"  # the outsider's cancel did nothing
    gate.set()


def _run_of(owner: Any, process: ServerProcess | None, **fields: Any) -> CommandRun:
    return CommandRun.objects.create(
        id=f"cmd_{uuid.uuid4().hex}",
        user=owner,
        session_id=SESSION,
        machine_id="m1",
        machine_name="laptop",
        request_id=uuid.uuid4(),
        caller="test",
        call_key="cmd:x",
        server_process=process,
        **fields,
    )


def _process(heartbeat_age: float) -> ServerProcess:
    return ServerProcess.objects.create(
        id=f"proc_{uuid.uuid4().hex[:16]}",
        kind=ServerProcess.Kind.SERVE,
        hostname="elsewhere",
        pid=1,
        heartbeat_at=timezone.now() - timedelta(seconds=heartbeat_age),
    )


@in_process
async def test_a_run_whose_process_is_gone_reads_lost_not_running(owner, settings):
    settings.PROCESS_TTL = 10.0
    silent = await database_sync_to_async(lambda: _run_of(owner, _process(heartbeat_age=60)))()
    reaped = await database_sync_to_async(lambda: _run_of(owner, None))()
    alive = await database_sync_to_async(lambda: _run_of(owner, _process(heartbeat_age=1)))()
    tools = await tools_for(owner)
    for run in (silent, reaped):
        state = await tools["local_pc_command_wait"]({"command_id": run.id, "timeout_seconds": 5})
        assert state["status"] == "lost" and state["error"]["code"] == "SERVER_PROCESS_LOST", state
        assert state["finished_at"]
        stored = await database_sync_to_async(CommandRun.objects.get)(pk=run.id)
        assert stored.status == "lost" and stored.finished_at is not None  # recorded, so retention applies
    assert (await tools["local_pc_command_read"]({"command_id": alive.id}))["status"] == "running"


@in_process
async def test_a_run_of_this_process_without_its_task_reads_lost(owner):
    # The task's final write failed (the database was away): nothing will ever end the row.
    def orphan() -> CommandRun:
        return _run_of(
            owner,
            ServerProcess.objects.get_or_create(
                id=current_process_id(), defaults={"kind": "test", "hostname": "here", "pid": 1}
            )[0],
        )

    run = await database_sync_to_async(orphan)()
    state = await (await tools_for(owner))["local_pc_command_read"]({"command_id": run.id})
    assert state["status"] == "lost"


@in_process
async def test_finished_runs_are_forgotten_after_the_retention(owner):
    def world() -> tuple[CommandRun, CommandRun, CommandRun]:
        old = timezone.now() - command_runs.COMMAND_RUN_RETENTION - timedelta(minutes=1)
        expired = _run_of(owner, None, status="finished", finished_at=old)
        recent = _run_of(owner, None, status="finished", finished_at=timezone.now())
        running = _run_of(owner, _process(heartbeat_age=0), started_at=old)
        return expired, recent, running

    expired, recent, running = await database_sync_to_async(world)()
    assert await database_sync_to_async(command_runs.command_runs_expired_delete)() == 1
    left = await database_sync_to_async(lambda: set(CommandRun.objects.values_list("pk", flat=True)))()
    assert left == {recent.id, running.id} and expired.id not in left


@in_process
async def test_output_past_one_mebibyte_per_stream_is_dropped_and_said(shims, owner):
    async def big(payload: dict[str, Any]) -> AsyncIterator[tuple[str, bytes]]:
        for _ in range(24):
            yield "stdout", b"x" * (64 * 1024)  # 1.5 MiB
        yield "stderr", b"warning\n"

    await live_machine(shims, owner, big)
    tools = await tools_for(owner)
    command_id = (await tools["local_pc_command_start"]({"argv": ["yes"]}))["command_id"]
    state = await tools["local_pc_command_wait"]({"command_id": command_id, "timeout_seconds": 20})
    assert state["status"] == "finished" and state["output_truncated"] is True
    assert state["stdout_bytes"] == command_runs.OUTPUT_KEPT_BYTES and state["stderr"] == "warning\n"
    assert len(state["stdout"]) == command_runs.READ_PAGE_BYTES  # one page per read
    offset = state["next_offset"]
    pages = [state["stdout"]]
    while offset["stdout"] < state["stdout_bytes"]:
        page = await tools["local_pc_command_read"]({"command_id": command_id, "offset": offset})
        pages.append(page["stdout"])
        offset = page["next_offset"]
    assert "".join(pages) == "x" * command_runs.OUTPUT_KEPT_BYTES


@in_process
@pytest.mark.parametrize(
    ("name", "arguments", "says"),
    [
        ("local_pc_command_read", {"command_id": "42"}, "does not match"),
        ("local_pc_command_read", {}, "'command_id' is a required property"),
        ("local_pc_command_read", {"command_id": "cmd_" + "0" * 32, "offset": {"stdout": -1}}, "minimum"),
        ("local_pc_command_read", {"command_id": "cmd_" + "0" * 32, "offset": {"stdout": "3"}}, "integer"),
        ("local_pc_command_read", {"command_id": "cmd_" + "0" * 32, "offset": 5}, "object"),
        ("local_pc_command_wait", {"command_id": "cmd_" + "0" * 32, "timeout_seconds": 0}, "less than or equal"),
        ("local_pc_command_wait", {"command_id": "cmd_" + "0" * 32, "timeout_seconds": 51}, "greater than"),
        ("local_pc_command_wait", {"command_id": "cmd_" + "0" * 32, "timeout_seconds": "9"}, "number"),
        ("local_pc_command_cancel", {"command_id": "cmd_" + "0" * 31 + "Z"}, "does not match"),
        ("local_pc_command_start", {}, "exactly one of argv"),
        ("local_pc_command_start", {"argv": ["ls"], "command": "ls"}, "exactly one of argv"),
        ("local_pc_command_start", {"argv": []}, "should be non-empty"),
        ("local_pc_command_start", {"argv": ["ls"], "target_machines": "*"}, "not target_machines"),
        ("local_pc_command_start", {"argv": ["ls"], "binary": True}, "binary"),
    ],
)
async def test_bad_arguments_are_refused_with_invalid_request(owner, name, arguments, says):
    tools = await tools_for(owner)
    with pytest.raises(DispatchError) as refused:
        await tools[name](arguments)
    assert refused.value.code == "INVALID_REQUEST"
    assert says in refused.value.message, refused.value.message


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda: command_runs.check_command_id("cmd_xyz"), "command_id must be"),
        (lambda: command_runs.check_offset({"stdout": -1}), "offset.stdout"),
        (lambda: command_runs.check_offset({"stdout": True}), "offset.stdout"),
        (lambda: command_runs.check_offset({"stdin": 0}), "offset must be"),
        (lambda: command_runs.check_wait_seconds(50.5), "at most 50"),
        (lambda: command_runs.check_wait_seconds(-1), "more than 0"),
        (lambda: command_runs.check_start_payload({"argv": []}), "payload.argv"),
        (lambda: command_runs.check_start_payload({"cwd": "/"}), "exactly one of argv"),
    ],
)
def test_the_services_check_their_arguments_too(call, says):
    with pytest.raises(DispatchError) as refused:
        call()
    assert refused.value.code == "INVALID_REQUEST" and says in refused.value.message


@in_process
async def test_an_offset_past_the_output_kept_is_refused(owner):
    run = await database_sync_to_async(lambda: _run_of(owner, _process(heartbeat_age=0), stdout="ab", stdout_bytes=2))()
    tools = await tools_for(owner)
    with pytest.raises(DispatchError) as refused:
        await tools["local_pc_command_read"]({"command_id": run.id, "offset": {"stdout": 3}})
    assert errors(refused) == ("INVALID_REQUEST", "offset.stdout is past the 2 bytes of stdout kept so far")


@in_process
async def test_an_agent_acts_only_in_its_own_session(shims, owner):
    def guard(session_id: str) -> None:
        if session_id != SESSION:
            raise DispatchError("PERMISSION_DENIED", "an agent acts only in its own session")

    gate = asyncio.Event()
    await live_machine(shims, owner, gated(gate))
    built = await machine_tools(user=owner, session_id=SESSION, caller="agent", session_guard=guard)
    tools = {tool.name: tool for tool in built}
    command_id = (await tools["local_pc_command_start"]({"argv": ["ls"]}))["command_id"]
    for name in COMMAND_HANDLE_TOOL_NAMES:
        arguments = {"argv": ["ls"]} if name == "local_pc_command_start" else {"command_id": command_id}
        with pytest.raises(DispatchError) as refused:
            await tools[name]({**arguments, "session_id": "elsewhere"})
        assert refused.value.code == "PERMISSION_DENIED", name
    gate.set()
    assert (await tools["local_pc_command_wait"]({"command_id": command_id}))["status"] == "finished"


# --- the run's task under failure (a scripted stream in place of live.operation_stream) --------------


def scripted(monkeypatch: pytest.MonkeyPatch, script: Any) -> None:
    """``local_pc_command_start`` runs ``script()`` (an async generator of live events) in
    place of ``live.operation_stream``: the run's task meets exactly the events, delays and
    failures the test sets up."""
    monkeypatch.setattr(command_runs.live, "operation_stream", lambda **kwargs: script())


REQUEST = str(uuid.uuid4())


def started() -> Started:
    return Started(request_id=REQUEST, machine_id="m1", name="laptop")


def output(data: str, stream: str = "stdout", seq: int = 0) -> Output:
    return Output(
        request_id=REQUEST, machine_id="m1", name="laptop", stream=stream, data=data, encoding="utf-8", seq=seq
    )


def result(exit_code: int = 0) -> Result:
    payload = {"exit_code": exit_code, "duration_seconds": 0.1, "cancelled": False}
    return Result(request_id=REQUEST, machine_id="m1", name="laptop", type="COMMAND_RESULT", payload=payload)


def appends(monkeypatch: pytest.MonkeyPatch, fails: Any) -> list[dict[str, Any]]:
    """Every ``_run_append`` call, recorded; those for which ``fails(call, calls so far)``
    raise ``OperationalError`` (the database away) instead of writing."""
    real = command_runs._run_append
    calls: list[dict[str, Any]] = []

    def append(**call: Any) -> None:
        calls.append(call)
        if fails(call, len(calls)):
            raise OperationalError("the database went away")
        real(**call)

    monkeypatch.setattr(command_runs, "_run_append", append)
    return calls


async def ended(command_id: str) -> None:
    """Wait (at most 10 s) for the task of run ``command_id`` to end."""
    tasks = [task for task in command_runs._TASKS if task.get_name() == f"command run {command_id}"]
    if tasks:
        await asyncio.wait(tasks, timeout=10)
        assert all(task.done() for task in tasks), "the run's task never ended"


async def row(command_id: str) -> CommandRun:
    return await database_sync_to_async(CommandRun.objects.get)(pk=command_id)


def tickers() -> list[asyncio.Task[Any]]:
    return [task for task in asyncio.all_tasks() if task.get_name().endswith(" ticker") and not task.done()]


@in_process
async def test_a_final_write_that_keeps_failing_is_retried_then_the_run_is_marked_lost(owner, monkeypatch):
    monkeypatch.setattr(command_runs, "FINAL_WRITE_DELAYS", (0, 0))
    calls = appends(monkeypatch, lambda call, n: call["end"] is not None)

    async def script() -> AsyncIterator[Any]:
        yield started()
        yield output("built\n")
        yield result()

    scripted(monkeypatch, script)
    command_id = (await (await tools_for(owner))["local_pc_command_start"]({"argv": ["make"]}))["command_id"]
    await ended(command_id)

    assert len([call for call in calls if call["end"] is not None]) == 3  # the first try, then one per delay
    stored = await row(command_id)
    assert stored.status == "lost" and stored.error["code"] == "SERVER_PROCESS_LOST" and stored.finished_at
    assert not tickers()


@in_process
async def test_a_cleanup_that_raises_neither_keeps_the_run_running_nor_leaves_its_ticker(owner, monkeypatch):
    # The task is cancelled while its 64 KiB write is in the database; the stream's cleanup
    # then raises (aclose): the end is still written, and the ticker stopped.
    monkeypatch.setattr(command_runs, "FLUSH_INTERVAL", 0.01)
    entered, release = threading.Event(), threading.Event()

    def blocks(call: dict[str, Any], n: int) -> bool:
        if call["end"] is None and call["sizes"]["stdout"] >= command_runs.FLUSH_BYTES:
            entered.set()
            release.wait(10)
        return False

    appends(monkeypatch, blocks)

    async def script() -> AsyncIterator[Any]:
        yield started()
        try:
            yield output("x" * command_runs.FLUSH_BYTES)
            await asyncio.Event().wait()
        except GeneratorExit:
            raise RuntimeError("the stream's cleanup failed") from None

    scripted(monkeypatch, script)
    command_id = (await (await tools_for(owner))["local_pc_command_start"]({"argv": ["make"]}))["command_id"]
    async with asyncio.timeout(10):
        while not entered.is_set():
            await asyncio.sleep(0.01)
    [task] = [task for task in command_runs._TASKS if task.get_name() == f"command run {command_id}"]
    task.cancel()
    release.set()
    await ended(command_id)

    stored = await row(command_id)
    assert stored.status == "lost" and stored.error["code"] == "SHUTTING_DOWN", (stored.status, stored.error)
    assert stored.stdout_bytes == command_runs.FLUSH_BYTES
    assert not tickers()


@in_process
async def test_a_database_error_while_writing_output_does_not_stop_the_command(owner, monkeypatch):
    monkeypatch.setattr(command_runs, "FLUSH_INTERVAL", 60)  # only the 64 KiB writes
    appends(monkeypatch, lambda call, n: n == 1)  # the first write: the 64 KiB one
    closed_early = []

    async def script() -> AsyncIterator[Any]:
        try:
            yield started()
            yield output("a" * command_runs.FLUSH_BYTES)
            yield output("b" * 10, seq=1)
            yield result()
        except GeneratorExit:
            closed_early.append(True)  # what CANCELs the command on the machine
            raise

    scripted(monkeypatch, script)
    command_id = (await (await tools_for(owner))["local_pc_command_start"]({"argv": ["make"]}))["command_id"]
    await ended(command_id)

    stored = await row(command_id)
    assert stored.status == "finished" and stored.exit_code == 0, (stored.status, stored.error)
    assert stored.stdout == "a" * command_runs.FLUSH_BYTES + "b" * 10  # the text of the failed write too
    assert not closed_early


@in_process
async def test_output_whose_timed_write_failed_is_written_with_the_next(owner, monkeypatch):
    monkeypatch.setattr(command_runs, "FLUSH_INTERVAL", 0.01)
    calls = appends(monkeypatch, lambda call, n: n == 1)

    async def script() -> AsyncIterator[Any]:
        yield started()
        yield output("first\n")
        async with asyncio.timeout(10):
            while not calls:  # the ticker tried (and failed) to write "first"
                await asyncio.sleep(0.01)
        yield output("second\n", seq=1)
        yield result()

    scripted(monkeypatch, script)
    command_id = (await (await tools_for(owner))["local_pc_command_start"]({"argv": ["make"]}))["command_id"]
    await ended(command_id)

    stored = await row(command_id)
    assert stored.status == "finished" and stored.stdout == "first\nsecond\n"
    assert stored.stdout_bytes == len("first\nsecond\n")


@in_process
async def test_a_run_that_got_its_result_keeps_it_when_the_stream_cleanup_then_fails(owner, monkeypatch):
    async def script() -> AsyncIterator[Any]:
        yield started()
        yield result(exit_code=3)
        raise RuntimeError("the in-flight row could not be deleted")

    scripted(monkeypatch, script)
    command_id = (await (await tools_for(owner))["local_pc_command_start"]({"argv": ["make"]}))["command_id"]
    await ended(command_id)

    stored = await row(command_id)
    assert stored.status == "finished" and stored.exit_code == 3 and stored.error is None


@in_process
async def test_the_kept_output_is_the_first_mebibyte_nothing_from_after_the_cut(owner, monkeypatch):
    kept = command_runs.OUTPUT_KEPT_BYTES

    async def script() -> AsyncIterator[Any]:
        yield started()
        yield output("a" * (kept - 1))
        yield output("é-LOST-TAIL", seq=1)  # "é" is 2 bytes: it does not fit the 1 byte left
        yield output("Z", seq=2)  # fits that byte, but comes after what was dropped
        yield output("late", stream="stderr", seq=3)  # the other stream keeps its own room
        yield result()

    scripted(monkeypatch, script)
    command_id = (await (await tools_for(owner))["local_pc_command_start"]({"argv": ["make"]}))["command_id"]
    await ended(command_id)

    stored = await row(command_id)
    assert stored.output_truncated is True and stored.stdout_bytes == kept - 1
    assert stored.stdout == "a" * (kept - 1)
    assert stored.stderr == "late"


@in_process
async def test_once_truncated_the_ticker_writes_only_when_there_is_output(owner, monkeypatch):
    monkeypatch.setattr(command_runs, "FLUSH_INTERVAL", 0.01)
    calls = appends(monkeypatch, lambda call, n: False)
    flushes = []
    real_flush = command_runs._Run.flush

    async def flush(self: Any, end: Any = None) -> None:
        flushes.append(end)
        await real_flush(self, end)

    monkeypatch.setattr(command_runs._Run, "flush", flush)

    async def script() -> AsyncIterator[Any]:
        yield started()
        yield output("x" * (command_runs.OUTPUT_KEPT_BYTES + 1))
        seen = len(flushes)
        async with asyncio.timeout(10):
            while len(flushes) < seen + 10:  # ten ticks with nothing new
                await asyncio.sleep(0.01)
        yield result()

    scripted(monkeypatch, script)
    command_id = (await (await tools_for(owner))["local_pc_command_start"]({"argv": ["make"]}))["command_id"]
    await ended(command_id)

    idle = [call for call in calls if call["end"] is None and not any(call["sizes"].values())]
    assert idle == []
    stored = await row(command_id)
    assert stored.output_truncated is True and stored.stdout_bytes == command_runs.OUTPUT_KEPT_BYTES


@in_process
async def test_the_real_end_replaces_lost_when_the_process_was_only_slow(shims, owner):
    gate = asyncio.Event()
    await live_machine(shims, owner, gated(gate))
    tools = await tools_for(owner)
    command_id = (await tools["local_pc_command_start"]({"argv": ["make"]}))["command_id"]
    # Another process found this one's heartbeat late and recorded the run lost.
    await database_sync_to_async(
        lambda: CommandRun.objects.filter(pk=command_id).update(
            status="lost", finished_at=timezone.now(), error=command_runs.PROCESS_LOST_ERROR
        )
    )()
    gate.set()
    await ended(command_id)

    state = await tools["local_pc_command_read"]({"command_id": command_id})
    assert state["status"] == "finished" and state["exit_code"] == 0 and "error" not in state, state
    assert state["stdout"] == "line 0\nline 1\n"


@in_process
async def test_cancel_still_stops_a_command_read_lost(shims, owner):
    machine = await live_machine(shims, owner, lambda payload: lines(600, pause=0.05))
    tools = await tools_for(owner)
    command_id = (await tools["local_pc_command_start"]({"argv": ["make"]}))["command_id"]
    await database_sync_to_async(
        lambda: CommandRun.objects.filter(pk=command_id).update(
            status="lost", finished_at=timezone.now(), error=command_runs.PROCESS_LOST_ERROR
        )
    )()

    state = await tools["local_pc_command_cancel"]({"command_id": command_id})

    assert state["cancel_sent"] is True
    stored = await row(command_id)
    assert machine.cancels(str(stored.request_id))
    assert state["status"] == "cancelled", state  # its process was alive: the real end replaced lost


@in_process
async def test_shutdown_records_each_run_lost_with_its_output_after_cancelling_it(shims, owner):
    machine = await live_machine(shims, owner, gated(asyncio.Event(), before=b"begun\n"))
    tools = await tools_for(owner)
    command_id = (await tools["local_pc_command_start"]({"argv": ["make"]}))["command_id"]
    await read_until(tools, command_id, lambda s: s["stdout"])

    assert await command_runs.command_runs_shutdown(grace=5) == 0

    stored = await row(command_id)
    assert stored.status == "lost" and stored.error["code"] == "SHUTTING_DOWN", (stored.status, stored.error)
    assert stored.stdout == "begun\n" and stored.finished_at
    assert machine.cancels(str(stored.request_id))
    assert not [task for task in command_runs._TASKS if task.get_name() == f"command run {command_id}"]


@in_process
async def test_retention_marks_a_run_whose_process_was_reaped_lost_and_keeps_it(owner):
    def world() -> tuple[CommandRun, CommandRun]:
        old = timezone.now() - command_runs.COMMAND_RUN_RETENTION - timedelta(minutes=1)
        long_running = _run_of(owner, None, started_at=old)  # ran over an hour, then its process was reaped
        forgotten = _run_of(owner, None, status="lost", started_at=old, finished_at=old)
        return long_running, forgotten

    long_running, forgotten = await database_sync_to_async(world)()
    assert await database_sync_to_async(command_runs.command_runs_expired_delete)() == 1
    kept = await row(long_running.id)
    assert kept.status == "lost" and kept.error["code"] == "SERVER_PROCESS_LOST" and kept.finished_at
    assert not await database_sync_to_async(CommandRun.objects.filter(pk=forgotten.id).exists)()


@in_process
async def test_a_wait_polls_the_status_without_the_output_and_reads_the_output_once(owner):
    from django.db import connection

    run = await database_sync_to_async(
        lambda: _run_of(owner, _process(heartbeat_age=0), stdout="y" * 1000, stdout_bytes=1000)
    )()
    statements: list[str] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        statements.append(sql)
        return execute(sql, params, many, context)

    # The shared sync thread runs every query of the service: its connection records them.
    await database_sync_to_async(lambda: connection.execute_wrappers.append(record))()
    try:
        state = await command_runs.command_wait(user=owner, session_id=SESSION, command_id=run.id, timeout_seconds=0.7)
    finally:
        await database_sync_to_async(lambda: connection.execute_wrappers.remove(record))()
    assert state["status"] == "running" and state["stdout"] == "y" * 1000
    reads = [sql for sql in statements if "machines_commandrun" in sql]
    with_output = [sql for sql in reads if '."stdout"' in sql]
    assert len(reads) >= 3 and len(with_output) == 1, reads


@pytest.mark.django_db
def test_the_admin_list_of_runs_does_not_load_their_output(owner, admin_client):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.urls import reverse

    run = _run_of(owner, None, stdout="secret output", stdout_bytes=13)
    with CaptureQueriesContext(connection) as queries:
        page = admin_client.get(reverse("admin:machines_commandrun_changelist"))
    assert page.status_code == 200 and run.id in page.content.decode()
    assert not [q["sql"] for q in queries if '."stdout"' in q["sql"]]


@in_process
@pytest.mark.parametrize("name", ["command_read", "command_wait", "command_cancel"])
async def test_a_malformed_session_id_is_refused_not_echoed(owner, name):
    with pytest.raises(DispatchError) as refused:
        await getattr(command_runs, name)(user=owner, session_id="s" * 5000, command_id=f"cmd_{uuid.uuid4().hex}")
    assert refused.value.code == "INVALID_REQUEST" and "session_id must be" in refused.value.message
    assert "s" * 300 not in refused.value.message


@in_process
async def test_an_offset_past_what_a_stream_can_keep_is_refused_before_the_wait(owner):
    offset = {"stdout": command_runs.OUTPUT_KEPT_BYTES + 1}
    with pytest.raises(DispatchError) as refused:
        # An unknown id: a wait that began would find nothing and answer NOT_FOUND.
        await command_runs.command_wait(
            user=owner, session_id=SESSION, command_id=f"cmd_{uuid.uuid4().hex}", timeout_seconds=50, offset=offset
        )
    assert errors(refused) == (
        "INVALID_REQUEST",
        f"offset.stdout is past the {command_runs.OUTPUT_KEPT_BYTES} bytes a stream keeps at most",
    )


@in_process
async def test_a_start_call_cut_before_the_answer_leaves_no_unretrieved_error(owner, monkeypatch):
    gate = asyncio.Event()

    async def script() -> AsyncIterator[Any]:
        await gate.wait()
        yield Failed(request_id=REQUEST, machine_id="m1", name="laptop", code="MACHINE_BUSY", message="busy")

    scripted(monkeypatch, script)
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda loop, context: reported.append(context))
    try:
        tools = await tools_for(owner)
        call = asyncio.ensure_future(tools["local_pc_command_start"]({"argv": ["make"]}))
        async with asyncio.timeout(10):
            while not [t for t in command_runs._TASKS if not t.done()]:
                await asyncio.sleep(0.01)
        runs = list(command_runs._TASKS)
        call.cancel()
        gate.set()
        await asyncio.wait(runs, timeout=10)
        del call, runs
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert not [c for c in reported if "never retrieved" in c.get("message", "")], reported


# --- through the MCP endpoint of a real serve, with a real shim ---------------------------------------


@dataclass
class Real:
    url: str
    token: str
    root: Path
    server: Any
    shim: Any


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Real]:
    from tests.infra import instance

    root = tmp_path_factory.mktemp("handles-root")
    with instance() as inst:
        server = inst.serve()
        shim = inst.shim("handle-box", root, "--session", "default")
        yield Real(url=f"{server.url}/mcp", token=inst.admin_token, root=root, server=server, shim=shim)


def _answer(result: Any) -> dict[str, Any]:
    from tests.mcp.test_mcp_endpoint import text_of

    assert not result.is_error, result
    return dict(json.loads(text_of(result)))


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_the_python_sdk_starts_a_command_then_waits_for_it_over_mcp(real: Real) -> None:
    from tests.mcp.test_mcp_endpoint import mcp_client

    command = "echo one; sleep 1.5; echo two"
    async with mcp_client(real.url, real.token) as client:
        started = _answer(await client.call_tool("local_pc_command_start", {"command": command}))
        assert started["status"] == "running" and started["machine"] == "handle-box"
        first = _answer(await client.call_tool("local_pc_command_wait", {"command_id": started["command_id"]}))
    assert first["status"] == "finished" and first["exit_code"] == 0
    assert first["stdout"] == "one\ntwo\n"


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_a_cancel_over_mcp_stops_a_sleep_on_the_real_machine(real: Real) -> None:
    from tests.infra import wait_until
    from tests.mcp.test_mcp_endpoint import mcp_client

    marker = real.root / f"marker-{uuid.uuid4().hex[:8]}"
    command = f"echo begun; sleep 30; touch {marker}"
    async with mcp_client(real.url, real.token) as client:
        command_id = _answer(await client.call_tool("local_pc_command_start", {"command": command}))["command_id"]
        read = {"command_id": command_id}
        for _ in range(100):
            state = _answer(await client.call_tool("local_pc_command_read", read))
            if state["stdout"]:
                break
            await asyncio.sleep(0.1)
        assert state["status"] == "running" and state["stdout"] == "begun\n", state
    # Another client, another request: only the id and the rows connect it to the command.
    async with mcp_client(real.url, real.token) as other:
        cancelled = _answer(await other.call_tool("local_pc_command_cancel", read))
    assert cancelled["status"] == "cancelled" and cancelled["cancel_sent"] is True, cancelled
    wait_until(
        lambda: [r for r in real.shim.audit() if str(marker) in json.dumps(r)], timeout=10, what="the audit record"
    )
    [record] = [r for r in real.shim.audit() if str(marker) in json.dumps(r)]
    assert record["result"].get("cancelled") is True, record
    assert not marker.exists()


# --- two serve processes (a private Redis, one SQLite file), a real shim on the first ----------------


@dataclass
class Cluster:
    instance: Any
    token: str
    a: Any  # holds the shim
    b: Any  # starts the commands

    def mcp(self, server: Any) -> str:
        return f"{server.url}/mcp"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from tests.infra import instance

    root = tmp_path_factory.mktemp("handles-cluster-root")
    with pytest.MonkeyPatch.context() as patch:
        # Nothing answers on port 1: tests.backends.redis_url starts a redis-server of our own,
        # so the machine's shared Redis is never used.
        patch.setenv("DISPATCH_TEST_REDIS_URL", "redis://127.0.0.1:1")
        with instance(redis=True, DISPATCH_PROCESS_TTL="4", DISPATCH_HEARTBEAT_INTERVAL="1") as inst:
            a, b = inst.serve(wait=False), inst.serve(wait=False)
            a.wait_healthy(), b.wait_healthy()
            inst.shim("cluster-box", root, "--session", "default", server=a)
            yield Cluster(instance=inst, token=inst.admin_token, a=a, b=b)


@pytest.mark.integration
@pytest.mark.multiprocess
@pytest.mark.redis
@pytest.mark.timeout(120)
async def test_a_command_started_on_one_process_is_read_and_cancelled_on_another(cluster: Cluster) -> None:
    from tests.mcp.test_mcp_endpoint import mcp_client

    async with mcp_client(cluster.mcp(cluster.b), cluster.token) as on_b:
        command = "echo begun; sleep 30"
        command_id = _answer(await on_b.call_tool("local_pc_command_start", {"command": command}))["command_id"]
    async with mcp_client(cluster.mcp(cluster.a), cluster.token) as on_a:
        read = {"command_id": command_id}
        for _ in range(100):
            state = _answer(await on_a.call_tool("local_pc_command_read", read))
            if state["stdout"]:
                break
            await asyncio.sleep(0.1)
        assert state["status"] == "running" and state["stdout"] == "begun\n", state
        cancelled = _answer(await on_a.call_tool("local_pc_command_cancel", read))
    # "cancelled" is the shim's own answer (its COMMAND_RESULT says cancelled), written by b's task.
    assert cancelled["status"] == "cancelled" and cancelled["cancel_sent"] is True, cancelled


@pytest.mark.integration
@pytest.mark.multiprocess
@pytest.mark.redis
@pytest.mark.timeout(120)
async def test_a_command_whose_process_was_killed_reads_lost_on_another(cluster: Cluster) -> None:
    from tests.mcp.test_mcp_endpoint import mcp_client

    doomed = cluster.instance.serve()  # a process of this test's own: the others stay up
    async with mcp_client(cluster.mcp(doomed), cluster.token) as on_doomed:
        start = await on_doomed.call_tool("local_pc_command_start", {"command": "sleep 30"})
        command_id = _answer(start)["command_id"]
    doomed.kill()  # SIGKILL: no clean shutdown, no final write
    async with mcp_client(cluster.mcp(cluster.a), cluster.token) as on_a:
        arguments = {"command_id": command_id, "timeout_seconds": 30}
        state = _answer(await on_a.call_tool("local_pc_command_wait", arguments))
    assert state["status"] == "lost" and state["error"]["code"] == "SERVER_PROCESS_LOST", state


@pytest.mark.integration
@pytest.mark.multiprocess
@pytest.mark.redis
@pytest.mark.timeout(120)
async def test_a_command_whose_process_stops_cleanly_reads_lost_with_its_output(cluster: Cluster) -> None:
    from tests.mcp.test_mcp_endpoint import mcp_client

    stopping = cluster.instance.serve()  # a process of this test's own: the others stay up
    async with mcp_client(cluster.mcp(stopping), cluster.token) as on_it:
        start = await on_it.call_tool("local_pc_command_start", {"command": "echo begun; sleep 30"})
        read = {"command_id": _answer(start)["command_id"]}
        for _ in range(100):
            state = _answer(await on_it.call_tool("local_pc_command_read", read))
            if state["stdout"]:
                break
            await asyncio.sleep(0.1)
        assert state["status"] == "running" and state["stdout"] == "begun\n", state
    assert await asyncio.to_thread(stopping.stop) == 0  # SIGTERM: the clean shutdown
    async with mcp_client(cluster.mcp(cluster.a), cluster.token) as on_a:
        state = _answer(await on_a.call_tool("local_pc_command_read", read))
    # Recorded by the stopping process itself, before its row went: not guessed from its silence.
    assert state["status"] == "lost" and state["error"]["code"] == "SHUTTING_DOWN", state
    assert state["stdout"] == "begun\n"
