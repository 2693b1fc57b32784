"""The shim's side of one connection's requests (docs/shim-protocol.md#operations): each
checked, run as its own task, answered and audited; protocol 2.1's CANCEL, FLOW and
COMMAND_INPUT handled at once (docs/live-operations.md). :class:`~machines.shim.connection.Shim`
feeds it the decoded frames of a connection."""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

from .audit import AuditLog, operation_details
from .live import OUTPUT_STREAMS, FrameSender, LiveCommand
from .operations import Operations
from .protocol import (
    ErrorCode,
    MessageType,
    ShimError,
    envelope,
    error_to,
    response_to,
    supports_live_operations,
)

logger = logging.getLogger("machines.shim")


_UNCOUNTED = frozenset({MessageType.PING, MessageType.MACHINE_LIST_REQUEST})
"""Requests answered at once and not counted against ``max_concurrent``."""


_CONTROL = frozenset({MessageType.CANCEL, MessageType.COMMAND_INPUT, MessageType.FLOW})
"""2.1 frames about a running operation: handled in the receive loop, never
counted against ``max_concurrent``, never ``SHIM_OVERLOADED``, never audited."""


_INPUT_ENCODINGS = ("utf-8", "base64")


SendFrame = Callable[[Mapping[str, Any]], Awaitable[None]]


