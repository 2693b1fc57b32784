"""CLI agents that misbehave, and messages that look like commands (agents/cli.py,
agents/supervisor.py; docs/agents.md), against real tmux and real programs.

Found by running the real CLIs in Dispatch: a CLI that exits at start must not take the
tmux server (and every other agent) with it; a message starting with ``!`` or ``/`` must
reach an ``llm`` CLI as text; a stop asks the CLI to exit its own way before any kill.
Every test runs a private tmux server (``private_tmux``) killed afterwards; the fake CLIs
are small Python programs configured as ``DISPATCH_AGENT_TYPES`` types. Waiting is
polling with a deadline.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from agents import cli, messages
from agents.models import Agent, AgentEvent, AgentMessage
from agents.tmux import TmuxRunner
from agents.types import parse_agent_types
from tests.agents.test_cli_agents import launch, supervise_until, wait_for

pytestmark = [
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
    pytest.mark.django_db,
]

SHELL = {"argv": ["bash", "--norc", "-i"], "kind": "shell", "stop": ["C-c", {"text": "exit"}, "Enter"]}

# Prints a line, then exits 1 a moment later: long enough for the supervisor to see a live
# pane and wait for it to go quiet, short enough to die before the paste.
CRASHING = "import time; print('fatal: no configuration found', flush=True); time.sleep(0.3); raise SystemExit(1)"

# Turns on bracketed paste, as the real CLIs do, then appends every byte it reads to a file.
RECORDER = """\
import os, sys
sys.stdout.write("\\x1b[?2004hrecorder ready\\n")
sys.stdout.flush()
while True:
    data = os.read(0, 65536)
    if not data:
        break
    with open(sys.argv[1], "ab") as record:
        record.write(data)
"""

# Ignores the first SIGINT (as Claude Code ignores one C-c) and exits 0 on the second.
STUBBORN = """\
import signal, sys, time
count = 0
def interrupted(signum, frame):
    global count
    count += 1
    print(f"interrupt {count}", flush=True)
    if count >= 2:
        sys.exit(0)
signal.signal(signal.SIGINT, interrupted)
print("stubborn ready", flush=True)
while True:
    time.sleep(1)
