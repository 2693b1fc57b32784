"""CLI agents in tmux: launch, stop, start and the supervisor (spec/agents.md §2).

This slice runs the ``shell`` type only (kind ``shell``: an interactive ``bash --norc -i``
whose prompt is typed in as the first command). Every function here is synchronous and
blocks on ``tmux`` subprocesses: call it from a sync view or a worker thread, never on
the event loop.

Out of scope for now (spec/agents.md §2): the per-host supervisor lease (every process
on a host supervises that host's agents), the activity watcher (working/idle from the
pane's output), the 60 s ``stopping`` timeout, the ``llm`` kinds and their MCP wiring.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from django.conf import settings
from django.contrib.auth.models import User

from dispatch.agents import services
from dispatch.errors import DispatchError, InvalidRequest
from dispatch.models import Agent
from dispatch.presence import HOSTNAME
from dispatch.services import instance_identity_get
from dispatch.tmux import TmuxError, TmuxRunner, TmuxSessionNotFound

logger = logging.getLogger(__name__)

Status = Agent.Status

# The CLI types this slice can launch, with their argv (kind "shell").
CLI_COMMANDS: dict[str, list[str]] = {"shell": ["bash", "--norc", "-i"]}
LAUNCHABLE_CLI_TYPES = tuple(CLI_COMMANDS)
# Seconds to wait for the pane to show a prompt (or any output) before pasting the prompt.
PROMPT_WAIT = 3.0
# Seconds between ``interrupt`` and ``kill`` when stopping.
STOP_GRACE = 2.0
# Lines of the dead pane kept in ``last_error``.
ERROR_LINES = 20
_POLL = 0.05


def default_runner() -> TmuxRunner:
    """The runner for the default tmux server, or the ``DISPATCH_TMUX_SOCKET`` server if set.

    Tests monkeypatch ``runner_factory`` to a private socket.
    """
    return TmuxRunner(socket_name=settings.TMUX_SOCKET or None)


runner_factory: Callable[[], TmuxRunner] = default_runner


def _runner(runner: TmuxRunner | None) -> TmuxRunner:
    return runner if runner is not None else runner_factory()


def session_name(agent: Agent) -> str:
    """The tmux session of ``agent``: ``dispatch_<agent id>``."""
    return f"dispatch_{agent.pk}"


def _start_session(*, agent: Agent, runner: TmuxRunner) -> bool:
    """Start the agent's session and mark it ``running``; ``error`` on a ``TmuxError``.

    The agent must be ``creating``. Returns True if the session started.
    """
    try:
        runner.start(
            session_name=session_name(agent),
            instance_id=instance_identity_get().instance_id,
            argv=list(CLI_COMMANDS[agent.type]),
            cwd=agent.cwd,
            env={"DISPATCH_AGENT_ID": agent.pk, "DISPATCH_URL": settings.PUBLIC_URL},
        )
    except TmuxError as error:
        services.agent_set_status(agent=agent, status=Status.ERROR, note=f"session failed to start: {error}")
        return False
    services.agent_set_status(agent=agent, status=Status.RUNNING, note="session started")
    return True


def _paste_prompt(*, agent: Agent, prompt: str, runner: TmuxRunner) -> None:
    """Type ``prompt`` into the pane once it shows a prompt or any output (at most ``PROMPT_WAIT`` s)."""
    name = session_name(agent)
    deadline = time.monotonic() + PROMPT_WAIT
    try:
        while time.monotonic() < deadline:
            screen = runner.capture(name)
            if "$ " in screen or screen.strip():
                break
            time.sleep(_POLL)
        runner.paste(name, prompt)
    except TmuxError as error:
        logger.warning("could not deliver the prompt to agent %s: %s", agent.pk, error)
        services.agent_event_record(agent=agent, type="system", message=f"prompt not delivered: {error}", metadata={})


def agent_launch(
    *,
    owner: User,
    type: str,
    name: str,
    prompt: str,
    cwd: str,
    parent: Agent | None = None,
    launched_by: Agent | None = None,
    full_access: bool = False,
    runner: TmuxRunner | None = None,
) -> Agent:
    """Launch a CLI agent (spec/agents.md §2 steps 1–4) and return it.

    Inserts it ``creating`` on this host, starts ``dispatch_<id>`` tagged with this
    instance's id, marks it ``running`` with a "session started" event, then types
    ``prompt`` (if any) into the pane. A tmux failure leaves it ``error`` with
    ``last_error``. Raises ``InvalidRequest`` for a type not launchable here or a bad
    ``cwd``/``name``.
    """
    if type not in CLI_COMMANDS:
        raise InvalidRequest(
            f"type '{type}' cannot be launched here; CLI types available: {', '.join(LAUNCHABLE_CLI_TYPES)}"
        )
    tmux = _runner(runner)
    agent = services.agent_create(
        owner=owner, type=type, name=name, cwd=cwd, parent=parent, launched_by=launched_by, full_access=full_access
    )
    if _start_session(agent=agent, runner=tmux) and prompt.strip():
        _paste_prompt(agent=agent, prompt=prompt, runner=tmux)
    agent.refresh_from_db()
    return agent


def _kill_quietly(runner: TmuxRunner, name: str) -> None:
    try:
        runner.kill(name)
    except TmuxSessionNotFound:
        pass


def agent_stop(*, agent: Agent, runner: TmuxRunner | None = None, grace: float | None = None) -> Agent:
    """Stop a running CLI agent: ``stopping``, interrupt, kill after ``grace`` s, ``stopped``.

    The session is killed early if its pane dies within the grace period. Raises
    ``DispatchError("CONFLICT")`` if the agent is not running.
    """
    tmux = _runner(runner)
    services.agent_set_status(agent=agent, status=Status.STOPPING, note="stop requested")
    name = session_name(agent)
    wait = STOP_GRACE if grace is None else grace
    try:
        tmux.interrupt(name)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not tmux.pane_state(name).dead:
            time.sleep(_POLL)
        _kill_quietly(tmux, name)
    except TmuxSessionNotFound:
        pass
    except TmuxError as error:
        services.agent_set_status(agent=agent, status=Status.ERROR, note=f"stop failed: {error}")
        return agent
    services.agent_set_status(agent=agent, status=Status.STOPPED, note="session stopped")
    return agent


def agent_start(*, agent: Agent, runner: TmuxRunner | None = None) -> Agent:
    """Start a ``stopped`` or ``error`` CLI agent again in the same session name.

    Raises ``DispatchError("CONFLICT")`` for another status or ``InvalidRequest`` for a
    type not launchable here.
    """
    if agent.type not in CLI_COMMANDS:
        raise InvalidRequest(f"type '{agent.type}' cannot be started here")
    if agent.status not in (Status.STOPPED, Status.ERROR):
        raise DispatchError(
            "CONFLICT", f"agent '{agent.pk}' cannot start from {agent.status}", {"status": agent.status}
        )
    tmux = _runner(runner)
    services.agent_set_status(agent=agent, status=Status.CREATING, note="start requested")
    _kill_quietly(tmux, session_name(agent))  # a leftover dead pane would block the name
    _start_session(agent=agent, runner=tmux)
    agent.refresh_from_db()
    return agent


def _settle(*, agent: Agent, status: str, note: str) -> None:
    """Move ``agent`` to ``status`` unless it moved meanwhile (a concurrent stop or archive)."""
    try:
        services.agent_set_status(agent=agent, status=status, note=note)
    except DispatchError as error:
        logger.info("supervisor left agent %s alone: %s", agent.pk, error)


def _last_lines(runner: TmuxRunner, name: str) -> str:
    try:
        return runner.capture(name, lines=ERROR_LINES)
    except TmuxError:
        return ""


def supervise_once(*, runner: TmuxRunner | None = None) -> None:
    """Reconcile this host's CLI agents with their tmux sessions (spec/agents.md §2).

    For each non-archived CLI agent on this host that is ``running`` or ``stopping``:
    session missing → ``stopped`` with a note; pane dead → ``stopped`` (exit status 0, or
    it was ``stopping``) or ``error`` (the pane's last lines in ``last_error``), then the
    session is killed. Sessions tagged with this instance whose agent is missing or
    stopped (not creating/running/stopping) are killed; sessions of other instances are
    never touched.

    Not yet here: the per-host supervisor lease (so a ``serve`` and a ``dispatch_worker``
    on one host both reconcile — the status changes are row-locked and a lost race is
    logged and skipped), the activity watcher, the 60 s ``stopping`` kill.
    """
    tmux = _runner(runner)
    watched = (
        Agent.objects.filter(host=HOSTNAME, status__in=[Status.RUNNING, Status.STOPPING], peer_agent_id="")
        .exclude(type=services.EXPERT)
        .order_by("pk")
    )
    for agent in watched:
        name = session_name(agent)
        try:
            state = tmux.pane_state(name)
        except TmuxSessionNotFound:
            _settle(agent=agent, status=Status.STOPPED, note="session missing; marked stopped")
            continue
        except TmuxError as error:
            logger.warning("supervisor could not read agent %s: %s", agent.pk, error)
            continue
        if not state.dead:
            continue
        if state.exit_status == 0 or agent.status == Status.STOPPING:
            _settle(agent=agent, status=Status.STOPPED, note=f"session ended (exit status {state.exit_status})")
        else:
            how = f"exit status {state.exit_status}" if state.signal is None else f"signal {state.signal}"
            lines = _last_lines(tmux, name)
            _settle(agent=agent, status=Status.ERROR, note=f"session ended ({how}):\n{lines}")
        _kill_quietly(tmux, name)

    alive = {Status.CREATING, Status.RUNNING, Status.STOPPING}
    for name in tmux.owned_sessions(instance_identity_get().instance_id):
        agent_id = name.removeprefix("dispatch_")
        row = Agent.objects.filter(pk=agent_id).values_list("status", flat=True).first()
        if row is None or row not in alive:
            logger.info("supervisor kills orphaned session %s (agent %s)", name, row or "missing")
            _kill_quietly(tmux, name)
