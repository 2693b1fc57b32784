"""The built-in agent's live operations (docs/live-operations.md#the-built-in-agent): a long command's
output tail reaches the run's timeline as it runs — at most one ``system`` event per 2 s
with the last 20 lines (≤ 2 KiB) — and cancelling the run cancels its operations.

The model is the double (``llm_double``); the command is a tool speaking the
``core.tools.TOOL_CALL`` contract as ``machines.tools`` does (output chunks to
``ToolCall.output``, bytes and the latest line to ``ToolCall.progress``), so these tests
hold the agent's side of it; the real shim path is in ``test_live_tail_real.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from channels.db import database_sync_to_async

from agents import executor, expert, tail
from agents.models import AgentEvent, Run
from agents.prompting import agent_prompt
from agents.services import run_cancel
from core.tools import TOOL_CALL, Tool, ToolCall
from tests.agents.llm_double import LlmDouble, answer, tool_calls

pytestmark = pytest.mark.django_db(transaction=True)

COMMAND = "local_pc_execute_command"


@pytest.fixture
def llm(settings: Any) -> Iterator[LlmDouble]:
    double = LlmDouble().start()
    settings.LLM_BASE_URL = double.url
    settings.LLM_MODEL = "double-1"
    yield double
    double.stop()


@pytest.fixture
def agent(owner: Any, make_agent: Any) -> Any:
    return make_agent(owner, type="expert", name="builder")


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tail interval and cancel poll short enough for a quick test."""
    monkeypatch.setattr(tail, "TAIL_INTERVAL", 0.5)
    monkeypatch.setattr(expert, "CANCEL_POLL", 0.1)


def serve_tool(monkeypatch: pytest.MonkeyPatch, handler: Callable[[dict[str, Any]], Awaitable[Any]]) -> None:
    """The run's only tool: ``local_pc_execute_command`` answered by ``handler``."""
    fake = Tool(name=COMMAND, description="run a command", parameters={"type": "object"}, handler=handler)

    async def only_the_command(**kwargs: Any) -> dict[str, Tool]:
        return {COMMAND: fake}

    monkeypatch.setattr(expert, "tool_set", only_the_command)


async def prompt(user: Any, agent: Any, instruction: str = "Build it.") -> Run:
    run: Run = await database_sync_to_async(agent_prompt)(user=user, agent=agent, instruction=instruction)
    return run


async def events_of(run: Run) -> list[AgentEvent]:
    return await database_sync_to_async(lambda: list(AgentEvent.objects.filter(run=run).order_by("created_at", "id")))()


def tails(events: list[AgentEvent]) -> list[AgentEvent]:
    return [event for event in events if event.metadata.get("tail")]


async def stream_lines(count: int, pause: float, *, prefix: str = "line") -> dict[str, Any]:
    """What ``machines.tools`` does for a streamed command: chunks to ``output``, the byte
    count and latest line to ``progress``."""
    call = TOOL_CALL.get()
    assert call is not None
    sent = 0
    for index in range(1, count + 1):
        chunk = f"{prefix}{index}\n"
        sent += len(chunk)
        if call.output is not None:
            await call.output("stdout", chunk)
        if call.progress is not None:
            await call.progress(sent, None, chunk.strip())
        await asyncio.sleep(pause)
    return {"exit_code": 0, "stdout": "", "stdout_bytes": sent}


# --- the tail -------------------------------------------------------------------------------


async def test_a_long_commands_output_reaches_the_timeline_while_it_runs_at_most_every_interval(
    llm, agent, owner, fast, monkeypatch
):
    seen: list[ToolCall] = []
    timeline_during: list[int] = []
    run_holder: list[Run] = []

    async def command(arguments: dict[str, Any]) -> Any:
        seen.append(TOOL_CALL.get())  # type: ignore[arg-type]
        result = await stream_lines(30, 0.05)
        timeline_during.append(len(tails(await events_of(run_holder[0]))))
        return result

    serve_tool(monkeypatch, command)
    llm.script = [tool_calls((COMMAND, {"command": "make test"})), answer("built")]
    run = await prompt(owner, agent)
    run_holder.append(run)
    started = time.monotonic()
    finished = await asyncio.wait_for(executor.run_next(), 15)
    took = time.monotonic() - started

    assert finished is not None and finished.status == "succeeded", finished and finished.error
    assert seen[0].call_key == f"agent:{agent.pk}:{run.pk}"
    assert seen[0].output is not None and seen[0].progress is not None
    assert TOOL_CALL.get() is None  # reset after the call
    assert timeline_during[0] >= 2, "the tail did not reach the timeline while the command ran"
    events = await events_of(run)
    reported = tails(events)
    # At most one per interval: the first at once, then one per 0.5 s of a ~1.5 s command.
    assert 2 <= len(reported) <= took / 0.5 + 1
    gaps = [(b.created_at - a.created_at).total_seconds() for a, b in itertools.pairwise(reported)]
    assert all(gap >= 0.45 for gap in gaps), gaps
    assert reported[0].type == AgentEvent.Type.SYSTEM
    assert reported[0].message.startswith(f"output of {COMMAND} so far")
    last = reported[-1].message.splitlines()[1:]
    assert 1 <= len(last) <= 20
    assert last == [f"line{index}" for index in range(int(last[-1][4:]) - len(last) + 1, int(last[-1][4:]) + 1)]
    assert reported[-1].metadata["tool"] == COMMAND and reported[-1].metadata["tool_call_id"] == "call_0"
    messages = [event.message for event in events]
    assert messages.index(reported[-1].message) < messages.index(f"tool result {COMMAND}")


