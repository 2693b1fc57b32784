"""CLI agents in tmux: launch, stop, start, archive, the pane view and the supervisor (spec/agents.md §2).

The types come from ``settings.AGENT_TYPES`` (``DISPATCH_AGENT_TYPES``, parsed by
``agents.types``); a type whose program is not on ``PATH`` is refused at launch.
Each start mints the agent's MCP token (``tokens.agent_token_mint``) and hands it to the
process in its environment only (``DISPATCH_MCP_TOKEN``, with ``DISPATCH_AGENT_ID``,
``DISPATCH_URL`` and ``DISPATCH_MCP_URL``); the tokens are revoked whenever the agent
stops, errs or is archived.

Nothing here blocks a request for seconds: ``agent_launch``/``agent_start`` run a few
short ``tmux`` commands, ``agent_stop`` only sends the interrupt. Everything that waits
(pasting queued messages — the prompt is the first one — once the pane is quiet, killing
a ``stopping`` session after the grace period, the activity watcher) is the supervisor's
job: ``supervise_once``, run by ``dispatch.background.cli_supervisor_loop`` every
``DISPATCH_CLI_SUPERVISE_INTERVAL`` seconds or sooner when ``messages.doorbell_ring``
rings. Only the holder of the host's ``SupervisorLease`` acts, and only on this host's
agents and on sessions tagged with this instance's id. Its state lives in the rows
(``Agent.pane_hash``, ``pane_changed_at``, ``stop_requested_at``, ``stop_interrupted``),
so a new lease holder — or a restarted Dispatch — simply continues; running agents are
never killed or reset at start.

Every function is synchronous (tmux subprocesses, the ORM): call it from a sync view or a
worker thread, never on the event loop.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from agents import messages, services, tokens
from agents.hooks import linked
from agents.models import Agent, AgentEvent, SupervisorLease
from agents.selectors import is_shadow
from agents.tmux import TmuxError, TmuxRunner, TmuxSessionNotFound
from agents.types import AgentType
from core import presence
from core.errors import DispatchError, InvalidRequest, database_unavailable
from core.services import instance_identity_get

logger = logging.getLogger(__name__)

Status = Agent.Status

# Lines of a dead pane kept in ``last_error``.
ERROR_LINES = 20
# Lines of the pane the activity watcher hashes.
WATCH_LINES = 100
# Seconds the pane must stay unchanged (and not blank) before a message is pasted.
QUIET = 0.4
# Seconds a queued message waits for a quiet pane before it is pasted anyway.
PASTE_ANYWAY_AFTER = 10.0
# Seconds a ``creating`` agent without a session is left to its launcher before the
# supervisor starts it itself (a start requested for another host, or a launcher that died).
CREATING_GRACE = 3.0
# The supervisor lease lasts this many supervise intervals.
LEASE_INTERVALS = 3
# ``metadata.source`` of the activity watcher's correction events.
WATCHER = "activity_watcher"
_ALIVE = (Status.CREATING, Status.RUNNING, Status.STOPPING)

# Compatibility for callers written before DISPATCH_AGENT_TYPES (prefer ``is_cli_type``).
LAUNCHABLE_CLI_TYPES = tuple(settings.AGENT_TYPES)


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


def _settle(*, agent: Agent, status: str, note: str) -> bool:
    """Move ``agent`` to ``status`` unless it moved meanwhile (a concurrent stop or archive)."""
    try:
        services.agent_set_status(agent=agent, status=status, note=note)
    except DispatchError as error:
        logger.info("supervisor left agent %s alone: %s", agent.pk, error)
        return False
    return True


def _ended(*, agent: Agent, status: str, note: str) -> None:
    """The agent's process is gone: ``status`` (stopped/error), tokens revoked, queued messages failed."""
    if _settle(agent=agent, status=status, note=note):
        tokens.agent_tokens_revoke(agent=agent)
        messages.messages_fail_pending(agent=agent, error="agent stopped")


def _kill_quietly(runner: TmuxRunner, name: str) -> None:
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
            _kill_quietly(runner, name)
    except TmuxError as error:
        logger.warning("could not list tmux sessions: %s", error)


def _launch_context(agent: Agent) -> str | None:
    """For an agent a peer launched (``launched_by_peer``), the preamble an ``llm`` agent
    would get in its prompt, for a ``shell`` agent's ``DISPATCH_LAUNCH_CONTEXT``
    (spec/peers.md §5 Launch; ``linked().launch_context``); ``None`` otherwise or when the
    link is gone."""
    if not agent.launched_by_peer:
        return None
    return linked().launch_context(agent=agent)


