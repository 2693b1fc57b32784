"""A CLI agent's hooks (agents/cli_hooks.py, agents/hook_api.py; docs/agents.md#hooks):
who may report, what a bad report changes (nothing), and what each event does to the
agent's readiness, messages and state. The payloads are the ones FINDINGS.md
(tests/agents/real_cli) recorded from Claude Code 2.1.328 and codex 0.171.0."""

from __future__ import annotations

import shlex
import sys
from datetime import timedelta
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
        ("a\tb\n\tindented", "a    b\n    indented"),  # Claude turns a tab into four spaces
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
    payload = {
        "hook_event_name": "PermissionRequest",
        "tool_name": "Bash",
        "tool_input": {"command": "echo perm > p.txt", "description": "write p"},
        "permission_suggestions": suggestions,
    }
    answer = agent_api.post(url(claude_agent), {"event": "PermissionRequest", "payload": payload}).json()
    # Pending: no output yet, the hook client waits for the approval (docs/agents.md#approvals).
    assert answer["output"] is None and answer["approval"]["status"] == "pending"
    assert latest(claude_agent) == ("blocked", "approval requested: Bash `echo perm > p.txt`")
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


# --- delivery through the supervisor (real tmux, a stand-in CLI with hooks) ----------------------
#
# The stand-in prints a screen, then echoes what is pasted (``cat``): enough to see whether
# and when the supervisor pastes; its hooks are reported straight to ``hook_event_record``
# (the real CLIs do it through the hook client in tests/agents/real_cli).

CLAUDE_SCREEN = "printf '%s\\n' '> ' 'bypass permissions on'"
CODEX_READY = "printf '%s\\n' '› Ask Codex to do anything' '  gpt-fake default'"
CODEX_DIALOG = "printf '%s\\n' 'Trust this folder?' '› 1. Trust and continue' '  2. Back'"


@pytest.fixture
def hooked(settings: Any, private_tmux: Any, owner: Any, workdir: str, make_agent: Any) -> Any:
    """``start(family, screen)``: a running agent of a type with ``hooks: family`` whose pane
    runs ``sh -c '<screen>; exec cat'`` on the test's private tmux server."""
    from agents.types import parse_agent_types

    settings.AGENT_TYPES = parse_agent_types(
        {
            "hooked-claude": {"argv": ["sh"], "kind": "llm", "hooks": "claude"},
            "hooked-codex": {"argv": ["sh"], "kind": "llm", "hooks": "codex"},
            "plain": {"argv": ["sh"], "kind": "llm"},
        }
    )

    def start(type: str, screen: str = CLAUDE_SCREEN) -> Agent:
        from agents import cli
        from core.services import instance_identity_get

        agent = make_agent(owner, type=type, name="h")
        private_tmux.start(
            session_name=cli.session_name(agent),
            instance_id=instance_identity_get().instance_id,
            argv=["sh", "-c", f"{screen}; exec cat"],
            cwd=workdir,
            env={},
        )
        wait_for(lambda: private_tmux.capture(cli.session_name(agent)).strip(), "the stand-in's screen")
        return force_status(agent, "running")

    return start


