"""CLI agents in tmux: launch, stop, start, archive and the pane view
(docs/agents.md#launch-start-stop-archive).

The types come from ``settings.AGENT_TYPES`` (``DISPATCH_AGENT_TYPES``, parsed by
``agents.types``); a type whose program is not on ``PATH`` is refused at launch.
Each start mints the agent's MCP token (``tokens.agent_token_mint``) and hands it to the
process in its environment only (``DISPATCH_MCP_TOKEN``, with ``DISPATCH_AGENT_ID``,
``DISPATCH_URL`` and ``DISPATCH_MCP_URL``); the tokens are revoked whenever the agent
stops, errs or is archived.

Nothing here blocks a request for seconds: ``agent_launch``/``agent_start`` run a few
short ``tmux`` commands, ``agent_stop`` only changes rows and rings the supervisor.
Everything that waits (pasting queued messages — the prompt is the first one — once the
pane is quiet, sending a stop's keys with pauses between them, killing a ``stopping``
session after the grace period, the activity watcher) is the supervisor's job
(``agents.supervisor``, in a thread of its own), which uses the session steps here
(``session_start``, ``session_kill``, ``session_stop_keys``, ``agent_settle``,
``agent_ended``). The edges call these through ``agents.lifecycle``.

CLI agents run on Dispatch's own tmux server (``tmux -L dispatch``, or
``DISPATCH_TMUX_SOCKET``), never the user's default one (docs/agents.md).

A type that reports through hooks (``AgentType.hooks``: Claude Code, codex) launches only
in a folder a person trusted (``agents.trust``), and each of its sessions is prepared
first (``agents.cli_prepare``: the CLI's config written so it starts with no dialog, its
hooks wired); a launch that cannot be prepared is refused before the agent exists
(docs/agents.md#folder-trust, docs/agents.md#what-dispatch-writes).

Every function is synchronous (tmux subprocesses, the ORM): call it from a sync view or a
worker thread, never on the event loop.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from agents import cli_prepare, messages, services, tokens, trust
from agents.hooks import linked
from agents.models import Agent
from agents.selectors import is_shadow
from agents.tmux import DEFAULT_SOCKET, TmuxError, TmuxPaneDead, TmuxRunner, TmuxSessionNotFound
from agents.types import AgentType
from core import presence
from core.errors import DispatchError, InvalidRequest
from core.services import instance_identity_get

logger = logging.getLogger(__name__)

Status = Agent.Status

# Compatibility for callers written before DISPATCH_AGENT_TYPES (prefer ``is_cli_type``).
LAUNCHABLE_CLI_TYPES = tuple(settings.AGENT_TYPES)


# Seconds between two steps of a stop sequence: a CLI that asks for a second C-c (Claude
# Code) must have drawn its hint first, and two SIGINTs sent at once may arrive as one.
STOP_STEP_PAUSE = 0.5


def default_runner() -> TmuxRunner:
    """The runner for Dispatch's own tmux server: ``tmux -L <DISPATCH_TMUX_SOCKET>``, or
    ``tmux -L dispatch`` (``agents.tmux.DEFAULT_SOCKET``) when that is empty — never the
    user's default server (docs/agents.md#the-private-tmux-server).

    Tests monkeypatch ``runner_factory`` to a private socket.
    """
    return TmuxRunner(socket_name=settings.TMUX_SOCKET or DEFAULT_SOCKET)


runner_factory: Callable[[], TmuxRunner] = default_runner


def tmux_runner(runner: TmuxRunner | None) -> TmuxRunner:
    """``runner`` if given, else ``runner_factory()`` (Dispatch's own tmux server)."""
    return runner if runner is not None else runner_factory()


def session_name(agent: Agent) -> str:
    """The tmux session of ``agent``: ``dispatch_<agent id>``."""
    return f"dispatch_{agent.pk}"


def is_cli_type(type: str) -> bool:
    """True if ``type`` is a configured CLI agent type (a key of ``settings.AGENT_TYPES``),
    available on this host or not."""
    return type in settings.AGENT_TYPES


def is_local(agent: Agent) -> bool:
    """True if ``agent`` runs on this host (``presence.HOSTNAME``): only then is its tmux touched."""
    return agent.host == presence.HOSTNAME


def mcp_url() -> str:
    """The MCP endpoint agents are given: ``<DISPATCH_PUBLIC_URL>/mcp``."""
    return f"{settings.PUBLIC_URL}/mcp"


def _launchable(type: str) -> AgentType:
    """The ``AgentType`` named ``type``; ``InvalidRequest`` if unknown or its program is missing."""
    spec = settings.AGENT_TYPES.get(type)
    if spec is None:
        known = ", ".join(settings.AGENT_TYPES) or "none"
        raise InvalidRequest(f"unknown CLI agent type '{type}'; CLI types: {known}")
    if not spec.available():
        missing = sorted({p for p in (spec.argv[0], spec.full_access_argv[0]) if shutil.which(p) is None})
        raise InvalidRequest(
            f"agent type '{type}' is unavailable here: {', '.join(missing)} is not on PATH",
            {"type": type, "missing_programs": missing},
        )
    return spec


# --- lifecycle ---------------------------------------------------------------------------


def agent_settle(*, agent: Agent, status: str, note: str) -> bool:
    """Move ``agent`` to ``status`` unless it moved meanwhile (a concurrent stop or archive)."""
    try:
        services.agent_set_status(agent=agent, status=status, note=note)
    except DispatchError as error:
        logger.info("supervisor left agent %s alone: %s", agent.pk, error)
        return False
    return True


def agent_ended(*, agent: Agent, status: str, note: str, reason: str = "agent stopped") -> None:
    """The agent's process is gone: ``status`` (stopped/error), tokens revoked, queued
    messages failed with ``reason`` (their ``error``), its per-agent files removed
    (``cli_prepare.agent_files_remove``)."""
    if agent_settle(agent=agent, status=status, note=note):
        tokens.agent_tokens_revoke(agent=agent)
        messages.messages_fail_pending(agent=agent, error=reason)
        cli_prepare.agent_files_remove(agent.pk)  # a start writes them again


def session_kill(runner: TmuxRunner, name: str) -> None:
    """Kill tmux session ``name``; a missing one is fine, another tmux failure is logged."""
    try:
        runner.kill(name)
    except TmuxSessionNotFound:
        pass
    except TmuxError as error:
        logger.warning("could not kill tmux session %s: %s", name, error)


def _kill_own(runner: TmuxRunner, name: str, instance_id: str) -> None:
    """Kill session ``name`` only if it is tagged with ``instance_id``."""
    try:
        if name in runner.owned_sessions(instance_id):
            session_kill(runner, name)
    except TmuxError as error:
        logger.warning("could not list tmux sessions: %s", error)


def _launch_context(agent: Agent) -> str | None:
    """For an agent a peer launched (``launched_by_peer``), the preamble an ``llm`` agent
    would get in its prompt, for a ``shell`` agent's ``DISPATCH_LAUNCH_CONTEXT``
    (docs/peers.md#using-a-link; ``linked().launch_context``); ``None`` otherwise or when the
    link is gone."""
    if not agent.launched_by_peer:
        return None
    return linked().launch_context(agent=agent)


def session_start(*, agent: Agent, runner: TmuxRunner, instance_id: str | None = None) -> bool:
    """Start the ``creating`` agent's session and mark it ``running``; ``error`` on failure.

    Mints a fresh token for the environment, resets the supervisor state, and rings the
    doorbell so queued messages (the prompt) are pasted as soon as the pane is quiet.
    Returns True if the session started.
    """
    spec = settings.AGENT_TYPES.get(agent.type)
    if spec is None or not spec.available():
        agent_ended(agent=agent, status=Status.ERROR, note=f"agent type '{agent.type}' is unavailable on this host")
        return False
    url = mcp_url()
    prepared = cli_prepare.Prepared()
    if spec.hooks is not None:
        try:
            if not trust.folder_is_trusted(owner=agent.owner, path=agent.cwd):
                raise trust.refusal(family=spec.hooks, path=agent.cwd, type=agent.type, person=True)
            prepared = cli_prepare.prepare(
                spec=spec,
                cwd=agent.cwd,
                full_access=agent.full_access,
                env=cli_prepare.agent_environment(spec, mcp_url=url, agent_id=agent.pk),
                agent_id=agent.pk,
            )
        except DispatchError as error:
            agent_ended(agent=agent, status=Status.ERROR, note=f"the CLI could not be prepared: {error.message}")
            return False
    token = tokens.agent_token_mint(agent=agent)
    env = {
        **spec.environment(mcp_url=url, agent_id=agent.pk),
        **prepared.env,
        "DISPATCH_AGENT_ID": agent.pk,
        "DISPATCH_URL": settings.PUBLIC_URL,
        "DISPATCH_MCP_URL": url,
        "DISPATCH_MCP_TOKEN": token,
    }
    context = _launch_context(agent) if spec.kind == "shell" else None
    if context:
        env["DISPATCH_LAUNCH_CONTEXT"] = context
    Agent.objects.filter(pk=agent.pk).update(
        pane_hash="", pane_changed_at=None, stop_requested_at=None, stop_interrupted=False, ready_at=None
    )
    try:
        runner.start(
            session_name=session_name(agent),
            instance_id=instance_id or instance_identity_get().instance_id,
            argv=[*spec.command(full_access=agent.full_access, mcp_url=url, agent_id=agent.pk), *prepared.argv],
            cwd=agent.cwd,
            env=env,
        )
    except TmuxError as error:
        if Agent.objects.filter(pk=agent.pk, status=Status.CREATING).exists():
            agent_ended(agent=agent, status=Status.ERROR, note=f"session failed to start: {error}")
        return False
    if not agent_settle(agent=agent, status=Status.RUNNING, note="session started"):
        session_kill(runner, session_name(agent))  # archived or stopped meanwhile
        tokens.agent_tokens_revoke(agent=agent)
        return False
    messages.doorbell_ring(agent.host)
    return True


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
    launched_by_peer: dict[str, Any] | None = None,
    trust_folder: bool = False,
    runner: TmuxRunner | None = None,
) -> Agent:
    """Launch a CLI agent of ``type`` (docs/agents.md#launch-start-stop-archive) and return it.

    Inserts it ``creating`` on this host and, in the same transaction, queues ``prompt``
    (if not blank) as its first message (from ``launched_by`` when given, else from
    ``owner``); then starts ``dispatch_<id>`` tagged with this instance's id running the
    type's argv (``full_access_argv`` when ``full_access``) with the token in the
    environment, and marks it ``running`` with a "session started" event. Returns at once:
    the supervisor pastes the prompt when the pane is quiet. A tmux failure leaves the
    agent ``error`` with ``last_error`` (and the prompt ``failed``). Raises
    ``InvalidRequest`` for an unknown type, one whose program is not on PATH (naming
    it), a bad ``cwd``/``name``/``prompt``; ``NotFound`` for another user's parent.

    A type with hooks (Claude Code, codex) launches only in a trusted folder
    (``agents.trust``): else ``FolderNotTrusted`` (``FOLDER_NOT_TRUSTED``) before anything
    is written, unless ``trust_folder`` — a person's decision, recorded with the agent
    (``PERMISSION_DENIED`` when an agent, ``launched_by``, or a linked instance,
    ``launched_by_peer``, asks). Its CLI's config is then prepared in the same transaction
    (``cli_prepare.prepare``): a refusal there (a corrupt config file, a codex that cannot
    reach a model) leaves no agent, no trust and no file changed.
    """
    spec = _launchable(type)
    tmux = tmux_runner(runner)
    # One transaction: a refusal below (trust, a config that cannot be prepared) rolls the
    # agent and its prompt back, after the name, cwd and prompt were judged first.
    with transaction.atomic():
        agent = services.agent_create(
            owner=owner,
            type=type,
            name=name,
            cwd=cwd,
            parent=parent,
            launched_by=launched_by,
            full_access=full_access,
            launched_by_peer=launched_by_peer,
        )
        if isinstance(prompt, str) and prompt.strip():
            messages.message_send(
                recipient=agent,
                content=prompt,
                sender_user=None if launched_by is not None else owner,
                sender_agent=launched_by,
            )
        must_trust = trust.launch_trust_check(
            owner=owner,
            family=spec.hooks,
            path=agent.cwd,
            type=type,
            trust_folder=trust_folder,
            person=launched_by is None and launched_by_peer is None,
        )
        if must_trust:
            trust.folder_trust(owner=owner, path=agent.cwd)
        if spec.hooks is not None:
            cli_prepare.prepare(
                spec=spec,
                cwd=agent.cwd,
                full_access=full_access,
                env=cli_prepare.agent_environment(spec, mcp_url=mcp_url(), agent_id=agent.pk),
            )
    session_start(agent=agent, runner=tmux)
    agent.refresh_from_db()
    return agent