def _start_session(*, agent: Agent, runner: TmuxRunner, instance_id: str | None = None) -> bool:
    """Start the ``creating`` agent's session and mark it ``running``; ``error`` on failure.

    Mints a fresh token for the environment, resets the supervisor state, and rings the
    doorbell so queued messages (the prompt) are pasted as soon as the pane is quiet.
    Returns True if the session started.
    """
    spec = settings.AGENT_TYPES.get(agent.type)
    if spec is None or not spec.available():
        _ended(agent=agent, status=Status.ERROR, note=f"agent type '{agent.type}' is unavailable on this host")
        return False
    url = mcp_url()
    token = tokens.agent_token_mint(agent=agent)
    env = {
        **spec.environment(mcp_url=url, agent_id=agent.pk),
        "DISPATCH_AGENT_ID": agent.pk,
        "DISPATCH_URL": settings.PUBLIC_URL,
        "DISPATCH_MCP_URL": url,
        "DISPATCH_MCP_TOKEN": token,
    }
    context = _launch_context(agent) if spec.kind == "shell" else None
    if context:
        env["DISPATCH_LAUNCH_CONTEXT"] = context
    Agent.objects.filter(pk=agent.pk).update(
        pane_hash="", pane_changed_at=None, stop_requested_at=None, stop_interrupted=False
    )
    try:
        runner.start(
            session_name=session_name(agent),
            instance_id=instance_id or instance_identity_get().instance_id,
            argv=spec.command(full_access=agent.full_access, mcp_url=url, agent_id=agent.pk),
            cwd=agent.cwd,
            env=env,
        )
    except TmuxError as error:
        if Agent.objects.filter(pk=agent.pk, status=Status.CREATING).exists():
            _ended(agent=agent, status=Status.ERROR, note=f"session failed to start: {error}")
        return False
    if not _settle(agent=agent, status=Status.RUNNING, note="session started"):
        _kill_quietly(runner, session_name(agent))  # archived or stopped meanwhile
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
    runner: TmuxRunner | None = None,
) -> Agent:
    """Launch a CLI agent of ``type`` (spec/agents.md §2 steps 1–4) and return it.

    Inserts it ``creating`` on this host and, in the same transaction, queues ``prompt``
    (if not blank) as its first message (from ``launched_by`` when given, else from
    ``owner``); then starts ``dispatch_<id>`` tagged with this instance's id running the
    type's argv (``full_access_argv`` when ``full_access``) with the token in the
    environment, and marks it ``running`` with a "session started" event. Returns at once:
    the supervisor pastes the prompt when the pane is quiet. A tmux failure leaves the
    agent ``error`` with ``last_error`` (and the prompt ``failed``). Raises
    ``InvalidRequest`` for an unknown type, one whose program is not on PATH (naming
    it), a bad ``cwd``/``name``/``prompt``; ``NotFound`` for another user's parent.
    """
    _launchable(type)
    tmux = _runner(runner)
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
    _start_session(agent=agent, runner=tmux)
    agent.refresh_from_db()
    return agent


def agent_stop(*, agent: Agent, runner: TmuxRunner | None = None) -> Agent:
    """Ask a CLI agent to stop; returns at once with the agent ``stopping``.

    Records ``stop_requested_at``, fails its queued messages ("agent stopped") and, on
    this host, sends the interrupt (C-c). The supervisor of the agent's host then kills
    the session after ``DISPATCH_AGENT_STOP_GRACE`` s (or once the pane dies) and marks
    it ``stopped``; its tokens are revoked at once, at the request; ``stopping`` never outlasts
    ``DISPATCH_AGENT_STOP_TIMEOUT`` s. A ``creating`` agent goes straight to ``stopped``.
    Raises ``DispatchError("CONFLICT")`` for any other status, ``InvalidRequest`` for an
    expert agent.
    """
    if agent.type == services.EXPERT:
        raise InvalidRequest("an expert agent has no session to stop")
    current = Agent.objects.get(pk=agent.pk)
    if current.status == Status.CREATING:
        if is_local(current):
            _kill_own(_runner(runner), session_name(current), instance_identity_get().instance_id)
        _ended(agent=current, status=Status.STOPPED, note="stopped before its session started")
        agent.refresh_from_db()
        return agent
    services.agent_set_status(agent=agent, status=Status.STOPPING, note="stop requested")
    Agent.objects.filter(pk=agent.pk).update(stop_requested_at=timezone.now(), stop_interrupted=False)
    tokens.agent_tokens_revoke(agent=agent)  # "revoked at stop": not after the grace period
    messages.messages_fail_pending(agent=agent, error="agent stopped")
    if is_local(agent):
        _interrupt(agent=agent, runner=_runner(runner))
    else:
        messages.doorbell_ring(agent.host)
    agent.refresh_from_db()
    return agent


