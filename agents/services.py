"""Every write about agents: status, events, runs, archive (docs/agents.md#status-changes,
docs/agents.md#the-expert-agent).

Each change is announced after commit to the owner's live-events group
(``user_events_group``) as ``{"type": "user.event", "event": <name>, "data": {...}}``;
event names are the SSE frame names of docs/agents.md#the-live-event-stream (``agent.upsert``,
``agent.deleted``, ``run.updated``) plus ``agent.event`` for a new timeline entry. The
channel layer is only a doorbell: the rows are the truth.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from agents.models import Agent, AgentEvent, Run
from agents.protocol import UserEventMessage
from agents.selectors import is_valid_id, not_found
from agents.serializers import agent_data, event_data, run_data
from agents.signals import agent_event_recorded, agent_status_changed, send_on_commit
from core import wire
from core.errors import DispatchError, InvalidRequest, NotFound
from core.presence import HOSTNAME
from core.realtime import ring_on_commit

logger = logging.getLogger(__name__)

EXPERT = "expert"
MAX_NAME_LENGTH = 100
MAX_EVENT_MESSAGE_LENGTH = 50_000
MAX_INSTRUCTION_LENGTH = 200_000
RESERVED_OPTION_KEYS = frozenset({"instruction", "input"})
WORKER_LOST = "worker lost"
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")

Status = Agent.Status

# The only status changes there are (docs/agents.md#status-changes), "any but archived →
# archived" included.
TRANSITIONS: dict[str, frozenset[str]] = {
    Status.CREATING: frozenset({Status.RUNNING, Status.ERROR, Status.STOPPED, Status.ARCHIVED}),
    Status.RUNNING: frozenset({Status.STOPPING, Status.STOPPED, Status.ERROR, Status.ARCHIVED}),
    Status.STOPPING: frozenset({Status.STOPPED, Status.ERROR, Status.ARCHIVED}),
    Status.STOPPED: frozenset({Status.CREATING, Status.ARCHIVED}),
    Status.ERROR: frozenset({Status.CREATING, Status.ARCHIVED}),
    Status.ARCHIVED: frozenset(),
}


# --- live events -------------------------------------------------------------------------


def user_events_group(user_id: int) -> str:
    """The channel-layer group of one user's live events: ``user.<id>``."""
    return f"user.{int(user_id)}"


def publish_on_commit(*, user_id: int, event: str, data: dict[str, Any]) -> None:
    """Send ``{"type": "user.event", "event", "data"}`` to the user's group after commit.

    ``data`` must be JSON-safe. Sent at once when no transaction is open. A full channel
    or an unreachable layer loses the doorbell, never the change: readers reload from the
    rows (``core.realtime.ring_on_commit``; never raises).
    """
    ring_on_commit(user_events_group(user_id), UserEventMessage(event=event, data=data))


def _publish_agent(agent: Agent) -> None:
    publish_on_commit(user_id=agent.owner_id, event="agent.upsert", data=agent_data(agent))


def _publish_run(run: Run, owner_id: int) -> None:
    publish_on_commit(user_id=owner_id, event="run.updated", data=run_data(run))


# --- agents ------------------------------------------------------------------------------


def agent_types() -> tuple[str, ...]:
    """Every agent type this instance knows: ``expert`` and the CLI types.

    CLI types come from ``settings.AGENT_TYPES`` (``DISPATCH_AGENT_TYPES``, parsed by
    ``agents.types``; the default types when unset, docs/agents.md#agent-types). A
    type whose program is not on PATH is still known, only not launchable.
    """
    return (EXPERT, *settings.AGENT_TYPES)


def storable_text(value: str, what: str) -> str:
    """``value`` if every database can store it: no NUL, no lone surrogate.

    PostgreSQL refuses NUL in text; a lone surrogate is not Unicode and no UTF-8 wire
    carries it (``core.wire``). Raises ``InvalidRequest``.
    """
    if "\x00" in value or not wire.encodable(value):
        raise InvalidRequest(f"{what} holds a NUL character or a lone surrogate")
    return value


