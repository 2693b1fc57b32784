"""Long commands behind a handle: start, read, wait, cancel (docs/live-operations.md#long-commands-handles).

A tool call of an MCP connector is cut at about 60 s, so a command that may run longer is
started with ``command_start`` and followed by its ``command_id``. The state is a
``CommandRun`` row, never this process's memory: the start, each read, each wait and the
cancel may land on different server processes behind a load balancer.

The process that starts a command runs it in a background asyncio task that consumes
``machines.services.live.operation_stream`` (the path of a streamed
``local_pc_execute_command``, with its audit record and its ``OperationInFlight`` row) and
writes the output into the row at most every ``FLUSH_INTERVAL`` seconds or every
``FLUSH_BYTES``, then the result. The task runs under its own ``call_key``
(``"cmd:<command_id>"``), so ``cancel_calls`` stops it from any process. A run whose
process is gone reads ``lost``; finished rows go after ``COMMAND_RUN_RETENTION``
(``command_runs_expired_delete``, also run on each start). A stopping process cancels its
runs first (``command_runs_shutdown``), so each records ``lost`` with its output.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import re
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, cast

from channels.db import database_sync_to_async
from django.conf import settings
from django.contrib.auth.models import User
from django.db.models import F, Q, Value
from django.db.models.functions import Concat
from django.utils import timezone
from pydantic import ValidationError

from core.errors import DispatchError, InvalidRequest, NotFound
from core.presence import current_process_id
from core.services import server_process_ensure
from core.tools import TOOL_CALL, ToolCall
from machines.models import CommandRun
from machines.schemas import CALLER_PAYLOAD_MODELS, payload_error, without_nulls
from machines.services import live
from machines.services.arguments import check_session_id
from machines.services.inflight import command_summary
from machines.services.live import Failed, LiveEvent, Output, Result, Started

logger = logging.getLogger(__name__)

COMMAND_ID_PATTERN = re.compile(r"^cmd_[0-9a-f]{32}$")
OUTPUT_KEPT_BYTES = CommandRun.OUTPUT_KEPT_BYTES  # bytes of UTF-8 kept per stream (1 MiB)
READ_PAGE_BYTES = 256 * 1024  # bytes of each stream one read returns at most
FLUSH_INTERVAL = 0.5  # seconds: output reaches the row at least this often while it comes
FLUSH_BYTES = 64 * 1024  # bytes of output that are written at once, without waiting for the interval
WAIT_DEFAULT_SECONDS = 30.0
WAIT_MAX_SECONDS = 50.0  # a wait stays under the ~60 s cut of MCP connectors
POLL_INTERVAL = 0.3  # seconds between the short queries of a wait
CANCEL_SETTLE_SECONDS = 5.0  # how long a cancel waits for the run to record its end
COMMAND_RUN_RETENTION = timedelta(hours=1)  # finished rows are kept this long
CALL_KEY_PREFIX = "cmd:"
FINAL_WRITE_DELAYS = (0.2, 0.6, 1.5)  # seconds before each retry of a run's final write; then it is marked lost
SHUTDOWN_GRACE = 3.0  # seconds a stopping process gives its runs to record their end
PROCESS_LOST_ERROR = {
    "code": "SERVER_PROCESS_LOST",
    "message": "the server process following the command is gone, or lost track of it",
}

# Strong references to the running tasks (the event loop keeps only weak ones), and the ids
# they follow. Not a registry: the rows are the state; the ids only tell this process that a
# row of its own still marked running has no task left (its final write failed) — lost.
_TASKS: set[asyncio.Task[None]] = set()
_FOLLOWED_HERE: set[str] = set()


def new_command_id() -> str:
    """A fresh command id: ``cmd_`` + 32 hex digits (a random UUID)."""
    return f"cmd_{uuid.uuid4().hex}"


def check_command_id(command_id: Any) -> str:
    """``command_id`` as given, or ``InvalidRequest`` when it is not ``cmd_`` + 32 hex digits."""
    if not isinstance(command_id, str) or not COMMAND_ID_PATTERN.match(command_id):
        raise InvalidRequest("command_id must be the id local_pc_command_start returned ('cmd_' + 32 hex digits)")
    return command_id


def check_offset(offset: Any) -> tuple[int, int]:
    """``offset`` (``None``, or ``{"stdout"?: int, "stderr"?: int}`` in bytes, as a read's
    ``next_offset`` gives it) as ``(stdout, stderr)``; ``InvalidRequest`` for another shape,
    a negative number, a non-integer, or past ``OUTPUT_KEPT_BYTES`` (no stream ever keeps
    more: refused before any wait)."""
    if offset is None:
        return 0, 0
    if not isinstance(offset, dict) or set(offset) - {"stdout", "stderr"}:
        raise InvalidRequest('offset must be {"stdout": bytes, "stderr": bytes} (a read\'s next_offset)')
    values = []
    for stream in ("stdout", "stderr"):
        value = offset.get(stream, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidRequest(f"offset.{stream} must be a whole number of bytes, 0 or more")
        if value > OUTPUT_KEPT_BYTES:
            raise InvalidRequest(f"offset.{stream} is past the {OUTPUT_KEPT_BYTES} bytes a stream keeps at most")
        values.append(value)
    return values[0], values[1]


def check_wait_seconds(timeout_seconds: Any) -> float:
    """A wait's ``timeout_seconds`` (default ``WAIT_DEFAULT_SECONDS``), or ``InvalidRequest``
    outside (0, ``WAIT_MAX_SECONDS``]."""
    if timeout_seconds is None:
        return WAIT_DEFAULT_SECONDS
    if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, (int, float)):
        raise InvalidRequest("timeout_seconds must be a number of seconds")
    if not 0 < timeout_seconds <= WAIT_MAX_SECONDS:
        raise InvalidRequest(
            f"timeout_seconds must be more than 0 and at most {WAIT_MAX_SECONDS:g} (MCP connectors cut a call at 60 s)"
        )
    return float(timeout_seconds)


# --- start ---------------------------------------------------------------------------------------


def check_start_payload(payload: dict[str, Any]) -> None:
    """Refuse (``InvalidRequest``) before anything is sent what would only fail on the
    machine: a payload its model refuses (``"payload.<field>: <sentence>"``), not exactly
    one of ``argv`` and ``command``, or ``binary: true`` (the row keeps text)."""
    if payload.get("binary"):
        raise InvalidRequest("a command started with a handle keeps its output as text: binary is not supported")
    plain = without_nulls(payload)
    try:
        CALLER_PAYLOAD_MODELS["EXECUTE_COMMAND"].model_validate(plain)
    except ValidationError as exc:
        raise InvalidRequest(payload_error(exc)) from None
    if ("argv" in plain) == ("command" in plain):
        raise InvalidRequest("give exactly one of argv (a list of strings) and command (a string)")


async def command_start(
    *,
    user: User,
    session_id: str,
    payload: dict[str, Any],
    target_machine: str | None,
    caller: str,
) -> dict[str, Any]:
    """Start ``EXECUTE_COMMAND`` ``payload`` (``{argv | command, cwd?, timeout_seconds?,
    env?}``) on one machine and return once it is sent: ``{"command_id", "machine" (name),
    "machine_id", "status": "running", "started_at" (ISO 8601)}``.

    Raises ``check_start_payload``'s ``InvalidRequest`` (``binary: true`` among them: the
    row keeps text), what ``live.operation_stream`` raises before its first event (routing's
    ``MachineError``, ``UNSUPPORTED_OPERATION`` on a protocol 2.0 shim, ``RATE_LIMITED``),
    and the ``Failed`` event's code when the command could not be sent
    (``MACHINE_UNREACHABLE``, ``MACHINE_BUSY``).
    """
    check_start_payload(payload)
    await database_sync_to_async(command_runs_expired_delete)()
    command_id = new_command_id()
    run = _Run(command_id=command_id, user=user, session_id=session_id, payload=payload, caller=caller)
    ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    # A start call cut before the answer leaves nobody to read an error set on ``ready``:
    # read here, or asyncio logs "Future exception was never retrieved".
    ready.add_done_callback(_retrieved)
    _FOLLOWED_HERE.add(command_id)
    task = asyncio.create_task(run.run(target_machine, ready), name=f"command run {command_id}")
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)
    task.add_done_callback(lambda _: _FOLLOWED_HERE.discard(command_id))
    # Shielded: a start call cut while sending leaves the task to finish what it began
    # (the row or the error); the command is not tied to the call that started it.
    return await asyncio.shield(ready)


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


@dataclass
class _Stream:
    """One stream's output of a run: kept bytes so far, whether it was cut (``full``), and
    text not yet in the row."""

    kept: int = 0
    # Set at the first cut: everything after is dropped, so the row holds the stream's
    # first bytes, not a gap followed by later small frames that fit the leftover room.
    full: bool = False
    pending: list[str] = field(default_factory=list)
    pending_bytes: int = 0


def _text_of(output: Output) -> str:
    """An output frame as storable text: base64 decoded (invalid UTF-8 replaced), lone
    surrogates replaced, NUL as U+FFFD (PostgreSQL text cannot hold it)."""
    text = output.data
    if output.encoding == "base64":
        try:
            text = base64.b64decode(output.data).decode("utf-8", "replace")
        except (binascii.Error, ValueError):
            text = ""
    return text.encode("utf-8", "replace").decode("utf-8").replace("\x00", "\ufffd")


class _Run:
    """The background task of one started command (in the starting process only)."""

    def __init__(self, *, command_id: str, user: User, session_id: str, payload: dict[str, Any], caller: str) -> None:
        self.command_id = command_id
        self.user = user
        self.session_id = session_id
        self.payload = payload
        self.caller = caller
        self.streams = {"stdout": _Stream(), "stderr": _Stream()}
        self.truncated = False
        self.truncated_written = False  # the row says output_truncated: no more writes just for that
        self.row_written = False
        self.lock = asyncio.Lock()

    async def run(self, target_machine: str | None, ready: asyncio.Future[dict[str, Any]]) -> None:
        # Its own call key (this task's copy of the context): cancel_calls finds its
        # in-flight row by it, from any process; the start call's own key does not stop it.
        TOOL_CALL.set(ToolCall(call_key=CALL_KEY_PREFIX + self.command_id))
        stream = live.operation_stream(
            user=self.user,
            session_id=self.session_id,
            op="EXECUTE_COMMAND",
            payload=self.payload,
            target_machine=target_machine,
            caller=self.caller,
        )
        events = cast(AsyncGenerator[LiveEvent, None], stream)  # an async generator: closed below
        ticker: asyncio.Task[None] | None = None
        end: dict[str, Any] | None = None
        try:
            async for event in events:
                if isinstance(event, Started):
                    ready.set_result(await self.created(event))
                    ticker = asyncio.create_task(self.tick(), name=f"command run {self.command_id} ticker")
                elif isinstance(event, Output):
                    await self.output(event)
                elif isinstance(event, Result):
                    end = self.result_fields(event)
                elif isinstance(event, Failed):
                    if not ready.done():
                        ready.set_exception(DispatchError(event.code, event.message, event.details))
                        return
                    end = self.failure_fields(event.code, event.message)
        except asyncio.CancelledError:
            # This process is stopping: the stream's own cleanup cancelled the command. A
            # run that already got its result keeps it.
            if end is None:
                end = self.failure_fields("SHUTTING_DOWN", "the server process running the command stopped")
                end["status"] = CommandRun.Status.LOST
            raise
        except Exception as exc:
            if not ready.done():
                ready.set_exception(exc)
                return
            logger.exception("command run %s failed", self.command_id)
            code = exc.code if isinstance(exc, DispatchError) else "INTERNAL_ERROR"
            end = end or self.failure_fields(code, str(exc) or type(exc).__name__)
        finally:
            # The ticker first: whatever fails below, no task is left waking every interval.
            if ticker is not None:
                ticker.cancel()
                await asyncio.gather(ticker, return_exceptions=True)
            if not ready.done():
                ready.set_exception(DispatchError("OUTPUT_LOST", "the command's stream ended before it started"))
            try:
                await events.aclose()
            except Exception:
                # The command's cleanup failed (its audit, its in-flight row): the run's
                # end is still written below, or the row would read running for ever.
                logger.exception("closing the stream of command run %s failed", self.command_id)
            if self.row_written:
                end = end or self.failure_fields("OUTPUT_LOST", "the command's stream ended without a result")
                await self.finish(end)

    async def created(self, started: Started) -> dict[str, Any]:
        """Write the row for the sent command; the start call's answer."""
        row = await database_sync_to_async(_run_create)(
            command_id=self.command_id,
            user=self.user,
            session_id=self.session_id,
            machine_id=started.machine_id,
            machine_name=started.name,
            request_id=started.request_id,
            summary=command_summary(self.payload),
            caller=self.caller,
        )
        self.row_written = True
        return {
            "command_id": row.id,
            "machine": row.machine_name,
            "machine_id": row.machine_id,
            "status": row.status,
            "started_at": row.started_at.isoformat(),
        }

    async def output(self, event: Output) -> None:
        """Keep a frame (the first ``OUTPUT_KEPT_BYTES`` of each stream, nothing after the
        first cut) and write it when enough waits. A failed write is logged and retried
        with the next one: a database hiccup never ends the command."""
        stream = self.streams["stderr" if event.stream == "stderr" else "stdout"]
        if stream.full:
            return
        text = _text_of(event)
        raw = text.encode("utf-8")
        room = OUTPUT_KEPT_BYTES - stream.kept
        if len(raw) > room:
            self.truncated = True
            stream.full = True
            # Cut on a character boundary: what is kept stays valid UTF-8.
            text = raw[: max(room, 0)].decode("utf-8", "ignore")
            raw = text.encode("utf-8")
        if raw:
            stream.kept += len(raw)
            stream.pending.append(text)
            stream.pending_bytes += len(raw)
        if sum(s.pending_bytes for s in self.streams.values()) >= FLUSH_BYTES:
            try:
                await self.flush()
            except Exception:
                # Not raised: the run's except branch would close the stream, which CANCELs
                # the command. The text is pending again (flush put it back).
                logger.exception("could not write the output of command run %s", self.command_id)

    async def tick(self) -> None:
        """Write pending output every ``FLUSH_INTERVAL`` seconds (a quiet command's last lines too)."""
        while True:
            await asyncio.sleep(FLUSH_INTERVAL)
            try:
                await self.flush()
            except Exception:
                logger.exception("could not write the output of command run %s", self.command_id)

    async def flush(self, end: dict[str, Any] | None = None) -> None:
        """Append the pending output to the row (with ``end``'s fields: the final write).
        Raises what the database raises; the output is then pending again, ahead of what
        came meanwhile (no chunk vanishes, the order holds)."""
        async with self.lock:
            appended = {name: "".join(stream.pending) for name, stream in self.streams.items()}
            sizes = {name: stream.pending_bytes for name, stream in self.streams.items()}
            truncated = self.truncated
            news = any(sizes.values()) or end is not None or (truncated and not self.truncated_written)
            if not news:
                return
            for stream in self.streams.values():
                stream.pending, stream.pending_bytes = [], 0
            try:
                await database_sync_to_async(_run_append)(
                    command_id=self.command_id, appended=appended, sizes=sizes, truncated=truncated, end=end
                )
            except Exception:
                for name, stream in self.streams.items():
                    if sizes[name]:
                        stream.pending.insert(0, appended[name])
                        stream.pending_bytes += sizes[name]
                raise
            self.truncated_written = self.truncated_written or truncated

    async def finish(self, end: dict[str, Any]) -> None:
        """The final write (``end``'s fields and the last output), to the end even when this
        task is cancelled meanwhile (it is bounded: ``FINAL_WRITE_DELAYS``); re-raises the
        cancellation after."""
        final = asyncio.ensure_future(self.final_write(end))
        cancelled = False
        while not final.done():
            try:
                await asyncio.shield(final)
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError

    async def final_write(self, end: dict[str, Any]) -> None:
        """Write ``end``, retried after each of ``FINAL_WRITE_DELAYS``; if every try fails,
        mark the run ``lost`` (best effort): a row left running would read so for ever on
        other processes, and retention would never see it end."""
        for delay in (*FINAL_WRITE_DELAYS, None):
            try:
                await self.flush(end)
                return
            except Exception:
                if delay is None:
                    logger.exception("could not write the end of command run %s: marking it lost", self.command_id)
                    break
                logger.warning("could not write the end of command run %s; again in %g s", self.command_id, delay)
                await asyncio.sleep(delay)
        try:
            await database_sync_to_async(_run_lost)(command_id=self.command_id)
        except Exception:
            logger.exception("could not mark command run %s lost either", self.command_id)

    def result_fields(self, result: Result) -> dict[str, Any]:
        """The final fields of a command that answered (``COMMAND_RESULT``)."""
        payload = result.payload
        cancelled = bool(payload.get("cancelled"))
        exit_code = payload.get("exit_code")
        duration = payload.get("duration_seconds")
        return {
            "status": CommandRun.Status.CANCELLED if cancelled else CommandRun.Status.FINISHED,
            "exit_code": exit_code if isinstance(exit_code, int) and not isinstance(exit_code, bool) else None,
            "timed_out": bool(payload.get("timed_out")),
            "duration_seconds": float(duration) if isinstance(duration, (int, float)) else None,
            "output_truncated": bool(payload.get("output_truncated") or payload.get("stream_truncated")),
            "error": None,  # a run read lost while this process was silent got its result after all
        }

    def failure_fields(self, code: str, message: str) -> dict[str, Any]:
        """The final fields of a command that failed (no result: the machine went away, …)."""
        return {
            "status": CommandRun.Status.FAILED,
            "error": {"code": code, "message": message[:1000]},
            "timed_out": code == "TIMEOUT",
        }