def _interrupt(*, agent: Agent, runner: TmuxRunner) -> None:
    """Send C-c to the agent's pane once (``stop_interrupted``); a missing session is the supervisor's."""
    try:
        runner.interrupt(session_name(agent))
    except TmuxSessionNotFound:
        return
    except TmuxError as error:
        logger.warning("could not interrupt agent %s: %s", agent.pk, error)
        return
    Agent.objects.filter(pk=agent.pk).update(stop_interrupted=True)


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
        tmux = _runner(runner)
        instance_id = instance_identity_get().instance_id
        _kill_own(tmux, session_name(agent), instance_id)  # a leftover dead pane would block the name
        _start_session(agent=agent, runner=tmux, instance_id=instance_id)
    else:
        messages.doorbell_ring(agent.host)
    agent.refresh_from_db()
    return agent


def agent_archive(*, agent: Agent, runner: TmuxRunner | None = None) -> Agent:
    """Archive an agent (spec/agents.md §2 "Archive stops, then hides the agent").

    A local CLI agent's session (of this instance) is killed first; its tokens are
    revoked and queued messages failed; then ``services.agent_archive``. For an agent of
    another host the session is left to that host's supervisor (it kills sessions of
    archived agents). Expert and shadow agents go straight to ``services.agent_archive``.
    Idempotent.
    """
    if agent.type == services.EXPERT or is_shadow(agent):
        return services.agent_archive(agent=agent)
    if is_local(agent):
        _kill_own(_runner(runner), session_name(agent), instance_identity_get().instance_id)
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
        return _runner(runner).capture(session_name(agent), lines=max(1, min(int(lines), 10_000)))
    except TmuxSessionNotFound:
        return ""
    except TmuxError as error:
        logger.warning("could not capture agent %s: %s", agent.pk, error)
        return ""


# --- the supervisor lease ----------------------------------------------------------------


def lease_ttl() -> float:
    """Seconds a supervisor lease lasts: ``LEASE_INTERVALS`` × ``DISPATCH_CLI_SUPERVISE_INTERVAL``."""
    return float(LEASE_INTERVALS * settings.CLI_SUPERVISE_INTERVAL)


def supervisor_lease_claim(*, holder: str, host: str | None = None, ttl: float | None = None) -> bool:
    """Claim or renew ``host``'s supervisor lease for ``holder`` (a ServerProcess id).

    True if ``holder`` now holds it until now + ``ttl`` seconds (default ``lease_ttl()``):
    a conditional UPDATE takes it when held by ``holder`` or expired, else the row is
    inserted if missing. False while another holder's lease is unexpired.
    """
    where = host or presence.HOSTNAME
    now = timezone.now()
    expires = now + timedelta(seconds=lease_ttl() if ttl is None else ttl)
    if (
        SupervisorLease.objects.filter(host=where)
        .filter(Q(holder=holder) | Q(expires_at__lt=now))
        .update(holder=holder, expires_at=expires)
    ):
        return True
    if SupervisorLease.objects.filter(host=where).exists():
        return False
    try:
        with transaction.atomic():
            SupervisorLease.objects.create(host=where, holder=holder, expires_at=expires)
    except IntegrityError:
        return False
    return True


def supervisor_lease_release(*, holder: str, host: str | None = None) -> None:
    """Give up ``host``'s lease if ``holder`` holds it (clean shutdown), so another process takes over at once."""
    SupervisorLease.objects.filter(host=host or presence.HOSTNAME, holder=holder).delete()


# --- the supervisor ----------------------------------------------------------------------


@dataclass(frozen=True)
class SupervisePass:
    """What one ``supervise_once`` did: ``held`` the lease; ``busy``: messages still wait."""

    held: bool
    busy: bool = False