def _validated_name(name: str) -> str:
    name = name.strip() if isinstance(name, str) else ""
    if not 1 <= len(name) <= MAX_NAME_LENGTH:
        raise InvalidRequest(f"name must be 1 to {MAX_NAME_LENGTH} characters")
    return storable_text(name, "name")


def validate_cwd(cwd: str) -> str:
    """The agent directory as an absolute path (docs/agents.md#launch-start-stop-archive).

    A leading ``~`` is expanded; the result must be absolute, exist and be a directory.
    Raises ``InvalidRequest`` otherwise.
    """
    if not isinstance(cwd, str) or not cwd.strip() or "\x00" in cwd:
        raise InvalidRequest("cwd must be an absolute directory")
    expanded = os.path.expanduser(cwd.strip())
    if not os.path.isabs(expanded):
        raise InvalidRequest(f"cwd must be an absolute directory, not '{cwd}'")
    if not os.path.isdir(expanded):
        raise InvalidRequest(f"cwd '{expanded}' is not an existing directory")
    return os.path.normpath(expanded)


def _own_agent(owner: User, agent: Agent | None, role: str) -> Agent | None:
    if agent is not None and agent.owner_id != owner.pk:
        raise NotFound(f"no agent '{agent.pk}'", {"field": role})
    return agent


@transaction.atomic
def agent_create(
    *,
    owner: User,
    type: str,
    name: str,
    cwd: str,
    parent: Agent | None = None,
    launched_by: Agent | None = None,
    full_access: bool = False,
    launched_by_peer: Mapping[str, Any] | None = None,
) -> Agent:
    """Insert an agent (docs/agents.md#the-agent-record) and announce it.

    ``type`` is one of ``agent_types()``; ``name`` 1–100 characters (trimmed); ``cwd`` as
    ``validate_cwd``; ``parent`` and ``launched_by`` must be ``owner``'s agents. An
    ``expert`` agent has no process and starts ``running``; a CLI agent starts
    ``creating`` (its launcher starts tmux and moves it on). ``launched_by_peer`` is
    ``{instance_id, agent_id | null, name}`` for an agent a peer launched (docs/peers.md#using-a-link).
    Raises ``InvalidRequest``,
    or ``NotFound`` for another user's parent or launcher.
    """
    if type not in agent_types():
        raise InvalidRequest(f"unknown agent type '{type}'; known types: {', '.join(agent_types())}")
    agent = Agent.objects.create(
        owner=owner,
        type=type,
        name=_validated_name(name),
        cwd=validate_cwd(cwd),
        parent=_own_agent(owner, parent, "parent"),
        launched_by=_own_agent(owner, launched_by, "launched_by"),
        full_access=bool(full_access),
        launched_by_peer=_json_object(launched_by_peer, "launched_by_peer") if launched_by_peer else None,
        status=Status.RUNNING if type == EXPERT else Status.CREATING,
        host=HOSTNAME,
    )
    _publish_agent(agent)
    return agent


@transaction.atomic
def agent_set_status(*, agent: Agent, status: str, note: str = "") -> Agent:
    """Move ``agent`` to ``status`` if the transition table of docs/agents.md#status-changes
    allows it.

    Reads the current status under a row lock, so two concurrent changes are judged one
    after the other. ``note``, when given, is recorded as a ``system`` event (and, for
    ``error``, as ``last_error``). Raises ``DispatchError("CONFLICT")`` (409) for any
    transition not in the table, the same status included. Returns the updated agent
    (the object passed in is updated too).
    """
    if status not in Status.values:
        raise InvalidRequest(f"unknown agent status '{status}'")
    current = Agent.objects.select_for_update().select_related("owner").get(pk=agent.pk)
    if status not in TRANSITIONS[current.status]:
        raise DispatchError(
            "CONFLICT",
            f"agent '{agent.pk}' cannot go from {current.status} to {status}",
            {"from": current.status, "to": status},
        )
    previous = current.status
    current.status = status
    current.updated_at = timezone.now()
    fields = ["status", "updated_at"]
    if status == Status.ERROR and note:
        current.last_error = note
        fields.append("last_error")
    current.save(update_fields=fields)
    send_on_commit(agent_status_changed, Agent, agent=current, previous=previous, status=status)
    if note:  # the event announces the agent as it is now, status included
        agent_event_record(
            agent=current, type=AgentEvent.Type.SYSTEM, message=note, metadata={"from": previous, "to": status}
        )
        current.refresh_from_db()
    else:
        _publish_agent(current)
    for field in ("status", "updated_at", "last_error", "latest_event_type", "latest_event_message", "latest_event_at"):
        setattr(agent, field, getattr(current, field))
    return current