def _run_create(
    *,
    command_id: str,
    user: User,
    session_id: str,
    machine_id: str,
    machine_name: str,
    request_id: str,
    summary: str,
    caller: str,
) -> CommandRun:
    return CommandRun.objects.create(
        id=command_id,
        user=user,
        session_id=session_id,
        machine_id=machine_id,
        machine_name=machine_name,
        request_id=request_id,
        summary=summary[:500],
        caller=caller[:200],
        call_key=CALL_KEY_PREFIX + command_id,
        server_process_id=server_process_ensure(),
    )


def _run_append(
    *,
    command_id: str,
    appended: dict[str, str],
    sizes: dict[str, int],
    truncated: bool,
    end: dict[str, Any] | None,
) -> None:
    """One write of a run's task: output appended in the database (the row's text is never
    read back here), and with ``end`` the final status, stamped ``finished_at``. A row still
    running gets it, and so does one a reader marked ``lost`` while it belongs to this
    process (its heartbeat was late, not gone: the real end replaces the guess); any other
    ended row keeps its status but gets the output."""
    changes: dict[str, Any] = {}
    for stream in ("stdout", "stderr"):
        if sizes[stream]:
            changes[stream] = Concat(F(stream), Value(appended[stream]))
            changes[f"{stream}_bytes"] = F(f"{stream}_bytes") + sizes[stream]
    if truncated:
        changes["output_truncated"] = True
    rows = CommandRun.objects.filter(pk=command_id)
    if changes:
        rows.update(**changes)
    if end is not None:
        final = dict(end)
        if final.pop("output_truncated", False) or truncated:
            final["output_truncated"] = True
        open_here = Q(status=CommandRun.Status.LOST, server_process_id=current_process_id())
        rows.filter(Q(status=CommandRun.Status.RUNNING) | open_here).update(**final, finished_at=timezone.now())


