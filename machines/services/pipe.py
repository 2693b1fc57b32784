"""Cross-machine pipes: one command's stdout into another's stdin, through the platform
(docs/live-operations.md#cross-machine-pipes; protocol 2.1).

The source runs ``EXECUTE_COMMAND {stream, binary, pipe: true}``; the destination
``EXECUTE_COMMAND {stream, stdin: "stream", pipe: true}``. Each source stdout frame (base64,
at most 64 KiB raw) goes on, as it is, as a ``COMMAND_INPUT`` of the destination. Credit is
end to end: the destination's stdin credit (its shim grants it as it writes into the
command) is granted to the source as stdout credit, byte for byte, so nothing waits in the
platform and memory stays constant however much flows. The source ending (or failing)
closes the destination's stdin; the destination ending first cancels the source. A pipe is
bounded by its ``timeout_seconds`` (each command's own timeout), not by
``max_stream_bytes``. Both machines need ``shell``; each shim applies its path jail to its
``cwd``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from channels.db import database_sync_to_async
from django.contrib.auth.models import User

from core.errors import DispatchError, InvalidRequest
from machines.models import OperationInFlight
from machines.protocol import DEFAULT_LIMITS
from machines.services import router
from machines.services.admission import OPERATIONS_IN_FLIGHT, payload_size
from machines.services.arguments import check_request_id, check_session_id
from machines.services.audit import streamed_command_audited, streamed_commands_audit_begin
from machines.services.errors import MachineError
from machines.services.inflight import (
    command_summary,
    current_call_key,
    inflight_create,
    inflight_delete,
    pipe_command_ids,
)
from machines.services.output import OutputAssembly
from machines.services.relay import Failed, LiveCommand, Output, Result
from machines.services.router import Candidate
from machines.services.transport import operation_timeout

logger = logging.getLogger(__name__)

PipeProgress = Callable[[int, "int | None"], Awaitable[None] | None]
END_FIELDS = frozenset({"machine", "argv", "command", "cwd", "env"})


def _command(end: Any, which: str) -> dict[str, Any]:
    """One end of a pipe, ``{machine?, argv | command, cwd?, env?}``, as an
    ``EXECUTE_COMMAND`` payload; ``InvalidRequest`` naming the field otherwise."""
    if not isinstance(end, dict):
        raise InvalidRequest(f"{which} must be an object {{machine, argv | command, cwd?}}")
    unknown = sorted(set(end) - END_FIELDS)
    if unknown:
        raise InvalidRequest(
            f"{which} has an unknown field '{unknown[0]}' (expected machine, argv or command, cwd, env)"
        )
    if ("argv" in end) == ("command" in end):
        raise InvalidRequest(f"{which} needs exactly one of argv (a list of strings) and command (a string)")
    payload: dict[str, Any] = {}
    if "argv" in end:
        argv = end["argv"]
        if not isinstance(argv, list) or not argv or not all(isinstance(part, str) for part in argv):
            raise InvalidRequest(f"{which}.argv must be a non-empty list of strings")
        payload["argv"] = argv
    else:
        if not isinstance(end["command"], str) or not end["command"].strip():
            raise InvalidRequest(f"{which}.command must be a non-empty string")
        payload["command"] = end["command"]
    if end.get("cwd") is not None:
        if not isinstance(end["cwd"], str):
            raise InvalidRequest(f"{which}.cwd must be a string")
        payload["cwd"] = end["cwd"]
    if end.get("env") is not None:
        env = end["env"]
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise InvalidRequest(f"{which}.env must be an object of strings")
        payload["env"] = env
    machine = end.get("machine")
    if machine is not None and not isinstance(machine, str):
        raise InvalidRequest(f"{which}.machine must be a string")
    return payload


def _timeout(timeout_seconds: Any, limits: dict[str, Any]) -> float:
    """The pipe's timeout in seconds: ``timeout_seconds`` (a positive number, at most
    ``max_command_timeout_seconds``) or the command timeout default."""
    default = float(limits.get("command_timeout_seconds", DEFAULT_LIMITS["command_timeout_seconds"]))
    if timeout_seconds is None:
        return default
    ceiling = float(limits.get("max_command_timeout_seconds", DEFAULT_LIMITS["max_command_timeout_seconds"]))
    if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, int | float) or timeout_seconds <= 0:
        raise InvalidRequest("timeout_seconds must be a positive number of seconds")
    if timeout_seconds > ceiling:
        raise InvalidRequest(f"timeout_seconds may be at most {ceiling:g}")
    return float(timeout_seconds)


async def pipe(
    *,
    user: User,
    session_id: str,
    source: dict[str, Any],
    destination: dict[str, Any],
    timeout_seconds: float | None = None,
    caller: str,
    request_id: str | None = None,
    on_progress: PipeProgress | None = None,
) -> dict[str, Any]:
    """Run ``source`` and ``destination`` (each ``{machine, argv | command, cwd?, env?}``;
    ``machine`` as a ``target_machine``, or left to the router) with the source's stdout
    piped into the destination's stdin, and answer both results::

        {"request_id", "bytes": <raw bytes moved>,
         "source": {machine_id, name, ok, exit_code, stderr, timed_out, cancelled,
                    duration_seconds, output_truncated} | {machine_id, name, ok: false, error},
         "destination": {... the same plus stdout}}

    ``stderr`` (and the destination's ``stdout``) are capped at ``max_file_size_bytes``
    (``output_truncated``). A failed end is ``{machine_id, name, ok: false, error: {code,
    message, details}}`` (e.g. ``MACHINE_UNREACHABLE``): the pipe still answers. The source
    failing or ending closes the destination's stdin; the destination ending first cancels
    the source (its result ``cancelled: true``). ``timeout_seconds`` (default: the command
    timeout default, 30 s) bounds both commands. ``on_progress(bytes_moved, None)`` (it may
    be async) after each piece moved. ``request_id``: the pipe's UUID in the in-flight list
    (kind ``pipe``), which ``cancel_operation`` takes (both commands are cancelled).

    Raises before anything runs: ``InvalidRequest`` (a malformed end, timeout, session id
    or ``request_id``) and ``MachineError`` (routing: ``MACHINE_NOT_ATTACHED``,
    ``MACHINE_AMBIGUOUS``, ``CAPABILITY_NOT_GRANTED`` without ``shell``;
    ``UNSUPPORTED_OPERATION`` for a machine on protocol 2.0, naming its shim's version;
    ``OPERATION_EXISTS``).
    """
    check_session_id(session_id)
    source_payload = _command(source, "source")
    destination_payload = _command(destination, "destination")
    request_id = check_request_id(request_id)
    _timeout(timeout_seconds, DEFAULT_LIMITS)  # a malformed one is refused before routing
    payloads = [source_payload, destination_payload]
    ends = await _route_ends(user=user, session_id=session_id, ends=[source, destination], payloads=payloads)
    source_command, destination_command = _live_commands(
        ends, payloads, request_id=request_id, session_id=session_id, timeout_seconds=timeout_seconds
    )
    run = _Pipe(source=source_command, destination=destination_command, on_progress=on_progress)
    # One operation in flight for as long as it runs (its bytes are bounded by the credit).
    sizes = payload_size(source_payload) + payload_size(destination_payload)
    with OPERATIONS_IN_FLIGHT.admit(user_id=user.pk, session_id=session_id, size=sizes):
        await _run_audited(run, payloads, user=user, session_id=session_id, caller=caller, request_id=request_id)
    return {
        "request_id": request_id,
        "bytes": run.moved,
        "source": run.answer(run.source, with_stdout=False),
        "destination": run.answer(run.destination, with_stdout=True),
    }


async def _route_ends(
    *, user: User, session_id: str, ends: list[dict[str, Any]], payloads: list[dict[str, Any]]
) -> list[Candidate]:
    """The machine of each end (its ``machine`` as a ``target_machine``), each on protocol
    2.1; a routing error as a ``MachineError``."""
    chosen_ends: list[Candidate] = []
    try:
        for end, payload in zip(ends, payloads, strict=True):
            chosen = await database_sync_to_async(router.choose)(
                user=user,
                session_id=session_id,
                op="EXECUTE_COMMAND",
                payload=payload,
                target_machine=end.get("machine"),
            )
            chosen.require_live("a pipe")
            chosen_ends.append(chosen)
    except DispatchError as exc:
        raise MachineError(exc.code, exc.message, exc.details) from None
    return chosen_ends


def _live_commands(
    ends: list[Candidate],
    payloads: list[dict[str, Any]],
    *,
    request_id: str,
    session_id: str,
    timeout_seconds: float | None,
) -> list[LiveCommand]:
    """The source's and the destination's commands: their payloads set for a pipe (in
    place), one timeout that both machines allow, the ids ``pipe_command_ids`` derives."""
    source_payload, destination_payload = payloads
    timeout = min(_timeout(timeout_seconds, ends[0].limits), _timeout(timeout_seconds, ends[1].limits))
    source_payload.update(timeout_seconds=timeout, binary=True, pipe=True)
    destination_payload.update(timeout_seconds=timeout, stdin="stream", pipe=True)
    return [
        LiveCommand(
            machine,
            request_id=command_id,
            session_id=session_id,
            payload=payload,
            timeout=operation_timeout("EXECUTE_COMMAND", payload, machine.limits),
            event_request_id=request_id,
        )
        for machine, payload, command_id in zip(ends, payloads, pipe_command_ids(request_id), strict=True)
    ]


async def _run_audited(
    run: _Pipe, payloads: list[dict[str, Any]], *, user: User, session_id: str, caller: str, request_id: str
) -> None:
    """Both audit records written, both commands opened, the pipe's in-flight row, the run;
    however it ends, both stopped, the row deleted and both audit records completed."""
    commands = list(zip((run.source, run.destination), payloads, strict=True))
    row_id: int | None = None
    started = time.monotonic()
    await streamed_commands_audit_begin(commands, user=user, session_id=session_id, caller=caller)
    try:
        await run.source.open()
        await run.destination.open()
        row_id = await _register(run, payloads, user=user, session_id=session_id, caller=caller, request_id=request_id)
        await run.run()
    finally:
        await run.stop()
        if row_id is not None:
            await database_sync_to_async(inflight_delete)(row_id=row_id)
        for command, payload in commands:
            streamed_command_audited(
                command,
                run.ends.get(id(command)),
                user=user,
                session_id=session_id,
                caller=caller,
                payload=payload,
                started=started,
                failure=None,
                observe=command.sent,
            )


async def _register(
    run: _Pipe, payloads: list[dict[str, Any]], *, user: User, session_id: str, caller: str, request_id: str
) -> int:
    """The pipe's in-flight row (kind ``pipe``), which ``cancel_operation`` takes; its id."""
    source_payload, destination_payload = payloads
    source_machine, destination_machine = run.source.candidate, run.destination.candidate
    return await database_sync_to_async(inflight_create)(
        user=user,
        session_id=session_id,
        request_id=request_id,
        kind=OperationInFlight.Kind.PIPE,
        op="PIPE",
        candidates=[source_machine, destination_machine],
        caller=caller,
        summary=f"{source_machine.name}: {command_summary(source_payload)} → "
        f"{destination_machine.name}: {command_summary(destination_payload)}",
        call_key=current_call_key(),
        caller_channel=run.source.channel,
    )


class _Pipe:
    """The two commands of one pipe, run: the source's stdout into the destination's stdin."""

    def __init__(self, *, source: LiveCommand, destination: LiveCommand, on_progress: PipeProgress | None) -> None:
        self.source = source
        self.destination = destination
        self.on_progress = on_progress
        self.moved = 0
        self.ends: dict[int, Result | Failed] = {}
        self.outputs = {
            id(command): OutputAssembly(
                int(command.candidate.limits.get("max_file_size_bytes", DEFAULT_LIMITS["max_file_size_bytes"]))
            )
            for command in (source, destination)
        }
        source.on_cancel = self._cancel_both
        destination.on_cancel = self._cancel_both
        destination.on_stdin_credit = self._credit_source

    async def _cancel_both(self) -> None:
        await self.source.cancel()
        await self.destination.cancel()

    async def _credit_source(self, credit_total: int) -> None:
        # The destination may now be sent this many bytes in all: the source may send as many.
        await self.source.grant("stdout", credit_total)

    async def run(self) -> None:
        """Send both (the destination first, so its stdin is there), pump until both end."""
        failure = await self.destination.send()
        if failure is not None:
            self.ends[id(self.destination)] = failure
            return  # nothing for the source to feed: it is never sent
        failure = await self.source.send()
        if failure is not None:
            self.ends[id(self.source)] = failure
        await asyncio.gather(self._pump_source(), self._read_destination())

    async def _pump_source(self) -> None:
        command = self.source
        if id(command) not in self.ends:
            while True:
                event = await command.next_event()
                if isinstance(event, Output):
                    if event.stream == "stdout":
                        if await self.destination.write_base64(event.data):
                            self.moved += event.raw_bytes
                            await self._progress()
                    else:
                        self.outputs[id(command)].add(event)
                        await command.consumed(event)
                    continue
                self.ends[id(command)] = event
                break
        await self.destination.write_base64("", eof=True)  # the source ended: close stdin

    async def _read_destination(self) -> None:
        command = self.destination
        while True:
            event = await command.next_event()
            if isinstance(event, Output):
                self.outputs[id(command)].add(event)
                await command.consumed(event)
                continue
            self.ends[id(command)] = event
            break
        await self.source.cancel()  # the destination ended first: stop the source (a no-op after)

    async def _progress(self) -> None:
        if self.on_progress is None:
            return
        outcome = self.on_progress(self.moved, None)
        if inspect.isawaitable(outcome):
            await outcome

    async def stop(self) -> None:
        """Cancel whatever still runs (the caller left, or an error), end both channels."""
        for command in (self.source, self.destination):
            if not command.finished:
                await command.cancel()
            await command.close()

    def answer(self, command: LiveCommand, *, with_stdout: bool) -> dict[str, Any]:
        """One end's part of the answer."""
        end = self.ends.get(id(command))
        entry: dict[str, Any] = {"machine_id": command.candidate.machine_id, "name": command.candidate.name}
        if not isinstance(end, Result):
            error = end or Failed(
                request_id=command.event_request_id,
                machine_id=command.candidate.machine_id,
                name=command.candidate.name,
                code="CANCELLED",
                message="the pipe stopped before this command ended",
            )
            return {
                **entry,
                "ok": False,
                "error": {"code": error.code, "message": error.message, "details": error.details},
            }
        result = self.outputs[id(command)].result(end.payload)
        entry.update(
            ok=True,
            exit_code=result.get("exit_code"),
            timed_out=bool(result.get("timed_out")),
            cancelled=bool(result.get("cancelled")),
            duration_seconds=result.get("duration_seconds"),
            output_truncated=bool(result.get("output_truncated")),
            stderr=result["stderr"],
        )
        if with_stdout:
            entry["stdout"] = result["stdout"]
        return entry