@transaction.atomic
def agent_archive(*, agent: Agent, note: str = "") -> Agent:
    """Archive (soft-delete) ``agent``; idempotent (docs/agents.md#launch-start-stop-archive).

    Queued and running runs are cancelled first, so nothing keeps working for a hidden
    agent (stopping a CLI agent's tmux session is its launcher's job). Announces
    ``agent.upsert`` and ``agent.deleted``.
    """
    # Agent row first, then its runs: the order run_claim_next takes them in.
    if Agent.objects.select_for_update().get(pk=agent.pk).status == Status.ARCHIVED:
        agent.refresh_from_db()
        return agent
    for run in Run.objects.filter(agent=agent, status__in=[Run.Status.QUEUED, Run.Status.RUNNING]):
        _run_close(run=run, status=Run.Status.CANCELLED, error="agent archived", owner_id=agent.owner_id)
    archived = agent_set_status(agent=agent, status=Status.ARCHIVED, note=note)
    publish_on_commit(user_id=archived.owner_id, event="agent.deleted", data={"id": archived.pk})
    return archived


# --- events ------------------------------------------------------------------------------


def _json_object(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"{what} must be a JSON object")
    return dict(json.loads(_json_text(dict(value), what)))


def _json_text(value: Any, what: str) -> str:
    """``value`` as storable JSON text.

    ``json.dumps`` writes a NUL as the escape ``\\u0000``, which PostgreSQL's jsonb
    refuses: an escape preceded by an even number of backslashes is one.
    """
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        raise InvalidRequest(f"{what} must be JSON-serialisable") from None
    if _JSON_NUL.search(text):
        raise InvalidRequest(f"{what} holds a NUL character")
    return storable_text(text, what)


@transaction.atomic
def agent_event_record(
    *,
    agent: Agent,
    type: str,
    message: str,
    metadata: Mapping[str, Any] | None = None,
    run: Run | None = None,
    created_at: datetime | None = None,
    mirrored: bool = False,
    latest: bool = True,
) -> AgentEvent | None:
    """Append an event to ``agent``'s timeline (docs/agents.md#the-timeline) and announce it.

    ``type`` is an ``AgentEvent.Type``; ``message`` at most 50,000 characters;
    ``metadata`` a JSON object. ``created_at`` defaults to now (a mirrored event passes
    the peer's time). A mirrored event already recorded for ``(agent, created_at, type)``
    adds nothing and returns ``None``. The agent's ``latest_event_*`` follow the newest
    event by ``created_at`` (an older replayed event does not overwrite them), unless
    ``latest`` is False: a side note (one MCP call the agent made, docs/agents.md#hooks)
    is on the timeline without hiding what the agent last reported.
    """
    if type not in AgentEvent.Type.values:
        raise InvalidRequest(f"unknown event type '{type}'; known types: {', '.join(AgentEvent.Type.values)}")
    if not isinstance(message, str) or len(message) > MAX_EVENT_MESSAGE_LENGTH:
        raise InvalidRequest(f"message must be text of at most {MAX_EVENT_MESSAGE_LENGTH} characters")
    storable_text(message, "message")
    if run is not None and run.agent_id != agent.pk:
        raise InvalidRequest(f"run '{run.pk}' is not a run of agent '{agent.pk}'")
    happened_at = created_at or timezone.now()
    try:
        with transaction.atomic():
            event = AgentEvent.objects.create(
                agent=agent,
                run=run,
                type=type,
                message=message,
                metadata=_json_object(metadata, "metadata"),
                created_at=happened_at,
                mirrored=mirrored,
            )
    except IntegrityError:
        if mirrored:
            return None
        raise
    publish_on_commit(user_id=agent.owner_id, event="agent.event", data=event_data(event))
    send_on_commit(agent_event_recorded, AgentEvent, event=event)
    if not latest:
        return event
    Agent.objects.filter(pk=agent.pk).filter(
        Q(latest_event_at__isnull=True) | Q(latest_event_at__lte=happened_at)
    ).update(
        latest_event_type=type,
        latest_event_message=message,
        latest_event_at=happened_at,
        updated_at=timezone.now(),
    )
    fresh = Agent.objects.select_related("owner", "peer").get(pk=agent.pk)
    _publish_agent(fresh)
    return event


