"""CLI agents in tmux, what reaches the pane (agents/cli.py, docs/agents.md#the-supervisor):
messages delivered through the supervisor, the token in the environment, types from
``DISPATCH_AGENT_TYPES``. The supervisor's own work (the activity watcher, its lease,
stopping) is test_cli_supervisor.py.

Real tmux on a private server per test (the ``runner`` fixture of tests/agents/conftest.py).
"""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from agents import cli, messages, supervisor, tokens
from agents.models import Agent, AgentEvent, AgentMessage
from agents.types import parse_agent_types
from core.errors import DispatchError, InvalidRequest
from core.presence import HOSTNAME
from tests.agents.conftest import send, status_of
from tests.agents.test_cli_agents import launch, supervise_until, wait_dead, wait_for

pytestmark = [
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
    pytest.mark.django_db,
]


def delivered(message: AgentMessage) -> bool:
    message.refresh_from_db()
    return message.status == "delivered"


# --- messages --------------------------------------------------------------------------------


def test_the_prompt_is_the_first_message_queued_then_pasted_by_the_supervisor(owner, runner, workdir):
    agent = launch(owner, runner, workdir, prompt="echo first-$((20+1))")

    prompt = AgentMessage.objects.get(recipient_agent=agent)
    assert prompt.status == "queued" and prompt.sender_user == owner and prompt.content == "echo first-$((20+1))"
    supervise_until(runner, lambda: delivered(prompt), "the prompt delivered")
    wait_for(lambda: "first-21" in cli.pane_text(agent=agent, runner=runner), "its output in the pane view")
    assert AgentEvent.objects.filter(agent=agent, message="message delivered").exists()


def test_a_message_a_dead_supervisor_pasted_is_marked_delivered_not_pasted_again(owner, runner, workdir):
    # A supervisor SIGKILLed between its paste and ``delivered`` leaves the message queued
    # with ``pasted_at``; its tmux client may still have finished the paste.
    agent = launch(owner, runner, workdir, prompt="true")
    supervise_until(runner, lambda: delivered(AgentMessage.objects.get(recipient_agent=agent)), "the prompt")
    message = send(agent, "echo once-$((40+2))")
    assert messages.message_mark_pasted(message=message)
    runner.paste(cli.session_name(agent), message.content)  # what the dead one's client did
    wait_for(lambda: "once-42" in cli.pane_text(agent=agent, runner=runner), "the paste's output")

    supervise_until(runner, lambda: delivered(message), "the message marked delivered")
    # A fence: a second paste by those passes went in before it, so it prints before it.
    runner.paste(cli.session_name(agent), "echo fence-$((1+1))")
    wait_for(lambda: "fence-2" in cli.pane_text(agent=agent, runner=runner), "the fence's output")
    assert cli.pane_text(agent=agent, runner=runner).count("once-42") == 1
    event = AgentEvent.objects.filter(agent=agent, message="message delivered").latest("created_at")
    assert event.metadata.get("recovered") is True


def test_a_message_a_dead_supervisor_marked_but_never_pasted_is_pasted(owner, runner, workdir):
    agent = launch(owner, runner, workdir, prompt="true")
    supervise_until(runner, lambda: delivered(AgentMessage.objects.get(recipient_agent=agent)), "the prompt")
    message = send(agent, "echo late-$((40+3))")
    assert messages.message_mark_pasted(message=message)  # killed before its paste ran

    supervise_until(runner, lambda: delivered(message), "the message delivered")
    wait_for(lambda: "late-43" in cli.pane_text(agent=agent, runner=runner), "its output")
    assert cli.pane_text(agent=agent, runner=runner).count("late-43") == 1


def test_a_prompt_from_an_agent_is_sent_by_that_agent(owner, runner, workdir, make_agent):
    parent = make_agent(owner)
    agent = cli.agent_launch(
        owner=owner, type="shell", name="c", prompt="true", cwd=workdir, launched_by=parent, runner=runner
    )

    prompt = AgentMessage.objects.get(recipient_agent=agent)
    assert prompt.sender_agent == parent and prompt.sender_user is None


def test_a_multi_line_message_arrives_whole(owner, runner, workdir):
    agent = launch(owner, runner, workdir)
    text = "cat > notes.txt <<'END'\nline one\n  line two; with $HOME unexpanded\nEND"

    message = send(agent, text)
    supervise_until(runner, lambda: delivered(message), "the message delivered")

    target = Path(workdir) / "notes.txt"
    expected = "line one\n  line two; with $HOME unexpanded\n"
    wait_for(lambda: target.exists() and target.read_text() == expected, "the file written by the one command")