def wait_for(condition: Any, what: str, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def supervise(private_tmux: Any) -> None:
    from agents import supervisor

    supervisor.supervise_once(runner=private_tmux)


def pane(private_tmux: Any, agent: Agent) -> str:
    from agents import cli

    return str(private_tmux.capture(cli.session_name(agent)))


def pane_name(agent: Agent) -> str:
    from agents import cli

    return cli.session_name(agent)


def send(agent: Agent, content: str) -> AgentMessage:
    return messages.message_send(recipient=agent, content=content, sender_user=agent.owner)


def hook(agent: Agent, event: str, **payload: Any) -> None:
    agent.refresh_from_db()
    cli_hooks.hook_event_record(agent=agent, event=event, payload={"hook_event_name": event, **payload})


def fresh(message: AgentMessage) -> AgentMessage:
    message.refresh_from_db()
    return message


def test_nothing_is_pasted_before_session_start_then_pasted_is_not_delivered(hooked, private_tmux):
    agent = hooked("hooked-claude")
    message = send(agent, "first marker-one")

    supervise(private_tmux)
    assert fresh(message).pasted_at is None and "marker-one" not in pane(private_tmux, agent)

    hook(agent, "SessionStart", source="startup")
    wait_for(lambda: (supervise(private_tmux), fresh(message).pasted_at)[1], "the paste")

    wait_for(lambda: "marker-one" in pane(private_tmux, agent), "the text in the pane")
    assert fresh(message).status == "queued"  # pasted, not yet taken
    hook(agent, "UserPromptSubmit", prompt="first marker-one")
    assert fresh(message).status == "delivered"


def test_a_message_sent_while_working_waits_for_the_turn_to_end(hooked, private_tmux):
    agent = hooked("hooked-claude")
    hook(agent, "SessionStart", source="startup")
    hook(agent, "UserPromptSubmit", prompt="typed by a person")  # working
    message = send(agent, "second marker-two")

    for _ in range(3):
        supervise(private_tmux)
    assert fresh(message).pasted_at is None and "marker-two" not in pane(private_tmux, agent)

    hook(agent, "Stop", last_assistant_message="done")
    wait_for(lambda: (supervise(private_tmux), fresh(message).pasted_at)[1], "the paste after Stop")
    wait_for(lambda: "marker-two" in pane(private_tmux, agent), "the text in the pane")


def test_nothing_is_pasted_while_a_permission_prompt_is_on_screen(hooked, private_tmux):
    agent = hooked("hooked-claude")
    hook(agent, "SessionStart", source="startup")
    hook(agent, "PermissionRequest", tool_name="Bash", tool_input={"command": "rm -rf build"})
    message = send(agent, "yes")

    for _ in range(3):
        supervise(private_tmux)
    assert fresh(message).pasted_at is None and fresh(message).status == "queued"

    hook(agent, "PostToolUse", tool_name="Bash")  # approved in the terminal: working
    supervise(private_tmux)
    assert fresh(message).pasted_at is None
    hook(agent, "Notification", notification_type="idle_prompt", message="waiting")
    wait_for(lambda: (supervise(private_tmux), fresh(message).pasted_at)[1], "the paste once idle")


def test_one_pasted_message_at_a_time_and_an_unconfirmed_one_fails_after_the_wait(hooked, private_tmux):
    from agents import supervisor

    agent = hooked("hooked-claude")
    hook(agent, "SessionStart", source="startup")
    first, second = send(agent, "one marker-3a"), send(agent, "two marker-3b")
    wait_for(lambda: (supervise(private_tmux), fresh(first).pasted_at)[1], "the first paste")

    supervise(private_tmux)
    assert fresh(second).pasted_at is None  # the first still waits for its UserPromptSubmit

    AgentMessage.objects.filter(pk=first.pk).update(
        pasted_at=fresh(first).pasted_at - timedelta(seconds=supervisor.DELIVERY_CONFIRM + 1)
    )
    supervise(private_tmux)
    assert fresh(first).status == "failed"
    assert fresh(first).error == (
        "the CLI did not take the message (no UserPromptSubmit within 20 s; a dialog may be open — see the pane)"
    )
    wait_for(lambda: (supervise(private_tmux), fresh(second).pasted_at)[1], "the second paste")


def test_a_late_confirmation_of_a_failed_message_does_not_deliver_it(hooked, private_tmux):
    agent = hooked("hooked-claude")
    hook(agent, "SessionStart", source="startup")
    message = send(agent, "late marker-4")
    wait_for(lambda: (supervise(private_tmux), fresh(message).pasted_at)[1], "the paste")
    messages.message_mark_failed(message=message, error="x")

    hook(agent, "UserPromptSubmit", prompt="late marker-4")

    assert fresh(message).status == "failed"
    assert latest(agent) == ("working", "prompt typed in the terminal")


def test_the_pane_watcher_leaves_a_hook_reported_state_alone(hooked, private_tmux, settings):
    from agents import supervisor

    settings.AGENT_IDLE_AFTER = 0
    agent = hooked("hooked-claude")
    hook(agent, "SessionStart", source="startup")
    hook(agent, "PermissionRequest", tool_name="Bash", tool_input={"command": "ls"})
    for index in range(3):  # the pane changes between passes (cat echoes what is typed)
        supervise(private_tmux)
        private_tmux.send_keys(pane_name(agent), ["x", "Enter"])
        wait_for(lambda index=index: pane(private_tmux, agent).count("x") >= index + 1, "the echo")

    assert not AgentEvent.objects.filter(agent=agent, metadata__source=supervisor.WATCHER).exists()
    assert latest(agent)[0] == "blocked"


def test_a_session_start_that_came_during_the_pass_already_silences_the_watcher(hooked, private_tmux):
    from agents import supervisor
    from core.services import instance_identity_get

    agent = hooked("hooked-claude")
    supervise(private_tmux)  # the watcher's first look: it records the pane's hash
    private_tmux.send_keys(pane_name(agent), ["x", "Enter"])  # the pane changes
    wait_for(lambda: "x" in pane(private_tmux, agent), "the echo")
    read_by_the_pass = Agent.objects.get(pk=agent.pk)  # ready_at still None in this copy
    hook(agent, "SessionStart", source="startup")

    supervisor._supervise_agent(
        agent=read_by_the_pass,
        runner=private_tmux,
        owned={pane_name(agent)},
        instance_id=instance_identity_get().instance_id,
    )

    assert not AgentEvent.objects.filter(agent=agent, metadata__source=supervisor.WATCHER).exists()


def test_codex_is_ready_by_its_input_line_before_its_lazy_session_start(hooked, private_tmux):
    ready = hooked("hooked-codex", CODEX_READY)
    dialog = hooked("hooked-codex", CODEX_DIALOG)
    to_ready, to_dialog = send(ready, "hello marker-5"), send(dialog, "hello marker-6")

    wait_for(lambda: (supervise(private_tmux), fresh(to_ready).pasted_at)[1], "the paste into the ready codex")
    for _ in range(2):
        supervise(private_tmux)
    assert fresh(to_dialog).pasted_at is None and "marker-6" not in pane(private_tmux, dialog)


def test_a_message_that_waited_a_minute_for_a_cli_never_ready_fails_saying_why(hooked, private_tmux):
    from agents import supervisor

    agent = hooked("hooked-codex", CODEX_DIALOG)
    stuck, later = send(agent, "hello marker-9"), send(agent, "later marker-9")
    supervise(private_tmux)
    assert fresh(stuck).status == "queued"

    AgentMessage.objects.filter(pk=stuck.pk).update(
        created_at=fresh(stuck).created_at - timedelta(seconds=supervisor.READY_WAIT + 1)
    )
    supervise(private_tmux)

    assert fresh(stuck).status == "failed" and fresh(stuck).pasted_at is None
    assert fresh(stuck).error == (
        "the CLI did not get ready within 60 s (no SessionStart hook; a dialog may be open, "
        "or its hooks cannot reach DISPATCH_URL — see the pane)"
    )
    assert fresh(later).status == "queued"  # its own minute has not passed
    assert "marker-9" not in pane(private_tmux, agent)


def test_a_claude_family_cli_is_not_ready_by_its_screen_alone(hooked, private_tmux):
    agent = hooked("hooked-claude", CODEX_READY)
    message = send(agent, "hello marker-7")
    for _ in range(3):
        supervise(private_tmux)
    assert fresh(message).pasted_at is None and fresh(message).status == "queued"
    assert "marker-7" not in pane(private_tmux, agent)


def test_a_type_without_hooks_keeps_pasted_as_delivered(hooked, private_tmux):
    agent = hooked("plain")
    message = send(agent, "plain marker-8")
    wait_for(lambda: (supervise(private_tmux), fresh(message).status == "delivered")[1], "the delivery")
    # pasted_at marks the paste (a takeover checks the pane for it); delivered needs no hook here
    assert fresh(message).pasted_at is not None
