"""Dispatch runs the REAL Claude Code (tests/clients) on a real ``manage.py serve`` against
the fake model, and the CLI's hooks are the source of truth (docs/agents.md#hooks): the
statuses follow the hook events (``working`` on the prompt, ``working`` "tool: Bash",
``done`` at the end), a message is ``delivered`` only once ``UserPromptSubmit`` carried
it, a message sent while the model works waits for the turn to end, multi-line, ``!`` and
``/`` messages reach the model as text, a permission prompt makes the agent ``blocked``
and nothing is pasted over it, and a Dispatch MCP tool the CLI calls answers the model.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from agents.types import DEFAULT_AGENT_TYPES
from tests.agents.fake_model import FakeModel, call, say
from tests.agents.real_cli.conftest import API_KEY, Run, cli_or_skip
from tests.agents.real_cli.dispatch_fixtures import Dispatch, dispatch_serve  # noqa: F401 - a fixture

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@dataclass
class Agent:
    """One agent Dispatch launched, watched through the REST API as its owner."""

    dispatch: Dispatch
    id: str

    def api(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.dispatch.token}"}
        return httpx.request(method, f"{self.dispatch.server.url}{path}", headers=headers, timeout=10, **kwargs)

    def row(self) -> dict[str, Any]:
        return self.dispatch.agent(self.id)

    def events(self) -> list[dict[str, Any]]:
        """The timeline, oldest first."""
        return list(
            reversed(self.api("GET", f"/api/v1/agents/{self.id}/events", params={"limit": 500}).json()["events"])
        )

    def hook_events(self) -> list[tuple[str, str]]:
        return [(e["type"], e["message"]) for e in self.events() if "hook" in e["metadata"]]

    def send(self, content: str) -> int:
        response = self.api("POST", f"/api/v1/agents/{self.id}/messages", json={"content": content})
        assert response.status_code == 201, response.text
        return int(response.json()["id"])

    def message(self, message_id: int) -> dict[str, Any]:
        return dict(self.api("GET", f"/api/v1/messages/{message_id}").json())

    def messages(self) -> list[dict[str, Any]]:
        return list(self.api("GET", f"/api/v1/agents/{self.id}/messages").json()["messages"])

    def wait(self, condition: Callable[[], Any], what: str, timeout: float = 25) -> Any:
        """Poll ``condition()`` until truthy; on timeout fail showing the timeline and the pane."""
        deadline = time.monotonic() + timeout
        while True:
            result = condition()
            if result:
                return result
            if time.monotonic() > deadline:
                pytest.fail(
                    f"timed out waiting for {what}\nevents: {self.hook_events()}\nmessages: {self.messages()}\n"
                    f"pane:\n{self.dispatch.pane(self.id)}"
                )
            time.sleep(0.2)

    def wait_event(self, type: str, message: str, count: int = 1) -> dict[str, Any]:
        def seen() -> Any:
            found = [e for e in self.events() if e["type"] == type and e["message"] == message]
            return found[count - 1] if len(found) >= count else None

        return dict(self.wait(seen, f"{count} × {type} '{message}'"))

    def wait_delivered(self, message_id: int) -> dict[str, Any]:
        return dict(self.wait(lambda: (m := self.message(message_id))["status"] == "delivered" and m, "the delivery"))


def launch(dispatch: Dispatch, type: str, run: Run, prompt: str, **body: Any) -> Agent:
    response = dispatch.launch(type=type, name="cc", cwd=str(run.workdir), prompt=prompt, trust_folder=True, **body)
    assert response.status_code == 201, response.text
    dispatch.wait_running(response.json()["id"])
    return Agent(dispatch, response.json()["id"])


@pytest.fixture
def claude(
    fake_model: FakeModel,
    run: Run,
    dispatch_serve: Callable[[dict[str, Any]], Dispatch],  # noqa: F811 - the fixture imported above
) -> Dispatch:
    """Dispatch with the pinned Claude Code as type ``claude`` (the default argv: its MCP
    config), as ``claude-ask`` (``--permission-mode default``: it asks before Bash) and as
    ``claude-quoted`` (``neutralise_prefix: "> "``)."""
    program = cli_or_skip("claude")
    default = DEFAULT_AGENT_TYPES["claude"]
    env = {"HOME": str(run.home), "ANTHROPIC_BASE_URL": fake_model.url, "ANTHROPIC_API_KEY": API_KEY}
    spec = {
        **default,
        "argv": [program, *default["argv"][1:]],
        "full_access_argv": [program, *default["full_access_argv"][1:]],
        "env": env,
    }
    asking = {**spec, "hooks": "claude"}  # the default argv asks (--permission-mode default)
    quoted = {**spec, "neutralise_prefix": "> ", "hooks": "claude"}
    return dispatch_serve({"claude": spec, "claude-ask": asking, "claude-quoted": quoted})


def test_statuses_follow_the_hooks_and_a_message_sent_while_working_waits_for_the_turn(
    claude: Dispatch, fake_model: FakeModel, run: Run
) -> None:
    fake_model.queue(
        call("Bash", {"command": "sleep 3; echo hi > out.txt", "description": "write out.txt"}),
        say("first-done"),
        say("second-done"),
    )
    agent = launch(claude, "claude", run, "first marker-a1", full_access=True)
    prompt_id = agent.messages()[0]["id"]

    agent.wait_event("working", "tool: Bash")
    second = agent.send("second marker-a2")  # while the Bash tool runs: the turn is not over
    assert agent.message(second)["status"] == "queued"

    first_stop = agent.wait_event("done", "turn finished")
    agent.wait_event("done", "turn finished", count=2)
    assert agent.hook_events() == [
        ("system", "ready (SessionStart)"),
        ("system", "message delivered"),
        ("working", "working on the message"),
        ("working", "tool: Bash"),
        ("done", "turn finished"),
        ("system", "message delivered"),
        ("working", "working on the message"),
        ("done", "turn finished"),
    ]
    assert (run.workdir / "out.txt").read_text() == "hi\n"
    tool = next(e for e in agent.events() if e["message"] == "tool: Bash")
    assert tool["metadata"]["tool_input"]["command"] == "sleep 3; echo hi > out.txt"
    assert first_stop["metadata"]["last_assistant_message"] == "first-done"
    # Delivered when UserPromptSubmit carried it; the second only after the first turn ended.
    deliveries = [e for e in agent.events() if e["message"] == "message delivered"]
    assert [e["metadata"]["message_id"] for e in deliveries] == [prompt_id, second]
    assert all(e["metadata"]["hook"] == "UserPromptSubmit" for e in deliveries)
    assert agent.message(second)["created_at"] < first_stop["created_at"] < agent.message(second)["delivered_at"]
    assert agent.row()["latest_event_type"] == "done"


def test_multi_line_and_bang_messages_reach_the_model_as_text(
    claude: Dispatch, fake_model: FakeModel, run: Run
) -> None:
    marker = run.workdir / "bang-ran"
    agent = launch(claude, "claude", run, "line one marker-b1\nline two\n\tline three")
    agent.wait_delivered(agent.messages()[0]["id"])
    # One prompt, the tab as four spaces (Claude's own rewrite; the delivery still matched).
    fake_model.wait_for(lambda: fake_model.prompts_containing("line one marker-b1\nline two\n    line three"), 25)

    bang = agent.send(f"!touch {marker}")
    agent.wait_delivered(bang)

    # Claude keeps the neutralising space (FINDINGS.md 3c): the text went to the model.
    fake_model.wait_for(lambda: fake_model.prompts_containing(f" !touch {marker}"), 25)
    agent.wait_event("done", "turn finished", count=2)
    assert not marker.exists()
    assert [e["message"] for e in agent.events()].count("working on the message") == 2  # one prompt each


def _slash_commands_stay_text(dispatch: Dispatch, fake_model: FakeModel, run: Run, type: str) -> None:
    agent = launch(dispatch, type, run, "/clear marker-e1")
    agent.wait_delivered(agent.messages()[0]["id"])
    exit_message = agent.send("/exit")
    agent.wait_delivered(exit_message)
    agent.wait_event("done", "turn finished", count=2)
    fake_model.wait_for(lambda: fake_model.prompts_containing("/clear marker-e1"), 25)
    fake_model.wait_for(lambda: fake_model.prompts_containing("/exit"), 25)
    assert agent.row()["status"] == "running"  # /exit as text did not end the CLI
    assert [m for t, m in agent.hook_events() if t == "system" and m.startswith("session")] == []


def test_a_slash_message_with_a_visible_neutralise_prefix_reaches_the_model_as_text(
    claude: Dispatch, fake_model: FakeModel, run: Run
) -> None:
    # The delivery is confirmed by a UserPromptSubmit whose prompt starts with the prefix.
    _slash_commands_stay_text(claude, fake_model, run, "claude-quoted")


def test_a_slash_message_reaches_the_default_claude_type_as_text(
    claude: Dispatch, fake_model: FakeModel, run: Run
) -> None:
    _slash_commands_stay_text(claude, fake_model, run, "claude")


def test_a_permission_prompt_is_blocked_and_no_message_is_pasted_over_it(
    claude: Dispatch, fake_model: FakeModel, run: Run
) -> None:
    fake_model.queue(call("Bash", {"command": "echo perm > p.txt", "description": "write p"}))
    agent = launch(claude, "claude-ask", run, "write p marker-c1")

    # The PermissionRequest hook waits for the approval (docs/agents.md#approvals).
    blocked = agent.wait_event("blocked", "approval requested: Bash `echo perm > p.txt`")
    assert blocked["metadata"]["tool_input"]["command"] == "echo perm > p.txt"
    assert agent.row()["latest_event_type"] == "blocked"
    answer = agent.send("yes marker-c2")

    # Several supervisor passes (every 0.5 s here) go by: the dialog keeps the message out.
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        assert agent.message(answer)["status"] == "queued"
        assert "marker-c2" not in claude.pane(agent.id)
        time.sleep(0.3)
    assert not (run.workdir / "p.txt").exists()
    assert agent.row()["latest_event_type"] == "blocked"


def test_the_cli_calls_dispatch_mcp_tools_and_the_results_reach_the_model(
    claude: Dispatch, fake_model: FakeModel, run: Run
) -> None:
    fake_model.queue(
        call("mcp__dispatch__list_agents", {}),
        call("mcp__dispatch__list_machines", {}),
        say("mcp-done"),
    )
    agent = launch(claude, "claude", run, "use dispatch marker-d1", full_access=True)

    agent.wait_event("done", "turn finished")
    # The last model request carries the whole conversation: both tools' results.
    texts = _tool_results([r for r in fake_model.received("/v1/messages") if r.agent_loop][-1].body)
    assert len(texts) == 2, texts
    assert agent.id in texts[0]  # list_agents named the caller itself
    assert json.loads(texts[1]) == [{"type": "text", "text": "[]"}]  # list_machines: none connected
    tools = [e["metadata"]["tool_name"] for e in agent.events() if e["message"].startswith("tool: ")]
    assert tools == ["mcp__dispatch__list_agents", "mcp__dispatch__list_machines"]
    # Each call through Dispatch's MCP endpoint is on the agent's timeline (docs/mcp.md).
    calls = [(e["message"], e["metadata"]["ok"]) for e in agent.events() if e["message"].startswith("MCP tool")]
    assert calls == [("MCP tool list_agents", True), ("MCP tool list_machines", True)]


def _tool_results(body: Any) -> list[str]:
    """The text of every tool_result block in an Anthropic Messages request body."""
    found = []
    for message in body.get("messages", []) if isinstance(body, dict) else []:
        content = message.get("content")
        for block in content if isinstance(content, list) else []:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                found.append(json.dumps(block.get("content"), ensure_ascii=False))
    return found
