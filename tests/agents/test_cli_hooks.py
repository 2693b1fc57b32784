"""A CLI agent's hooks (agents/cli_hooks.py, agents/hook_api.py; docs/agents.md "Hooks"):
who may report, what a bad report changes (nothing), and what each event does to the
agent's readiness, messages and state. The payloads are the ones FINDINGS.md
(tests/agents/real_cli) recorded from Claude Code 2.1.328 and codex 0.171.0."""

from __future__ import annotations

import shlex
import sys
from typing import Any

import pytest

from agents import cli_hooks, messages, tokens
from agents.models import Agent, AgentEvent, AgentMessage
from tests.agents.conftest import Api, error_of, force_status

pytestmark = pytest.mark.django_db

SESSION = "10711e5e-9b4c-411f-af03-db68f6afa93c"


@pytest.fixture
def claude_agent(owner: Any, make_agent: Any) -> Agent:
    return force_status(make_agent(owner, type="claude", name="c"), "running")


@pytest.fixture
def agent_api(claude_agent: Agent) -> Api:
    """The API as the agent itself: its own token, as its CLI's hook client sends it."""
    return Api(tokens.agent_token_mint(agent=claude_agent))


def url(agent: Agent) -> str:
    return f"/api/v1/agents/{agent.pk}/hooks"


def report(api: Api, agent: Agent, event: str, **payload: Any) -> Any:
    response = api.post(url(agent), {"event": event, "payload": {"hook_event_name": event, **payload}})
    assert response.status_code == 200, response.content
    assert response.json() == {"output": None}
    return response


def timeline(agent: Agent) -> list[tuple[str, str]]:
    return [(e.type, e.message) for e in AgentEvent.objects.filter(agent=agent).order_by("created_at", "pk")]


def latest(agent: Agent) -> tuple[str, str]:
    agent.refresh_from_db()
    return agent.latest_event_type, agent.latest_event_message


def pasted(agent: Agent, content: str) -> AgentMessage:
    """A message the supervisor pasted into the pane (queued, pasted, not yet confirmed)."""
    message = messages.message_send(recipient=agent, content=content, sender_user=agent.owner)
    assert messages.message_mark_pasted(message=message)
    return message


def state(agent: Agent) -> dict[str, Any]:
    agent.refresh_from_db()
    return {
        "ready_at": agent.ready_at,
        "latest": (agent.latest_event_type, agent.latest_event_message),
        "events": AgentEvent.objects.filter(agent=agent).count(),
        "messages": list(AgentMessage.objects.filter(recipient_agent=agent).values_list("status", "delivered_at")),
    }


# --- the hook command --------------------------------------------------------------------------


def test_the_hook_command_runs_the_hook_client_under_this_python():
    command = cli_hooks.hook_command("PreToolUse")
    assert shlex.split(command) == [sys.executable, str(cli_hooks.HOOK_CLIENT), "PreToolUse"]
    assert cli_hooks.HOOK_CLIENT.name == "hook_client.py" and cli_hooks.HOOK_CLIENT.is_file()


# --- who may report ----------------------------------------------------------------------------


def test_the_agents_own_token_reports_its_hooks(agent_api, claude_agent):
    report(agent_api, claude_agent, "SessionStart", source="startup", session_id=SESSION)

    claude_agent.refresh_from_db()
    assert claude_agent.ready_at is not None


def test_another_agents_token_is_refused_and_changes_nothing(owner, make_agent, claude_agent):
    other = force_status(make_agent(owner, type="claude", name="other"), "running")
    other_api = Api(tokens.agent_token_mint(agent=other))
    before = state(claude_agent)

    response = other_api.post(url(claude_agent), {"event": "SessionStart", "payload": {}})

    assert response.status_code == 403
    assert other.pk in error_of(response)["message"] and claude_agent.pk in error_of(response)["message"]
    assert state(claude_agent) == before


def test_a_users_token_is_refused_even_the_owners(api, claude_agent):
    before = state(claude_agent)

    response = api.post(url(claude_agent), {"event": "SessionStart", "payload": {}})

    assert response.status_code == 403
    assert error_of(response)["code"] == "PERMISSION_DENIED"
    assert "DISPATCH_MCP_TOKEN" in error_of(response)["message"]
    assert state(claude_agent) == before


def test_no_token_is_401_and_a_revoked_one_too(claude_agent, agent_api):
    anonymous = Api("")
    anonymous.headers = {}
    assert anonymous.post(url(claude_agent), {"event": "Stop", "payload": {}}).status_code == 401
    tokens.agent_tokens_revoke(agent=claude_agent)
    assert agent_api.post(url(claude_agent), {"event": "Stop", "payload": {}}).status_code == 401


def test_an_unknown_agent_is_404(agent_api):
    response = agent_api.post("/api/v1/agents/agt_000000000000/hooks", {"event": "Stop", "payload": {}})
    assert response.status_code == 404


