"""The harness itself, without the CLIs: the fake model's two wire protocols, its script
and record, and the skip-or-fail rule when the CLIs are not installed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import backends
from tests.agents import fake_model as fm
from tests.agents.real_cli import conftest


def sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_anthropic_stream_gives_scripted_tool_use_to_tool_requests_and_fallback_to_side_requests() -> None:
    with fm.FakeModel([fm.call("Bash", {"command": "ls"})], fallback="title") as model:
        side = httpx.post(f"{model.url}/v1/messages?beta=true", json={"stream": True, "messages": []})
        loop = httpx.post(f"{model.url}/v1/messages?beta=true", json={"stream": True, "tools": [{"name": "Bash"}]})
    side_events = sse(side.text)
    assert side_events[2][1]["delta"] == {"type": "text_delta", "text": "title"}
    events = sse(loop.text)
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[1][1]["content_block"]["name"] == "Bash"
    assert json.loads(events[2][1]["delta"]["partial_json"]) == {"command": "ls"}
    assert events[4][1]["delta"]["stop_reason"] == "tool_use"
    assert [r.agent_loop for r in model.requests] == [False, True]


def test_anthropic_non_streaming_and_count_tokens() -> None:
    with fm.FakeModel([fm.say("hello")]) as model:
        message = httpx.post(f"{model.url}/v1/messages", json={"tools": [{}], "messages": []}).json()
        count = httpx.post(f"{model.url}/v1/messages/count_tokens", json={"messages": []}).json()
        missing = httpx.get(f"{model.url}/nowhere")
    assert message["content"] == [{"type": "text", "text": "hello"}]
    assert message["stop_reason"] == "end_turn"
    assert count["input_tokens"] >= 1
    assert missing.status_code == 404
    assert model.unknown == ["GET /nowhere"]


def test_responses_stream_with_a_namespaced_function_call_then_text() -> None:
    turns = [fm.call("echo", {"text": "x"}, namespace="mcp__dispatch"), fm.say("done")]
    with fm.FakeModel(turns) as model:
        first = sse(httpx.post(f"{model.url}/v1/responses", json={"tools": [{}], "input": []}).text)
        second = sse(httpx.post(f"{model.url}/v1/responses", json={"tools": [{}], "input": []}).text)
    item = first[-2][1]["item"]
    assert first[0][0] == "response.created" and first[-1][0] == "response.completed"
    assert item["type"] == "function_call"
    assert (item["namespace"], item["name"], json.loads(item["arguments"])) == ("mcp__dispatch", "echo", {"text": "x"})
    assert [name for name, _ in second] == [
        "response.created",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_item.done",
        "response.completed",
    ]
    assert second[3][1]["delta"] == "done"
    assert second[-1][1]["response"]["output"][0]["content"][0]["text"] == "done"


def test_prompts_containing_and_wait_for() -> None:
    with fm.FakeModel() as model:
        httpx.post(f"{model.url}/v1/responses", json={"tools": [{}], "input": [{"text": 'say "hi"'}]})
        assert model.wait_for(lambda: model.prompts_containing('say "hi"'), timeout=5)
        with pytest.raises(TimeoutError):
            model.wait_for(lambda: model.prompts_containing("never"), timeout=0.2)


def test_mcp_endpoint_answers_initialize_list_and_call() -> None:
    with fm.FakeModel() as model:
        url = f"{model.url}/mcp"
        init = httpx.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}).json()
        note = httpx.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"})
        call = httpx.post(
            url, json={"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"arguments": {"text": "a"}}}
        ).json()
    assert init["result"]["capabilities"] == {"tools": {}}
    assert note.status_code == 202
    assert call["result"]["content"] == [{"type": "text", "text": "echo: a"}]


def test_missing_cli_skips_locally_and_fails_on_ci(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(conftest, "BIN", tmp_path)
    monkeypatch.setattr(backends, "ON_CI", False)
    with pytest.raises(pytest.skip.Exception, match="not installed"):
        conftest.cli_or_skip("claude")
    monkeypatch.setattr(backends, "ON_CI", True)
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        conftest.cli_or_skip("claude")