class RequestDispatcher:
    """Serves the requests of one connection (docs/shim-protocol.md#operations, and the 2.1 control frames).

    Checks each request (``UNSUPPORTED_OPERATION``, ``CAPABILITY_NOT_GRANTED``,
    ``SHIM_OVERLOADED`` beyond ``max_concurrent`` in flight — PING and
    MACHINE_LIST_REQUEST exempt), runs it as its own task, sends the response with the
    request's ``id`` and appends an audit record (not for PING). :meth:`aclose` cancels
    what is still running (a running command's process group is killed).

    Protocol 2.1 control frames (refused ``UNSUPPORTED_OPERATION`` when
    ``operations.protocol_version`` is below 2.1), handled at once and never counted:

    - ``CANCEL {request_id}`` → ``ACK {}`` to the CANCEL's own id, always (also for an
      unknown or finished operation). A running command is terminated (it still answers
      its ``COMMAND_RESULT {cancelled: true}``); any other running operation's task is
      cancelled and it answers ``ERROR CANCELLED``.
    - ``FLOW {request_id, stream: "stdout"|"stderr", credit_total}`` raises a streamed
      command's credit; no answer.
    - ``COMMAND_INPUT {request_id, data, encoding: "utf-8"|"base64", eof}`` feeds a
      command's stdin; no answer.

    A malformed control frame, input past the stdin credit or for an operation that is not
    a ``stdin: "stream"`` command is answered ``ERROR INVALID_REQUEST`` under the frame's
    own id (and dropped); ``FLOW``/``COMMAND_INPUT`` for an unknown or finished operation
    are dropped silently (they may race its end).
    """

    def __init__(
        self,
        *,
        operations: Operations,
        send: SendFrame,
        machine_id: str,
        audit: AuditLog | None = None,
    ) -> None:
        self.operations = operations
        self.machine_id = machine_id
        self._send = send
        self._audit = audit
        self._tasks: dict[asyncio.Task[None], str | None] = {}
        self._counted: set[str] = set()
        self._running: set[asyncio.Task[None]] = set()  # requests whose operation has not finished
        self._operations: dict[str, tuple[asyncio.Task[None], LiveCommand | None]] = {}  # counted, unfinished
        self._cancel_requested: set[str] = set()  # non-command operations a CANCEL stopped
        self._closing = False

    @property
    def in_flight(self) -> int:
        """Operations running now that count against ``max_concurrent``."""
        return len(self._counted)

    def running_command(self, request_id: str) -> LiveCommand | None:
        """The :class:`LiveCommand` of the ``EXECUTE_COMMAND`` ``request_id`` while it runs,
        else ``None`` (for status and tests: its byte counts, buffered bytes)."""
        entry = self._operations.get(request_id)
        return entry[1] if entry is not None else None

    def dispatch(self, frame: Mapping[str, Any]) -> None:
        """Start serving one decoded request frame (``protocol.decode`` output); a
        ``CANCEL``, ``FLOW`` or ``COMMAND_INPUT`` is handled at once (see the class)."""
        started = time.monotonic()
        op = str(frame["type"])
        if op in _CONTROL:
            self._control(frame)
            return
        request_id = frame.get("id")
        counted = op not in _UNCOUNTED
        live: LiveCommand | None = None
        try:
            if not isinstance(request_id, str) or not request_id:
                raise ShimError(ErrorCode.INVALID_REQUEST, "a request needs a non-empty string 'id'")
            self.operations.check_allowed(op)
            if counted and request_id in self._counted:
                raise ShimError(ErrorCode.INVALID_REQUEST, "a request with this id is already running")
            limit = self.operations.limits.max_concurrent
            if counted and self.in_flight >= limit:
                raise ShimError(
                    ErrorCode.SHIM_OVERLOADED,
                    f"{self.in_flight} operations are running; this shim takes at most {limit} at once",
                    {"max_concurrent": limit},
                )
            if op == MessageType.EXECUTE_COMMAND:
                live = self.operations.live_command(frame["payload"], send=self._live_sender(frame))
        except ShimError as error:
            self._start(self._refuse(frame, error, started), None)
            return
        if counted:
            self._counted.add(request_id)
        task = self._start(self._serve(frame, started, live), request_id if counted else None)
        self._running.add(task)  # cancellable until its operation has finished
        if counted:
            self._operations[request_id] = (task, live)

    async def aclose(self) -> None:
        """Cancel every operation still running and wait until all requests are done
        (operations that already finished still get their audit record written)."""
        self._closing = True
        for task in self._running:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- 2.1 control frames ----------------------------------------------------------------

    def _control(self, frame: Mapping[str, Any]) -> None:
        op = str(frame["type"])
        payload = frame["payload"]
        try:
            if not isinstance(frame.get("id"), str) or not frame["id"]:
                raise ShimError(ErrorCode.INVALID_REQUEST, "a request needs a non-empty string 'id'")
            version = self.operations.protocol_version
            if not supports_live_operations(version):
                raise ShimError(
                    ErrorCode.UNSUPPORTED_OPERATION,
                    f"this connection negotiated shim protocol {version}; {op} needs protocol 2.1",
                    {"op": op, "protocol_version": version, "required_version": "2.1"},
                )
            target = payload.get("request_id")
            if not isinstance(target, str) or not target:
                raise ShimError(ErrorCode.INVALID_REQUEST, f"{op} needs the operation's 'request_id' (a string)")
            if op == MessageType.CANCEL:
                self._cancel(target)
                self._start(self._answer(response_to(frame, MessageType.ACK, {})), None)
            elif op == MessageType.FLOW:
                self._flow(target, payload)
            else:
                self._input(target, payload)
        except ShimError as error:
            self._start(self._answer(error_to(frame, error)), None)

    def _cancel(self, target: str) -> None:
        entry = self._operations.get(target)
        if entry is None:
            logger.debug("CANCEL of %s: not running (finished or unknown)", target)
            return
        task, live = entry
        if live is not None:
            live.cancel()
        else:
            self._cancel_requested.add(target)
            task.cancel()

    def _flow(self, target: str, payload: Mapping[str, Any]) -> None:
        stream, credit_total = payload.get("stream"), payload.get("credit_total")
        if stream not in OUTPUT_STREAMS:
            raise ShimError(
                ErrorCode.INVALID_REQUEST,
                "FLOW from the platform grants 'stdout' or 'stderr' credit (the shim grants stdin's)",
            )
        if isinstance(credit_total, bool) or not isinstance(credit_total, int) or credit_total < 0:
            raise ShimError(ErrorCode.INVALID_REQUEST, "FLOW 'credit_total' must be an integer of at least 0")
        entry = self._operations.get(target)
        if entry is None or entry[1] is None:
            logger.debug("FLOW for %s: no running command", target)
            return
        entry[1].grant(str(stream), credit_total)

    def _input(self, target: str, payload: Mapping[str, Any]) -> None:
        data, encoding, eof = payload.get("data", ""), payload.get("encoding", "utf-8"), payload.get("eof", False)
        if not isinstance(data, str):
            raise ShimError(ErrorCode.INVALID_REQUEST, "COMMAND_INPUT 'data' must be a string")
        if encoding not in _INPUT_ENCODINGS:
            raise ShimError(ErrorCode.INVALID_REQUEST, "COMMAND_INPUT 'encoding' must be 'utf-8' or 'base64'")
        if not isinstance(eof, bool):
            raise ShimError(ErrorCode.INVALID_REQUEST, "COMMAND_INPUT 'eof' must be true or false")
        if encoding == "base64":
            try:
                raw = base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError):
                raise ShimError(ErrorCode.INVALID_REQUEST, "COMMAND_INPUT 'data' is not valid base64") from None
        else:
            raw = data.encode("utf-8", "surrogatepass")
        entry = self._operations.get(target)
        if entry is None:
            logger.debug("COMMAND_INPUT for %s: not running (finished or unknown); dropped", target)
            return
        if entry[1] is None:
            raise ShimError(ErrorCode.INVALID_REQUEST, f"operation {target} is not a command; it takes no input")
        entry[1].feed(raw, eof)

    async def _answer(self, frame: Mapping[str, Any]) -> None:
        await self._send(frame)

    def _live_sender(self, request: Mapping[str, Any]) -> FrameSender:
        """How a command's ``LiveCommand`` sends: ``COMMAND_OUTPUT`` under the request's id,
        ``FLOW`` under a fresh id naming the request."""

        async def send(message_type: str, payload: dict[str, Any]) -> None:
            if message_type == MessageType.COMMAND_OUTPUT:
                frame = response_to(request, message_type, payload)
            else:
                session_id = request.get("session_id")
                frame = envelope(
                    message_type,
                    {"request_id": request["id"], **payload},
                    session_id=session_id if isinstance(session_id, str) else None,
                )
            await self._send(frame)

        return send

    def _start(self, work: Coroutine[Any, Any, None], counted_id: str | None) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self._tasks[task] = counted_id
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        counted_id = self._tasks.pop(task, None)
        if counted_id is not None:
            self._counted.discard(counted_id)
        if not task.cancelled() and task.exception() is not None:
            logger.error("serving a request failed", exc_info=task.exception())

    def _release(self, frame: Mapping[str, Any]) -> None:
        """Free the request's ``max_concurrent`` slot (if it holds one)."""
        task = asyncio.current_task()
        if task is not None and self._tasks.get(task) is not None:
            self._tasks[task] = None
            self._counted.discard(str(frame.get("id")))

    async def _refuse(self, frame: Mapping[str, Any], error: ShimError, started: float) -> None:
        self._release(frame)
        await self._send(error_to(frame, error))
        await self._record(frame, started, ok=False, error_code=str(error.code))

    async def _serve(self, frame: Mapping[str, Any], started: float, live: LiveCommand | None) -> None:
        task = asyncio.current_task()
        request_id = str(frame["id"])
        try:
            reply, error_code, exit_code = await self._perform(frame, live)
        except asyncio.CancelledError:
            if request_id in self._cancel_requested and not self._closing and task is not None:
                task.uncancel()  # a CANCEL stopped it: answer, as the operation's own reply
                error = ShimError(ErrorCode.CANCELLED, f"{frame['type']} was cancelled", {"request_id": request_id})
                reply, error_code, exit_code = error_to(frame, error), str(error.code), None
            else:
                if frame["type"] != MessageType.PING and self._audit is not None:
                    audit = self._write_audit
                    await asyncio.to_thread(audit, frame, started, False, "CANCELLED", None, live, True)
                raise
        finally:
            if task is not None:
                self._running.discard(task)
                entry = self._operations.get(request_id)
                if entry is not None and entry[0] is task:  # finished: a CANCEL now only gets its ACK
                    del self._operations[request_id]
            self._cancel_requested.discard(request_id)
        self._release(frame)  # before answering: the platform may send the next one at once
        await self._send(reply)
        await self._record(frame, started, ok=error_code is None, error_code=error_code, exit_code=exit_code, live=live)

    async def _perform(
        self, frame: Mapping[str, Any], live: LiveCommand | None = None
    ) -> tuple[dict[str, Any], str | None, int | None]:
        """``(reply frame, error code or None, exit code of a command or None)``."""
        op = str(frame["type"])
        try:
            response_type, response = await self.operations.perform(op, frame["payload"], live=live)
        except ShimError as error:
            return error_to(frame, error), str(error.code), None
        except Exception as error:
            logger.exception("%s %s failed inside the shim", op, frame.get("id"))
            internal = ShimError(ErrorCode.INTERNAL_ERROR, f"the shim failed: {type(error).__name__}")
            return error_to(frame, internal), str(internal.code), None
        exit_code = response.get("exit_code") if op == MessageType.EXECUTE_COMMAND else None
        return response_to(frame, response_type, response), None, exit_code

    async def _record(
        self,
        frame: Mapping[str, Any],
        started: float,
        *,
        ok: bool,
        error_code: str | None,
        exit_code: int | None = None,
        live: LiveCommand | None = None,
    ) -> None:
        if frame.get("type") == MessageType.PING or self._audit is None:
            return
        cancelled = error_code == ErrorCode.CANCELLED or (live is not None and live.cancelled)
        await asyncio.to_thread(self._write_audit, frame, started, ok, error_code, exit_code, live, cancelled)

    def _write_audit(
        self,
        frame: Mapping[str, Any],
        started: float,
        ok: bool,
        error_code: str | None,
        exit_code: int | None,
        live: LiveCommand | None = None,
        cancelled: bool = False,
    ) -> None:
        if self._audit is None:
            return
        payload = frame.get("payload")
        request_id, session_id = frame.get("id"), frame.get("session_id")
        self._audit.write(
            session_id=session_id if isinstance(session_id, str) else None,
            machine_id=self.machine_id,
            request_id=request_id if isinstance(request_id, str) else None,
            op=str(frame.get("type")),
            details=operation_details(str(frame.get("type")), payload if isinstance(payload, dict) else {}),
            ok=ok,
            error_code=error_code,
            duration_ms=(time.monotonic() - started) * 1000,
            exit_code=exit_code,
            cancelled=cancelled,
            byte_counts=live.byte_counts if live is not None else None,
        )