def supervise_once(
    *, runner: TmuxRunner | None = None, holder: str | None = None, instance_id: str | None = None
) -> SupervisePass:
    """One pass of the CLI supervisor of this host (spec/agents.md §2).

    Acts only if ``holder`` (default: this process's id) holds or can claim the host's
    lease. For each CLI agent of this host (shadow agents skipped) that is creating,
    running or stopping:

    - ``creating`` for over ``CREATING_GRACE`` s: started here if it has no session,
      else marked ``running`` (its launcher died half-way);
    - session missing (or not tagged ``instance_id``) → ``stopped`` with a note;
    - pane dead → ``stopped`` (exit status 0, or it was ``stopping``) or ``error`` with
      the pane's last lines in ``last_error``; the session is killed;
    - ``stopping``: interrupted if not yet, killed and ``stopped`` after the grace
      period or the hard limit (``DISPATCH_AGENT_STOP_GRACE``/``_TIMEOUT``);
    - ``running``: the activity watcher (``working``/``idle`` corrections, events with
      ``metadata.source == "activity_watcher"``), then the oldest queued message is
      pasted when the pane is quiet and marked delivered (or failed with tmux's error).

    Every end revokes the agent's tokens and fails its queued messages. Then sessions
    tagged ``instance_id`` (default: this instance) whose agent is missing or not alive
    are killed; other sessions are never touched. ``instance_id`` and ``holder`` exist
    for tests that play a second instance or process.
    """
    who = holder or presence.current_process_id()
    if not supervisor_lease_claim(holder=who):
        return SupervisePass(held=False)
    tmux = _runner(runner)
    instance = instance_id or instance_identity_get().instance_id
    # Rows first, then sessions: an agent read as running already has its session.
    watched = list(
        Agent.objects.filter(host=presence.HOSTNAME, status__in=_ALIVE, peer_agent_id="")
        .exclude(type=services.EXPERT)
        .order_by("pk")
    )
    try:
        owned = set(tmux.owned_sessions(instance))
    except TmuxError as error:
        logger.warning("supervisor could not list tmux sessions: %s", error)
        return SupervisePass(held=True)
    busy = False
    renewed = time.monotonic()
    for agent in watched:
        if time.monotonic() - renewed > settings.CLI_SUPERVISE_INTERVAL:
            if not supervisor_lease_claim(holder=who):
                return SupervisePass(held=False)
            renewed = time.monotonic()
        try:
            busy |= _supervise_agent(agent=agent, runner=tmux, owned=owned, instance_id=instance)
        except Exception as exc:
            if database_unavailable(exc):
                raise  # the whole pass fails; the supervisor loop backs off and logs once
            logger.exception("supervising agent %s failed", agent.pk)
    _clean_orphans(runner=tmux, instance_id=instance)
    return SupervisePass(held=True, busy=busy)


def _supervise_agent(*, agent: Agent, runner: TmuxRunner, owned: set[str], instance_id: str) -> bool:
    """One agent's share of a pass; True if it still has messages waiting."""
    name = session_name(agent)
    if agent.status == Status.CREATING:
        if timezone.now() - agent.updated_at <= timedelta(seconds=CREATING_GRACE):
            return False  # its launcher is (probably) starting it right now
        if name not in owned:
            _start_session(agent=agent, runner=runner, instance_id=instance_id)
        else:  # the launcher started the session but died before recording it
            _settle(agent=agent, status=Status.RUNNING, note="session started")
        return False
    if name not in owned:
        _ended(agent=agent, status=Status.STOPPED, note="session missing; marked stopped")
        return False
    try:
        state = runner.pane_state(name)
    except TmuxSessionNotFound:
        _ended(agent=agent, status=Status.STOPPED, note="session missing; marked stopped")
        return False
    if state.dead:
        if state.exit_status == 0 or agent.status == Status.STOPPING:
            _ended(agent=agent, status=Status.STOPPED, note=f"session ended (exit status {state.exit_status})")
        else:
            how = f"exit status {state.exit_status}" if state.signal is None else f"signal {state.signal}"
            lines = _last_lines(runner, name)
            _ended(agent=agent, status=Status.ERROR, note=f"session ended ({how}):\n{lines}")
        _kill_quietly(runner, name)
        return False
    if agent.status == Status.STOPPING:
        _supervise_stopping(agent=agent, runner=runner)
        return False
    _watch_activity(agent=agent, runner=runner)
    return _deliver(agent=agent, runner=runner)


def _last_lines(runner: TmuxRunner, name: str) -> str:
    try:
        return runner.capture(name, lines=ERROR_LINES)
    except TmuxError:
        return ""