def test_another_users_agent_is_404(outsider, make_agent, agent_api):
    theirs = force_status(make_agent(outsider, type="claude", name="theirs"), "running")
    assert agent_api.post(url(theirs), {"event": "Stop", "payload": {}}).status_code == 404


@pytest.mark.parametrize(
    "body",
    [
        {"event": "Nope", "payload": {}},
        {"event": "sessionstart", "payload": {}},
        {"payload": {}},
        {"event": "Stop", "payload": [1, 2]},
        {"event": "Stop", "payload": "text"},
        {"event": "Stop", "payload": 3},
        {"event": "Stop"},
        {"event": 7, "payload": {}},
        {"event": "Stop", "payload": {"last_assistant_message": "x" * (1024 * 1024)}},
    ],
)
def test_a_bad_body_is_400_and_changes_nothing(agent_api, claude_agent, body):
    before = state(claude_agent)

    response = agent_api.post(url(claude_agent), body)

    assert response.status_code == 400, response.content
    assert state(claude_agent) == before


def test_a_nul_in_the_payload_is_400_and_changes_nothing(agent_api, claude_agent):
    before = state(claude_agent)
    response = agent_api.client.post(
        url(claude_agent),
        '{"event": "Stop", "payload": {"last_assistant_message": "a\\u0000b"}}',
        content_type="application/json",
        headers=agent_api.headers,
    )
    assert response.status_code == 400
    assert state(claude_agent) == before


def test_a_null_payload_is_taken(agent_api, claude_agent):
    response = agent_api.post(url(claude_agent), {"event": "Stop", "payload": None})
    assert response.status_code == 200
    assert latest(claude_agent) == ("done", "turn finished")


# --- what each event does ------------------------------------------------------------------------


def test_session_start_makes_the_session_ready_once(agent_api, claude_agent):
    report(agent_api, claude_agent, "SessionStart", source="startup")
    claude_agent.refresh_from_db()
    first = claude_agent.ready_at
    assert latest(claude_agent) == ("system", "ready (SessionStart)")

    report(agent_api, claude_agent, "SessionStart", source="compact")

    claude_agent.refresh_from_db()
    assert claude_agent.ready_at == first  # a compaction does not start a new session
    assert latest(claude_agent) == ("system", "session restarted (compact)")


def test_user_prompt_submit_delivers_the_pasted_message_it_carries(agent_api, claude_agent):
    report(agent_api, claude_agent, "SessionStart", source="startup")
    message = pasted(claude_agent, "hello marker-alpha-1")
    message.refresh_from_db()
    assert message.status == "queued" and message.pasted_at is not None  # pasted is not delivered

    report(agent_api, claude_agent, "UserPromptSubmit", prompt="hello marker-alpha-1")

    message.refresh_from_db()
    assert message.status == "delivered" and message.delivered_at is not None
    delivery = AgentEvent.objects.get(agent=claude_agent, message="message delivered")
    assert delivery.metadata["message_id"] == message.pk and delivery.metadata["hook"] == "UserPromptSubmit"
    assert latest(claude_agent) == ("working", "working on the message")


@pytest.mark.parametrize(
    ("content", "prompt"),
    [
        ("!echo x", " !echo x"),  # Claude keeps the neutralising space
        ("!echo x", "!echo x"),  # codex trims it
        ("/exit", " /exit"),
        ("line one\r\nline two\n", "line one\nline two"),  # line endings and the trailing newline
        ("  spaced out  ", "spaced out"),
    ],
)
def test_the_prompt_matches_the_message_as_the_cli_reports_it(agent_api, claude_agent, content, prompt):
    message = pasted(claude_agent, content)

    report(agent_api, claude_agent, "UserPromptSubmit", prompt=prompt)

    message.refresh_from_db()
    assert message.status == "delivered"


def test_a_prompt_matching_no_pasted_message_was_typed_in_the_terminal(agent_api, claude_agent):
    waiting = messages.message_send(recipient=claude_agent, content="not pasted yet", sender_user=claude_agent.owner)
    other = pasted(claude_agent, "the pasted one")

    report(agent_api, claude_agent, "UserPromptSubmit", prompt="not pasted yet")

    waiting.refresh_from_db()
    other.refresh_from_db()
    assert waiting.status == "queued" and other.status == "queued"  # a queued, unpasted text is not taken
    assert latest(claude_agent) == ("working", "prompt typed in the terminal")
    event = AgentEvent.objects.filter(agent=claude_agent).latest("pk")
    assert event.metadata == {"hook": "UserPromptSubmit", "prompt": "not pasted yet"}


