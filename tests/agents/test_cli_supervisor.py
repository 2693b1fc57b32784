"""CLI agents in tmux, the supervisor's own work (agents/cli.py, docs/agents.md#the-supervisor):
the activity watcher, the supervisor lease, stopping, starting and archiving. What reaches
the pane (messages, the token, types) is test_cli_delivery.py.

Real tmux on a private server per test (the ``runner`` fixture of tests/agents/conftest.py).
"""

from __future__ import annotations

import shutil
import time
from datetime import timedelta

import pytest
from django.db.models import F
from django.utils import timezone

from agents import cli, services, supervisor
from agents.models import Agent, AgentEvent, SupervisorLease
from agents.tmux import TmuxRunner
from agents.types import parse_agent_types
from core.errors import DispatchError
from core.presence import HOSTNAME
from tests.agents.conftest import send, status_of
from tests.agents.test_cli_agents import launch, supervise_until, wait_dead, wait_for

pytestmark = [
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
    pytest.mark.django_db,
]


# --- the activity watcher --------------------------------------------------------------------


def quiet_for(agent: Agent, *, seconds: float) -> None:
    """Move the agent's last pane change ``seconds`` back: the watcher reads its clock from
    the row (``Agent.pane_changed_at``), so this stands for that much silence."""
    Agent.objects.filter(pk=agent.pk).update(pane_changed_at=F("pane_changed_at") - timedelta(seconds=seconds))


def watcher_events(agent: Agent) -> list[str]:
    return list(
        AgentEvent.objects.filter(agent=agent, metadata__source=supervisor.WATCHER)
        .order_by("created_at", "pk")
        .values_list("type", flat=True)
    )


def test_output_while_reported_idle_or_done_is_corrected_to_working(owner, runner, workdir):
    agent = launch(owner, runner, workdir)
    name = cli.session_name(agent)
    wait_for(lambda: runner.capture(name).strip(), "the shell prompt")
    supervisor.supervise_once(runner=runner)  # the watcher's first look: a baseline, no event
    services.agent_event_record(agent=agent, type="done", message="finished (reported by the agent)")
    supervisor.supervise_once(runner=runner)
    assert watcher_events(agent) == []  # no output, no correction

    runner.paste(name, "echo busy-again")
    wait_for(lambda: runner.capture(name).count("busy-again") >= 2, "the command and its output")
    supervisor.supervise_once(runner=runner)

    assert watcher_events(agent) == ["working"]
    event = AgentEvent.objects.get(agent=agent, metadata__source=supervisor.WATCHER)
    assert event.metadata["reported"] == "done"
    agent.refresh_from_db()
    assert agent.latest_event_type == "working"

    services.agent_event_record(agent=agent, type="idle", message="waiting (reported)")
    runner.paste(name, "echo more")
    wait_for(lambda: runner.capture(name).count("more") >= 2, "the command and its output")
    supervisor.supervise_once(runner=runner)
    assert watcher_events(agent) == ["working", "working"]


def test_silence_while_working_is_corrected_to_idle(owner, runner, workdir, settings):
    settings.AGENT_IDLE_AFTER = 5.0
    agent = launch(owner, runner, workdir)
    wait_for(lambda: runner.capture(cli.session_name(agent)).strip(), "the shell prompt")
    supervisor.supervise_once(runner=runner)
    services.agent_event_record(agent=agent, type="working", message="on it (reported)")

    supervisor.supervise_once(runner=runner)
    assert watcher_events(agent) == []  # not silent long enough yet
    quiet_for(agent, seconds=6)
    supervisor.supervise_once(runner=runner)
    assert watcher_events(agent) == ["idle"]
    supervisor.supervise_once(runner=runner)
    assert watcher_events(agent) == ["idle"]  # once
    assert Agent.objects.get(pk=agent.pk).latest_event_type == "idle"


def test_the_watcher_state_is_in_the_row_so_another_holder_continues(owner, runner, workdir, settings):
    settings.AGENT_IDLE_AFTER = 5.0
    agent = launch(owner, runner, workdir)
    wait_for(lambda: runner.capture(cli.session_name(agent)).strip(), "the shell prompt")
    assert supervisor.supervise_once(runner=runner, holder="proc_first").held
    services.agent_event_record(agent=agent, type="working", message="on it")
    agent.refresh_from_db()
    assert agent.pane_hash and agent.pane_changed_at is not None
    SupervisorLease.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    quiet_for(agent, seconds=6)

    assert supervisor.supervise_once(runner=runner, holder="proc_second").held
    assert watcher_events(agent) == ["idle"]


def test_shadow_agents_are_skipped(owner, runner, workdir, make_agent):
    shadow = make_agent(owner, type="shell")
    Agent.objects.filter(pk=shadow.pk).update(status="running", peer_agent_id="peer_agt_1")

    supervisor.supervise_once(runner=runner)

    assert status_of(shadow) == "running"  # no session here, yet not marked stopped


