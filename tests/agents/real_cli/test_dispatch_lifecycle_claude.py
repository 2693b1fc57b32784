"""The REAL Claude Code (tests/clients) launched by a real ``manage.py serve`` against the
fake model, through its whole life with Dispatch: it calls a REMOTE served by a real
``python -m remotes.client serve`` and a MACHINE tool of a real ``machines.shim`` through
Dispatch's MCP and the results reach the model; a Claude that dies at start (an unknown
flag in its type's argv) is ``error`` with its own words in ``last_error`` while a
``shell`` agent on the same serve keeps running and takes a message; a stop ends the
running CLI through its stop keys within the grace period, not by a kill
(docs/agents.md#a-cli-that-dies-at-start, docs/agents.md#how-stop-works).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from agents.types import DEFAULT_AGENT_TYPES
from examples.weather_service import get_forecast
from tests.agents.fake_model import FakeModel, call, say
from tests.agents.real_cli.conftest import API_KEY, Run, cli_or_skip
from tests.agents.real_cli.dispatch_fixtures import (  # noqa: F401 - dispatch_serve is a fixture
    WEATHER_REMOTE,
    Dispatch,
    attach_shim,
    dispatch_serve,
    serve_weather_remote,
    session_gone,
)
from tests.agents.real_cli.test_dispatch_hooks_claude import Agent, _tool_results, launch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

# What Claude Code 2.1 prints (and exits 1) for a flag it does not know.
UNKNOWN_FLAG_ERROR = "error: unknown option '--no-such-flag'"


@pytest.fixture
def claude(
    fake_model: FakeModel,
    run: Run,
    dispatch_serve: Callable[[dict[str, Any]], Dispatch],  # noqa: F811 - the fixture imported above
) -> Dispatch:
    """Dispatch with the pinned Claude Code as ``claude`` (the default argv: its MCP config),
    as ``claude-broken`` (the same plus ``--no-such-flag``) and a ``shell`` type."""
    program = cli_or_skip("claude")
    default = DEFAULT_AGENT_TYPES["claude"]
    spec = {
        **default,
        "argv": [program, *default["argv"][1:]],
        "full_access_argv": [program, *default["full_access_argv"][1:]],
        "env": {"HOME": str(run.home), "ANTHROPIC_BASE_URL": fake_model.url, "ANTHROPIC_API_KEY": API_KEY},
    }
    broken = {**spec, "argv": [*spec["argv"], "--no-such-flag"]}
    return dispatch_serve({"claude": spec, "claude-broken": broken, "shell": DEFAULT_AGENT_TYPES["shell"]})


def _last_tool_results(model: FakeModel) -> list[Any]:
    """The JSON each tool returned, from the last agent-loop request (the whole conversation):
    Claude passes a tool's text as the tool_result's content, a string or text blocks."""
    results = []
    for content in map(json.loads, _tool_results([r for r in model.received("/v1/messages") if r.agent_loop][-1].body)):
        text = content if isinstance(content, str) else "".join(block["text"] for block in content)
        results.append(json.loads(text))
    return results


def _mcp_calls(agent: Agent) -> list[tuple[str, bool]]:
    return [(e["message"], e["metadata"]["ok"]) for e in agent.events() if e["message"].startswith("MCP tool")]


def test_claude_calls_a_remote_served_by_a_real_client_and_the_result_reaches_the_model(
    claude: Dispatch, fake_model: FakeModel, run: Run
) -> None:
    serve_weather_remote(claude)
    tool = f"remote__{WEATHER_REMOTE}__get_forecast"
    fake_model.queue(call(f"mcp__dispatch__{tool}", {"city": "Rome"}), say("forecast-done"))

    agent = launch(claude, "claude", run, "the weather in Rome marker-r1", full_access=True)

    agent.wait_event("done", "turn finished")
    [result] = _last_tool_results(fake_model)
    assert result == get_forecast("Rome"), result
    assert _mcp_calls(agent) == [(f"MCP tool {tool}", True)]


def test_claude_calls_a_machine_tool_on_a_real_shim_and_the_result_reaches_the_model(
    claude: Dispatch, fake_model: FakeModel, run: Run, tmp_path: Path
) -> None:
    root = tmp_path / "pc"
    root.mkdir()
    (root / "notes.txt").write_text("remember the milk marker-m2\n")
    agent = launch(claude, "claude", run, "hello marker-m1", full_access=True)
    agent.wait_event("done", "turn finished")  # the fallback answer; the shim attaches to its session now
    shim = attach_shim(claude, agent.id, root)
    fake_model.queue(call("mcp__dispatch__local_pc_file_read", {"path": "notes.txt"}), say("read-done"))

    agent.wait_delivered(agent.send("read my note marker-m3"))

    agent.wait_event("done", "turn finished", count=2)
    [read] = _last_tool_results(fake_model)
    assert (read["content"], read["machine_id"]) == ("remember the milk marker-m2\n", shim.machine_id)
    assert shim.audited_ops() == ["FILE_READ"]
    assert _mcp_calls(agent) == [("MCP tool local_pc_file_read", True)]


def test_a_claude_that_dies_at_start_is_error_with_its_words_and_a_bystander_shell_runs_on(
    claude: Dispatch, run: Run
) -> None:
    bystander = launch(claude, "shell", run, "echo bystander-up")

    response = claude.launch(type="claude-broken", name="broken", cwd=str(run.workdir), prompt="hi", trust_folder=True)

    assert response.status_code == 201, response.text
    broken = Agent(claude, response.json()["id"])
    row = broken.wait(lambda: (r := broken.row())["status"] == "error" and r, "the broken claude to be error")
    assert row["last_error"].startswith("session ended (exit status 1):"), row["last_error"]
    assert UNKNOWN_FLAG_ERROR in row["last_error"]
    [prompt] = broken.messages()
    assert prompt["status"] == "failed"
    assert "the agent's program ended (exit status 1)" in prompt["error"]
    # The shell on the same tmux server is untouched and still takes a message.
    assert bystander.row()["status"] == "running"
    bystander.wait_delivered(bystander.send("echo bystander-$((40+2))"))
    bystander.wait(lambda: "bystander-42" in claude.pane(bystander.id), "the shell to answer")
    assert bystander.row()["status"] == "running"


def test_stop_ends_the_running_claude_gracefully_within_the_grace_period(
    claude: Dispatch, fake_model: FakeModel, run: Run
) -> None:
    fake_model.queue(say("ready-to-stop"))
    agent = launch(claude, "claude", run, "hello marker-s1", full_access=True)
    agent.wait_event("done", "turn finished")

    started = time.monotonic()
    stopping = httpx.post(
        f"{claude.server.url}/api/v1/agents/{agent.id}/stop",
        headers={"Authorization": f"Bearer {claude.token}"},
        timeout=10,
    )
    assert stopping.status_code == 200, stopping.text
    assert stopping.json()["status"] == "stopping"
    agent.wait(lambda: agent.row()["status"] == "stopped", "the agent to be stopped", timeout=20)
    elapsed = time.monotonic() - started

    assert elapsed < 10  # DISPATCH_AGENT_STOP_GRACE's default: the kill would come only then
    # The supervisor's note: "session ended (exit status N)" when the pane died of the stop
    # keys, "session killed …" after the grace (agents/supervisor.py, _supervise_stopping).
    notes = [e["message"] for e in agent.events() if e["type"] == "system"]
    ends = [note for note in notes if note.startswith(("session ended (exit status ", "session killed"))]
    assert len(ends) == 1 and ends[0].startswith("session ended (exit status "), notes
    assert session_gone(claude, agent.id)