def agent_stop(*, agent: Agent, runner: TmuxRunner | None = None) -> Agent:
    """Ask a CLI agent to stop; returns at once with the agent ``stopping``.

    Records ``stop_requested_at``, revokes its tokens, fails its queued messages ("agent
    stopped") and rings the supervisor of the agent's host, which sends the type's stop
    keys (``AgentType.stop``, e.g. C-c twice for Claude Code; ``session_stop_keys``),
    marks the agent ``stopped`` once the pane dies, and kills the session only if it still
    lives ``DISPATCH_AGENT_STOP_GRACE`` s after the request; ``stopping`` never outlasts
    ``DISPATCH_AGENT_STOP_TIMEOUT`` s (docs/agents.md#how-stop-works). Nothing here
    waits on tmux: the keys and their pauses are the supervisor's, in its own thread. A
    ``creating`` agent goes straight to ``stopped``. Raises ``DispatchError("CONFLICT")``
    for any other status, ``InvalidRequest`` for an expert agent.
    """
    if agent.type == services.EXPERT:
        raise InvalidRequest("an expert agent has no session to stop")
    current = Agent.objects.get(pk=agent.pk)
    if current.status == Status.CREATING:
        if is_local(current):
            _kill_own(tmux_runner(runner), session_name(current), instance_identity_get().instance_id)
        agent_ended(agent=current, status=Status.STOPPED, note="stopped before its session started")
        agent.refresh_from_db()
        return agent
    services.agent_set_status(agent=agent, status=Status.STOPPING, note="stop requested")
    Agent.objects.filter(pk=agent.pk).update(stop_requested_at=timezone.now(), stop_interrupted=False)
    tokens.agent_tokens_revoke(agent=agent)  # "revoked at stop": not after the grace period
    messages.messages_fail_pending(agent=agent, error="agent stopped")
    messages.doorbell_ring(agent.host)
    agent.refresh_from_db()
    return agent