def _run_lost(*, command_id: str) -> None:
    """Mark a run whose final write failed ``lost`` (``SERVER_PROCESS_LOST``), if still running."""
    CommandRun.objects.filter(pk=command_id, status=CommandRun.Status.RUNNING).update(
        status=CommandRun.Status.LOST, finished_at=timezone.now(), error=PROCESS_LOST_ERROR
    )


# --- read, wait, cancel -----------------------------------------------------------------------


def _run_for(*, user: User, command_id: str, session_id: str, with_output: bool = True) -> CommandRun:
    """``user``'s run ``command_id`` in ``session_id``, with its process (and its
    ``stdout``/``stderr``, up to 1 MiB each, only ``with_output``); a run found lost is
    recorded as such. Another user's run, or one of another session, is ``NotFound`` as an
    unknown id is: the answer never says it exists."""
    rows = CommandRun.objects.select_related("server_process")
    if not with_output:
        rows = rows.defer("stdout", "stderr")
    run = rows.filter(user=user, session_id=session_id, pk=command_id).first()
    if run is None:
        raise NotFound(
            f"no command {command_id} in session '{session_id}' (unknown, or ended over an hour ago and forgotten)"
        )
    alive_after = timezone.now() - timedelta(seconds=settings.PROCESS_TTL)
    here = current_process_id()
    orphaned = run.server_process_id == here and run.id not in _FOLLOWED_HERE
    if run.lost(alive_after=alive_after, current_process_id=here) or (
        run.status == CommandRun.Status.RUNNING and orphaned
    ):
        ended = timezone.now()
        error = dict(PROCESS_LOST_ERROR)
        if CommandRun.objects.filter(pk=run.pk, status=CommandRun.Status.RUNNING).update(
            status=CommandRun.Status.LOST, finished_at=ended, error=error
        ):
            run.status, run.finished_at, run.error = CommandRun.Status.LOST, ended, error
        else:
            run.refresh_from_db()
    return run


