"""Routed operations on machines: ``machine_op`` (docs/shim-protocol.md).

``machine_op`` is ``async def`` and waits on the channel layer (never on the shared sync
thread); the shim may be held by another server process. While waiting it re-checks that
the connection row exists and its process is alive, so a dead holder is noticed within
seconds (``MACHINE_UNREACHABLE``).

One operation is a short sequence: route (``router``, with the route cache) → audit record
(``audit``) → in-flight row (``inflight``) → send and wait (``transport``; streamed:
``output``) → record (``audit``). Payload checks are ``arguments``; the reads of
``list_machines`` are ``machines.selectors``.

``machine_op``'s live operations (docs/live-operations.md):

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

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from channels.db import database_sync_to_async
from django.contrib.auth.models import User
from django.db import DatabaseError

from core import metrics
from core.errors import DispatchError, InvalidRequest
from machines.models import OperationInFlight
from machines.protocol import MachineReplyMessage
from machines.services import router
from machines.services.admission import OPERATIONS_IN_FLIGHT, payload_size
from machines.services.arguments import check_operation, check_plain_payload, check_request_id, check_target_machines
from machines.services.audit import (
    after_reply,
    audit_record_begin,
    audit_unwritable,
    in_background,
    operation_recorded,
    path_recency_record,
)
from machines.services.errors import MachineError, fan_out_error
from machines.services.inflight import command_summary, current_call_key, inflight_create, inflight_delete
from machines.services.output import OutputSink, execute_streamed
from machines.services.router import Candidate, FanOutTarget
from machines.services.transport import cancel_quietly, operation_timeout, send_to_machine

logger = logging.getLogger(__name__)


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
    sent and ``TemporarilyUnavailable`` (503) says why. Its result is written with the path's
    recency in one transaction before the answer returns (``_RoutedOp.finish``); for a
    streamed command, a cancel or a failed transaction, in the background. ``caller`` names
    who asked (agent id, ``mcp``, ``api``). ``target_machines``, ``request_id``,
    ``on_output`` and ``operation_id``: see the module.
    """
    check_operation(op, payload, session_id, target_machine)
    check_plain_payload(op, payload)
    if target_machines is not None and target_machine is not None:
        raise InvalidRequest("target_machine and target_machines are exclusive: pass one of them")
    # Counted while it runs; over a cap it is refused here, before anything is sent.
    with OPERATIONS_IN_FLIGHT.admit(user_id=user.pk, session_id=session_id, size=payload_size(payload)):
        common: dict[str, Any] = {"user": user, "session_id": session_id, "op": op, "payload": payload}
        common["caller"] = caller  # what the fan-out and the single operation share
        if target_machines is not None:
            targets = check_target_machines(target_machines)
            return await _fan_out(
                **common, target_machines=targets, request_id=check_request_id(request_id), on_output=on_output
            )
        operation = _RoutedOp(
            **common, request_id=check_request_id(request_id), operation_id=operation_id, own_row=True
        )
        return await operation.run(target_machine=target_machine, on_output=on_output)


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
    targets = await router.route_many(user=user, session_id=session_id, op=op, target_machines=target_machines)
    runnable = [t.candidate for t in targets if t.error is None and t.candidate is not None]
    row_id: int | None = None
    if op == "EXECUTE_COMMAND" and runnable:
        row_id = await database_sync_to_async(inflight_create)(
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
    operation = {"user": user, "session_id": session_id, "op": op, "payload": payload, "caller": caller}
    try:
        entries = (_fan_out_entry(target, on_output, request_id=request_id, **operation) for target in targets)
        # Every entry ends before the row goes: one raising (a bug) must not leave its
        # siblings running on their machines with no row to cancel them by.
        results = await asyncio.gather(*entries, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return {"results": results}
    finally:
        if row_id is not None:  # shielded: a second cancel would drop the queued delete
            await asyncio.shield(database_sync_to_async(inflight_delete)(row_id=row_id))


async def _fan_out_entry(target: FanOutTarget, on_output: OutputSink | None, **operation: Any) -> dict[str, Any]:
    """One machine's entry of a fan-out: its result, or the error that stopped it there."""
    machine = target.candidate
    entry: dict[str, Any] = {
        "machine_id": machine.machine_id if machine else None,
        "name": machine.name if machine else target.requested,
    }
    if target.error is not None or machine is None:
        error = target.error or DispatchError("MACHINE_NOT_ATTACHED", f"no machine '{target.requested}'")
        return {**entry, "ok": False, "error": fan_out_error(error)}
    try:
        result = await _RoutedOp(**operation).run(candidate=machine, on_output=on_output)
    except DispatchError as exc:  # a machine's error, or the outage's 503 on this machine's writes
        return {**entry, "ok": False, "error": fan_out_error(exc)}
    return {**entry, "ok": True, "result": result}


@dataclass
class _RoutedOp:
    """One operation on one machine (``run``): streamed when ``on_output`` asks it of a 2.1
    shim; with its own in-flight row (``own_row``, commands only); audited, measured. What
    the audit record and the metric need at the end is kept on it as the steps go."""

    user: User
    session_id: str
    op: str
    payload: dict[str, Any]
    caller: str
    request_id: str
    operation_id: str = ""
    own_row: bool = False
    target_machine: str | None = None
    candidate: Candidate | None = None  # the machine chosen (a rerouted operation's last)
    from_cache: bool = False
    audit_id: int | None = None
    audit_refused: bool = False
    row_id: int | None = None  # its own in-flight row, once written
    recorded: bool = False  # answered: finish writes its recency and audit result in one step
    result: dict[str, Any] = field(default_factory=lambda: {"ok": False})
    started: float = field(default_factory=time.monotonic)

    async def run(
        self, *, target_machine: str | None = None, candidate: Candidate | None = None, on_output: OutputSink | None
    ) -> dict[str, Any]:
        """Route (``candidate``, else with ``target_machine``) → audit → register → send →
        record; the in-flight row, metric and audit result are settled however it ends."""
        self.target_machine = target_machine
        # What ended it, caught here: sys.exc_info() in a coroutine also sees an exception
        # its caller is handling (a copy's clean-up runs this inside its except).
        failure: BaseException | None = None
        try:
            chosen = await self.route(candidate)
            await self.audit_begin(chosen)
            if self.op == "EXECUTE_COMMAND" and on_output is not None and chosen.live:
                return await self.streamed(chosen, on_output)
            await self.register("")
            return await self.record(await self.send(chosen))
        except MachineError as exc:
            failure = exc
            self.result = {**self.result, "ok": False, "error_code": exc.code}
            raise
        except BaseException as exc:
            failure = exc
            raise
        finally:
            await self.finish(failure)

    async def route(self, candidate: Candidate | None) -> Candidate:
        """``candidate``, else the route cache's choice, else the database's."""
        if candidate is None:
            candidate = router.choose_cached(
                user=self.user,
                session_id=self.session_id,
                op=self.op,
                payload=self.payload,
                target_machine=self.target_machine,
            )
            self.from_cache = candidate is not None
            if candidate is None:
                candidate = await self.route_fresh()
        self.candidate = candidate
        return candidate

    async def route_fresh(self) -> Candidate:
        return await router.route(
            user=self.user, session_id=self.session_id, op=self.op, payload=self.payload, target=self.target_machine
        )

    async def audit_begin(self, chosen: Candidate) -> None:
        """The audit record, written before the send; unwritable, nothing is sent (503)."""
        try:
            self.audit_id = await database_sync_to_async(audit_record_begin)(
                user=self.user,
                session_id=self.session_id,
                machine_id=chosen.machine_id,
                request_id=self.request_id,
                op=self.op,
                payload=self.payload,
                caller=self.caller,
                operation_id=self.operation_id,
            )
        except DatabaseError as exc:
            self.audit_refused = True
            raise audit_unwritable(exc) from None

    async def register(self, caller_channel: str) -> None:
        """The operation's own in-flight row (a command's, when ``own_row``)."""
        if self.own_row and self.op == "EXECUTE_COMMAND":
            assert self.candidate is not None
            self.row_id = await database_sync_to_async(inflight_create)(
                user=self.user,
                session_id=self.session_id,
                request_id=self.request_id,
                kind=OperationInFlight.Kind.COMMAND,
                op=self.op,
                candidates=[self.candidate],
                caller=self.caller,
                summary=command_summary(self.payload),
                call_key=current_call_key(),
                caller_channel=caller_channel,
            )

    async def streamed(self, chosen: Candidate, on_output: OutputSink) -> dict[str, Any]:
        """A command run streamed on a 2.1 shim (``output.execute_streamed``)."""
        response, audited = await execute_streamed(
            chosen,
            session_id=self.session_id,
            payload=self.payload,
            request_id=self.request_id,
            timeout=operation_timeout(self.op, self.payload, chosen.limits),
            on_output=on_output,
            register=self.register,
        )
        self.result = {"ok": True, **audited}
        return response

    async def send(self, chosen: Candidate) -> MachineReplyMessage:
        """Send to ``chosen`` and wait for the reply, routed again once when a cached route
        named a connection that is gone; cancelled, a live command is cancelled on the shim."""
        try:
            try:
                return await self.send_to(chosen)
            except MachineError as exc:
                if not self.from_cache or exc.code != "MACHINE_UNREACHABLE":
                    raise
                # A route of up to a second ago named a connection that is gone: this
                # operation may run twice (router.rerouting_safe), so route it again, fresh.
                router.route_cache_clear()
                self.candidate = chosen = await self.route_fresh()
                return await self.send_to(chosen)
        except asyncio.CancelledError:
            if self.op == "EXECUTE_COMMAND" and chosen.live:
                await cancel_quietly(chosen, self.request_id)
            raise

    async def send_to(self, chosen: Candidate) -> MachineReplyMessage:
        timeout = operation_timeout(self.op, self.payload, chosen.limits)
        return await send_to_machine(
            chosen,
            op=self.op,
            payload=self.payload,
            session_id=self.session_id,
            timeout=timeout,
            request_id=self.request_id,
        )

    async def record(self, reply: MachineReplyMessage) -> dict[str, Any]:
        """The response of ``reply`` (its ``ERROR`` raised) and what the audit record adds;
        ``finish`` writes them, with the path's recency."""
        assert self.candidate is not None
        chosen = self.candidate
        if reply.response_type == "ERROR":
            error = reply.payload
            code = str(error.get("code") or "MACHINE_ERROR")
            raise MachineError(code, str(error.get("message") or code), error.get("details") or {})
        response = {"machine_id": chosen.machine_id, "type": reply.response_type, "payload": reply.payload}
        self.result = {"ok": True}
        if self.op == "EXECUTE_COMMAND":
            self.result["exit_code"] = reply.payload.get("exit_code")
            if "cancelled" in reply.payload:
                self.result["cancelled"] = bool(reply.payload.get("cancelled"))
            if "timed_out" in reply.payload:
                self.result["timed_out"] = bool(reply.payload.get("timed_out"))
        self.recorded = True
        return response

    async def finish(self, failure: BaseException | None) -> None:
        """However it ended: the in-flight row deleted, the metric observed (``failure``:
        what ended it) and the audit result written.

        An answered operation's writes — the path's recency, the audit result, the in-flight
        row — are one call to the database thread and one transaction, awaited: recency is a
        routing input that must be visible to the very next operation, in any process (a
        write and the following read of one file go to one machine:
        docs/shim-protocol.md#routing). Written in the background instead, the audit result
        of one operation would queue on the database thread ahead of the next operation's
        audit record anyway, one commit more. If that transaction fails, the operation has
        still run: its recency is written alone (its failure is the operation's, as before)
        and its audit result in the background. Any other ending writes the audit result in
        the background and deletes the in-flight row."""
        self.result["duration_ms"] = round((time.monotonic() - self.started) * 1000)
        if failure is None and self.recorded and self.audit_id is not None:
            assert self.candidate is not None
            row_id, self.row_id = self.row_id, None
            try:
                await database_sync_to_async(operation_recorded)(
                    row_id=row_id,
                    audit_id=self.audit_id,
                    user=self.user,
                    session_id=self.session_id,
                    machine_id=self.candidate.machine_id,
                    op=self.op,
                    payload=self.payload,
                    result=self.result,
                )
            except asyncio.CancelledError as cancelled:
                # The caller went away while the writes were queued or running: a queued
                # call is dropped, so they are written again in the background (each write
                # is idempotent), and the in-flight row deleted.
                self.row_id = row_id
                await self._recorded_fallback(cancelled)
                raise
            except DatabaseError as exc:
                self.row_id = row_id
                logger.warning("an answered %s's audit result could not be written with its recency: %r", self.op, exc)
                await self._recorded_fallback(None, wait_for_recency=True)
                return
            except Exception as exc:  # a bug, not the database: the caller sees it, no row is left
                self.row_id = row_id
                await self.finish_unrecorded(exc)
                raise
            metrics.machine_operation_observed(
                operation=self.op, ok=True, failure=None, seconds=time.monotonic() - self.started
            )
            return
        await self.finish_unrecorded(failure)

    async def _recorded_fallback(self, failure: BaseException | None, *, wait_for_recency: bool = False) -> None:
        """An answered operation whose one-step writes did not happen: the audit result in
        the background and the in-flight row deleted (``finish_unrecorded``), and the path's
        recency written alone — awaited after those (``wait_for_recency``: a database failure
        is the operation's, as before the one-step writes) or, for a cancel, put in the
        background before anything is awaited (a second cancel loses nothing)."""
        assert self.candidate is not None
        candidate = self.candidate
        has_path = router.operation_path(self.op, self.payload) is not None

        def recency() -> Any:
            return database_sync_to_async(path_recency_record)(
                user=self.user,
                session_id=self.session_id,
                machine_id=candidate.machine_id,
                op=self.op,
                payload=self.payload,
            )

        # Started before anything is awaited, so a cancel arriving later loses nothing; a
        # caller that waits for it gets its database failure.
        written = in_background(recency()) if has_path else None
        await self.finish_unrecorded(failure)
        if written is not None and wait_for_recency:
            await asyncio.shield(written)

    async def finish_unrecorded(self, failure: BaseException | None) -> None:
        """``finish`` of an operation whose writes were not made in one step: the metric
        observed and the audit result written in the background before anything is awaited
        (a caller cancelled again at the next await loses neither), then the in-flight row
        deleted, shielded (a cancel does not drop the delete; it is gone before an answer
        returns, so the same request id may be used again at once)."""
        metrics.machine_operation_observed(
            operation=self.op, ok=self.result["ok"], failure=failure, seconds=time.monotonic() - self.started
        )
        if not self.audit_refused:
            after_reply(
                audit_id=self.audit_id,
                user=self.user,
                session_id=self.session_id,
                machine_id=self.candidate.machine_id if self.candidate else "",
                request_id=self.request_id,
                op=self.op,
                payload=self.payload,
                result=self.result,
                caller=self.caller,
                operation_id=self.operation_id,
            )
        if self.row_id is not None:
            row_id, self.row_id = self.row_id, None
            await asyncio.shield(database_sync_to_async(inflight_delete)(row_id=row_id))
