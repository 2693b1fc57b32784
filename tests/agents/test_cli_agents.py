"""CLI agents in tmux (agents/cli.py, docs/agents.md), against real tmux.

Every test runs a private tmux server (``tmux -L <unique name>``) killed afterwards; the
API is pointed at it through ``cli.runner_factory``. Waiting is polling with a deadline.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable

import pytest

from agents import cli, supervisor
from agents.models import Agent, AgentEvent
from agents.tmux import TmuxError, TmuxRunner
from core.services import instance_identity_get
from tests.agents.conftest import force_status

pytestmark = [
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
    pytest.mark.django_db,
]


@pytest.fixture
def runner(private_tmux: TmuxRunner) -> TmuxRunner:
    """The private tmux server ``cli`` uses in this test (``tests/conftest.py``)."""
    return private_tmux


def wait_for(condition: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def launch(owner, runner: TmuxRunner, workdir: str, prompt: str = "") -> Agent:
    """Launch a shell agent and wait until its shell shows something (its prompt): a stop's
    Ctrl-C sent while the pane's program is still starting would end it before bash runs."""
    agent = cli.agent_launch(owner=owner, type="shell", name="sh", prompt=prompt, cwd=workdir, runner=runner)
    if agent.status == "running":
        wait_for(lambda: runner.capture(cli.session_name(agent)).strip(), "the shell to start")
    return agent