def _page(text: str, offset: int, stream: str) -> tuple[str, int]:
    """The text of ``text``'s UTF-8 from byte ``offset`` on (at most ``READ_PAGE_BYTES``,
    cut on character boundaries), and the offset after it."""
    raw = text.encode("utf-8")
    if offset > len(raw):
        raise InvalidRequest(f"offset.{stream} is past the {len(raw)} bytes of {stream} kept so far")
    start = offset
    while start < len(raw) and raw[start] & 0xC0 == 0x80:  # inside a character: skip to the next
        start += 1
    end = min(len(raw), start + READ_PAGE_BYTES)
    while end < len(raw) and raw[end] & 0xC0 == 0x80:
        end -= 1
    return raw[start:end].decode("utf-8"), end


def _state(run: CommandRun, offset: tuple[int, int]) -> dict[str, Any]:
    """What read and wait answer for ``run`` (see ``command_read``)."""
    stdout, stdout_next = _page(run.stdout, offset[0], "stdout")
    stderr, stderr_next = _page(run.stderr, offset[1], "stderr")
    state: dict[str, Any] = {
        "command_id": run.id,
        "status": run.status,
        "machine": run.machine_name,
        "machine_id": run.machine_id,
        "stdout": stdout,
        "stderr": stderr,
        "next_offset": {"stdout": stdout_next, "stderr": stderr_next},
        "stdout_bytes": run.stdout_bytes,
        "stderr_bytes": run.stderr_bytes,
        "output_truncated": run.output_truncated,
        "started_at": run.started_at.isoformat(),
    }
    if run.status != CommandRun.Status.RUNNING:
        state["exit_code"] = run.exit_code
        state["timed_out"] = run.timed_out
        state["duration_seconds"] = run.duration_seconds
        state["finished_at"] = run.finished_at.isoformat() if run.finished_at else None
        if run.error:
            state["error"] = run.error
    return state