def test_pre_tool_use_is_working_on_the_named_tool_with_its_input_cut_to_2_kb(agent_api, claude_agent):
    report(agent_api, claude_agent, "PreToolUse", tool_name="Bash", tool_input={"command": "echo hi > out.txt"})
    assert latest(claude_agent) == ("working", "tool: Bash")
    event = AgentEvent.objects.filter(agent=claude_agent).latest("pk")
    assert event.metadata == {"hook": "PreToolUse", "tool_name": "Bash", "tool_input": {"command": "echo hi > out.txt"}}

    report(agent_api, claude_agent, "PreToolUse", tool_name="Write", tool_input={"content": "y" * 10_000})

    event = AgentEvent.objects.filter(agent=claude_agent).latest("pk")
    assert isinstance(event.metadata["tool_input"], str) and len(event.metadata["tool_input"]) == 2048


def test_a_permission_request_is_blocked_waiting_for_approval_and_post_tool_use_resumes(agent_api, claude_agent):
    report(agent_api, claude_agent, "SessionStart", source="startup")
    suggestions = [{"type": "addDirectories", "directories": ["/w"], "destination": "session"}]
    report(
        agent_api,
        claude_agent,
        "PermissionRequest",
        tool_name="Bash",
        tool_input={"command": "echo perm > p.txt", "description": "write p"},
        permission_suggestions=suggestions,
    )
    assert latest(claude_agent) == ("blocked", "waiting for approval: Bash echo perm > p.txt")
    event = AgentEvent.objects.filter(agent=claude_agent).latest("pk")
    assert event.metadata["permission_suggestions"] == suggestions
    assert event.metadata["tool_input"]["command"] == "echo perm > p.txt"
    assert cli_hooks.hook_state(claude_agent) == "blocked"

    report(agent_api, claude_agent, "Notification", notification_type="permission_prompt", message="Claude needs")
    assert latest(claude_agent)[0] == "blocked"
    assert AgentEvent.objects.filter(agent=claude_agent, type="blocked").count() == 1  # already blocked

    report(agent_api, claude_agent, "PostToolUse", tool_name="Bash", tool_response={"stdout": ""})
    assert latest(claude_agent) == ("working", "approved in the terminal")
    count = AgentEvent.objects.filter(agent=claude_agent).count()

    report(agent_api, claude_agent, "PostToolUse", tool_name="Bash", tool_response={"stdout": ""})
    assert AgentEvent.objects.filter(agent=claude_agent).count() == count  # not blocked: nothing


def test_notifications_say_blocked_or_idle(agent_api, claude_agent):
    report(agent_api, claude_agent, "Notification", notification_type="permission_prompt", message="Claude needs it")
    assert latest(claude_agent) == ("blocked", "waiting for approval: Claude needs it")
    report(agent_api, claude_agent, "Notification", notification_type="idle_prompt", message="waiting")
    assert latest(claude_agent) == ("idle", "idle: waiting for input")


def test_stop_is_done_with_the_last_answer(agent_api, claude_agent):
    report(agent_api, claude_agent, "Stop", last_assistant_message="OK." + "z" * 5000, stop_hook_active=False)
    assert latest(claude_agent) == ("done", "turn finished")
    event = AgentEvent.objects.filter(agent=claude_agent).latest("pk")
    assert event.metadata["last_assistant_message"].startswith("OK.")
    assert len(event.metadata["last_assistant_message"]) == cli_hooks.TEXT_LIMIT


def test_session_end_is_a_system_event_with_the_reason_and_the_agent_keeps_its_status(agent_api, claude_agent):
    report(agent_api, claude_agent, "SessionEnd", reason="prompt_input_exit")
    assert latest(claude_agent) == ("system", "session ended (prompt_input_exit)")
    assert Agent.objects.get(pk=claude_agent.pk).status == "running"  # the supervisor judges the pane


@pytest.mark.django_db(transaction=True)
def test_states_are_broadcast_like_any_event(agent_api, claude_agent, live_events):
    events = live_events(claude_agent.owner)
    report(agent_api, claude_agent, "PreToolUse", tool_name="Bash", tool_input={"command": "ls"})
    frames = events.drain()
    assert any(f["event"] == "agent.event" and f["data"]["message"] == "tool: Bash" for f in frames)
    assert any(f["event"] == "agent.upsert" and f["data"]["latest_event_type"] == "working" for f in frames)


def test_hook_state_counts_only_the_current_sessions_hook_events(agent_api, claude_agent):
    report(agent_api, claude_agent, "PreToolUse", tool_name="Bash", tool_input={})
    assert cli_hooks.hook_state(claude_agent) is None  # no session ready yet
    report(agent_api, claude_agent, "SessionStart", source="startup")
    claude_agent.refresh_from_db()
    assert cli_hooks.hook_state(claude_agent) is None  # the working before it was another session's
    report(agent_api, claude_agent, "Stop", last_assistant_message="x")
    assert cli_hooks.hook_state(claude_agent) == "done"