# --- runs --------------------------------------------------------------------------------


def prompt_options_validate(options: Mapping[str, Any]) -> dict[str, Any]:
    """Prompt options as a JSON-safe dict (docs/agents.md#prompts-and-runs).

    Raises ``InvalidRequest`` for the reserved keys ``instruction`` and ``input`` or for a
    value that is not JSON. Checking what each option means is its consumer's job.
    """
    if not isinstance(options, Mapping):
        raise InvalidRequest("options must be a JSON object")
    reserved = sorted(RESERVED_OPTION_KEYS & set(options))
    if reserved:
        raise InvalidRequest(f"options may not use the reserved key '{reserved[0]}'")
    return _json_object(options, "options")


@transaction.atomic
def run_enqueue(*, agent: Agent, instruction: str, input: Any = None, **options: Any) -> Run:
    """Queue a prompt for an expert agent (docs/agents.md#the-expert-agent).

    ``Run.input`` becomes ``{"instruction", "input", **options}``. Runs of one agent are
    processed one at a time, first in first out (``run_claim_next``). Raises
    ``InvalidRequest`` for an empty instruction, a CLI agent (its prompt is a message) or
    bad options, and ``CONFLICT`` when the agent is not running (a stopped expert agent
    refuses prompts).
    """
    if not isinstance(instruction, str) or not instruction.strip():
        raise InvalidRequest("instruction must be a non-empty string")
    if len(instruction) > MAX_INSTRUCTION_LENGTH:
        raise InvalidRequest(f"instruction must be at most {MAX_INSTRUCTION_LENGTH} characters")
    storable_text(instruction, "instruction")
    checked = prompt_options_validate(options)
    _json_text(input, "input")
    current = Agent.objects.select_for_update().get(pk=agent.pk)
    if current.type != EXPERT:
        raise InvalidRequest(f"agent '{agent.pk}' is a {current.type} agent: its prompts are messages, not runs")
    if current.status != Status.RUNNING:
        raise DispatchError(
            "CONFLICT", f"agent '{agent.pk}' is not running (status {current.status})", {"status": current.status}
        )
    run = Run.objects.create(agent=current, input={"instruction": instruction, "input": input, **checked})
    _publish_run(run, current.owner_id)
    return run


def run_claim_next(*, process_id: str) -> Run | None:
    """Claim the oldest queued run whose agent has no running run, for ``process_id``.

    Claims are a conditional UPDATE (``status='queued'`` and no running run of the same
    agent), taken while holding the agent's row lock, so two processes never claim the
    same run nor two runs of one agent. Runs of agents that are
    not ``running`` stay queued. Returns the claimed run (status ``running``,
    ``claimed_by`` = ``process_id``) or ``None`` when there is nothing to do.
    """
    for _ in range(10):
        candidate = (
            Run.objects.filter(status=Run.Status.QUEUED, agent__status=Status.RUNNING)
            .exclude(agent__runs__status=Run.Status.RUNNING)
            .order_by("created_at", "id")
            .values_list("pk", "agent_id")
            .first()
        )
        if candidate is None:
            return None
        run_id, agent_id = candidate
        with transaction.atomic():
            owner_id = Agent.objects.select_for_update().values_list("owner_id", flat=True).get(pk=agent_id)
            claimed = (
                Run.objects.filter(pk=run_id, status=Run.Status.QUEUED)
                .exclude(agent__runs__status=Run.Status.RUNNING)
                .update(status=Run.Status.RUNNING, claimed_by=process_id, started_at=timezone.now())
            )
            if claimed:
                run = Run.objects.get(pk=run_id)
                _publish_run(run, owner_id)
                return run
    return None