# --- the lease --------------------------------------------------------------------------------


def test_only_the_lease_holder_supervises_and_another_takes_over_after_expiry(owner, runner, workdir, settings):
    settings.CLI_SUPERVISE_INTERVAL = 0.2  # lease of 0.6 s
    agent = launch(owner, runner, workdir)
    assert supervisor.supervise_once(runner=runner, holder="proc_aaaa").held
    runner.paste(cli.session_name(agent), "exit 0")
    wait_dead(runner, agent)

    assert not supervisor.supervise_once(runner=runner, holder="proc_bbbb").held
    assert status_of(agent) == "running"  # the non-holder did nothing
    assert SupervisorLease.objects.get(host=HOSTNAME).holder == "proc_aaaa"

    time.sleep(0.7)  # proc_aaaa stopped renewing: its lease expired
    assert supervisor.supervise_once(runner=runner, holder="proc_bbbb").held
    assert status_of(agent) == "stopped"
    assert SupervisorLease.objects.get(host=HOSTNAME).holder == "proc_bbbb"
    assert not supervisor.supervise_once(runner=runner, holder="proc_aaaa").held


def test_the_lease_is_renewed_by_its_holder_and_released(db):
    assert supervisor.supervisor_lease_claim(holder="proc_one", ttl=60)
    first = SupervisorLease.objects.get(host=HOSTNAME).expires_at
    assert supervisor.supervisor_lease_claim(holder="proc_one", ttl=120)
    assert SupervisorLease.objects.get(host=HOSTNAME).expires_at > first
    assert not supervisor.supervisor_lease_claim(holder="proc_two", ttl=60)
    supervisor.supervisor_lease_release(holder="proc_two")  # not the holder: no effect
    assert SupervisorLease.objects.get(host=HOSTNAME).holder == "proc_one"
    supervisor.supervisor_lease_release(holder="proc_one")
    assert supervisor.supervisor_lease_claim(holder="proc_two", ttl=60)


# --- stopping, starting, archiving, the pane view ---------------------------------------------


@pytest.fixture
def shell_surviving_its_stop(settings) -> None:
    """The ``shell`` type with a stop sequence bash survives (one C-c), so only the kill ends it."""
    settings.AGENT_TYPES = parse_agent_types(
        {"shell": {"argv": ["bash", "--norc", "-i"], "kind": "shell", "stop": ["C-c"]}}
    )


def test_stop_returns_stopping_and_the_supervisor_kills_after_the_grace(
    owner, runner, workdir, settings, shell_surviving_its_stop
):
    settings.AGENT_STOP_GRACE = 0.5
    agent = launch(owner, runner, workdir)
    name = cli.session_name(agent)
    wait_for(lambda: runner.capture(name).strip(), "the shell prompt")

    started = time.monotonic()
    stopped = cli.agent_stop(agent=agent, runner=runner)
    assert time.monotonic() - started < 0.5
    # The stop keys are the supervisor's (they may pause between keys): not sent by the request.
    assert stopped.status == "stopping" and not Agent.objects.get(pk=agent.pk).stop_interrupted
    supervisor.supervise_once(runner=runner)
    assert Agent.objects.get(pk=agent.pk).stop_interrupted
    assert status_of(agent) == "stopping" and runner.exists(name)  # bash survives C-c: grace not over

    supervise_until(runner, lambda: status_of(agent) == "stopped", "stopped")
    assert not runner.exists(name)
    agent.refresh_from_db()
    assert "grace" in agent.latest_event_message


def test_stopping_for_longer_than_the_hard_limit_is_killed(owner, runner, workdir, settings, shell_surviving_its_stop):
    settings.AGENT_STOP_GRACE = 1000.0
    settings.AGENT_STOP_TIMEOUT = 5.0
    agent = launch(owner, runner, workdir)
    name = cli.session_name(agent)
    cli.agent_stop(agent=agent, runner=runner)
    supervisor.supervise_once(runner=runner)
    assert status_of(agent) == "stopping" and runner.exists(name)

    # The stop was asked 6 s ago: the row's clock, not a sleep past the limit.
    Agent.objects.filter(pk=agent.pk).update(stop_requested_at=F("stop_requested_at") - timedelta(seconds=6))
    supervisor.supervise_once(runner=runner)
    assert status_of(agent) == "stopped"
    assert not runner.exists(name)
    assert "stopping for over 5 s" in Agent.objects.get(pk=agent.pk).latest_event_message


def test_a_pane_that_exits_non_zero_while_stopping_ends_stopped(owner, runner, workdir, settings):
    settings.AGENT_STOP_GRACE = 1000.0
    agent = launch(owner, runner, workdir)
    wait_for(lambda: runner.capture(cli.session_name(agent)).strip(), "the shell's prompt")
    cli.agent_stop(agent=agent, runner=runner)
    runner.paste(cli.session_name(agent), "exit 5")
    wait_dead(runner, agent)

    supervisor.supervise_once(runner=runner)

    assert status_of(agent) == "stopped"