def supervise_until(runner: TmuxRunner, condition: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    """Run supervisor passes (delivering messages, reconciling) until ``condition()`` holds."""

    def check() -> object:
        supervisor.supervise_once(runner=runner)
        return condition()

    wait_for(check, what, timeout)


def wait_dead(runner: TmuxRunner, agent: Agent) -> None:
    wait_for(lambda: runner.pane_state(cli.session_name(agent)).dead, "the pane to die")


def test_it_launches_a_shell_agent_running_with_its_prompt_typed_in(owner, runner, workdir):
    agent = launch(owner, runner, workdir, prompt="echo hello-$((40+2))")

    assert agent.status == "running"
    assert agent.host and agent.cwd == workdir
    name = cli.session_name(agent)
    assert name == f"dispatch_{agent.pk}"
    assert runner.owned_sessions(instance_identity_get().instance_id) == [name]
    supervise_until(runner, lambda: "hello-42" in cli.pane_text(agent=agent, runner=runner), "the prompt's output")
    assert AgentEvent.objects.filter(agent=agent, type="system", message="session started").exists()


def test_it_gives_the_session_the_agent_id_and_url_in_its_environment(owner, runner, workdir, settings):
    agent = launch(owner, runner, workdir, prompt='echo "id=$DISPATCH_AGENT_ID url=$DISPATCH_URL"')

    name = cli.session_name(agent)
    supervise_until(runner, lambda: f"id={agent.pk} url={settings.PUBLIC_URL}" in runner.capture(name), "the env")


def test_it_marks_an_agent_whose_shell_exits_0_stopped_and_kills_the_session(owner, runner, workdir):
    agent = launch(owner, runner, workdir)
    runner.paste(cli.session_name(agent), "exit 0")
    wait_dead(runner, agent)

    supervisor.supervise_once(runner=runner)

    agent.refresh_from_db()
    assert agent.status == "stopped"
    assert not runner.exists(cli.session_name(agent))


def test_it_marks_an_agent_whose_shell_exits_non_zero_error_with_the_last_lines(owner, runner, workdir):
    agent = launch(owner, runner, workdir, prompt="echo last-words-$((6*7))")
    name = cli.session_name(agent)
    supervise_until(runner, lambda: "last-words-42" in runner.capture(name), "the output")
    runner.paste(name, "exit 3")
    wait_dead(runner, agent)

    supervisor.supervise_once(runner=runner)

    agent.refresh_from_db()
    assert agent.status == "error"
    assert "exit status 3" in agent.last_error
    assert "last-words-42" in agent.last_error
    assert not runner.exists(name)


def test_it_marks_an_agent_whose_session_vanished_stopped_with_a_note(owner, runner, workdir):
    agent = launch(owner, runner, workdir)
    runner.kill(cli.session_name(agent))

    supervisor.supervise_once(runner=runner)

    agent.refresh_from_db()
    assert agent.status == "stopped"
    assert agent.latest_event_message == "session missing; marked stopped"


def test_it_stops_an_agent_and_removes_its_session_then_starts_it_again(owner, runner, workdir, settings):
    settings.AGENT_STOP_GRACE = 0.3
    agent = launch(owner, runner, workdir)
    name = cli.session_name(agent)

    cli.agent_stop(agent=agent, runner=runner)
    agent.refresh_from_db()
    assert agent.status == "stopping"  # returns at once; the supervisor finishes the stop
    supervise_until(runner, lambda: Agent.objects.get(pk=agent.pk).status == "stopped", "stopped")
    assert not runner.exists(name)

    cli.agent_start(agent=agent, runner=runner)
    agent.refresh_from_db()
    assert agent.status == "running"
    assert runner.exists(name)
    assert not runner.pane_state(name).dead


def test_it_kills_sessions_of_this_instance_whose_agent_is_stopped_or_missing(owner, runner, workdir):
    agent = launch(owner, runner, workdir)
    force_status(agent, "stopped")
    instance_id = instance_identity_get().instance_id
    orphan = "dispatch_agt_000000000000"
    runner.start(session_name=orphan, instance_id=instance_id, argv=["sleep", "600"], cwd=workdir, env={})

    supervisor.supervise_once(runner=runner)

    assert runner.owned_sessions(instance_id) == []


def test_it_never_touches_a_session_tagged_with_another_instance(owner, runner, workdir):
    agent = launch(owner, runner, workdir)
    name = cli.session_name(agent)
    runner.kill(name)
    # The same session name, now another instance's: missing for us, left alone.
    runner.start(session_name=name, instance_id="ins_someone_else", argv=["sleep", "600"], cwd=workdir, env={})
    foreign = "dispatch_agt_ffffffffffff"
    runner.start(session_name=foreign, instance_id="ins_someone_else", argv=["sleep", "600"], cwd=workdir, env={})

    supervisor.supervise_once(runner=runner)

    assert runner.exists(foreign)
    assert runner.owned_sessions("ins_someone_else") == sorted([name, foreign])


class BrokenRunner(TmuxRunner):
    def start(self, *, session_name: str, instance_id: str, argv: list[str], cwd: str, env: dict[str, str]) -> None:
        raise TmuxError("tmux new-session failed: boom")


def test_it_marks_an_agent_error_with_last_error_when_tmux_fails_to_start(owner, runner, workdir):
    agent = launch(owner, BrokenRunner(socket_name=runner.socket_name), workdir, prompt="echo never")

    assert agent.status == "error"
    assert "boom" in agent.last_error
    assert not runner.exists(cli.session_name(agent))


def test_the_api_launches_a_shell_agent_running(api, runner, workdir):
    response = api.post(
        "/api/v1/agents", {"type": "shell", "name": "build", "cwd": workdir, "prompt": "echo api-$((1+1))"}
    )

    assert response.status_code == 201, response.content
    body = response.json()
    assert body["status"] == "running" and body["type"] == "shell"
    name = f"dispatch_{body['id']}"
    supervise_until(runner, lambda: "api-2" in runner.capture(name), "the prompt's output")


def test_the_api_stops_and_starts_a_shell_agent(api, runner, workdir, settings):
    settings.AGENT_STOP_GRACE = 0.1
    agent_id = api.post("/api/v1/agents", {"type": "shell", "name": "b", "cwd": workdir}).json()["id"]

    stopped = api.post(f"/api/v1/agents/{agent_id}/stop")
    assert stopped.status_code == 200 and stopped.json()["status"] == "stopping"
    assert api.post(f"/api/v1/agents/{agent_id}/stop").status_code == 409
    supervise_until(runner, lambda: Agent.objects.get(pk=agent_id).status == "stopped", "stopped")
    assert not runner.exists(f"dispatch_{agent_id}")

    started = api.post(f"/api/v1/agents/{agent_id}/start")
    assert started.status_code == 200 and started.json()["status"] == "running"
    assert runner.exists(f"dispatch_{agent_id}")
