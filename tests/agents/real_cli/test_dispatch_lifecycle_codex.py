"""The REAL codex (tests/clients) launched by a real ``manage.py serve`` against the fake
model (a custom provider in the agent's CODEX_HOME), through its whole life with Dispatch:
it calls a REMOTE served by a real ``python -m remotes.client serve`` and a MACHINE tool
of a real ``machines.shim`` through Dispatch's MCP and the results reach the model; a
codex that dies at start (an unknown flag in its type's argv) is ``error`` with its own
words in ``last_error`` while a ``shell`` agent on the same serve keeps running and takes
a message; a stop ends the running CLI through its stop key within the grace period, not
by a kill (docs/agents.md#a-cli-that-dies-at-start, docs/agents.md#how-stop-works).
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
from tests.agents.real_cli.conftest import Run
from tests.agents.real_cli.dispatch_fixtures import (  # noqa: F401 - dispatch_serve is a fixture
    WEATHER_REMOTE,
    Dispatch,
    attach_shim,
    dispatch_serve,
    serve_weather_remote,
    session_gone,
)
from tests.agents.real_cli.test_dispatch_hooks_claude import Agent, launch
from tests.agents.real_cli.test_dispatch_launch_codex import codex_type, provider_toml

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

# What codex 0.171 prints (and exits 2) for a flag it does not know.
UNKNOWN_FLAG_ERROR = "error: unexpected argument '--no-such-flag' found"


@pytest.fixture
def codex(
    fake_model: FakeModel,
    run: Run,
    dispatch_serve: Callable[[dict[str, Any]], Dispatch],  # noqa: F811 - the fixture imported above
) -> Dispatch:
    """Dispatch with the pinned codex as ``codex`` (the default argv: its MCP server; its
    CODEX_HOME naming the fake model as provider), as ``codex-broken`` (the same plus
    ``--no-such-flag``) and a ``shell`` type."""
    spec = codex_type(run, FAKE_MODEL_API_KEY="fake-key")
    (run.home / ".codex").mkdir()
    (run.home / ".codex" / "config.toml").write_text(provider_toml(fake_model))
    broken = {**spec, "argv": [*spec["argv"], "--no-such-flag"]}
    return dispatch_serve({"codex": spec, "codex-broken": broken, "shell": DEFAULT_AGENT_TYPES["shell"]})


def _last_tool_outputs(model: FakeModel) -> list[Any]:
    """The JSON each tool returned, from the last agent-loop request (the whole
    conversation): codex passes an MCP tool's text as the function_call_output, after a
    "Wall time: … Output:" header for some."""
    last = [r for r in model.received("/v1/responses") if r.agent_loop][-1]
    results = []
    for item in last.body.get("input", []):
        if item.get("type") != "function_call_output":
            continue
        output = item.get("output")
        text = output if isinstance(output, str) else "".join(part.get("text", "") for part in output)
        results.append(json.loads(text.partition("Output:\n")[2] or text))
    return results


def _mcp_calls(agent: Agent) -> list[tuple[str, bool]]:
    return [(e["message"], e["metadata"]["ok"]) for e in agent.events() if e["message"].startswith("MCP tool")]


def test_codex_calls_a_remote_served_by_a_real_client_and_the_result_reaches_the_model(
    codex: Dispatch, fake_model: FakeModel, run: Run
) -> None:
    serve_weather_remote(codex)
    tool = f"remote__{WEATHER_REMOTE}__get_forecast"
    # codex offers MCP tools with '-' made '_' (its own naming; the call reaches Dispatch's name).
    offered = tool.replace("-", "_")
    fake_model.queue(call(offered, {"city": "Rome"}, namespace="mcp__dispatch"), say("forecast-done"))

    agent = launch(codex, "codex", run, "the weather in Rome marker-r1", full_access=True)

    agent.wait_event("done", "turn finished")
    [result] = _last_tool_outputs(fake_model)
    assert result == get_forecast("Rome"), result
    assert _mcp_calls(agent) == [(f"MCP tool {tool}", True)]


def test_codex_calls_a_machine_tool_on_a_real_shim_and_the_result_reaches_the_model(
    codex: Dispatch, fake_model: FakeModel, run: Run, tmp_path: Path
) -> None:
    root = tmp_path / "pc"
    root.mkdir()
    agent = launch(codex, "codex", run, "hello marker-m1", full_access=True)
    agent.wait_event("done", "turn finished")  # the fallback answer; the shim attaches to its session now
    shim = attach_shim(codex, agent.id, root)
    fake_model.queue(
        call("local_pc_execute_command", {"command": "echo from-the-shim-$((40+2))"}, namespace="mcp__dispatch"),
        say("echo-done"),
    )

    agent.wait_delivered(agent.send("run echo marker-m3"))

    agent.wait_event("done", "turn finished", count=2)
    [executed] = _last_tool_outputs(fake_model)
    assert (executed["stdout"], executed["exit_code"]) == ("from-the-shim-42\n", 0), executed
    assert executed["machine_id"] == shim.machine_id
    assert shim.audited_ops() == ["EXECUTE_COMMAND"]
    assert _mcp_calls(agent) == [("MCP tool local_pc_execute_command", True)]


def test_a_codex_that_dies_at_start_is_error_with_its_words_and_a_bystander_shell_runs_on(
    codex: Dispatch, run: Run
) -> None:
    bystander = launch(codex, "shell", run, "echo bystander-up")

    response = codex.launch(type="codex-broken", name="broken", cwd=str(run.workdir), prompt="hi", trust_folder=True)

    assert response.status_code == 201, response.text
    broken = Agent(codex, response.json()["id"])
    row = broken.wait(lambda: (r := broken.row())["status"] == "error" and r, "the broken codex to be error")
    assert row["last_error"].startswith("session ended (exit status 2):"), row["last_error"]
    assert UNKNOWN_FLAG_ERROR in row["last_error"]
    [prompt] = broken.messages()
    assert prompt["status"] == "failed"
    assert "the agent's program ended (exit status 2)" in prompt["error"]
    # The shell on the same tmux server is untouched and still takes a message.
    assert bystander.row()["status"] == "running"
    bystander.wait_delivered(bystander.send("echo bystander-$((40+2))"))
    bystander.wait(lambda: "bystander-42" in codex.pane(bystander.id), "the shell to answer")
    assert bystander.row()["status"] == "running"


def test_stop_ends_the_running_codex_gracefully_within_the_grace_period(
    codex: Dispatch, fake_model: FakeModel, run: Run
) -> None:
    fake_model.queue(say("ready-to-stop"))
    agent = launch(codex, "codex", run, "hello marker-s1", full_access=True)
    agent.wait_event("done", "turn finished")

    started = time.monotonic()
    stopping = httpx.post(
        f"{codex.server.url}/api/v1/agents/{agent.id}/stop",
        headers={"Authorization": f"Bearer {codex.token}"},
        timeout=10,
    )
    assert stopping.status_code == 200, stopping.text
    assert stopping.json()["status"] == "stopping"
    agent.wait(lambda: agent.row()["status"] == "stopped", "the agent to be stopped", timeout=20)
    elapsed = time.monotonic() - started

    assert elapsed < 10  # DISPATCH_AGENT_STOP_GRACE's default: the kill would come only then
    # The supervisor's note: "session ended (exit status N)" when the pane died of the stop
    # key, "session killed …" after the grace (agents/supervisor.py, _supervise_stopping).
    notes = [e["message"] for e in agent.events() if e["type"] == "system"]
    ends = [note for note in notes if note.startswith(("session ended (exit status ", "session killed"))]
    assert len(ends) == 1 and ends[0].startswith("session ended (exit status "), notes
    assert session_gone(codex, agent.id)
