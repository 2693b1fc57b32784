"""What an operation leaves behind: its ``AuditRecord`` (written before it is sent, its result
filled in with the path's recency once answered: docs/shim-protocol.md#audit), the machine's
last activity and health, and the path recency routing reads (docs/shim-protocol.md#routing)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import Any

from channels.db import database_sync_to_async
from django.contrib.auth.models import User
from django.db import DatabaseError, IntegrityError, transaction
from django.db.models import Case, F, Q, Value, When
from django.utils import timezone

from core import metrics
from core.errors import TemporarilyUnavailable
from machines.audit_note import audit_note
from machines.models import AuditRecord, Machine, PathRecency
from machines.services import router
from machines.services.inflight import inflight_delete
from machines.services.relay import Failed, LiveCommand, Result
from machines.shim.redaction import redact, redact_argv

logger = logging.getLogger(__name__)

_background: set[asyncio.Future[Any]] = set()


def in_background(work: Any) -> asyncio.Task[Any]:
    """Run ``work`` (a coroutine) as a task that outlives the caller; returns the task (a
    caller that needs the outcome awaits it through ``asyncio.shield``). Its failure is
    logged here, so none goes unseen when nobody awaits it.

    The task starts from an empty context: one copied from an async view would send its
    ``database_sync_to_async`` calls to that request's thread executor, which is gone
    once the response is sent ("CurrentThreadExecutor already quit"), losing the work.
    """
    task = asyncio.get_running_loop().create_task(work, context=contextvars.Context())
    _background.add(task)
    task.add_done_callback(_finished)
    return task


def _finished(task: asyncio.Task[Any]) -> None:
    _background.discard(task)
    if not task.cancelled() and task.exception() is not None:
        logger.warning("background write failed: %r", task.exception())


def after_reply(*, audit_id: int | None = None, **record: Any) -> None:
    """Write the audit record in the background, after the reply: fill in the one written
    before the send (``audit_id``), or write one for an operation refused before it."""
    if audit_id is None:
        in_background(database_sync_to_async(audit_record_create)(**record))
    else:
        in_background(database_sync_to_async(audit_record_finish)(record_id=audit_id, **record))


PENDING: dict[str, Any] = {"ok": False, "pending": True}
"""The ``result`` of an audit record written before its operation was sent (``AuditRecord.outcome``: running)."""


def audit_unwritable(exc: BaseException) -> TemporarilyUnavailable:
    """The 503 of an operation whose audit record could not be written: it was not sent."""
    return TemporarilyUnavailable(
        f"the operation was not sent: its audit record could not be written ({type(exc).__name__}: "
        f"{str(exc).strip()[:200]})",
        {"service": "database"},
    )


def audit_record_begin(
    *,
    user: User,
    session_id: str,
    machine_id: str,
    request_id: str,
    op: str,
    payload: dict[str, Any],
    caller: str,
    operation_id: str = "",
) -> int:
    """Record an operation about to be sent to ``machine_id`` (result ``PENDING``; one
    INSERT) and return the record's id for ``audit_record_finish``. Raises what the
    database raises (``DatabaseError``): the caller must then not send the operation."""
    record = AuditRecord.objects.create(
        user=user,
        session_id=session_id,
        machine_id=machine_id,
        request_id=request_id,
        op=op,
        details={**audit_details(op, payload), **audit_note()},
        result=PENDING,
        caller=caller[:200],
        operation_id=operation_id,
    )
    return int(record.pk)


def audit_record_finish(*, record_id: int, user: User, machine_id: str, result: dict[str, Any], **_record: Any) -> None:
    """Fill in the ``result`` (and the ``machine_id`` it ran on: a rerouted operation's
    last) of the record ``audit_record_begin`` wrote, and stamp the machine's activity as
    ``audit_record_create`` does. The other fields of the record are left as written."""
    AuditRecord.objects.filter(pk=record_id).update(machine_id=machine_id, result=result)
    _activity_stamped(user=user, machine_id=machine_id, result=result)


def audit_details(op: str, payload: dict[str, Any]) -> dict[str, Any]:
    """What an audit record keeps of a payload: paths, argv (redacted), sizes, env keys —
    never contents or env values (docs/shim-protocol.md#audit)."""
    details: dict[str, Any] = {}
    for key in ("path", "src", "dst", "cwd", "glob", "encoding", "offset", "length", "recursive", "timeout_seconds"):
        if key in payload and isinstance(payload[key], (str, int, float, bool)):
            details[key] = payload[key]
    if isinstance(payload.get("argv"), list):
        details["argv"] = redact_argv(payload["argv"])
    if isinstance(payload.get("command"), str):
        details["command"] = redact(payload["command"])
    if isinstance(payload.get("env"), dict):
        details["env_keys"] = sorted(str(k) for k in payload["env"])
    if isinstance(payload.get("content"), str):
        details["content_chars"] = len(payload["content"])
    return details


LAST_ACTIVE_RESOLUTION = 5.0
"""Seconds: a process stamps a machine's ``last_active_at`` at most this often (bench B4 in
bench/README.md: this was one UPDATE per operation). What reads it — the machine
list's ``last_active_at`` / ``last_active_ts`` — is that much behind at most."""


_last_active_written: dict[tuple[int, str], float] = {}  # (user id, machine_id) → monotonic time of the write


_LAST_ACTIVE_MAX = 10_000  # entries before the memo is emptied


def last_active_forget(*, user_id: int, machine_id: str) -> None:
    """Let the next successful operation on this machine stamp ``last_active_at`` at once
    (it (re)connected, or refused work)."""
    _last_active_written.pop((user_id, machine_id), None)


def audit_record_create(
    *,
    user: User,
    session_id: str,
    machine_id: str,
    request_id: str,
    op: str,
    payload: dict[str, Any],
    result: dict[str, Any],
    caller: str,
    operation_id: str = "",
) -> AuditRecord:
    """Record one routed operation (``request_id``: the envelope id the shim saw, so the
    record matches the shim's own audit log; ``operation_id``: the copy or pipe it is one
    step of, ``""`` for none) and stamp the machine's last activity: one
    INSERT, plus — at most once every ``LAST_ACTIVE_RESOLUTION`` seconds per machine and
    process, or when this process saw the machine refuse work — one UPDATE of
    ``last_active_at`` that also clears ``OVERLOADED`` (the health axis of docs/shim-protocol.md#machine-status)."""
    record = AuditRecord.objects.create(
        user=user,
        session_id=session_id,
        machine_id=machine_id,
        request_id=request_id,
        op=op,
        details={**audit_details(op, payload), **audit_note()},
        result=result,
        caller=caller[:200],
        operation_id=operation_id,
    )
    _activity_stamped(user=user, machine_id=machine_id, result=result)
    return record


def _activity_stamped(*, user: User, machine_id: str, result: dict[str, Any]) -> None:
    """The machine's ``last_active_at`` / health after an operation's ``result`` (see ``audit_record_create``)."""
    key = (user.pk, machine_id)
    if machine_id and result.get("ok"):
        now = time.monotonic()
        written = _last_active_written.get(key)
        if written is None or now - written >= LAST_ACTIVE_RESOLUTION:
            overloaded = Q(health=Machine.Health.OVERLOADED)
            Machine.objects.filter(user=user, machine_id=machine_id).update(
                last_active_at=timezone.now(),
                health=Case(When(overloaded, then=Value(Machine.Health.OK)), default=F("health")),
                status_reason=Case(When(overloaded, then=Value("connected")), default=F("status_reason")),
            )

            def remember() -> None:
                if len(_last_active_written) >= _LAST_ACTIVE_MAX:
                    _last_active_written.clear()
                _last_active_written[key] = now

            # Remembered once committed: in a transaction that rolls back (operation_recorded)
            # the stamp was not made, and the audit written again must make it.
            transaction.on_commit(remember)
    elif machine_id and result.get("error_code") == "SHIM_OVERLOADED":
        # The health axis of the status: shown until the machine completes an operation again.
        Machine.objects.filter(user=user, machine_id=machine_id).update(
            health=Machine.Health.OVERLOADED, status_reason="the shim refused work: too many operations in flight"
        )
        last_active_forget(user_id=user.pk, machine_id=machine_id)  # the next success clears it at once


def path_recency_record(*, user: User, session_id: str, machine_id: str, op: str, payload: dict[str, Any]) -> None:
    """Remember that ``machine_id`` last operated on the operation's path in ``session_id``
    (routing step 2, recency): one UPDATE, and an INSERT the first time a path is seen."""
    path = router.operation_path(op, payload)
    if not path or len(path) > 1024:
        return
    now = timezone.now()
    row = PathRecency.objects.filter(user=user, session_id=session_id, path=path)
    if row.update(machine_id=machine_id, updated_at=now):
        return
    try:
        with transaction.atomic():
            PathRecency.objects.create(
                user=user, session_id=session_id, path=path, machine_id=machine_id, updated_at=now
            )
    except IntegrityError:  # another process inserted it meanwhile: ours is the later operation
        row.update(machine_id=machine_id, updated_at=now)


def operation_recorded(
    *,
    row_id: int | None,
    audit_id: int,
    user: User,
    session_id: str,
    machine_id: str,
    op: str,
    payload: dict[str, Any],
    result: dict[str, Any],
) -> None:
    """An answered operation's writes in one transaction: its in-flight row deleted (``row_id``,
    if it has one), the path's recency (``path_recency_record``) and its audit record's
    ``result`` (``audit_record_finish``). Raises what the database raises (``DatabaseError``);
    then none of them is written."""
    with transaction.atomic():
        if row_id is not None:
            inflight_delete(row_id=row_id)
        path_recency_record(user=user, session_id=session_id, machine_id=machine_id, op=op, payload=payload)
        audit_record_finish(record_id=audit_id, user=user, machine_id=machine_id, result=result)


def streamed_command_audited(
    command: LiveCommand,
    end: Result | Failed | None,
    *,
    user: User,
    session_id: str,
    caller: str,
    payload: dict[str, Any],
    started: float,
    failure: BaseException | None,
    observe: bool = True,
) -> None:
    """One ``AuditRecord`` for a streamed command (exit code, cancelled, bytes per
    stream) and, when ``observe``, its metric (``failure``: what ended it, for
    the metric's label). ``end``: how it ended; ``None``: it was cancelled (the caller
    left, or the pipe stopped it). ``started``: ``time.monotonic()`` at its start."""
    result: dict[str, Any] = {"ok": isinstance(end, Result), "bytes": dict(command.bytes)}
    if isinstance(end, Result):
        result["exit_code"] = end.payload.get("exit_code")
        result["cancelled"] = bool(end.payload.get("cancelled"))
        result["timed_out"] = bool(end.payload.get("timed_out"))
    else:
        result["error_code"] = end.code if end is not None else "CANCELLED"
        result["cancelled"] = command.cancel_sent
    seconds = time.monotonic() - started
    result["duration_ms"] = round(seconds * 1000)
    if observe:
        metrics.machine_operation_observed(
            operation="EXECUTE_COMMAND", ok=result["ok"], failure=failure, seconds=seconds
        )
    after_reply(
        audit_id=command.audit_id,
        user=user,
        session_id=session_id,
        machine_id=command.candidate.machine_id,
        request_id=command.request_id,
        op="EXECUTE_COMMAND",
        payload={**payload, "stream": True},
        result=result,
        caller=caller,
        # A pipe's two commands carry the pipe's own id as their event id: it links them.
        operation_id=command.event_request_id if command.event_request_id != command.request_id else "",
    )


async def streamed_commands_audit_begin(
    commands: list[tuple[LiveCommand, dict[str, Any]]], *, user: User, session_id: str, caller: str
) -> None:
    """Write the audit record of each streamed command (with its payload) before any is
    sent, as for every operation (``audit_record_begin``: the audit is the record that it
    ran). Raises ``audit_unwritable`` when one cannot be written: nothing is sent, and the
    records already written say so."""
    for command, payload in commands:
        try:
            command.audit_id = await database_sync_to_async(audit_record_begin)(
                user=user,
                session_id=session_id,
                machine_id=command.candidate.machine_id,
                request_id=command.request_id,
                op="EXECUTE_COMMAND",
                payload={**payload, "stream": True},
                caller=caller,
                operation_id=command.event_request_id if command.event_request_id != command.request_id else "",
            )
        except DatabaseError as exc:
            refused = audit_unwritable(exc)
            for written, _payload in commands:
                if written.audit_id is not None:
                    after_reply(
                        audit_id=written.audit_id,
                        user=user,
                        machine_id=written.candidate.machine_id,
                        result={"ok": False, "error_code": refused.code, "sent": False},
                    )
            raise refused from None
