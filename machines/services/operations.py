"""Routed operations on machines: ``machine_op``, snapshots, ``list_machines`` (docs/shim-protocol.md).

``machine_op`` is ``async def`` and waits on the channel layer (never on the shared sync
thread); the shim may be held by another server process. While waiting it re-checks that
the connection row exists and its process is alive, so a dead holder is noticed within
seconds (``MACHINE_UNREACHABLE``).
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import contextvars
import inspect
import json
import logging
import re
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from channels.db import database_sync_to_async
from channels.exceptions import ChannelFull
from django.contrib.auth.models import User
from django.db import DatabaseError, IntegrityError, transaction
from django.db.models import Case, F, Q, Value, When
from django.utils import timezone

from core import metrics, wire
from core.errors import DispatchError, InvalidRequest, TemporarilyUnavailable
from core.realtime import Gone, layer_send, request_reply, send_on_commit
from core.services import server_process_ensure
from core.tools import TOOL_CALL
from machines.audit_note import audit_note
from machines.models import AuditRecord, Machine, MachineConnection, OperationInFlight, PathRecency
from machines.protocol import (
    CALLER_OPERATIONS,
    DEFAULT_LIMITS,
    SESSION_ID_PATTERN,
    MachineCancelMessage,
    MachineOpMessage,
    MachineReplyMessage,
)
from machines.services import router
from machines.services.admission import OPERATIONS_IN_FLIGHT, payload_size
from machines.services.relay import Failed, LiveCommand, Output, Result, connection_alive
from machines.services.router import Candidate, FanOutTarget
from machines.shim.protocol import supports_live_operations
from machines.shim.redaction import redact, redact_argv

logger = logging.getLogger(__name__)

# An operation travels as a MachineOpMessage to machines.consumers.ShimConsumer, which
# answers on its reply_channel with a MachineReplyMessage (machines.protocol).
TIMEOUT_MARGIN = 10.0  # seconds the platform waits past an operation's own timeout
SNAPSHOT_TIMEOUT = 10.0  # seconds to wait for MACHINE_LIST_RESPONSEs
_background: set[asyncio.Future[Any]] = set()


class MachineError(DispatchError):
    """A failed machine operation: a shim ``ERROR`` or a platform code (docs/shim-protocol.md#errors)."""


def check_session_id(session_id: str) -> str:
    """Validate a machine ``session_id`` (docs/shim-protocol.md#machine-sessions) or raise ``InvalidRequest``."""
    if not isinstance(session_id, str) or not re.fullmatch(SESSION_ID_PATTERN, session_id):
        raise InvalidRequest(
            "session_id must be 1-256 characters from letters, digits and '._:-', not starting with a symbol"
        )
    return session_id


def operation_timeout(op: str, payload: dict[str, Any], limits: dict[str, int]) -> float:
    """Seconds to wait for a response: the command's own timeout (or the default) + 10 s."""
    timeout = float(limits.get("command_timeout_seconds", DEFAULT_LIMITS["command_timeout_seconds"]))
    requested = payload.get("timeout_seconds")
    if op == "EXECUTE_COMMAND" and isinstance(requested, (int, float)) and not isinstance(requested, bool):
        timeout = max(0.0, min(float(payload["timeout_seconds"]), limits.get("max_command_timeout_seconds", 600)))
    return float(timeout) + TIMEOUT_MARGIN


_connection_alive = connection_alive  # the liveness check (machines.services.relay), patched by tests


async def send_to_machine(
    candidate: Candidate,
    *,
    op: str,
    payload: dict[str, Any],
    session_id: str,
    timeout: float,
    request_id: str | None = None,
) -> MachineReplyMessage:
    """Send one operation to the chosen machine's connection and wait for its reply
    (``core.realtime.request_reply``), re-checking every ``DISPATCH_REMOTE_LIVENESS_INTERVAL``
    seconds that the connection row exists and its process is alive.

    ``request_id`` is the envelope ``id`` the shim sees (a fresh uuid4 unless given);
    ``timeout`` in seconds from the send. Returns the ``MachineReplyMessage``
    (``response_type``, ``payload``; ``ERROR`` included); raises ``MachineError``
    ``MACHINE_UNREACHABLE`` (connection gone, its process dead, or its channel full) or
    ``TIMEOUT``.
    """

    async def connected() -> Gone | None:
        if await _connection_alive(candidate.connection_id, candidate.server_process_id):
            return None
        return Gone(MachineError("MACHINE_UNREACHABLE", f"machine '{candidate.name}' disconnected"))

    return await request_reply(
        candidate.channel_name,
        MachineOpMessage(
            op=op, payload=payload, request_id=request_id or str(uuid.uuid4()), session_id=session_id, timeout=timeout
        ),
        reply=MachineReplyMessage,
        timeout=timeout,
        timed_out=lambda: MachineError(
            "TIMEOUT", f"no answer from machine '{candidate.name}' within {timeout:g}s; the operation may have run"
        ),
        busy=lambda: MachineError("MACHINE_UNREACHABLE", f"machine '{candidate.name}' is not taking requests"),
        liveness=connected,
    )


OutputSink = Callable[[Output], Awaitable[None] | None]
"""``on_output(output)``: called with each ``Output`` of a streamed command (it may be async)."""

LIVE_PAYLOAD_FIELDS = ("stream", "binary", "stdin", "pipe")
SUMMARY_MAX = 500  # characters of an in-flight row's summary


def check_request_id(request_id: Any) -> str:
    """A caller's ``request_id`` in canonical form (a UUID string, lower case with hyphens),
    or a fresh uuid4 for ``None``. Raises ``InvalidRequest`` for anything else (a caller
    chooses it to cancel the operation by: docs/live-operations.md#cancelling)."""
    if request_id is None:
        return str(uuid.uuid4())
    if isinstance(request_id, str) and len(request_id) <= 45:
        try:
            return str(uuid.UUID(request_id))
        except ValueError:
            pass
    raise InvalidRequest(f"request_id must be a UUID, e.g. {uuid.uuid4()} (got {str(request_id)[:45]!r})")


def check_target_machines(target_machines: Any) -> list[str] | Literal["*"]:
    """``target_machines`` as a fan-out takes it: ``"*"`` or a non-empty list of names;
    ``InvalidRequest`` otherwise."""
    if target_machines == "*":
        return "*"
    if (
        not isinstance(target_machines, list)
        or not target_machines
        or not all(isinstance(name, str) and name.strip() for name in target_machines)
    ):
        raise InvalidRequest('target_machines must be a non-empty list of machine names, or "*" for every machine')
    return list(target_machines)


def command_summary(payload: dict[str, Any]) -> str:
    """What an in-flight list shows of a command: its argv or command line, redacted."""
    if isinstance(payload.get("argv"), list):
        text = " ".join(str(part) for part in redact_argv(payload["argv"]))
    else:
        text = redact(str(payload.get("command") or ""))
    return text[:SUMMARY_MAX]


def current_call_key() -> str | None:
    """The ``call_key`` of the tool call running in this context (``core.tools.TOOL_CALL``)."""
    call = TOOL_CALL.get()
    return call.call_key if call is not None else None


def inflight_create(
    *,
    user: User,
    session_id: str,
    request_id: str,
    kind: str,
    op: str,
    candidates: list[Candidate],
    caller: str,
    summary: str,
    call_key: str | None,
    caller_channel: str = "",
    machine_ids: list[str] | None = None,
    machine_names: list[str] | None = None,
) -> None:
    """Record an operation in flight (``OperationInFlight``), owned by this
    process. Raises ``MachineError`` ``OPERATION_EXISTS`` when ``user`` already has
    ``request_id`` in flight (request ids are per user: another user's is no conflict)."""
    try:
        with transaction.atomic():
            OperationInFlight.objects.create(
                request_id=request_id,
                user=user,
                session_id=session_id,
                kind=kind,
                op=op,
                machine_ids=machine_ids if machine_ids is not None else [c.machine_id for c in candidates],
                machine_names=machine_names if machine_names is not None else [c.name for c in candidates],
                shim_channels=[c.channel_name for c in candidates],
                protocol_versions=[c.protocol_version for c in candidates],
                caller_channel=caller_channel,
                caller=caller[:200],
                call_key=(call_key or "")[:300],
                summary=summary[:SUMMARY_MAX],
                server_process_id=server_process_ensure(),
            )
    except IntegrityError:
        refused = f"an operation with request_id {request_id} is already in flight"
        raise MachineError("OPERATION_EXISTS", refused) from None


def pipe_command_ids(request_id: str) -> tuple[str, str]:
    """The ids the shims see for pipe ``request_id``'s source and destination commands
    (derived from it, so a reaper can cancel them from the ``OperationInFlight`` row)."""
    base = uuid.UUID(str(request_id))
    return str(uuid.uuid5(base, "pipe-source")), str(uuid.uuid5(base, "pipe-destination"))


def operations_of_processes_cancelled(process_ids: list[str]) -> None:
    """``CANCEL`` every command still running for these (dead or stopping) server
    processes' operations in flight, once their rows are gone: the caller is gone, so
    nothing else would stop them and they would hold the shims' ``max_concurrent`` slots
    until their timeout. A command (or fan-out) → its ``request_id`` to each 2.1 shim; a
    pipe → its two commands. (A copy's FILE_* chunks are short and end on their own.)

    Registered in ``core.services.PROCESSES_GONE_HOOKS`` (it runs in the deleting
    transaction; the cancels are sent when it commits)."""
    rows = OperationInFlight.objects.filter(server_process_id__in=process_ids).exclude(kind=OperationInFlight.Kind.COPY)
    for row in rows:
        request_id = str(row.request_id)
        if row.kind == OperationInFlight.Kind.PIPE:
            ids: list[str] = list(pipe_command_ids(request_id))
        else:
            ids = [request_id] * len(row.shim_channels)
        for channel, version, shim_request_id in zip(row.shim_channels, row.protocol_versions, ids, strict=False):
            if supports_live_operations(version):
                send_on_commit(channel, MachineCancelMessage(request_id=shim_request_id))


def inflight_delete(*, user: User, request_id: str) -> None:
    """Forget ``user``'s operation ``request_id`` in flight (it was answered); another
    user's operation with the same id stays."""
    OperationInFlight.objects.filter(user=user, request_id=request_id).delete()


def _check_operation(op: str, payload: Any, session_id: str, target_machine: Any) -> None:
    check_session_id(session_id)
    if op not in CALLER_OPERATIONS:
        raise InvalidRequest(
            f"unknown operation '{str(op)[:40]}'; expected one of {', '.join(sorted(CALLER_OPERATIONS))}"
        )
    if not isinstance(payload, dict):
        raise InvalidRequest("payload must be an object")
    if not wire.encodable(json.dumps(payload, ensure_ascii=False, default=str)):
        raise InvalidRequest("payload holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text")
    if target_machine is not None and not isinstance(target_machine, str):
        raise InvalidRequest("target_machine must be a string or null")


def _check_plain_payload(op: str, payload: dict[str, Any]) -> None:
    """The 2.1 live fields are the platform's to set (a stream, a pipe), not a payload's."""
    if op != "EXECUTE_COMMAND":
        return
    for key in LIVE_PAYLOAD_FIELDS:
        value = payload.get(key)
        if value not in (None, False) and not (key == "stdin" and value == "null"):
            raise InvalidRequest(
                f"payload field '{key}' is set by the platform: ask for streamed output with stream "
                "(operation_stream) and for stdin from another command with a pipe"
            )


async def machine_op(
    *,
    user: User,
    session_id: str,
    op: str,
    payload: dict[str, Any],
    target_machine: str | None = None,
    target_machines: list[str] | Literal["*"] | None = None,
    caller: str,
    request_id: str | None = None,
    on_output: OutputSink | None = None,
    operation_id: str = "",
) -> dict[str, Any]:
    """Route ``op`` with ``payload`` to a machine of ``session_id`` and return its response.

    Returns ``{"machine_id", "type", "payload"}`` (the shim's response). Raises
    ``InvalidRequest`` (unknown op, bad payload, session id or ``request_id``) and
    ``MachineError`` with a code of docs/shim-protocol.md#errors (``MACHINE_NOT_ATTACHED``, ``MACHINE_AMBIGUOUS``,
    ``CAPABILITY_NOT_GRANTED``, ``MACHINE_UNREACHABLE``, ``TIMEOUT``, ``MACHINE_BUSY`` when
    the shim has not read what it was sent (over ``DISPATCH_WS_HIGH_WATER``; nothing is
    queued, docs/shim-protocol.md#back-pressure), or the shim's own code such as
    ``PATH_OUTSIDE_ALLOWED_ROOT``), and ``admission.OperationRefused`` (``RATE_LIMITED``)
    over a cap on operations in flight (docs/operating.md#bounds). Never retried
    automatically, but for one case:
    an operation that may run twice (``router.rerouting_safe``) routed from the route cache
    (``router.choose_cached``, up to ``ROUTE_CACHE_SECONDS`` old) to a connection found
    ``MACHINE_UNREACHABLE`` is routed again from the database and sent once more. An
    ``AuditRecord`` is written before the operation is sent (the audit is the record that it
    ran): when it cannot be written (a full disk, a read-only database) the operation is not
    sent and ``TemporarilyUnavailable`` (503) says why; its result is filled in after the
    reply, off the hot path. ``caller`` names who asked (agent id, ``mcp``, ``api``).

    Live operations (docs/live-operations.md):

    - ``target_machines`` (a list of names, or ``"*"``: every attached machine granted the
      op's capability; exclusive with ``target_machine``) runs the operation on each machine
      in parallel and answers ``{"results": [{"machine_id", "name", "ok", "result" |
      "error": {"code", "message", "details"}}]}`` (``result`` the usual ``{machine_id,
      type, payload}``); a machine that is unreachable, unknown or not capable is one
      failed entry (``machine_id`` ``None`` when the name matched no machine). Only ``"*"``
      finding nothing raises (``MACHINE_NOT_ATTACHED`` / ``CAPABILITY_NOT_GRANTED``).
    - ``request_id``: a client-chosen UUID, the id the shim sees (every machine of a
      fan-out sees the same); ``InvalidRequest`` when not a UUID. ``EXECUTE_COMMAND`` gets an
      in-flight row (``OperationInFlight``, cancellable with ``cancel_operation`` on a 2.1
      shim; its ``call_key`` is ``core.tools.TOOL_CALL``'s), ``MachineError``
      ``OPERATION_EXISTS`` when that ``request_id`` is already in flight.
    - ``on_output(Output)`` (async or not): ``EXECUTE_COMMAND`` on a 2.1 shim runs streamed,
      each output frame handed to it as it arrives, and the result is assembled to look like
      a 2.0 ``COMMAND_RESULT`` plus ``cancelled``: ``stdout``/``stderr`` capped together at
      ``max_file_size_bytes`` (``output_truncated``). A 2.0 shim runs it unstreamed.
    - the caller's task cancelled while a command runs on a 2.1 shim → ``CANCEL`` is sent.

    ``operation_id``: the ``request_id`` of the copy this operation is one step of, kept on
    its audit record (``AuditRecord.operation_id``) so the Machines page shows the copy as
    one row; ``""`` for an operation of its own.
    """
    _check_operation(op, payload, session_id, target_machine)
    _check_plain_payload(op, payload)
    if target_machines is not None and target_machine is not None:
        raise InvalidRequest("target_machine and target_machines are exclusive: pass one of them")
    # Counted while it runs; over a cap it is refused here, before anything is sent.
    with OPERATIONS_IN_FLIGHT.admit(user_id=user.pk, session_id=session_id, size=payload_size(payload)):
        if target_machines is not None:
            return await _fan_out(
                user=user,
                session_id=session_id,
                op=op,
                payload=payload,
                target_machines=check_target_machines(target_machines),
                caller=caller,
                request_id=check_request_id(request_id),
                on_output=on_output,
            )
        return await _routed_op(
            user=user,
            session_id=session_id,
            op=op,
            payload=payload,
            target_machine=target_machine,
            caller=caller,
            request_id=check_request_id(request_id),
            on_output=on_output,
            own_row=True,
            operation_id=operation_id,
        )


async def _fan_out(
    *,
    user: User,
    session_id: str,
    op: str,
    payload: dict[str, Any],
    target_machines: list[str] | Literal["*"],
    caller: str,
    request_id: str,
    on_output: OutputSink | None,
) -> dict[str, Any]:
    """``machine_op`` over ``target_machines`` (see there): one in-flight row for the whole
    fan-out (a command), the operations in parallel, one entry per machine."""
    try:
        targets = await database_sync_to_async(router.choose_many)(
            user=user, session_id=session_id, op=op, target_machines=target_machines
        )
    except DispatchError as exc:
        raise MachineError(exc.code, exc.message, exc.details) from None
    runnable = [t.candidate for t in targets if t.error is None and t.candidate is not None]
    row = op == "EXECUTE_COMMAND" and bool(runnable)
    if row:
        await database_sync_to_async(inflight_create)(
            user=user,
            session_id=session_id,
            request_id=request_id,
            kind=OperationInFlight.Kind.COMMAND,
            op=op,
            candidates=runnable,
            caller=caller,
            summary=command_summary(payload),
            call_key=current_call_key(),
        )

    async def one(target: FanOutTarget) -> dict[str, Any]:
        machine = target.candidate
        entry: dict[str, Any] = {
            "machine_id": machine.machine_id if machine else None,
            "name": machine.name if machine else target.requested,
        }
        if target.error is not None or machine is None:
            error = target.error or DispatchError("MACHINE_NOT_ATTACHED", f"no machine '{target.requested}'")
            return {**entry, "ok": False, "error": fan_out_error(error)}
        try:
            result = await _routed_op(
                user=user,
                session_id=session_id,
                op=op,
                payload=payload,
                caller=caller,
                request_id=request_id,
                on_output=on_output,
                candidate=machine,
                own_row=False,
            )
        except MachineError as exc:
            return {**entry, "ok": False, "error": fan_out_error(exc)}
        return {**entry, "ok": True, "result": result}

    try:
        return {"results": list(await asyncio.gather(*(one(target) for target in targets)))}
    finally:
        if row:
            await database_sync_to_async(inflight_delete)(user=user, request_id=request_id)


def fan_out_error(error: DispatchError) -> dict[str, Any]:
    """A fan-out entry's ``error``: ``{code, message, details}``."""
    return {"code": error.code, "message": error.message, "details": error.details or {}}


async def _routed_op(
    *,
    user: User,
    session_id: str,
    op: str,
    payload: dict[str, Any],
    caller: str,
    request_id: str,
    on_output: OutputSink | None,
    own_row: bool,
    target_machine: str | None = None,
    candidate: Candidate | None = None,
    operation_id: str = "",
) -> dict[str, Any]:
    """One operation on one machine (``candidate``, else routed with ``target_machine``):
    streamed when ``on_output`` asks it of a 2.1 shim; with its own in-flight row
    (``own_row``, commands only); audited, measured."""
    started = time.monotonic()
    result: dict[str, Any] = {"ok": False}
    row_written = False
    from_cache = False
    audit_id: int | None = None
    audit_refused = False
    try:
        if candidate is None:
            candidate = router.choose_cached(
                user=user, session_id=session_id, op=op, payload=payload, target_machine=target_machine
            )
            from_cache = candidate is not None
            if candidate is None:
                candidate = await _route(
                    user=user, session_id=session_id, op=op, payload=payload, target=target_machine
                )
        chosen = candidate
        timeout = operation_timeout(op, payload, chosen.limits)
        try:
            audit_id = await database_sync_to_async(audit_record_begin)(
                user=user,
                session_id=session_id,
                machine_id=chosen.machine_id,
                request_id=request_id,
                op=op,
                payload=payload,
                caller=caller,
                operation_id=operation_id,
            )
        except DatabaseError as exc:
            audit_refused = True
            raise audit_unwritable(exc) from None

        async def register(caller_channel: str) -> None:
            nonlocal row_written
            if own_row and op == "EXECUTE_COMMAND":
                await database_sync_to_async(inflight_create)(
                    user=user,
                    session_id=session_id,
                    request_id=request_id,
                    kind=OperationInFlight.Kind.COMMAND,
                    op=op,
                    candidates=[chosen],
                    caller=caller,
                    summary=command_summary(payload),
                    call_key=current_call_key(),
                    caller_channel=caller_channel,
                )
                row_written = True

        if op == "EXECUTE_COMMAND" and on_output is not None and chosen.live:
            response, audited = await _execute_streamed(
                chosen,
                session_id=session_id,
                payload=payload,
                request_id=request_id,
                timeout=timeout,
                on_output=on_output,
                register=register,
            )
            result = {"ok": True, **audited}
            return response
        await register("")
        try:
            try:
                reply = await send_to_machine(
                    chosen, op=op, payload=payload, session_id=session_id, timeout=timeout, request_id=request_id
                )
            except MachineError as exc:
                if not from_cache or exc.code != "MACHINE_UNREACHABLE":
                    raise
                # A route of up to a second ago named a connection that is gone: this
                # operation may run twice (router.rerouting_safe), so route it again, fresh.
                router.route_cache_clear()
                candidate = chosen = await _route(
                    user=user, session_id=session_id, op=op, payload=payload, target=target_machine
                )
                timeout = operation_timeout(op, payload, chosen.limits)
                reply = await send_to_machine(
                    chosen, op=op, payload=payload, session_id=session_id, timeout=timeout, request_id=request_id
                )
        except asyncio.CancelledError:
            if op == "EXECUTE_COMMAND" and chosen.live:
                await _cancel_quietly(chosen, request_id)
            raise
        if reply.response_type == "ERROR":
            error = reply.payload
            code = str(error.get("code") or "MACHINE_ERROR")
            raise MachineError(code, str(error.get("message") or code), error.get("details") or {})
        response = {"machine_id": chosen.machine_id, "type": reply.response_type, "payload": reply.payload}
        result = {"ok": True}
        if op == "EXECUTE_COMMAND":
            result["exit_code"] = reply.payload.get("exit_code")
            if "cancelled" in reply.payload:
                result["cancelled"] = bool(reply.payload.get("cancelled"))
        if router.operation_path(op, payload) is not None:
            # Recency is a routing input: it must be visible to the very next operation
            # (a write and the following read of one file go to one machine: docs/shim-protocol.md#routing),
            # so unlike the audit record it is written before the reply is returned.
            await database_sync_to_async(path_recency_record)(
                user=user, session_id=session_id, machine_id=chosen.machine_id, op=op, payload=payload
            )
        return response
    except MachineError as exc:
        result = {**result, "ok": False, "error_code": exc.code}
        raise
    finally:
        if row_written:
            await database_sync_to_async(inflight_delete)(user=user, request_id=request_id)
        result["duration_ms"] = round((time.monotonic() - started) * 1000)
        metrics.machine_operation_observed(
            operation=op, ok=result["ok"], failure=sys.exc_info()[1], seconds=time.monotonic() - started
        )
        if not audit_refused:
            _after_reply(
                audit_id=audit_id,
                user=user,
                session_id=session_id,
                machine_id=candidate.machine_id if candidate else "",
                request_id=request_id,
                op=op,
                payload=payload,
                result=result,
                caller=caller,
                operation_id=operation_id,
            )


async def _route(*, user: User, session_id: str, op: str, payload: dict[str, Any], target: str | None) -> Candidate:
    """``router.choose`` on the database thread; its routing error as a ``MachineError``."""
    try:
        return await database_sync_to_async(router.choose)(
            user=user, session_id=session_id, op=op, payload=payload, target_machine=target
        )
    except DispatchError as exc:
        raise MachineError(exc.code, exc.message, exc.details) from None


async def _cancel_quietly(candidate: Candidate, request_id: str) -> None:
    """Send ``CANCEL`` for ``request_id`` to ``candidate``'s shim; a failure is logged."""
    try:
        await layer_send(candidate.channel_name, MachineCancelMessage(request_id=request_id))
    except (ChannelFull, OSError) as exc:
        logger.warning("could not cancel %s on %s: %s", request_id, candidate.name, exc)


async def _execute_streamed(
    candidate: Candidate,
    *,
    session_id: str,
    payload: dict[str, Any],
    request_id: str,
    timeout: float,
    on_output: OutputSink,
    register: Callable[[str], Awaitable[None]],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run a command streamed (2.1), handing each ``Output`` to ``on_output`` and assembling
    stdout/stderr up to ``max_file_size_bytes`` together (``output_truncated``). Returns the
    response ``{machine_id, type, payload}`` (a 2.0-shaped ``COMMAND_RESULT`` plus
    ``cancelled``) and what the audit record adds (``exit_code``, ``cancelled``, ``bytes``).
    Raises ``MachineError`` (the shim's ``ERROR``, ``OUTPUT_LOST``, ``MACHINE_UNREACHABLE``,
    ``TIMEOUT``); cancelled, it sends ``CANCEL`` first."""
    command = LiveCommand(
        candidate,
        request_id=request_id,
        session_id=session_id,
        payload={k: v for k, v in payload.items() if k not in LIVE_PAYLOAD_FIELDS},
        timeout=timeout,
    )
    cap = int(candidate.limits.get("max_file_size_bytes", DEFAULT_LIMITS["max_file_size_bytes"]))
    assembled = OutputAssembly(cap)
    try:
        await command.open()
        await register(command.channel)
        failure = await command.send()
        while failure is None:
            event = await command.next_event()
            if isinstance(event, Output):
                assembled.add(event)
                outcome = on_output(event)
                if inspect.isawaitable(outcome):
                    await outcome
                await command.consumed(event)
                continue
            if isinstance(event, Failed):
                failure = event
                break
            answer = assembled.result(event.payload)
            audited = {
                "exit_code": answer.get("exit_code"),
                "cancelled": bool(answer.get("cancelled")),
                "bytes": {"stdout": command.bytes["stdout"], "stderr": command.bytes["stderr"]},
            }
            return {"machine_id": candidate.machine_id, "type": event.type, "payload": answer}, audited
        raise MachineError(failure.code, failure.message, failure.details)
    except BaseException:
        if not command.finished:
            await command.cancel()
        raise
    finally:
        await command.close()


class OutputAssembly:
    """Streamed stdout/stderr put back together for a result, at most ``cap`` bytes of the
    two together (the rest dropped, ``truncated``); base64 frames are decoded as UTF-8
    with replacement."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.kept = 0
        self.truncated = False
        self.parts: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self.decoders = {stream: codecs.getincrementaldecoder("utf-8")("replace") for stream in self.parts}

    def add(self, output: Output) -> None:
        """Keep what fits of ``output``."""
        room = self.cap - self.kept
        if output.encoding == "base64":
            raw = base64.b64decode(output.data)
            if len(raw) > room:
                raw, self.truncated = raw[: max(room, 0)], True
            text = self.decoders[output.stream].decode(raw)
        else:
            raw = output.data.encode("utf-8", "surrogatepass")
            if len(raw) > room:
                raw, self.truncated = raw[: max(room, 0)], True
            text = raw.decode("utf-8", "ignore")  # a character the cap split is dropped whole
        self.kept += len(raw)
        if text:
            self.parts[output.stream].append(text)

    def result(self, payload: dict[str, Any]) -> dict[str, Any]:
        """``payload`` (a streamed ``COMMAND_RESULT``) as a 2.0 ``COMMAND_RESULT`` plus
        ``cancelled``: the assembled ``stdout``/``stderr``, ``output_truncated`` when the cap
        or the shim's ``max_stream_bytes`` cut anything."""
        answer = dict(payload)
        stream_truncated = bool(answer.pop("stream_truncated", False))
        answer.pop("stdout_bytes", None)
        answer.pop("stderr_bytes", None)
        answer["stdout"] = "".join(self.parts["stdout"])
        answer["stderr"] = "".join(self.parts["stderr"])
        answer["output_truncated"] = bool(answer.get("output_truncated")) or stream_truncated or self.truncated
        answer["cancelled"] = bool(answer.get("cancelled"))
        return answer


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
    else:
        result["error_code"] = end.code if end is not None else "CANCELLED"
        result["cancelled"] = command.cancel_sent
    seconds = time.monotonic() - started
    result["duration_ms"] = round(seconds * 1000)
    if observe:
        metrics.machine_operation_observed(
            operation="EXECUTE_COMMAND", ok=result["ok"], failure=failure, seconds=seconds
        )
    _after_reply(
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
                    _after_reply(
                        audit_id=written.audit_id,
                        user=user,
                        machine_id=written.candidate.machine_id,
                        result={"ok": False, "error_code": refused.code, "sent": False},
                    )
            raise refused from None


def _after_reply(*, audit_id: int | None = None, **record: Any) -> None:
    """Write the audit record in the background, after the reply: fill in the one written
    before the send (``audit_id``), or write one for an operation refused before it."""
    if audit_id is None:
        _in_background(database_sync_to_async(audit_record_create)(**record))
    else:
        _in_background(database_sync_to_async(audit_record_finish)(record_id=audit_id, **record))


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


def _in_background(work: Any) -> None:
    """Run ``work`` (a coroutine) as a task that outlives the caller.

    The task starts from an empty context: one copied from an async view would send its
    ``database_sync_to_async`` calls to that request's thread executor, which is gone
    once the response is sent ("CurrentThreadExecutor already quit"), losing the work.
    """
    task = asyncio.get_running_loop().create_task(work, context=contextvars.Context())
    _background.add(task)
    task.add_done_callback(_background.discard)


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
            if len(_last_active_written) >= _LAST_ACTIVE_MAX:
                _last_active_written.clear()
            _last_active_written[key] = now
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


async def request_snapshots(*, user_id: int, connection_ids: list[str]) -> None:
    """Ask each connection for its ``MACHINE_LIST_RESPONSE`` and cache them (docs/shim-protocol.md#machine-sessions)."""
    rows = await database_sync_to_async(
        lambda: list(MachineConnection.objects.filter(connection_id__in=connection_ids).select_related("machine"))
    )()

    async def one(row: MachineConnection) -> None:
        candidate = Candidate.of(row)
        try:
            await send_to_machine(
                candidate, op="MACHINE_LIST_REQUEST", payload={}, session_id="*", timeout=SNAPSHOT_TIMEOUT
            )
        except MachineError as exc:
            logger.info("no snapshot from %s: %s", candidate.name, exc.message)

    async def every() -> None:
        await asyncio.gather(*(one(row) for row in rows))

    _in_background(every())


def attached_machines(*, user: User, session_id: str) -> list[dict[str, Any]]:
    """Per machine of ``user`` attached to ``session_id``, by name: its snapshot (the cached
    ``MACHINE_LIST_RESPONSE`` payload, else what its ``HELLO`` said) plus
    ``display_name`` (its name), ``last_active_at`` (an aware ``datetime`` of its last
    routed operation, or ``None``), ``status`` and ``is_default``. Each edge renders
    ``last_active_at`` in its own words (REST: ISO 8601; the tool: ``last_active_ts``).
    Raises ``InvalidRequest`` for a malformed ``session_id``."""
    check_session_id(session_id)
    default_id = router.default_machine_id(user=user)
    attached = {c.machine_id for c in router.attached_candidates(user=user, session_id=session_id)}
    snapshots = []
    for machine in Machine.objects.filter(user=user, machine_id__in=attached).order_by("display_name", "hostname"):
        snapshot = machine.snapshot or {
            "machine_id": machine.machine_id,
            "hostname": machine.hostname,
            "display_name": machine.display_name,
            "platform": machine.platform,
            "arch": machine.arch,
            "capabilities": machine.granted_capabilities,
            "hardware_devices": machine.hardware_devices,
        }
        snapshots.append(
            {
                **snapshot,
                "display_name": machine.name,
                "last_active_at": machine.last_active_at,
                "status": machine_status(machine),
                "is_default": machine.machine_id == default_id,
            }
        )
    return snapshots


def list_machines(*, user: User, session_id: str) -> list[dict[str, Any]]:
    """The ``list_machines`` tool's answer (docs/mcp.md#tools): ``attached_machines`` with, in
    place of ``last_active_at``, the tool's ``last_active_ts`` (epoch seconds, or ``None``)."""
    listed = []
    for entry in attached_machines(user=user, session_id=session_id):
        listed.append(
            {
                ("last_active_ts" if key == "last_active_at" else key): (
                    value.timestamp() if key == "last_active_at" and value is not None else value
                )
                for key, value in entry.items()
            }
        )
    return listed


def machine_status(machine: Machine) -> dict[str, str]:
    """The two-axis status shown to users (docs/shim-protocol.md#machine-status): connection, health and a reason."""
    return {"connection": machine.connection_status, "health": machine.health, "reason": machine.status_reason}