def _supervise_stopping(*, agent: Agent, runner: TmuxRunner) -> None:
    """Interrupt once, then kill after the grace period (or the hard limit) and mark ``stopped``."""
    since = agent.stop_requested_at or agent.updated_at
    elapsed = (timezone.now() - since).total_seconds()
    grace, limit = settings.AGENT_STOP_GRACE, settings.AGENT_STOP_TIMEOUT
    if elapsed >= min(grace, limit):
        _kill_quietly(runner, session_name(agent))
        if elapsed >= limit:
            note = f"session killed: stopping for over {limit:g} s"
        else:
            note = f"session killed after the {grace:g} s stop grace period"
        _ended(agent=agent, status=Status.STOPPED, note=note)
    elif not agent.stop_interrupted:
        _interrupt(agent=agent, runner=runner)


def _reported_state(agent: Agent) -> str | None:
    """The type of the agent's newest non-``system`` event (what it last reported), or None."""
    return (
        AgentEvent.objects.filter(agent=agent)
        .exclude(type=AgentEvent.Type.SYSTEM)
        .order_by("-created_at", "-pk")
        .values_list("type", flat=True)
        .first()
    )


def _watch_activity(*, agent: Agent, runner: TmuxRunner) -> None:
    """The activity watcher: hash the pane's last ``WATCH_LINES`` lines and correct the state.

    Output changed while the agent last reported a non-working state (or nothing) →
    a ``working`` event; unchanged for ``DISPATCH_AGENT_IDLE_AFTER`` s while ``working`` →
    an ``idle`` event. The first look only records the hash.
    """
    try:
        text = runner.capture(session_name(agent), lines=WATCH_LINES)
    except TmuxError:
        return
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    now = timezone.now()
    if digest != agent.pane_hash:
        Agent.objects.filter(pk=agent.pk).update(pane_hash=digest, pane_changed_at=now)
        reported = _reported_state(agent)
        if agent.pane_hash and reported != AgentEvent.Type.WORKING:
            services.agent_event_record(
                agent=agent,
                type=AgentEvent.Type.WORKING,
                message="output changed: working",
                metadata={"source": WATCHER, "reported": reported},
            )
        return
    if agent.pane_changed_at is None:
        Agent.objects.filter(pk=agent.pk).update(pane_changed_at=now)
        return
    silent = (now - agent.pane_changed_at).total_seconds()
    if silent >= settings.AGENT_IDLE_AFTER and _reported_state(agent) == AgentEvent.Type.WORKING:
        services.agent_event_record(
            agent=agent,
            type=AgentEvent.Type.IDLE,
            message=f"no output for {int(silent)} s: idle",
            metadata={"source": WATCHER, "silent_seconds": int(silent)},
        )


def _quiet(runner: TmuxRunner, name: str) -> bool:
    """True if the pane shows something and stays unchanged for ``QUIET`` s."""
    before = runner.capture(name, lines=WATCH_LINES)
    if not before.strip():
        return False
    time.sleep(QUIET)
    return runner.capture(name, lines=WATCH_LINES) == before


def _deliver(*, agent: Agent, runner: TmuxRunner) -> bool:
    """Paste the oldest queued message when the pane is quiet; True if messages still wait."""
    pending = messages.messages_pending(agent=agent)
    if not pending:
        return False
    name = session_name(agent)
    message = pending[0]
    waited = (timezone.now() - message.created_at).total_seconds()
    try:
        # A pane that never goes quiet (a ticking clock, ``tail -f``) or stays blank still
        # gets the message after PASTE_ANYWAY_AFTER seconds: waiting forever helps nobody.
        if waited < PASTE_ANYWAY_AFTER and not _quiet(runner, name):
            return True
        runner.paste(name, message.content)
    except TmuxSessionNotFound:
        return False  # the next pass marks it stopped and fails the rest
    except TmuxError as error:
        messages.message_mark_failed(message=message, error=str(error))
        return len(pending) > 1
    messages.message_mark_delivered(message=message)
    return len(pending) > 1


def _clean_orphans(*, runner: TmuxRunner, instance_id: str) -> None:
    """Kill sessions tagged ``instance_id`` whose agent is missing or not alive."""
    try:
        names = runner.owned_sessions(instance_id)
    except TmuxError as error:
        logger.warning("supervisor could not list tmux sessions: %s", error)
        return
    for name in names:
        agent_id = name.removeprefix("dispatch_")
        status = Agent.objects.filter(pk=agent_id).values_list("status", flat=True).first()
        if status is None or status not in _ALIVE:
            logger.info("supervisor kills orphaned session %s (agent %s)", name, status or "missing")
            _kill_quietly(runner, name)