"""


@pytest.fixture
def runner(private_tmux: TmuxRunner) -> TmuxRunner:
    """The private tmux server ``cli`` uses in this test (``tests/conftest.py``)."""
    return private_tmux


@pytest.fixture
def fake_clis(tmp_path: Path, settings) -> Path:
    """Types ``crashing``, ``recorder`` and ``stubborn`` (kind ``llm``) plus ``shell``; the
    directory the recorder writes ``<agent id>.in`` to."""
    records = tmp_path / "records"
    records.mkdir()
    (tmp_path / "recorder.py").write_text(RECORDER)
    (tmp_path / "stubborn.py").write_text(STUBBORN)
    settings.AGENT_TYPES = parse_agent_types(
        {
            "crashing": {"argv": [sys.executable, "-c", CRASHING], "kind": "llm"},
            "recorder": {"argv": [sys.executable, str(tmp_path / "recorder.py"), f"{records}/{{agent_id}}.in"]},
            "stubborn": {"argv": [sys.executable, str(tmp_path / "stubborn.py")], "stop": ["C-c", "C-c"]},
            "shell": SHELL,
        }
    )
    return records


def status_of(agent: Agent) -> str:
    return Agent.objects.get(pk=agent.pk).status


def send(agent: Agent, content: str) -> AgentMessage:
    return messages.message_send(recipient=agent, content=content, sender_user=agent.owner)


def delivered(message: AgentMessage) -> bool:
    message.refresh_from_db()
    return message.status == "delivered"


def delivery_event(message: AgentMessage) -> AgentEvent:
    return AgentEvent.objects.get(agent_id=message.recipient_agent_id, metadata__message_id=message.pk)


# --- a CLI that dies at start -------------------------------------------------------------------


def test_a_cli_that_dies_at_start_is_an_error_and_its_neighbour_lives_on(owner, runner, workdir, fake_clis):
    bystander = launch(owner, runner, workdir)
    supervise_until(runner, lambda: not messages.messages_pending(agent=bystander), "the bystander settled")
    crashing = cli.agent_launch(owner=owner, type="crashing", name="c", prompt="hello", cwd=workdir, runner=runner)
    name = cli.session_name(crashing)
    wait_for(lambda: "fatal: no configuration found" in runner.capture(name), "the CLI's last words")

    # The supervisor sees a live pane, waits for it to go quiet, and pastes the prompt as
    # the CLI exits: a paste into the dead pane would crash tmux and every session on it.
    supervise_until(runner, lambda: status_of(crashing) == "error", "the crashed CLI marked error")

    crashing.refresh_from_db()
    assert "exit status 1" in crashing.last_error
    assert "fatal: no configuration found" in crashing.last_error
    assert "session missing" not in crashing.last_error
    prompt = AgentMessage.objects.get(recipient_agent=crashing)
    assert prompt.status == "failed" and "exit status 1" in prompt.error
    assert not runner.exists(name)
    # The bystander on the same tmux server is untouched and still takes messages.
    bystander_session = cli.session_name(bystander)
    assert status_of(bystander) == "running"
    assert runner.exists(bystander_session) and not runner.pane_state(bystander_session).dead
    still = send(bystander, "echo still-$((40+2))")
    supervise_until(runner, lambda: delivered(still), "a message to the bystander")
    wait_for(lambda: "still-42" in runner.capture(bystander_session), "the bystander's output")
    assert status_of(bystander) == "running"


# --- messages are text --------------------------------------------------------------------------


def recorded(records: Path, agent: Agent) -> str:
    path = records / f"{agent.pk}.in"
    return path.read_text() if path.exists() else ""


def test_a_message_starting_with_a_slash_or_a_bang_reaches_an_llm_cli_as_text(owner, runner, workdir, fake_clis):
    agent = cli.agent_launch(owner=owner, type="recorder", name="r", prompt="", cwd=workdir, runner=runner)
    wait_for(lambda: "recorder ready" in runner.capture(cli.session_name(agent)), "the recorder")

    slash = send(agent, "/exit")
    supervise_until(runner, lambda: delivered(slash), "the /exit message delivered")
    wait_for(lambda: recorded(fake_clis, agent).endswith("\n"), "the recorder's input")
    # One bracketed paste, then Enter: the CLI sees " /exit", which no CLI reads as a command.
    assert recorded(fake_clis, agent) == "\x1b[200~ /exit\x1b[201~\n"
    assert delivery_event(slash).metadata["neutralised"] is True
    assert delivery_event(slash).metadata["pasted_start"] == " /exit"
    slash.refresh_from_db()
    assert slash.content == "/exit"  # the row keeps what the sender wrote

    bang = send(agent, "  !rm -rf ~\nand a second line")
    supervise_until(runner, lambda: delivered(bang), "the ! message delivered")
    wait_for(lambda: recorded(fake_clis, agent).count("\x1b[201~") == 2, "the second paste")
    assert recorded(fake_clis, agent).endswith("\x1b[200~   !rm -rf ~\nand a second line\x1b[201~\n")
    assert delivery_event(bang).metadata["neutralised"] is True

    plain = send(agent, "please /exit later")
    supervise_until(runner, lambda: delivered(plain), "the plain message delivered")
    wait_for(lambda: recorded(fake_clis, agent).count("\x1b[201~") == 3, "the third paste")
    assert recorded(fake_clis, agent).endswith("\x1b[200~please /exit later\x1b[201~\n")
    assert "neutralised" not in delivery_event(plain).metadata


def test_an_escape_cannot_hide_a_leading_slash_from_the_neutraliser(owner, runner, workdir, fake_clis):
    agent = cli.agent_launch(owner=owner, type="recorder", name="r", prompt="", cwd=workdir, runner=runner)
    wait_for(lambda: "recorder ready" in runner.capture(cli.session_name(agent)), "the recorder")

    # The ESC is removed before pasting (it could end the bracketed paste): the / then leads.
    message = send(agent, "\x1b/exit")
    supervise_until(runner, lambda: delivered(message), "the message delivered")

    wait_for(lambda: recorded(fake_clis, agent).endswith("\n"), "the recorder's input")
    assert recorded(fake_clis, agent) == "\x1b[200~ /exit\x1b[201~\n"


def test_a_shell_agents_message_is_the_command_itself(owner, runner, workdir, fake_clis):
    agent = launch(owner, runner, workdir)
    supervise_until(runner, lambda: not messages.messages_pending(agent=agent), "the shell settled")

    message = send(agent, "/bin/echo slash-$((2+3))")
    supervise_until(runner, lambda: delivered(message), "the message delivered")

    wait_for(lambda: "slash-5" in runner.capture(cli.session_name(agent)), "the command's output")
    assert "neutralised" not in delivery_event(message).metadata


# --- stop asks the CLI to exit its own way ------------------------------------------------------


def test_a_cli_that_needs_two_interrupts_stops_without_a_kill(owner, runner, workdir, fake_clis, settings):
    settings.AGENT_STOP_GRACE = 60.0  # a kill would come far too late for this test
    settings.AGENT_STOP_TIMEOUT = 120.0
    agent = cli.agent_launch(owner=owner, type="stubborn", name="s", prompt="", cwd=workdir, runner=runner)
    name = cli.session_name(agent)
    wait_for(lambda: "stubborn ready" in runner.capture(name), "the CLI's SIGINT handler")

    assert cli.agent_stop(agent=agent, runner=runner).status == "stopping"
    supervise_until(runner, lambda: status_of(agent) == "stopped", "stopped by its two interrupts")

    agent.refresh_from_db()
    assert agent.latest_event_message == "session ended (exit status 0)"
    notes = list(AgentEvent.objects.filter(agent=agent).values_list("message", flat=True))
    assert not [note for note in notes if "killed" in note]
    assert not runner.exists(name)


def test_the_default_shell_stop_ends_bash_without_a_kill(owner, runner, workdir, settings):
    settings.AGENT_STOP_GRACE = 60.0
    settings.AGENT_STOP_TIMEOUT = 120.0
    agent = launch(owner, runner, workdir)
    supervise_until(runner, lambda: not messages.messages_pending(agent=agent), "the shell settled")

    cli.agent_stop(agent=agent, runner=runner)
    supervise_until(runner, lambda: status_of(agent) == "stopped", "stopped by C-c and exit")

    notes = list(AgentEvent.objects.filter(agent=agent).values_list("message", flat=True))
    assert any(note.startswith("session ended") for note in notes)
    assert not [note for note in notes if "killed" in note]


# --- Dispatch's own tmux server ----------------------------------------------------------------


def test_without_a_socket_setting_agents_run_on_dispatchs_own_tmux_server(settings):
    settings.TMUX_SOCKET = ""
    assert cli.default_runner().socket_name == "dispatch"  # never the user's default server
    settings.TMUX_SOCKET = "elsewhere"
    assert cli.default_runner().socket_name == "elsewhere"