def session_stop_keys(*, agent: Agent, runner: TmuxRunner) -> bool:
    """Send the ``stopping`` agent's stop sequence (``AgentType.stop``) to its pane, once.

    Claims the sequence first (``stop_interrupted``, a conditional update: a second
    supervisor pass or process sends nothing), then sends each step — a key through
    ``TmuxRunner.send_keys``, a text typed with ``TmuxRunner.paste(bracketed=False)`` —
    ``STOP_STEP_PAUSE`` s apart, each only into a live pane; a pane that dies or a session
    that goes missing ends the sequence (the supervisor's next look settles the agent).
    Blocks for the pauses: call it from the supervisor's thread only. Returns True if this
    call sent the sequence (or tried to).
    """
    if not Agent.objects.filter(pk=agent.pk, stop_interrupted=False).update(stop_interrupted=True):
        return False
    spec = settings.AGENT_TYPES.get(agent.type)
    steps = spec.stop if spec is not None else (("key", "C-c"),)
    name = session_name(agent)
    for index, (kind, value) in enumerate(steps):
        if index:
            time.sleep(STOP_STEP_PAUSE)
        try:
            if kind == "key":
                runner.send_keys(name, [value])
            else:
                runner.paste(name, value, enter=False, bracketed=False)
        except (TmuxSessionNotFound, TmuxPaneDead):
            break  # it is already gone: exactly what the stop asked for
        except TmuxError as error:
            logger.warning("could not send agent %s its stop keys: %s", agent.pk, error)
            break
    return True


