"""The MCP edge of live operations (docs/live-operations.md#mcp-progress-and-cancellation),
in process: tool calls answered as server-sent events carrying ``notifications/progress``
with the client's ``progressToken``, the ``core.tools.TOOL_CALL`` a tool sees,
``notifications/cancelled`` answered at the edge with the call's ``call_key``, and the
machine tools' progress reports (``machines.tools.OutputProgress``). Against real shims and
a real ``serve``: tests/mcp/test_mcp_live_clients.py.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from core.tools import TOOL_CALL, Tool, ToolCall
from dispatch.mcp import app as mcp_app
from dispatch.mcp import server as mcp_server
from machines import tools as machine_tools
from machines.services import live

pytestmark = pytest.mark.django_db(transaction=True)

LEGACY = "2025-11-25"
SSE_ACCEPT = "application/json, text/event-stream"


def call(request_id: Any, name: str, arguments: dict[str, Any], progress_token: Any = None) -> dict[str, Any]:
    params: dict[str, Any] = {"name": name, "arguments": arguments}
    if progress_token is not None:
        params["_meta"] = {"progressToken": progress_token}
    return {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params}


def sse_messages(text: str) -> list[dict[str, Any]]:
    """The JSON-RPC messages of an SSE body (each ``data:`` line of a ``message`` event)."""
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and line[5:].strip()]


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=mcp_app.mcp_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as http:
        yield http
    await mcp_app.shutdown()


@pytest.fixture
def seen_calls(monkeypatch: pytest.MonkeyPatch) -> list[ToolCall | None]:
    """A tool ``slow_tool`` replaces the caller's tools: it reports progress three times
    (when it may) and answers the ``ToolCall`` it saw."""
    seen: list[ToolCall | None] = []

    async def run(arguments: dict[str, Any]) -> Any:
        tool_call = TOOL_CALL.get()
        seen.append(tool_call)
        if tool_call is not None and tool_call.progress is not None:
            for done in (1.0, 2.0, 3.0):
                await tool_call.progress(done, 3.0, f"step {int(done)}")
        return {"call_key": None if tool_call is None else tool_call.call_key}

    tool = Tool(name="slow_tool", description="reports progress", parameters={"type": "object"}, handler=run)

    async def tools_for(**kwargs: Any) -> dict[str, Tool]:
        return {tool.name: tool}

    monkeypatch.setattr(mcp_server, "tools_for", tools_for)
    return seen


def headers(token: str, accept: str = SSE_ACCEPT) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", "Accept": accept, "MCP-Protocol-Version": LEGACY}


def test_the_call_key_is_the_tokens_hash_and_the_json_rpc_id_as_json() -> None:
    digest = hashlib.sha256(b"tok").hexdigest()[:32]
    assert mcp_server.call_key("tok", 7) == f"mcp:{digest}:7"
    assert mcp_server.call_key("tok", "7") == f'mcp:{digest}:"7"'


async def test_a_tool_call_is_answered_as_events_with_progress_under_the_clients_token(
    client, owner_token, seen_calls
) -> None:
    response = await client.post(
        "/mcp", json=call(5, "slow_tool", {}, progress_token="p-1"), headers=headers(owner_token)
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    messages = sse_messages(response.text)
    progress = [m["params"] for m in messages if m.get("method") == "notifications/progress"]
    assert progress == [
        {"progressToken": "p-1", "progress": p, "total": 3.0, "message": f"step {int(p)}"} for p in (1.0, 2.0, 3.0)
    ]
    [answer] = [m for m in messages if m.get("id") == 5]
    key = json.loads(answer["result"]["content"][0]["text"])["call_key"]
    assert key == mcp_server.call_key(owner_token, 5)
    assert seen_calls[0] is not None and seen_calls[0].call_key == key
    assert TOOL_CALL.get() is None  # reset after the call


async def test_without_a_progress_token_the_tool_gets_no_progress_sink(client, owner_token, seen_calls) -> None:
    response = await client.post("/mcp", json=call("abc", "slow_tool", {}), headers=headers(owner_token))
    assert response.status_code == 200
    assert not [m for m in sse_messages(response.text) if m.get("method") == "notifications/progress"]
    assert seen_calls[0] is not None and seen_calls[0].progress is None
    assert seen_calls[0].call_key == mcp_server.call_key(owner_token, "abc")


async def test_a_client_accepting_only_json_still_gets_a_json_answer(client, owner_token, seen_calls) -> None:
    response = await client.post(
        "/mcp", json=call(1, "slow_tool", {}, progress_token=9), headers=headers(owner_token, "application/json")
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["id"] == 1


async def test_initialize_and_tools_list_keep_their_json_answers(client, owner_token, seen_calls) -> None:
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": LEGACY, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
    }
    for body in (initialize, {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}):
        response = await client.post("/mcp", json=body, headers=headers(owner_token))
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/json"), body
        assert "result" in response.json()


async def test_notifications_cancelled_cancels_the_calls_operations_by_their_key(
    client, owner, owner_token, monkeypatch
) -> None:
    cancelled: list[dict[str, Any]] = []

    async def cancel_calls(**kwargs: Any) -> int:
        cancelled.append(kwargs)
        return 1

    monkeypatch.setattr(mcp_app, "cancel_calls", cancel_calls)
    for request_id in (5, "x-5"):
        notification = {
            "jsonrpc": "2.0",
            "method": "notifications/cancelled",
            "params": {"requestId": request_id, "reason": "AbortError"},
        }
        response = await client.post("/mcp", json=notification, headers=headers(owner_token))
        assert response.status_code == 202
        assert response.content == b""
    assert cancelled == [
        {"user": owner, "call_key": mcp_server.call_key(owner_token, 5)},
        {"user": owner, "call_key": mcp_server.call_key(owner_token, "x-5")},
    ]


@pytest.mark.parametrize("params", [None, {}, {"requestId": None}, {"requestId": 1.5}, {"requestId": True}])
async def test_a_malformed_notifications_cancelled_is_acknowledged_and_ignored(
    client, owner_token, monkeypatch, params
) -> None:
    async def cancel_calls(**kwargs: Any) -> int:
        raise AssertionError("nothing to cancel")

    monkeypatch.setattr(mcp_app, "cancel_calls", cancel_calls)
    notification: dict[str, Any] = {"jsonrpc": "2.0", "method": "notifications/cancelled"}
    if params is not None:
        notification["params"] = params
    assert (await client.post("/mcp", json=notification, headers=headers(owner_token))).status_code == 202


async def test_notifications_cancelled_needs_a_token(client, monkeypatch) -> None:
    notification = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1}}
    response = await client.post("/mcp", json=notification, headers={"Accept": SSE_ACCEPT})
    assert response.status_code == 401


# --- the machine tools' progress --------------------------------------------------------------------


class Reports:
    def __init__(self) -> None:
        self.sent: list[tuple[float, float | None, str | None]] = []

    async def __call__(self, progress: float, total: float | None, message: str | None) -> None:
        self.sent.append((progress, total, message))


def out(data: str, seq: int, stream: str = "stdout", name: str = "laptop", encoding: str = "utf-8") -> live.Output:
    return live.Output(
        request_id="r", machine_id="m-" + name, name=name, stream=stream, data=data, encoding=encoding, seq=seq
    )


async def test_output_progress_counts_bytes_and_reports_the_latest_complete_line() -> None:
    reports = Reports()
    progress = machine_tools.OutputProgress(reports)
    await progress.on_output(out("compiling a\ncompil", 0))
    assert reports.sent == [(18.0, None, "compiling a")]
    await asyncio.sleep(0.3)
    await progress.on_output(out("ing b\n\n", 1))
    assert reports.sent[-1] == (25.0, None, "compiling b")
    await asyncio.sleep(0.3)
    await progress.on_output(out(base64.b64encode("é done\npartial".encode()).decode(), 2, encoding="base64"))
    assert reports.sent[-1] == (25.0 + len("é done\npartial".encode()), None, "é done")
    await progress.finish()  # nothing new: progress must grow, so no repeat
    assert len(reports.sent) == 3


async def test_output_progress_is_throttled_to_four_a_second_and_always_sends_the_last_state() -> None:
    reports = Reports()
    progress = machine_tools.OutputProgress(reports)
    for seq in range(50):
        await progress.on_output(out(f"line {seq}\n", seq))
    assert len(reports.sent) == 1
    await asyncio.sleep(0.35)  # the timer sends the latest state once
    assert len(reports.sent) == 2 and reports.sent[-1][2] == "line 49"
    await asyncio.sleep(0.3)
    await progress.on_output(out("x" * 500 + "\n", 50, stream="stderr"))
    assert reports.sent[-1][2] == "x" * machine_tools.PROGRESS_LINE_MAX
    await progress.on_output(out("tail without newline", 51))
    await progress.finish()
    progresses = [sent[0] for sent in reports.sent]
    assert progresses == sorted(set(progresses))  # strictly increasing (MCP "Progress")
    assert reports.sent[-1][2] == "tail without newline"


async def test_output_progress_of_a_fan_out_names_the_machine_and_a_silent_command_still_reports() -> None:
    reports = Reports()
    progress = machine_tools.OutputProgress(reports, fan_out=True)
    await progress.on_output(out("ok\n", 0, name="buildbox"))
    assert reports.sent == [(3.0, None, "buildbox: ok")]
    silent = Reports()
    await machine_tools.OutputProgress(silent).finish()
    assert silent.sent == [(0.0, None, None)]


async def test_execute_command_streams_with_on_output_only_when_the_call_listens(owner, monkeypatch) -> None:
    calls: list[dict[str, Any]] = []

    async def machine_op(**kwargs: Any) -> dict[str, Any]:
        calls.append(kwargs)
        if "on_output" in kwargs:
            await kwargs["on_output"](out("hello\n", 0))
        return {"machine_id": "m1", "type": "COMMAND_RESULT", "payload": {"exit_code": 0, "stdout": "hello\n"}}

    monkeypatch.setattr(machine_tools, "machine_op", machine_op)
    tools = {
        tool.name: tool for tool in await machine_tools.machine_tools(user=owner, session_id="default", caller="mcp")
    }
    command = tools["local_pc_execute_command"]
    assert await command({"argv": ["echo", "hello"]}) == {"exit_code": 0, "stdout": "hello\n", "machine_id": "m1"}
    assert "on_output" not in calls[-1]
    reports = Reports()
    token = TOOL_CALL.set(ToolCall(progress=reports, call_key="mcp:x:1"))
    try:
        await command({"argv": ["echo", "hello"]})
    finally:
        TOOL_CALL.reset(token)
    assert "on_output" in calls[-1]
    assert reports.sent == [(6.0, None, "hello")]


async def test_execute_command_sends_every_chunk_to_the_calls_output_sink(owner, monkeypatch) -> None:
    # The built-in agent's output tail (ToolCall.output) gets the whole output, chunk by
    # chunk and decoded, not the one-line progress message.
    async def machine_op(**kwargs: Any) -> dict[str, Any]:
        await kwargs["on_output"](out("one\ntwo\n", 0))
        await kwargs["on_output"](out(base64.b64encode("thr\u00e9e\n".encode()).decode(), 1, encoding="base64"))
        return {"machine_id": "m1", "type": "COMMAND_RESULT", "payload": {"exit_code": 0}}

    monkeypatch.setattr(machine_tools, "machine_op", machine_op)
    tools = {
        tool.name: tool for tool in await machine_tools.machine_tools(user=owner, session_id="default", caller="agt")
    }
    chunks: list[tuple[str, str]] = []

    async def sink(stream: str, text: str) -> None:
        chunks.append((stream, text))

    token = TOOL_CALL.set(ToolCall(output=sink, call_key="agent:a:r"))
    try:
        await tools["local_pc_execute_command"]({"argv": ["x"]})
    finally:
        TOOL_CALL.reset(token)
    assert chunks == [("stdout", "one\ntwo\n"), ("stdout", "thr\u00e9e\n")]


async def test_every_operation_tool_but_copy_and_pipe_takes_target_machines(owner, monkeypatch) -> None:
    calls: list[dict[str, Any]] = []

    async def machine_op(**kwargs: Any) -> dict[str, Any]:
        calls.append(kwargs)
        return {"results": [{"machine_id": "m1", "name": "laptop", "ok": True, "result": {}}]}

    monkeypatch.setattr(machine_tools, "machine_op", machine_op)
    tools = {
        tool.name: tool for tool in await machine_tools.machine_tools(user=owner, session_id="default", caller="mcp")
    }
    for name in machine_tools.OPERATION_TOOLS:
        schema = tools[name].parameters["properties"]["target_machines"]
        assert schema["anyOf"] == [
            {"type": "array", "items": {"type": "string"}, "minItems": 1},
            {"const": "*"},
        ]
        assert "target_machines" in tools[name].description and "exclusive" in schema["description"]
    for name in ("local_pc_file_copy", "local_pc_pipe", "list_machines"):
        assert "target_machines" not in tools[name].parameters["properties"]
    answer = await tools["local_pc_file_stat"]({"path": "/x", "target_machines": "*"})
    assert answer["results"][0]["name"] == "laptop"
    assert calls[-1]["target_machines"] == "*" and calls[-1]["payload"] == {"path": "/x"}
    with pytest.raises(Exception, match="exclusive"):
        await tools["local_pc_file_stat"]({"path": "/x", "target_machines": ["a"], "target_machine": "b"})
    with pytest.raises(Exception, match="invalid arguments"):
        await tools["local_pc_file_stat"]({"path": "/x", "target_machines": []})
    assert len(calls) == 1


async def test_the_pipe_tool_validates_its_ends_and_reports_bytes_moved(owner, monkeypatch) -> None:
    calls: list[dict[str, Any]] = []

    async def pipe(**kwargs: Any) -> dict[str, Any]:
        calls.append(kwargs)
        await kwargs["on_progress"](1024, None)
        return {"request_id": "r", "bytes": 1024, "source": {}, "destination": {}}

    monkeypatch.setattr(live, "pipe", pipe)
    tools = {
        tool.name: tool for tool in await machine_tools.machine_tools(user=owner, session_id="default", caller="mcp")
    }
    ends = {"source": {"machine": "a", "argv": ["cat", "f"]}, "destination": {"machine": "b", "command": "wc -c"}}
    reports = Reports()
    token = TOOL_CALL.set(ToolCall(progress=reports))
    try:
        assert (await tools["local_pc_pipe"](ends))["bytes"] == 1024
    finally:
        TOOL_CALL.reset(token)
    assert calls[0]["source"] == ends["source"] and calls[0]["caller"] == "mcp"
    assert reports.sent == [(1024.0, None, None)]
    with pytest.raises(Exception, match="needs exactly one of argv, command \\(at 'source'\\)"):
        await tools["local_pc_pipe"]({**ends, "source": {"machine": "a"}})
    with pytest.raises(Exception, match="needs exactly one of argv, command, not argv and command"):
        await tools["local_pc_pipe"]({**ends, "source": {"machine": "a", "argv": ["cat"], "command": "cat"}})
    assert len(calls) == 1