def _run_close(*, run: Run, status: str, owner_id: int, output: str = "", error: str = "") -> bool:
    """Finish a queued or running run with a conditional UPDATE; False if it had finished."""
    closed = Run.objects.filter(pk=run.pk, status__in=[Run.Status.QUEUED, Run.Status.RUNNING]).update(
        status=status, output=output, error=error, finished_at=timezone.now()
    )
    run.refresh_from_db()
    if closed:
        _publish_run(run, owner_id)
    return bool(closed)


@transaction.atomic
def run_finish(*, run: Run, status: str, output: str | None = None, error: str | None = None) -> Run:
    """Record the end of a running run: ``succeeded``, ``failed`` or ``cancelled``.

    A run that was finished meanwhile (cancelled by its user, failed as orphaned) keeps
    its first ending: the late result is dropped and the stored run returned. Raises
    ``InvalidRequest`` for another status.
    """
    finished = {Run.Status.SUCCEEDED, Run.Status.FAILED, Run.Status.CANCELLED}
    if status not in finished:
        raise InvalidRequest(f"a run ends succeeded, failed or cancelled, not '{status}'")
    owner_id = Agent.objects.values_list("owner_id", flat=True).get(pk=run.agent_id)
    _run_close(run=run, status=status, output=output or "", error=error or "", owner_id=owner_id)
    return run


@transaction.atomic
def run_cancel(*, user: User, run_id: str) -> Run:
    """Cancel one of ``user``'s queued or running runs (``POST /api/v1/runs/{id}/cancel``).

    A running run's worker sees the status at its next step and stops. Raises
    ``NotFound`` for another user's run and ``CONFLICT`` for a finished one.
    """
    run = Run.objects.filter(pk=run_id, agent__owner=user).first() if is_valid_id(run_id) else None
    if run is None:
        raise not_found("run", run_id)
    if not _run_close(run=run, status=Run.Status.CANCELLED, error="cancelled", owner_id=user.pk):
        raise DispatchError("CONFLICT", f"run '{run_id}' has already finished ({run.status})", {"status": run.status})
    return run


def runs_fail_orphaned(*, alive_process_ids: Iterable[str]) -> list[Run]:
    """Fail every running run whose claiming process is not alive ("worker lost").

    Never requeued: a replay could repeat a command on a machine.
    Each failure is also a ``system`` event on the agent. Returns the failed runs.
    """
    alive = list(alive_process_ids)
    orphans = list(Run.objects.filter(status=Run.Status.RUNNING).exclude(claimed_by__in=alive).select_related("agent"))
    failed = []
    for run in orphans:
        with transaction.atomic():
            closed = Run.objects.filter(pk=run.pk, status=Run.Status.RUNNING, claimed_by=run.claimed_by).update(
                status=Run.Status.FAILED, error=WORKER_LOST, finished_at=timezone.now()
            )
            if not closed:
                continue
            run.refresh_from_db()
            _publish_run(run, run.agent.owner_id)
            agent_event_record(
                agent=run.agent,
                run=run,
                type=AgentEvent.Type.SYSTEM,
                message=f"run {run.pk} failed: {WORKER_LOST}",
                metadata={"run_id": run.pk, "claimed_by": run.claimed_by},
            )
            failed.append(run)
    if failed:
        logger.warning("failed %d orphaned run(s): %s", len(failed), ", ".join(run.pk for run in failed))
    return failed