def agent_start(*, agent: Agent, runner: TmuxRunner | None = None) -> Agent:
    """Start a ``stopped`` or ``error`` CLI agent again in the same session name.

    ``creating``, then on this host the session starts at once (a fresh token; a
    leftover session of this instance is killed first) and the agent is ``running``
    (or ``error``). For an agent of another host only the row changes: that host's
    supervisor starts it. Raises ``DispatchError("CONFLICT")`` for another status,
    ``InvalidRequest`` for a type not configured or not available here.
    """
    if not is_cli_type(agent.type):
        raise InvalidRequest(f"type '{agent.type}' is not a CLI agent type: it cannot be started")
    current = Agent.objects.get(pk=agent.pk)
    if current.status not in (Status.STOPPED, Status.ERROR):
        raise DispatchError(
            "CONFLICT", f"agent '{agent.pk}' cannot start from {current.status}", {"status": current.status}
        )
    if is_local(current):
        _launchable(agent.type)
    services.agent_set_status(agent=agent, status=Status.CREATING, note="start requested")
    if is_local(agent):
        tmux = tmux_runner(runner)
        instance_id = instance_identity_get().instance_id
        _kill_own(tmux, session_name(agent), instance_id)  # a leftover dead pane would block the name
        session_start(agent=agent, runner=tmux, instance_id=instance_id)
    else:
        messages.doorbell_ring(agent.host)
    agent.refresh_from_db()
    return agent


