"""The CLI supervisor of this host (docs/agents.md#the-supervisor): lease, passes, the activity watcher.

``supervise_once`` is run by ``dispatch.background.cli_supervisor_loop`` every
``DISPATCH_CLI_SUPERVISE_INTERVAL`` seconds or sooner when ``messages.doorbell_ring``
rings. Only the holder of the host's ``SupervisorLease`` acts, and only on this host's
agents and on sessions tagged with this instance's id: it pastes queued messages (the
prompt is the first one) once the pane is quiet, finishes stops after the grace period,
notices dead panes and missing sessions, corrects ``working``/``idle`` from the pane's
activity and kills orphaned sessions. Its state lives in the rows (``Agent.pane_hash``,
``pane_changed_at``, ``stop_requested_at``, ``stop_interrupted``), so a new lease holder —
or a restarted Dispatch — simply continues; running agents are never killed or reset at
start. The session steps themselves are ``agents.cli``'s.

Every function is synchronous (tmux subprocesses, short sleeps, the ORM): the loop runs
it in a worker thread of its own, never on the event loop nor the shared sync thread.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from agents import cli, cli_hooks, messages, services
from agents.models import Agent, AgentEvent, SupervisorLease
from agents.tmux import TmuxError, TmuxPaneDead, TmuxRunner, TmuxSessionNotFound, pasteable
from core import presence
from core.errors import database_unavailable
from core.services import instance_identity_get

logger = logging.getLogger(__name__)

Status = Agent.Status

# Lines of a dead pane kept in ``last_error``.
ERROR_LINES = 20
# Lines of the pane the activity watcher hashes.
WATCH_LINES = 100
RECOVER_LINES = 300  # pane lines searched for a message a dead supervisor may have pasted
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
# Seconds a message pasted into a CLI with hooks waits for the ``UserPromptSubmit`` that
# confirms it before it is failed. The CLIs fire that hook within a second or two of the
# Enter even on a loaded 2-core machine (one Python start and one local HTTP call); a paste
# that nothing confirms in 20 s landed in a dialog or a composer that did not submit, and
# the sender should hear it while the pane still shows why (docs/agents.md#hooks).
DELIVERY_CONFIRM = 20.0
NOT_TAKEN = (
    f"the CLI did not take the message (no UserPromptSubmit within {DELIVERY_CONFIRM:g} s; "
    "a dialog may be open — see the pane)"
)
# Seconds a message waits for a CLI with hooks to become ready before it is failed: a
# start takes seconds, so a minute without SessionStart (or codex's input line) means
# something is in the way — a dialog, or hooks that cannot reach DISPATCH_URL — and the
# sender should hear why instead of waiting on a queued message forever.
READY_WAIT = 60.0
NEVER_READY = (
    f"the CLI did not get ready within {READY_WAIT:g} s (no SessionStart hook; a dialog may be "
    "open, or its hooks cannot reach DISPATCH_URL — see the pane)"
)
# What a CLI with hooks last reported while nothing may be pasted: a turn running (the
# message waits for ``done``/``idle``), a permission prompt on screen (a paste would answer it).
BUSY_STATES = frozenset({AgentEvent.Type.WORKING, AgentEvent.Type.BLOCKED})
# codex fires SessionStart only at the first prompt (docs/agents.md#hooks), so until then
# its input line on the pane says it is ready: a line starting with "›" that is not a
# numbered choice ("› 1. Trust and continue", "› 1. Review hooks" are dialogs).
CODEX_INPUT = re.compile(r"^\s*›(?!\s*\d+\.)", re.MULTILINE)
CODEX_CHOICE = re.compile(r"^\s*›\s*\d+\.", re.MULTILINE)
_ALIVE = (Status.CREATING, Status.RUNNING, Status.STOPPING)


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
    """One pass of the CLI supervisor of this host (docs/agents.md#the-supervisor).

    Acts only if ``holder`` (default: this process's id) holds or can claim the host's
    lease. For each CLI agent of this host (shadow agents skipped) that is creating,
    running or stopping:

    - ``creating`` for over ``CREATING_GRACE`` s: started here if it has no session,
      else marked ``running`` (its launcher died half-way);
    - session missing (or not tagged ``instance_id``) → ``stopped`` with a note;
    - pane dead → ``stopped`` (exit status 0, or it was ``stopping``) or ``error`` with
      the pane's last lines in ``last_error``, its queued messages failed with that
      reason; the session is killed;
    - ``stopping``: the type's stop keys sent once (``cli.session_stop_keys``), killed and
      ``stopped`` after the grace period or the hard limit
      (``DISPATCH_AGENT_STOP_GRACE``/``_TIMEOUT``) if the pane still lives;
    - ``running``: the activity watcher (``working``/``idle`` corrections, events with
      ``metadata.source == "activity_watcher"``), then the oldest queued message is
      pasted when the pane is quiet — neutralised for an ``llm`` type
      (``AgentType.neutralise``), only into a live pane — and marked delivered (or failed
      with tmux's error); a pane found dead at the paste ends the agent as above.

    Every end revokes the agent's tokens and fails its queued messages. Then sessions
    tagged ``instance_id`` (default: this instance) whose agent is missing or not alive
    are killed; other sessions are never touched. ``instance_id`` and ``holder`` exist
    for tests that play a second instance or process.
    """
    who = holder or presence.current_process_id()
    if not supervisor_lease_claim(holder=who):
        return SupervisePass(held=False)
    tmux = cli.tmux_runner(runner)
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
    name = cli.session_name(agent)
    if agent.status == Status.CREATING:
        if timezone.now() - agent.updated_at <= timedelta(seconds=CREATING_GRACE):
            return False  # its launcher is (probably) starting it right now
        if name not in owned:
            cli.session_start(agent=agent, runner=runner, instance_id=instance_id)
        else:  # the launcher started the session but died before recording it
            cli.agent_settle(agent=agent, status=Status.RUNNING, note="session started")
        return False
    if name not in owned:
        cli.agent_ended(agent=agent, status=Status.STOPPED, note="session missing; marked stopped")
        return False
    try:
        state = runner.pane_state(name)
    except TmuxSessionNotFound:
        cli.agent_ended(agent=agent, status=Status.STOPPED, note="session missing; marked stopped")
        return False
    if state.dead:
        _end_dead_pane(agent=agent, runner=runner)
        return False
    if agent.status == Status.STOPPING:
        _supervise_stopping(agent=agent, runner=runner)
        return False
    family = hook_family(agent)
    if family is not None and agent.ready_at is None:
        # The pass read its rows before this CLI's SessionStart may have come in.
        agent.ready_at = Agent.objects.values_list("ready_at", flat=True).get(pk=agent.pk)
    # Once the CLI reports through its hooks, the pane's activity is no judge of its state
    # (a spinner beside a permission prompt is not work, a static dialog is not idle).
    if family is None or agent.ready_at is None:
        _watch_activity(agent=agent, runner=runner)
    return _deliver(agent=agent, runner=runner)


def hook_family(agent: Agent) -> str | None:
    """The CLI family whose hooks ``agent``'s type wires (``AgentType.hooks``: ``"claude"``,
    ``"codex"``), or ``None`` for a type without hooks (shell, opencode)."""
    spec = settings.AGENT_TYPES.get(agent.type)
    return spec.hooks if spec is not None else None


def _hooked_ready(*, agent: Agent, family: str, runner: TmuxRunner) -> bool:
    """Whether a CLI with hooks takes input: its SessionStart came (``ready_at``); for codex,
    whose SessionStart waits for the first prompt, its input line on the pane also counts."""
    if agent.ready_at is not None:
        return True
    if family != "codex":
        return False
    try:
        screen = runner.capture(cli.session_name(agent), lines=WATCH_LINES)
    except TmuxError:
        return False
    return CODEX_INPUT.search(screen) is not None and CODEX_CHOICE.search(screen) is None


def _hooked_wait(*, agent: Agent, family: str, runner: TmuxRunner) -> bool | None:
    """For a CLI with hooks: ``None`` when its next queued message may be pasted now, else
    whether to look again soon (True) or wait for a hook's doorbell (False).

    One pasted message at a time: while one waits for its ``UserPromptSubmit`` nothing else
    is pasted, and past ``DELIVERY_CONFIRM`` s it is failed (``NOT_TAKEN``). Nothing is
    pasted before the CLI is ready (``_hooked_ready``; a message that waited ``READY_WAIT``
    s for that is failed, ``NEVER_READY``) nor while it last reported
    ``working`` or ``blocked`` (``BUSY_STATES``) — its Stop, idle or SessionStart hook rings
    the supervisor's doorbell."""
    unconfirmed = messages.messages_pasted_unconfirmed(agent=agent)
    if unconfirmed:
        message = unconfirmed[0]
        pasted_at = message.pasted_at or timezone.now()
        if (timezone.now() - pasted_at).total_seconds() < DELIVERY_CONFIRM:
            return False
        messages.message_mark_failed(message=message, error=NOT_TAKEN)
        return len(unconfirmed) > 1 or bool(messages.messages_pending(agent=agent))
    pending = messages.messages_pending(agent=agent)
    if not pending:
        return False
    if not _hooked_ready(agent=agent, family=family, runner=runner):
        oldest = pending[0]
        if (timezone.now() - oldest.created_at).total_seconds() >= READY_WAIT:
            messages.message_mark_failed(message=oldest, error=NEVER_READY)
            return len(pending) > 1
        return family == "codex"  # its input line is looked for on the pane; Claude's SessionStart rings
    if cli_hooks.hook_state(agent) in BUSY_STATES:
        return False
    return None


def _end_dead_pane(*, agent: Agent, runner: TmuxRunner) -> None:
    """The agent's pane is dead: ``stopped`` (exit status 0, or it was ``stopping``) or
    ``error`` with the pane's last lines in ``last_error`` — a CLI that exits at start
    lands here — its queued messages failed saying why, then the session killed."""
    name = cli.session_name(agent)
    try:
        state = runner.pane_state(name)
    except TmuxSessionNotFound:
        cli.agent_ended(agent=agent, status=Status.STOPPED, note="session missing; marked stopped")
        return
    if state.exit_status == 0 or agent.status == Status.STOPPING:
        cli.agent_ended(agent=agent, status=Status.STOPPED, note=f"session ended (exit status {state.exit_status})")
    else:
        how = f"exit status {state.exit_status}" if state.signal is None else f"signal {state.signal}"
        lines = _last_lines(runner, name)
        cli.agent_ended(
            agent=agent,
            status=Status.ERROR,
            note=f"session ended ({how}):\n{lines}",
            reason=f"not delivered: the agent's program ended ({how}) before this message was pasted",
        )
    cli.session_kill(runner, name)


def _last_lines(runner: TmuxRunner, name: str) -> str:
    try:
        return runner.capture(name, lines=ERROR_LINES)
    except TmuxError:
        return ""


def _supervise_stopping(*, agent: Agent, runner: TmuxRunner) -> None:
    """Send the stop keys once, then — if the pane still lives — kill after the grace
    period (or the hard limit) and mark ``stopped``. A pane that dies of the keys is seen
    dead by a later pass and ends ``stopped`` without a kill (docs/agents.md#how-stop-works)."""
    since = agent.stop_requested_at or agent.updated_at
    elapsed = (timezone.now() - since).total_seconds()
    grace, limit = settings.AGENT_STOP_GRACE, settings.AGENT_STOP_TIMEOUT
    if elapsed >= min(grace, limit):
        cli.session_kill(runner, cli.session_name(agent))
        if elapsed >= limit:
            note = f"session killed: stopping for over {limit:g} s"
        else:
            note = f"session killed after the {grace:g} s stop grace period"
        cli.agent_ended(agent=agent, status=Status.STOPPED, note=note)
    elif not agent.stop_interrupted:
        cli.session_stop_keys(agent=agent, runner=runner)


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
        text = runner.capture(cli.session_name(agent), lines=WATCH_LINES)
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


def _pane_shows(runner: TmuxRunner, name: str, text: str) -> bool:
    """Whether the pane's recent text holds ``text``'s first line (wrapped rows joined
    back: line breaks are ignored on both sides)."""
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if not first:
        return False
    shown = runner.capture(name, lines=RECOVER_LINES).replace("\n", "")
    return first[:200].replace(" ", "") in shown.replace(" ", "")


def _deliver(*, agent: Agent, runner: TmuxRunner) -> bool:
    """Paste the oldest queued message when the pane is quiet; True if messages still wait
    and the next pass should come soon.

    For a type with hooks (``hook_family``) only when ``_hooked_wait`` allows it, and the
    message is then only ``pasted`` (``pasted_at``): ``delivered`` is the CLI's
    ``UserPromptSubmit`` hook's to say (``agents.cli_hooks``; docs/agents.md#hooks).
    Other types keep the pane's rule: pasted is delivered.

    The text is neutralised for the agent's type first (``AgentType.neutralise``: a
    leading ``!`` or ``/`` never reaches an ``llm`` CLI as a command) and the delivery
    event says so (``metadata.neutralised``). The paste happens only into a live pane
    (``TmuxRunner.paste``); a pane that died meanwhile ends the agent at once."""
    family = hook_family(agent)
    if family is not None:
        waiting = _hooked_wait(agent=agent, family=family, runner=runner)
        if waiting is not None:
            return waiting
    pending = messages.messages_pending(agent=agent)
    if not pending:
        return False
    name = cli.session_name(agent)
    message = pending[0]
    waited = (timezone.now() - message.created_at).total_seconds()
    spec = settings.AGENT_TYPES.get(agent.type)
    text = pasteable(message.content)
    pasted = spec.neutralise(text) if spec is not None else text
    noted = {"neutralised": True, "pasted_start": pasted[:40]} if pasted != text else None
    try:
        if family is None and message.pasted_at is not None:
            # Marked pasted by a supervisor that died before marking it delivered (a
            # SIGKILLed worker's tmux client may still have finished the paste): the pane
            # says whether it arrived, so the survivor neither repeats nor loses it.
            if _pane_shows(runner, name, pasted):
                messages.message_mark_delivered(message=message, metadata={**(noted or {}), "recovered": True})
                return len(pending) > 1
        # A pane that never goes quiet (a ticking clock, ``tail -f``) or stays blank still
        # gets the message after PASTE_ANYWAY_AFTER seconds: waiting forever helps nobody.
        elif waited < PASTE_ANYWAY_AFTER and not _quiet(runner, name):
            return True
        # Marked before the paste: the CLI's UserPromptSubmit may report the text before
        # this thread would get to it after the paste, and a supervisor killed between the
        # paste and ``delivered`` leaves the mark for the next one to check (above).
        elif not messages.message_mark_pasted(message=message):
            return False  # failed or stopped meanwhile
        runner.paste(name, pasted)
    except TmuxPaneDead:
        _end_dead_pane(agent=agent, runner=runner)
        return False
    except TmuxSessionNotFound:
        return False  # the next pass marks it stopped and fails the rest
    except TmuxError as error:
        messages.message_mark_failed(message=message, error=str(error))
        return len(pending) > 1
    if family is not None:
        return False  # pasted is not delivered: the CLI's UserPromptSubmit hook says when it took it
    messages.message_mark_delivered(message=message, metadata=noted)
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
            cli.session_kill(runner, name)