def test_a_100_kb_message_arrives_whole(owner, runner, workdir):
    agent = launch(owner, runner, workdir)
    body = "\n".join(f"{i:05d}-" + "x" * 93 for i in range(1000))  # 1,000 lines of 99 characters
    message = send(agent, f"cat > big.txt <<'END'\n{body}\nEND")
    assert len(message.content) > 100_000

    supervise_until(runner, lambda: delivered(message), "the message delivered")
    target = Path(workdir) / "big.txt"
    wait_for(lambda: target.exists() and target.stat().st_size == len(body) + 1, "the whole file", timeout=30)
    assert target.read_text() == body + "\n"


def test_a_pane_that_never_goes_quiet_still_gets_its_message_after_the_wait(owner, runner, workdir, monkeypatch):
    agent = launch(owner, runner, workdir)
    supervise_until(runner, lambda: not messages.messages_pending(agent=agent), "the prompt pasted")
    ticker = send(agent, "while true; do date +%s%N; sleep 0.1; done")
    supervise_until(runner, lambda: delivered(ticker), "the ticking loop started")
    waiting = send(agent, "echo never-quiet")
    supervisor.supervise_once(runner=runner)
    assert not delivered(waiting)  # the pane keeps changing: not quiet, not waited long enough

    AgentMessage.objects.filter(pk=waiting.pk).update(created_at=timezone.now() - timedelta(seconds=11))
    supervise_until(runner, lambda: delivered(waiting), "the message pasted anyway")


def test_queued_messages_fail_when_the_agent_stops_first(owner, runner, workdir):
    agent = launch(owner, runner, workdir)
    message = send(agent, "echo never")

    cli.agent_stop(agent=agent, runner=runner)

    message.refresh_from_db()
    assert message.status == "failed" and message.error == "agent stopped"
    with pytest.raises(DispatchError):
        send(agent, "echo refused")


def test_queued_messages_fail_when_the_pane_dies(owner, runner, workdir):
    agent = launch(owner, runner, workdir)
    runner.paste(cli.session_name(agent), "exit 0")
    wait_dead(runner, agent)
    message = send(agent, "echo too late")

    supervisor.supervise_once(runner=runner)

    message.refresh_from_db()
    assert status_of(agent) == "stopped"
    assert message.status == "failed" and message.error == "agent stopped"


def test_sending_a_message_rings_the_hosts_doorbell(owner, workdir, make_agent, django_capture_on_commit_callbacks):
    import asyncio

    from channels.layers import get_channel_layer

    agent = make_agent(owner, type="shell")  # creating: accepts messages
    layer = get_channel_layer()
    loop = asyncio.new_event_loop()
    try:
        channel = loop.run_until_complete(layer.new_channel())
        group = messages.doorbell_group(HOSTNAME)
        assert len(group) < 100 and all(c.isalnum() or c in "._-" for c in group)
        loop.run_until_complete(layer.group_add(group, channel))
        with django_capture_on_commit_callbacks(execute=True):
            send(agent, "echo ring")
        received = loop.run_until_complete(asyncio.wait_for(layer.receive(channel), 2))
        assert received == {"type": "cli.doorbell"}
    finally:
        loop.close()


# --- tokens and environment ------------------------------------------------------------------