def agent_archive(*, agent: Agent, runner: TmuxRunner | None = None) -> Agent:
    """Archive an agent (stops it, then hides it).

    A local CLI agent's session (of this instance) is killed first; its tokens are
    revoked and queued messages failed; then ``services.agent_archive``. For an agent of
    another host the session is left to that host's supervisor (it kills sessions of
    archived agents). Expert and shadow agents go straight to ``services.agent_archive``.
    Idempotent.
    """
    if agent.type == services.EXPERT or is_shadow(agent):
        return services.agent_archive(agent=agent)
    if is_local(agent):
        _kill_own(tmux_runner(runner), session_name(agent), instance_identity_get().instance_id)
        cli_prepare.agent_files_remove(agent.pk)
    tokens.agent_tokens_revoke(agent=agent)
    messages.messages_fail_pending(agent=agent, error="agent archived")
    return services.agent_archive(agent=agent, note="archived")


def pane_text(*, agent: Agent, lines: int = 200, runner: TmuxRunner | None = None) -> str:
    """The agent's pane as plain text: the visible screen plus scrollback, at most ``lines`` lines.

    Trailing blank rows dropped, no escape sequences. ``""`` when the session is gone.
    ``lines`` is clamped to 1–10,000. Raises ``DispatchError("CONFLICT")`` when the agent
    runs on another host (its pane is only visible there).
    """
    if not is_local(agent):
        raise DispatchError(
            "CONFLICT",
            f"agent '{agent.pk}' runs on host '{agent.host}': its pane is only visible there",
            {"host": agent.host},
        )
    try:
        return tmux_runner(runner).capture(session_name(agent), lines=max(1, min(int(lines), 10_000)))
    except TmuxSessionNotFound:
        return ""
    except TmuxError as error:
        logger.warning("could not capture agent %s: %s", agent.pk, error)
        return ""