def command_read_sync(
    *, user: User, session_id: str, command_id: str, offset: tuple[int, int] = (0, 0)
) -> dict[str, Any]:
    """``command_read`` as one sync database read (for ``database_sync_to_async``)."""
    return _state(_run_for(user=user, command_id=command_id, session_id=session_id), offset)


async def command_read(*, user: User, session_id: str, command_id: Any, offset: Any = None) -> dict[str, Any]:
    """The state of ``user``'s run ``command_id`` started in ``session_id``: ``{command_id, status: "running" |
    "finished" | "failed" | "cancelled" | "lost", machine, machine_id, stdout, stderr
    (text from ``offset``, at most ``READ_PAGE_BYTES`` each), next_offset: {stdout,
    stderr} (bytes: pass it back as ``offset`` to read only what is new), stdout_bytes,
    stderr_bytes (kept so far, at most 1 MiB each), output_truncated, started_at}``;
    once ended also ``exit_code``, ``timed_out``, ``duration_seconds``, ``finished_at``
    and, failed or lost, ``error: {code, message}``.

    Raises ``InvalidRequest`` (a malformed ``command_id`` or ``offset``, an offset past the
    output kept) and ``NotFound`` (unknown, another user's or another session's run, or one
    forgotten ``COMMAND_RUN_RETENTION`` after it ended)."""
    check_session_id(session_id)
    command_id = check_command_id(command_id)
    offsets = check_offset(offset)
    return await database_sync_to_async(command_read_sync)(
        user=user, command_id=command_id, offset=offsets, session_id=session_id
    )