def test_the_tail_keeps_the_last_20_lines_within_2_kib():
    reporter = tail.TailReporter(lambda message, metadata: asyncio.sleep(0))
    reporter.wake = lambda: None  # type: ignore[method-assign]
    output = reporter.start(COMMAND, "call_0")

    async def feed() -> None:
        await output.output("stdout", "".join(f"row {index}\n" for index in range(100)))
        await output.output("stderr", "warning: half a li")
        await output.output("stderr", "ne\r\nprogress 10%\rprogress 55%")

    asyncio.run(feed())
    text, count = output.text()
    assert text.splitlines() == [f"row {index}" for index in range(82, 100)] + [
        "warning: half a line",
        "progress 55%",
    ]
    assert count == 20

    asyncio.run(output.output("stdout", "é" * 5000 + "\n" + "x" * 100 + "\n"))
    text, count = output.text()
    assert len(text.encode()) <= tail.TAIL_BYTES
    assert text.endswith("x" * 100 + "\nprogress 55%")
    assert "\ufffd" not in text


def test_a_tool_that_only_reports_progress_still_gets_a_tail_of_its_latest_lines():
    reporter = tail.TailReporter(lambda message, metadata: asyncio.sleep(0))
    reporter.wake = lambda: None  # type: ignore[method-assign]
    output = reporter.start(COMMAND, "call_0")

    async def feed() -> None:
        for index, line in enumerate(["compiling a", "compiling b", "compiling b", "linking"]):
            await output.progress(100 * (index + 1), None, line)

    asyncio.run(feed())
    message, metadata = output.report()
    assert message.splitlines()[1:] == ["compiling a", "compiling b", "linking"]
    assert metadata["bytes"] == 400


# --- cancel ---------------------------------------------------------------------------------


async def test_cancelling_the_run_cancels_its_operations_and_stops_the_tool_call(llm, agent, owner, fast, monkeypatch):
    keys: list[str] = []
    stopped = asyncio.Event()

    async def cancel_calls(*, user: Any, call_key: str) -> int:
        assert user.pk == owner.pk
        keys.append(call_key)
        return 1

    async def command(arguments: dict[str, Any]) -> Any:
        try:
            await stream_lines(1, 0, prefix="started")
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            stopped.set()
            raise
        return {"exit_code": 0}

    monkeypatch.setattr(expert, "cancel_calls", cancel_calls)
    serve_tool(monkeypatch, command)
    llm.script = [tool_calls((COMMAND, {"command": "echo started; sleep 30"})), answer("never")]
    run = await prompt(owner, agent)

    async def cancel_once_started() -> None:
        while not tails(await events_of(run)):
            await asyncio.sleep(0.05)
        await database_sync_to_async(run_cancel)(user=owner, run_id=run.pk)

    started = time.monotonic()
    finished, _ = await asyncio.wait_for(asyncio.gather(executor.run_next(), cancel_once_started()), 10)

    assert time.monotonic() - started < 5
    assert finished is not None and finished.status == "cancelled"
    assert keys == [f"agent:{agent.pk}:{run.pk}"]
    assert stopped.is_set()
    assert len(llm.requests) == 1  # the model is not asked again
    messages = [event.message for event in await events_of(run)]
    assert "run cancelled: its tool calls were stopped" in messages
    assert "started1" in tails(await events_of(run))[0].message


async def test_a_run_that_is_not_cancelled_never_cancels_by_key(llm, agent, owner, fast, monkeypatch):
    keys: list[str] = []

    async def cancel_calls(*, user: Any, call_key: str) -> int:
        keys.append(call_key)
        return 0

    checks = [0]
    run_status = expert._run_status

    def counted_status(run_id: str) -> str:
        checks[0] += 1
        return run_status(run_id)

    checked_while_running: list[int] = []

    async def command(arguments: dict[str, Any]) -> Any:
        started_at = checks[0]
        async with asyncio.timeout(5):
            while checks[0] < started_at + 3:  # the run's status is checked several times meanwhile
                await asyncio.sleep(0.01)
        checked_while_running.append(checks[0] - started_at)
        return {"exit_code": 0}

    monkeypatch.setattr(expert, "_run_status", counted_status)
    monkeypatch.setattr(expert, "cancel_calls", cancel_calls)
    serve_tool(monkeypatch, command)
    llm.script = [tool_calls((COMMAND, {"command": "true"})), answer("done")]
    await prompt(owner, agent)

    finished = await asyncio.wait_for(executor.run_next(), 10)

    assert finished is not None and finished.status == "succeeded"
    assert checked_while_running and checked_while_running[0] >= 3
    assert keys == []