def test_the_token_is_in_the_environment_only_and_works_while_running(owner, runner, workdir):
    agent = launch(owner, runner, workdir, prompt='echo "len=${#DISPATCH_MCP_TOKEN} mcp=$DISPATCH_MCP_URL"')
    name = cli.session_name(agent)
    supervise_until(runner, lambda: "len=43 mcp=" in runner.capture(name), "the token's length")
    assert f"len=43 mcp={cli.mcp_url()}" in runner.capture(name)

    # Read the token back from the pane's process environment, and check argv never had it.
    pid = runner.pane_state(name).pid
    assert pid is not None
    environ = dict(
        item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in item
    )
    token = environ["DISPATCH_MCP_TOKEN"]
    assert len(token) == 43 and environ["DISPATCH_AGENT_ID"] == agent.pk
    assert token not in Path(f"/proc/{pid}/cmdline").read_bytes().decode()
    started = subprocess.run(
        ["tmux", "-L", runner.socket_name, "list-panes", "-a", "-F", "#{pane_start_command}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert token not in started
    authenticated = tokens.agent_token_authenticate(token)
    assert authenticated is not None and authenticated.pk == agent.pk

    cli.agent_stop(agent=agent, runner=runner)
    assert status_of(agent) == "stopping"
    assert tokens.agent_token_authenticate(token) is None  # at the stop request, not once stopped
    supervise_until(runner, lambda: status_of(agent) == "stopped", "stopped", timeout=15)
    assert tokens.agent_token_authenticate(token) is None


def test_a_dead_pane_revokes_the_token(owner, runner, workdir):
    agent = launch(owner, runner, workdir)
    assert agent.tokens.filter(revoked_at__isnull=True).count() == 1
    runner.paste(cli.session_name(agent), "exit 3")
    wait_dead(runner, agent)

    supervisor.supervise_once(runner=runner)

    assert status_of(agent) == "error"
    assert agent.tokens.filter(revoked_at__isnull=True).count() == 0


# --- types from DISPATCH_AGENT_TYPES ---------------------------------------------------------


@pytest.fixture
def fake_llm(tmp_path: Path, settings) -> Path:
    """A fake ``llm`` CLI on disk recording its argv and environment, configured as type ``fake``."""
    record = tmp_path / "records"
    record.mkdir()
    script = tmp_path / "fake-llm"
    script.write_text(
        "#!/bin/sh\n"
        f'out="{record}/$DISPATCH_AGENT_ID"\n'
        'printf "%s\\n" "$@" > "$out.argv"\n'
        # Written whole, then renamed: once the .env file exists both records are complete.
        'env > "$out.env.part" && mv "$out.env.part" "$out.env"\n'
        "echo fake-llm ready\n"
        "exec cat\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    settings.AGENT_TYPES = parse_agent_types(
        {
            "fake": {
                "argv": [str(script), "--mcp", "{mcp_url}", "--id={agent_id}", "printf a;"],
                "full_access_argv": [str(script), "--yolo", "{agent_id}"],
                "kind": "llm",
                "env": {"FAKE_CONFIG": '{"url": "{mcp_url}"}'},
            },
            "ghost": {"argv": ["dispatch-no-such-program-xyz", "-i"], "kind": "llm"},
            "shell": {"argv": ["bash", "--norc", "-i"], "kind": "shell"},
        }
    )
    return record


def _records(record: Path, agent: Agent) -> tuple[list[str], dict[str, str]]:
    argv_file, env_file = record / f"{agent.pk}.argv", record / f"{agent.pk}.env"
    wait_for(env_file.exists, "the fake CLI's records")
    env = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line)
    return argv_file.read_text().splitlines(), env


def test_an_llm_type_runs_its_argv_with_placeholders_filled_and_the_env(owner, runner, workdir, fake_llm, settings):
    agent = cli.agent_launch(owner=owner, type="fake", name="f", prompt="hello fake", cwd=workdir, runner=runner)

    assert agent.status == "running"
    argv, env = _records(fake_llm, agent)
    mcp = f"{settings.PUBLIC_URL}/mcp"
    assert argv == ["--mcp", mcp, f"--id={agent.pk}", "printf a;"]
    assert env["DISPATCH_AGENT_ID"] == agent.pk and env["DISPATCH_MCP_URL"] == mcp
    assert env["DISPATCH_URL"] == settings.PUBLIC_URL and len(env["DISPATCH_MCP_TOKEN"]) == 43
    assert json.loads(env["FAKE_CONFIG"]) == {"url": mcp}
    assert env["PWD"] == workdir
    # The prompt is pasted into the CLI (cat echoes it back).
    prompt = AgentMessage.objects.get(recipient_agent=agent)
    supervise_until(runner, lambda: delivered(prompt), "the prompt delivered")
    wait_for(lambda: cli.pane_text(agent=agent, runner=runner).count("hello fake") >= 1, "the prompt in the pane")


def test_full_access_uses_the_full_access_argv(owner, runner, workdir, fake_llm):
    agent = cli.agent_launch(
        owner=owner, type="fake", name="f", prompt="", cwd=workdir, full_access=True, runner=runner
    )

    argv, _ = _records(fake_llm, agent)
    assert argv == ["--yolo", agent.pk]


def test_a_type_whose_program_is_missing_is_refused_at_launch(owner, runner, workdir, fake_llm):
    with pytest.raises(InvalidRequest) as refused:
        cli.agent_launch(owner=owner, type="ghost", name="g", prompt="hi", cwd=workdir, runner=runner)

    assert "dispatch-no-such-program-xyz" in refused.value.message
    assert not Agent.objects.filter(owner=owner).exists()
    assert cli.is_cli_type("ghost") and not cli.is_cli_type("expert")


def test_an_unknown_type_and_a_bad_prompt_create_nothing(owner, runner, workdir):
    with pytest.raises(InvalidRequest):
        cli.agent_launch(owner=owner, type="nope", name="g", prompt="hi", cwd=workdir, runner=runner)
    with pytest.raises(InvalidRequest):
        cli.agent_launch(owner=owner, type="shell", name="g", prompt="nul\x00here", cwd=workdir, runner=runner)
    assert not Agent.objects.filter(owner=owner).exists()
    assert runner.owned_sessions(services_instance_id()) == []


def services_instance_id() -> str:
    from core.services import instance_identity_get

    return instance_identity_get().instance_id