def _status_of(*, user: User, command_id: str, session_id: str) -> str:
    # Without the output: a wait polls every POLL_INTERVAL, and the text is read once at the end.
    return _run_for(user=user, command_id=command_id, session_id=session_id, with_output=False).status


async def _until_ended(
    *, user: User, command_id: str, session_id: str, seconds: float, status: str = CommandRun.Status.RUNNING
) -> None:
    """Return once the run's status is no longer ``status`` (``running``: it ended) or
    after ``seconds``. The row is the state (the starting process may be another), so it
    is polled with one short query every ``POLL_INTERVAL`` seconds; nothing is held
    between polls."""
    status_of = database_sync_to_async(_status_of)
    try:
        async with asyncio.timeout(seconds):
            while True:
                if await status_of(user=user, command_id=command_id, session_id=session_id) != status:
                    return
                await asyncio.sleep(POLL_INTERVAL)
    except TimeoutError:
        return


async def command_wait(
    *,
    user: User,
    session_id: str,
    command_id: Any,
    timeout_seconds: Any = None,
    offset: Any = None,
) -> dict[str, Any]:
    """Wait until ``user``'s run ``command_id`` ends or ``timeout_seconds`` (default 30, at
    most ``WAIT_MAX_SECONDS``) pass, then answer as ``command_read`` (``status`` still
    ``"running"`` when the wait ran out). Polls the row every ``POLL_INTERVAL`` seconds
    with short queries: no database thread is held while waiting.

    Raises ``InvalidRequest`` (a malformed ``session_id``, ``command_id``, ``offset`` or
    ``timeout_seconds``, before any wait) and ``NotFound`` as ``command_read`` does."""
    check_session_id(session_id)
    command_id = check_command_id(command_id)
    offsets = check_offset(offset)
    seconds = check_wait_seconds(timeout_seconds)
    await _until_ended(user=user, command_id=command_id, session_id=session_id, seconds=seconds)
    return await database_sync_to_async(command_read_sync)(
        user=user, command_id=command_id, offset=offsets, session_id=session_id
    )