def test_a_stop_for_another_host_only_changes_the_row(owner, runner, workdir):
    agent = launch(owner, runner, workdir)
    Agent.objects.filter(pk=agent.pk).update(host="elsewhere.example")
    agent.refresh_from_db()

    cli.agent_stop(agent=agent, runner=runner)

    assert status_of(agent) == "stopping"
    assert not Agent.objects.get(pk=agent.pk).stop_interrupted
    with pytest.raises(DispatchError) as conflict:
        cli.pane_text(agent=agent, runner=runner)
    assert conflict.value.code == "CONFLICT"


def test_a_start_requested_elsewhere_is_picked_up_by_the_hosts_supervisor(owner, runner, workdir):
    agent = launch(owner, runner, workdir)
    name = cli.session_name(agent)
    runner.paste(name, "exit 0")
    wait_dead(runner, agent)
    supervisor.supervise_once(runner=runner)
    assert status_of(agent) == "stopped" and not runner.exists(name)
    # As another host's request would: only the row moves to creating.
    services.agent_set_status(agent=agent, status="creating", note="start requested")
    Agent.objects.filter(pk=agent.pk).update(
        updated_at=timezone.now() - timedelta(seconds=supervisor.CREATING_GRACE + 1)
    )

    supervisor.supervise_once(runner=runner)

    assert status_of(agent) == "running"
    assert runner.exists(name) and not runner.pane_state(name).dead


def test_archive_kills_the_session_and_revokes_tokens(owner, runner, workdir):
    agent = launch(owner, runner, workdir)
    message = send(agent, "echo never")

    archived = cli.agent_archive(agent=agent, runner=runner)

    assert archived.status == "archived"
    assert not runner.exists(cli.session_name(agent))
    assert agent.tokens.filter(revoked_at__isnull=True).count() == 0
    message.refresh_from_db()
    assert message.status == "failed"
    assert cli.agent_archive(agent=agent, runner=runner).status == "archived"  # idempotent


def test_pane_text_is_empty_once_the_session_is_gone(owner, runner, workdir):
    agent = launch(owner, runner, workdir, prompt="seq 1 300")
    # "\n300\n": the output's last line, not the typed command "seq 1 300" echoed.
    supervise_until(runner, lambda: "\n300\n" in cli.pane_text(agent=agent, runner=runner), "the output")
    text = cli.pane_text(agent=agent, runner=runner, lines=120)
    assert len(text.splitlines()) <= 120 and text.splitlines()[-2] == "300"

    runner.kill(cli.session_name(agent))
    assert cli.pane_text(agent=agent, runner=runner) == ""


def test_start_again_mints_a_fresh_token(owner, runner, workdir, settings):
    settings.AGENT_STOP_GRACE = 0.0
    agent = launch(owner, runner, workdir)
    first = agent.tokens.get()
    cli.agent_stop(agent=agent, runner=runner)
    supervise_until(runner, lambda: status_of(agent) == "stopped", "stopped")

    cli.agent_start(agent=agent, runner=runner)

    assert status_of(agent) == "running"
    first.refresh_from_db()
    assert first.revoked_at is not None
    assert agent.tokens.filter(revoked_at__isnull=True).count() == 1


def test_a_second_instance_id_never_touches_this_instances_sessions(owner, runner, workdir, tmp_path):
    """A second instance on this computer (own database, same tmux server) lists only its own
    sessions: its orphan cleanup and reconciliation leave ours alone."""
    agent = launch(owner, runner, workdir)
    name = cli.session_name(agent)
    other = TmuxRunner(socket_name=runner.socket_name)
    theirs = "inst_0123456789ab"
    their_orphan = "dispatch_agt_0123456789ab"
    other.start(session_name=their_orphan, instance_id=theirs, argv=["sleep", "600"], cwd=workdir, env={})
    # The other instance's database has none of our rows (here: none on its host).
    Agent.objects.filter(pk=agent.pk).update(host="not-this-host")

    assert supervisor.supervise_once(runner=other, holder="proc_other", instance_id=theirs).held

    assert not runner.exists(their_orphan)  # it cleaned up its own orphan...
    assert runner.exists(name) and not runner.pane_state(name).dead  # ...and left ours alone


def test_a_creating_agent_whose_launcher_died_after_starting_it_is_marked_running(owner, runner, workdir):
    agent = launch(owner, runner, workdir)
    Agent.objects.filter(pk=agent.pk).update(
        status="creating", updated_at=timezone.now() - timedelta(seconds=supervisor.CREATING_GRACE + 1)
    )

    supervisor.supervise_once(runner=runner)

    assert status_of(agent) == "running"
    assert runner.exists(cli.session_name(agent)) and not runner.pane_state(cli.session_name(agent)).dead
