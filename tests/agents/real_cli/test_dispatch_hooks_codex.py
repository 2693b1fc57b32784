"""Dispatch runs the REAL codex (tests/clients) on a real ``manage.py serve`` against the
fake model (a custom provider in the agent's CODEX_HOME), and the CLI's hooks are the
source of truth (docs/agents.md#hooks): codex's first message is pasted once its input
line shows (its SessionStart waits for that first prompt), the statuses follow the hook
events, a message is ``delivered`` only once ``UserPromptSubmit`` carried it, a message
sent while the model works waits for the turn to end, multi-line, ``!`` and ``/``
messages reach the model as text, and a Dispatch MCP tool codex calls answers the model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from agents.types import DEFAULT_AGENT_TYPES
from tests.agents.fake_model import FakeModel, call, say
from tests.agents.real_cli.conftest import Run, cli_or_skip
from tests.agents.real_cli.dispatch_fixtures import Dispatch, dispatch_serve  # noqa: F401 - a fixture
from tests.agents.real_cli.test_dispatch_hooks_claude import launch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
def codex(
    fake_model: FakeModel,
    run: Run,
    dispatch_serve: Callable[[dict[str, Any]], Dispatch],  # noqa: F811 - the fixture imported above
) -> Dispatch:
    """Dispatch with the pinned codex as type ``codex`` (the default argv: its MCP server),
    its CODEX_HOME naming the fake model as provider (FINDINGS.md 3a)."""
    program = cli_or_skip("codex")
    home = run.home / ".codex"
    home.mkdir()
    (home / "config.toml").write_text(
        'model = "gpt-fake"\nmodel_provider = "fake"\n\n[model_providers.fake]\nname = "fake"\n'
        f'base_url = "{fake_model.url}/v1"\nwire_api = "responses"\nenv_key = "FAKE_MODEL_API_KEY"\n'
    )
    default = DEFAULT_AGENT_TYPES["codex"]
    spec = {
        **default,
        "argv": [program, *default["argv"][1:]],
        "full_access_argv": [program, *default["full_access_argv"][1:]],
        "env": {"HOME": str(run.home), "CODEX_HOME": str(home), "FAKE_MODEL_API_KEY": "fake-key"},
    }
    return dispatch_serve({"codex": spec})


def test_statuses_follow_the_hooks_and_a_message_sent_while_working_waits_for_the_turn(
    codex: Dispatch, fake_model: FakeModel, run: Run
) -> None:
    fake_model.queue(call("exec_command", {"cmd": "sleep 3; echo hi > out.txt"}), say("first-done"), say("second-done"))
    agent = launch(codex, "codex", run, "first marker-x1", full_access=True)
    prompt_id = agent.messages()[0]["id"]

    agent.wait_event("working", "tool: Bash")
    second = agent.send("second marker-x2")  # while the tool runs: the turn is not over
    assert agent.message(second)["status"] == "queued"

    first_stop = agent.wait_event("done", "turn finished")
    agent.wait_event("done", "turn finished", count=2)
    assert agent.hook_events() == [
        ("system", "ready (SessionStart)"),  # lazily, with the first prompt
        ("system", "message delivered"),
        ("working", "working on the message"),
        ("working", "tool: Bash"),
        ("done", "turn finished"),
        ("system", "message delivered"),
        ("working", "working on the message"),
        ("done", "turn finished"),
    ]
    assert (run.workdir / "out.txt").read_text() == "hi\n"
    assert first_stop["metadata"]["last_assistant_message"] == "first-done"
    deliveries = [e for e in agent.events() if e["message"] == "message delivered"]
    assert [e["metadata"]["message_id"] for e in deliveries] == [prompt_id, second]
    assert agent.message(second)["created_at"] < first_stop["created_at"] < agent.message(second)["delivered_at"]


def test_multi_line_bang_and_slash_messages_reach_the_model_as_text(
    codex: Dispatch, fake_model: FakeModel, run: Run
) -> None:
    marker = run.workdir / "bang-ran"
    agent = launch(codex, "codex", run, "line one marker-y1\nline two\n\tline three")
    agent.wait_delivered(agent.messages()[0]["id"])
    fake_model.wait_for(lambda: fake_model.prompts_containing("line one marker-y1\nline two\n\tline three"), 25)

    bang = agent.send(f"!touch {marker}")
    agent.wait_delivered(bang)
    slash = agent.send("/exit")
    agent.wait_delivered(slash)

    # codex trims the neutralising space (FINDINGS.md 3c): the text from the ! or / on.
    fake_model.wait_for(lambda: fake_model.prompts_containing(f"!touch {marker}"), 25)
    fake_model.wait_for(lambda: fake_model.prompts_containing("/exit"), 25)
    agent.wait_event("done", "turn finished", count=3)
    assert not marker.exists()
    assert agent.row()["status"] == "running"  # /exit as text did not end the CLI
    assert [e["message"] for e in agent.events()].count("working on the message") == 3  # one prompt each


def test_codex_calls_dispatch_mcp_tools_and_the_results_reach_the_model(
    codex: Dispatch, fake_model: FakeModel, run: Run
) -> None:
    fake_model.queue(
        call("list_agents", {}, namespace="mcp__dispatch"),
        call("list_machines", {}, namespace="mcp__dispatch"),
        say("mcp-done"),
    )
    agent = launch(codex, "codex", run, "use dispatch marker-z1", full_access=True)

    agent.wait_event("done", "turn finished")
    # The last model request carries the whole conversation: both tools' outputs.
    last = [r for r in fake_model.received("/v1/responses") if r.agent_loop][-1]
    outputs = [item for item in last.body.get("input", []) if item.get("type") == "function_call_output"]
    texts = [json.dumps(item.get("output"), ensure_ascii=False) for item in outputs]
    assert len(texts) == 2, texts
    assert agent.id in texts[0]  # list_agents named the caller itself
    assert "[]" in texts[1]  # list_machines: none connected
    # Each call through Dispatch's MCP endpoint is on the agent's timeline (docs/mcp.md).
    calls = [(e["message"], e["metadata"]["ok"]) for e in agent.events() if e["message"].startswith("MCP tool")]
    assert calls == [("MCP tool list_agents", True), ("MCP tool list_machines", True)]