async def command_cancel(*, user: User, session_id: str, command_id: Any) -> dict[str, Any]:
    """Stop ``user``'s run ``command_id`` from any process (``live.cancel_calls`` with the
    run's ``call_key``: its ``OperationInFlight`` row names the shim to send ``CANCEL`` to),
    wait up to ``CANCEL_SETTLE_SECONDS`` for the run to record its end, and answer as
    ``command_read`` (from offset 0) with ``cancel_sent`` (whether a running command was
    reached). A ``lost`` run is cancelled too: its process may only have been silent, and
    its command may still run on the machine (then the real end replaces ``lost``). A run
    that ended otherwise is answered as it is.

    Raises ``InvalidRequest`` (a malformed ``session_id`` or ``command_id``) and ``NotFound``
    as ``command_read`` does."""
    check_session_id(session_id)
    command_id = check_command_id(command_id)
    run = await database_sync_to_async(_run_for)(
        user=user, command_id=command_id, session_id=session_id, with_output=False
    )
    sent = 0
    if run.status in (CommandRun.Status.RUNNING, CommandRun.Status.LOST):
        sent = await live.cancel_calls(user=user, call_key=run.call_key)
        if sent:
            await _until_ended(
                user=user,
                command_id=command_id,
                session_id=session_id,
                seconds=CANCEL_SETTLE_SECONDS,
                status=run.status,
            )
    state = await database_sync_to_async(command_read_sync)(user=user, command_id=command_id, session_id=session_id)
    return {**state, "cancel_sent": bool(sent)}


# --- retention ----------------------------------------------------------------------------------


def command_runs_expired_delete() -> int:
    """Mark ``lost`` (ended now) the runs still marked running whose process row is gone
    (nobody read them yet), then delete the runs that ended over ``COMMAND_RUN_RETENTION``
    ago; returns how many went. A run is only ever deleted by when it ended: one that ran
    over an hour and whose process was then reaped reads ``lost`` for an hour, never
    ``NOT_FOUND`` at once. Sync (two queries)."""
    now = timezone.now()
    CommandRun.objects.filter(status=CommandRun.Status.RUNNING, server_process__isnull=True).update(
        status=CommandRun.Status.LOST, finished_at=now, error=PROCESS_LOST_ERROR
    )
    deleted, _ = CommandRun.objects.filter(finished_at__lt=now - COMMAND_RUN_RETENTION).delete()
    return int(deleted)


# --- shutdown -----------------------------------------------------------------------------------


async def command_runs_shutdown(*, grace: float = SHUTDOWN_GRACE) -> int:
    """Cancel the runs this process follows and wait up to ``grace`` seconds for them to
    record their end: each CANCELs its command (the stream's cleanup) and writes ``lost``
    (``SHUTTING_DOWN``) with its last output. Called by ``serve`` on shutdown before its
    process row goes: otherwise the loop stops with the tasks pending (output lost, nothing
    recorded), and the CANCELs sent for the process's in-flight rows may end the run as
    ``cancelled``. Returns how many runs had not ended in time."""
    tasks = list(_TASKS)
    if not tasks:
        return 0
    for task in tasks:
        task.cancel()
    _, pending = await asyncio.wait(tasks, timeout=grace)
    if pending:
        logger.warning("%d command runs did not record their end within %g s", len(pending), grace)
    return len(pending)
