"""Live operations: streamed commands, cancel, the in-flight list (docs/live-operations.md).

What the edges call (REST, MCP, the built-in agent, the pages):

- ``operation_stream(...)``: an ``EXECUTE_COMMAND`` on one machine or many, as an async
  iterator of ``LiveEvent`` (``Started``, ``Output``, ``Result`` | ``Failed``), credit
  granted as the consumer pulls;
- ``cancel_operation(...)`` / ``cancel_calls(...)``: stop operations in flight, from any
  process (the ``OperationInFlight`` rows name the shims' and the caller's channels);
- ``operations_in_flight(...)``: the rows, for a list;
- ``pipe(...)``: a cross-machine pipe (``machines.services.pipe``, re-exported here).

``machines.services.operations.machine_op`` (``target_machines``, ``request_id``,
``on_output``) and ``machines.services.copy.copy_between_machines`` (``request_id``,
``on_progress``) are the other two entries. The caller's side of one streamed command is
``machines.services.relay.LiveCommand``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any, Literal

from channels.db import database_sync_to_async
from channels.exceptions import ChannelFull
from django.conf import settings
from django.contrib.auth.models import User
from django.db.models import Q
from django.utils import timezone

from core.errors import DispatchError, InvalidRequest
from core.presence import current_process_id
from core.realtime import layer_send
from machines.models import Machine, OperationInFlight
from machines.protocol import MachineCancelMessage, OperationCancelMessage
from machines.services import router
from machines.services.admission import OPERATIONS_IN_FLIGHT, payload_size
from machines.services.arguments import (
    LIVE_PAYLOAD_FIELDS,
    check_operation,
    check_request_id,
    check_session_id,
    check_target_machines,
)
from machines.services.audit import streamed_command_audited, streamed_commands_audit_begin
from machines.services.errors import MachineError
from machines.services.inflight import command_summary, current_call_key, inflight_create, inflight_delete
from machines.services.pipe import pipe
from machines.services.relay import Failed, LiveCommand, LiveEvent, Output, Progress, Result, Started
from machines.services.router import Candidate
from machines.services.transport import operation_timeout
from machines.shim.protocol import supports_live_operations

__all__ = [
    "Failed",
    "LiveEvent",
    "Output",
    "Progress",
    "Result",
    "Started",
    "cancel_calls",
    "cancel_operation",
    "operation_stream",
    "operations_in_flight",
    "pipe",
]

logger = logging.getLogger(__name__)


def _stream_payload(payload: dict[str, Any]) -> dict[str, Any]:
    """The payload of a streamed command: ``binary`` (a bool) may be asked; ``stdin`` and
    ``pipe`` are a pipe's (``InvalidRequest``); ``stream`` is the platform's to set."""
    binary = payload.get("binary", False)
    if not isinstance(binary, bool):
        raise InvalidRequest("payload field 'binary' must be a boolean")
    for key in ("stdin", "pipe"):
        value = payload.get(key)
        if value not in (None, False) and not (key == "stdin" and value == "null"):
            raise InvalidRequest(f"payload field '{key}' belongs to a pipe (machines pipe), not to a stream")
    clean = {key: value for key, value in payload.items() if key not in LIVE_PAYLOAD_FIELDS}
    if binary:
        clean["binary"] = True
    return clean


async def operation_stream(
    *,
    user: User,
    session_id: str,
    op: str,
    payload: dict[str, Any],
    target_machine: str | None = None,
    target_machines: list[str] | Literal["*"] | None = None,
    caller: str,
    request_id: str | None = None,
) -> AsyncIterator[LiveEvent]:
    """Run ``EXECUTE_COMMAND`` streamed (protocol 2.1) and yield its events.

    One machine (routed as ``machine_op`` routes, ``target_machine`` or not): ``Started``,
    ``Output``* (``seq`` order), then ``Result`` (``COMMAND_RESULT``: ``stdout``/``stderr``
    empty, ``stdout_bytes``, ``stderr_bytes``, ``stream_truncated``, ``cancelled``, exit
    code …) or ``Failed`` (``OUTPUT_LOST``, ``MACHINE_UNREACHABLE``, ``TIMEOUT``, the shim's
    ``ERROR``). ``target_machines`` (names or ``"*"``, exclusive with ``target_machine``):
    per machine ``Started``/``Output``/``Result`` | ``Failed`` interleaved, each naming its
    machine; a machine that could not be routed to, or runs protocol 2.0, is one ``Failed``
    (``machine_id`` ``None`` when no machine matched). Every event carries ``request_id``
    (the caller's UUID, or a fresh one), which every machine sees and which
    ``cancel_operation`` takes. ``payload`` may ask ``binary: true`` (``Output.data`` base64).

    Raises before the first event: ``InvalidRequest`` (not ``EXECUTE_COMMAND``, a bad
    payload, session id, ``request_id`` or ``target_machines``), ``MachineError`` — routing
    (``MACHINE_NOT_ATTACHED``, ``MACHINE_AMBIGUOUS``, ``CAPABILITY_NOT_GRANTED``),
    ``UNSUPPORTED_OPERATION`` (a single machine on protocol 2.0, naming its shim's version),
    ``OPERATION_EXISTS`` (``request_id`` in flight); ``RATE_LIMITED`` over a cap on
    operations in flight (``machines.services.admission``). A machine whose socket is over
    its high-water mark answers ``MACHINE_BUSY`` (a ``Failed`` event).

    Credit is granted as the consumer pulls events (a slow consumer slows the command, never
    grows memory). Leaving the iterator early (``aclose()``, ``break``, the consuming task
    cancelled) sends ``CANCEL`` for every command still running. An in-flight row is kept
    while it runs; one ``AuditRecord`` per machine (bytes per stream, cancelled, exit code).
    """
    if op != "EXECUTE_COMMAND":
        raise InvalidRequest("only EXECUTE_COMMAND streams its output")
    check_operation(op, payload, session_id, target_machine)
    streamed = _stream_payload(payload)
    request_id = check_request_id(request_id)
    refused: list[Failed] = []
    if target_machines is None:
        candidates = [await _stream_machine(user, session_id, payload, target_machine)]
    elif target_machine is not None:
        raise InvalidRequest("target_machine and target_machines are exclusive: pass one of them")
    else:
        candidates, refused = await _stream_machines(user, session_id, target_machines, request_id)
    with OPERATIONS_IN_FLIGHT.admit(user_id=user.pk, session_id=session_id, size=payload_size(streamed)):
        async for event in _stream(
            user=user,
            session_id=session_id,
            payload=streamed,
            candidates=candidates,
            refused=refused,
            caller=caller,
            request_id=request_id,
        ):
            yield event


async def _stream_machine(
    user: User, session_id: str, payload: dict[str, Any], target_machine: str | None
) -> Candidate:
    """The one machine of a stream, routed as ``machine_op`` routes, on protocol 2.1; a
    routing error as a ``MachineError``."""
    try:
        chosen = await database_sync_to_async(router.choose)(
            user=user, session_id=session_id, op="EXECUTE_COMMAND", payload=payload, target_machine=target_machine
        )
        chosen.require_live("streamed output")
    except DispatchError as exc:
        raise MachineError(exc.code, exc.message, exc.details) from None
    return chosen


async def _stream_machines(
    user: User, session_id: str, target_machines: Any, request_id: str
) -> tuple[list[Candidate], list[Failed]]:
    """The machines of a fan-out stream on protocol 2.1, and a ``Failed`` for each other entry."""
    wanted = check_target_machines(target_machines)
    targets = await router.route_many(user=user, session_id=session_id, op="EXECUTE_COMMAND", target_machines=wanted)
    candidates: list[Candidate] = []
    refused: list[Failed] = []
    for target in targets:
        machine = target.candidate
        error = target.error
        if error is None and machine is not None and not machine.live:
            try:
                machine.require_live("streamed output")
            except DispatchError as exc:
                error = exc
        if error is not None or machine is None:
            error = error or DispatchError("MACHINE_NOT_ATTACHED", f"no machine '{target.requested}'")
            refused.append(
                Failed(
                    request_id=request_id,
                    machine_id=machine.machine_id if machine else None,
                    name=machine.name if machine else target.requested,
                    code=error.code,
                    message=error.message,
                    details=error.details or {},
                )
            )
        else:
            candidates.append(machine)
    return candidates, refused


async def _stream(
    *,
    user: User,
    session_id: str,
    payload: dict[str, Any],
    candidates: list[Candidate],
    refused: list[Failed],
    caller: str,
    request_id: str,
) -> AsyncIterator[LiveEvent]:
    """The commands of ``operation_stream`` on ``candidates`` (2.1 connections), after the
    ``refused`` machines' ``Failed`` events; one task per command feeds one queue, and
    credit is granted when the consumer takes an ``Output``."""
    run = _Streams(user=user, session_id=session_id, payload=payload, caller=caller, request_id=request_id)
    run.commands = [
        LiveCommand(
            candidate,
            request_id=request_id,
            session_id=session_id,
            payload=payload,
            timeout=operation_timeout("EXECUTE_COMMAND", payload, candidate.limits),
        )
        for candidate in candidates
    ]
    await streamed_commands_audit_begin(
        [(command, payload) for command in run.commands], user=user, session_id=session_id, caller=caller
    )
    try:
        await run.open(candidates)
        for failure in refused:
            yield failure
        run.tasks = [asyncio.ensure_future(run.produce(command)) for command in run.commands]
        while len(run.ended) < len(run.commands):
            command, event = await run.queue.get()
            if isinstance(event, (Result, Failed)):
                await run.end(command, event, failure=sys.exc_info()[1])
            yield event
            if isinstance(event, Output):
                await command.consumed(event)
    finally:
        await run.stop(failure=sys.exc_info()[1])


class _Streams:
    """The state of one ``_stream``: its commands, the queue their tasks feed, which ended,
    and whether its in-flight row is still there."""

    def __init__(self, *, user: User, session_id: str, payload: dict[str, Any], caller: str, request_id: str) -> None:
        self.user = user
        self.session_id = session_id
        self.payload = payload
        self.caller = caller
        self.request_id = request_id
        self.commands: list[LiveCommand] = []
        self.queue: asyncio.Queue[tuple[LiveCommand, LiveEvent]] = asyncio.Queue()
        self.tasks: list[asyncio.Task[None]] = []
        self.started = time.monotonic()
        self.ended: dict[int, LiveEvent] = {}
        self.row_id: int | None = None  # the in-flight row, while there is one

    async def produce(self, command: LiveCommand) -> None:
        """Send ``command`` and put its events on the queue until it ends."""
        failure = await command.send()
        if failure is not None:
            await self.queue.put((command, failure))
            return
        await self.queue.put((command, command.started()))
        while True:
            event = await command.next_event()
            await self.queue.put((command, event))
            if not isinstance(event, Output):
                return

    async def open(self, candidates: list[Candidate]) -> None:
        """Open each command's channel and write the in-flight row (when there is a command)."""
        for command in self.commands:
            await command.open()
        if self.commands:
            self.row_id = await database_sync_to_async(inflight_create)(
                user=self.user,
                session_id=self.session_id,
                request_id=self.request_id,
                kind=OperationInFlight.Kind.COMMAND,
                op="EXECUTE_COMMAND",
                candidates=candidates,
                caller=self.caller,
                summary=command_summary(self.payload),
                call_key=current_call_key(),
                caller_channel=self.commands[0].channel,
            )

    def audited(self, command: LiveCommand, end: Result | Failed | None, failure: BaseException | None) -> None:
        streamed_command_audited(
            command,
            end,
            user=self.user,
            session_id=self.session_id,
            caller=self.caller,
            payload=self.payload,
            started=self.started,
            failure=failure,
        )

    async def end(self, command: LiveCommand, event: Result | Failed, *, failure: BaseException | None) -> None:
        """``command`` ended with ``event``: its audit record; the last one, the row deleted."""
        self.ended[id(command)] = event
        self.audited(command, event, failure)
        if self.row_id is not None and len(self.ended) == len(self.commands):
            # Answered: out of the in-flight list before the last event goes out.
            row_id, self.row_id = self.row_id, None
            await database_sync_to_async(inflight_delete)(row_id=row_id)

    async def stop(self, *, failure: BaseException | None) -> None:
        """However the stream ended: the commands still running cancelled (and audited),
        the tasks stopped, the channels closed, the row deleted."""
        for command in self.commands:
            if id(command) not in self.ended:
                await command.cancel()
                self.audited(command, None, failure)
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        for command in self.commands:
            await command.close()
        if self.row_id is not None:
            row_id, self.row_id = self.row_id, None
            await database_sync_to_async(inflight_delete)(row_id=row_id)


# --- cancel ------------------------------------------------------------------------------------


def _row_for(*, user: User, session_id: str, request_id: str) -> OperationInFlight | None:
    return OperationInFlight.objects.filter(user=user, session_id=session_id, request_id=request_id).first()


def _shim_versions(*, user_id: int, machine_ids: list[str]) -> dict[str, str]:
    rows = Machine.objects.filter(user_id=user_id, machine_id__in=machine_ids)
    return dict(rows.values_list("machine_id", "shim_version"))


async def _cancel_row(row: OperationInFlight, *, reason: str) -> None:
    """Stop the operation of ``row`` from this process: ``CANCEL`` to each 2.1 shim of a
    command, and ``OperationCancelMessage`` to its caller (a copy or a pipe stops there; a
    command's caller sends ``CANCEL`` again, after its own send). Raises ``MachineError``
    ``UNSUPPORTED_OPERATION`` for a command whose shims all run protocol 2.0."""
    request_id = str(row.request_id)
    if row.kind == OperationInFlight.Kind.COMMAND:
        live = [
            channel
            for channel, version in zip(row.shim_channels, row.protocol_versions, strict=False)
            if supports_live_operations(version)
        ]
        if not live:
            shims = database_sync_to_async(_shim_versions)
            versions = await shims(user_id=row.user_id, machine_ids=list(row.machine_ids))
            names = ", ".join(
                f"machine '{name}' runs shim {versions.get(machine_id) or '(unknown version)'} (protocol {version})"
                for machine_id, name, version in zip(
                    row.machine_ids, row.machine_names, row.protocol_versions, strict=False
                )
            )
            raise MachineError(
                "UNSUPPORTED_OPERATION",
                f"{names}; cancelling a command needs protocol 2.1",
                {"request_id": request_id},
            )
        for channel in live:
            await _send_quietly(channel, MachineCancelMessage(request_id=request_id))
    if row.caller_channel:
        await _send_quietly(row.caller_channel, OperationCancelMessage(request_id=request_id, reason=reason))


async def _send_quietly(channel: str, message: MachineCancelMessage | OperationCancelMessage) -> None:
    try:
        await layer_send(channel, message)
    except ChannelFull:
        logger.warning("could not send %s to %s: channel full", message.type, channel)


async def cancel_operation(*, user: User, session_id: str, request_id: str) -> dict[str, Any]:
    """Cancel operation ``request_id`` (a command, a fan-out, a copy or a pipe) that
    ``user`` runs in ``session_id``, from any process: returns ``{"request_id",
    "cancelled": true}`` once the cancel is sent (the operation then ends on its own:
    a command with ``cancelled: true``, a copy with ``CANCELLED``).

    Raises ``InvalidRequest`` (a malformed session id or ``request_id``), ``MachineError``
    ``OPERATION_NOT_FOUND`` (not in flight in that session of that user: never started,
    already answered, or another user's) or ``UNSUPPORTED_OPERATION`` (a command on shims of
    protocol 2.0, naming their versions).
    """
    check_session_id(session_id)
    request_id = check_request_id(request_id)
    row = await database_sync_to_async(_row_for)(user=user, session_id=session_id, request_id=request_id)
    if row is None:
        raise MachineError("OPERATION_NOT_FOUND", f"no operation {request_id} is in flight in session '{session_id}'")
    await _cancel_row(row, reason="cancelled")
    return {"request_id": request_id, "cancelled": True}


def _rows_of_call(*, user: User, call_key: str) -> list[OperationInFlight]:
    return list(OperationInFlight.objects.filter(user=user, call_key=call_key))


async def cancel_calls(*, user: User, call_key: str) -> int:
    """Cancel every operation in flight that ``user`` started under the tool call
    ``call_key`` (``core.tools.ToolCall.call_key``: an MCP ``notifications/cancelled``, an
    agent run cancelled), from any process; returns how many were cancelled (commands on
    protocol 2.0 shims cannot be, and are not counted). An empty key cancels nothing."""
    if not call_key:
        return 0
    cancelled = 0
    for row in await database_sync_to_async(_rows_of_call)(user=user, call_key=call_key):
        try:
            await _cancel_row(row, reason="the tool call was cancelled")
        except MachineError:
            continue
        cancelled += 1
    return cancelled


# --- the list ----------------------------------------------------------------------------------


def operations_in_flight(*, user: User, session_id: str | None = None) -> list[dict[str, Any]]:
    """``user``'s operations in flight (in ``session_id``, or every session), newest first:
    ``{request_id, session_id, kind: "command"|"copy"|"pipe", op, machine_ids, machines
    (names), summary (the redacted argv/command, or "src → dst"), caller, started_at (ISO
    8601)}``. Rows of a process that stopped heartbeating are left out (the reaper deletes
    them). Sync (a database read). Raises ``InvalidRequest`` for a malformed session id."""
    if session_id is not None:
        check_session_id(session_id)
    cutoff = timezone.now() - timedelta(seconds=settings.PROCESS_TTL)
    rows = OperationInFlight.objects.filter(user=user).filter(
        Q(server_process_id=current_process_id()) | Q(server_process__heartbeat_at__gte=cutoff)
    )
    if session_id is not None:
        rows = rows.filter(session_id=session_id)
    return [
        {
            "request_id": str(row.request_id),
            "session_id": row.session_id,
            "kind": row.kind,
            "op": row.op,
            "machine_ids": list(row.machine_ids),
            "machines": list(row.machine_names),
            "summary": row.summary,
            "caller": row.caller,
            "started_at": row.started_at.isoformat(),
        }
        for row in rows.order_by("-started_at")
    ]
