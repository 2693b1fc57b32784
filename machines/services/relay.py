"""The caller's side of a live operation on one machine (protocol 2.1:
docs/shim-protocol.md#live-operations-21).

A ``LiveCommand`` is one streamed ``EXECUTE_COMMAND`` on one machine: it sends a
``MachineOpMessage(relay=True)`` to the shim consumer's channel with its own long-lived
reply channel (a ``core.realtime.Subscription``), and reads that channel itself:
``MachineOutputMessage`` (the shim's ``COMMAND_OUTPUT`` frames), ``MachineFlowMessage``
(the shim's stdin credit), the final ``MachineReplyMessage``, and ``OperationCancelMessage``
(a cancel route, from any process). Towards the shim it sends ``MachineFlowMessage``
(stdout/stderr credit, granted as the caller consumes), ``MachineInputMessage`` (stdin) and
``MachineCancelMessage``.

Rules it holds (docs/shim-protocol.md#flow-control-flow, docs/shim-protocol.md#streamed-output):

- credit is end to end: the shim may send ``stream_window_bytes`` raw bytes of each stream
  before the first grant; ``consumed(output)`` grants more (cumulative ``credit_total`` =
  raw bytes consumed + window) once a quarter window has been consumed, so memory along the
  way is bounded by the window;
- ``seq`` counts from 0 per operation across both streams: a gap means a message was lost
  on the at-most-once layer, and the operation is cancelled and ends ``OUTPUT_LOST``;
- while it waits it re-checks every ``DISPATCH_REMOTE_LIVENESS_INTERVAL`` seconds that the
  connection row exists and its process is alive (``connection_alive``); gone →
  ``MACHINE_UNREACHABLE``. A shim whose socket closes fails its pending operations at once
  (the consumer's cleanup), and kills its process groups itself;
- the operation's deadline is its timeout (the command's own + 10 s); past it, ``CANCEL``
  and ``TIMEOUT``.

The events callers see (``LiveEvent``: ``Started``, ``Output``, ``Progress``, ``Result``,
``Failed``) are defined here and re-exported by ``machines.services.live``.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, ClassVar, Literal

from channels.db import database_sync_to_async
from channels.exceptions import ChannelFull
from django.conf import settings
from django.utils import timezone

from core.presence import current_process_id
from core.realtime import Subscription, layer_send
from machines.models import MachineConnection
from machines.protocol import (
    DEFAULT_LIMITS,
    MachineCancelMessage,
    MachineFlowMessage,
    MachineInputMessage,
    MachineOpMessage,
    MachineOutputMessage,
    MachineReplyMessage,
    OperationCancelMessage,
)
from machines.services.router import Candidate
from machines.shim.protocol import STREAM_FLUSH_BYTES

logger = logging.getLogger(__name__)

STREAMS = ("stdout", "stderr")


# --- events ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LiveEvent:
    """One event of a live operation; ``event`` names it on an SSE stream, ``as_json()`` is
    its data (a plain JSON object)."""

    event: ClassVar[str] = ""

    def as_json(self) -> dict[str, Any]:
        """The event as a JSON object (its fields)."""
        return asdict(self)


@dataclass(frozen=True)
class Started(LiveEvent):
    """Operation ``request_id`` was sent to machine ``machine_id`` (``name``)."""

    event: ClassVar[str] = "started"
    request_id: str
    machine_id: str
    name: str


@dataclass(frozen=True)
class Output(LiveEvent):
    """One ``COMMAND_OUTPUT`` frame: ``stream`` ``"stdout"|"stderr"``, ``data`` (UTF-8 text, or
    base64 of raw bytes when ``encoding`` is ``"base64"``), ``seq`` (from 0 per operation)."""

    event: ClassVar[str] = "output"
    request_id: str
    machine_id: str
    name: str
    stream: str
    data: str
    encoding: str
    seq: int

    @property
    def raw_bytes(self) -> int:
        """The raw bytes this frame stands for (what credit counts): the decoded base64, or
        the UTF-8 text encoded again (an invalid byte became U+FFFD: a few bytes more, never
        fewer than a window's worth short)."""
        if self.encoding == "base64":
            return base64_length(self.data)
        return len(self.data.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True)
class Progress(LiveEvent):
    """Bytes moved so far of a copy (``bytes_total``: the file's size) or a pipe
    (``bytes_total``: ``None``)."""

    event: ClassVar[str] = "progress"
    request_id: str
    bytes_done: int
    bytes_total: int | None


@dataclass(frozen=True)
class Result(LiveEvent):
    """The operation's response on machine ``machine_id``: ``type`` (e.g. ``COMMAND_RESULT``)
    and its ``payload`` (2.1: ``stdout``/``stderr`` empty when streamed, plus
    ``stdout_bytes``, ``stderr_bytes``, ``stream_truncated``, ``cancelled``)."""

    event: ClassVar[str] = "result"
    request_id: str
    machine_id: str
    name: str
    type: str
    payload: dict[str, Any]


@dataclass(frozen=True)
class Failed(LiveEvent):
    """The operation failed on ``machine_id`` (``None`` when no machine was chosen): a code
    of docs/shim-protocol.md#errors (``MACHINE_UNREACHABLE``, ``TIMEOUT``, ``OUTPUT_LOST``,
    ``UNSUPPORTED_OPERATION``, the shim's own …), its message and details."""

    event: ClassVar[str] = "error"
    request_id: str
    machine_id: str | None
    name: str | None
    code: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)


def base64_length(data: str) -> int:
    """The number of bytes base64 ``data`` decodes to, counted without decoding it."""
    padding = 2 if data.endswith("==") else 1 if data.endswith("=") else 0
    return max(len(data) * 3 // 4 - padding, 0)


# --- liveness ----------------------------------------------------------------------------------


@database_sync_to_async
def connection_alive(connection_id: str, server_process_id: str) -> bool:
    """Whether the connection row still exists and (held by another process) that process's
    heartbeat is fresh (docs/shim-protocol.md#presence-and-takeover: a dead process's
    waiting callers hear of it within seconds)."""
    rows = MachineConnection.objects.filter(connection_id=connection_id)
    if server_process_id != current_process_id():
        cutoff = timezone.now() - timedelta(seconds=settings.PROCESS_TTL)
        rows = rows.filter(server_process__heartbeat_at__gte=cutoff)
    return rows.exists()


def stream_window(limits: dict[str, Any]) -> int:
    """The initial credit of each stream, in bytes (``HELLO_ACK.limits.stream_window_bytes``)."""
    value = limits.get("stream_window_bytes", DEFAULT_LIMITS["stream_window_bytes"])
    return int(value) if isinstance(value, int) and value > 0 else int(DEFAULT_LIMITS["stream_window_bytes"])


# --- one live command ----------------------------------------------------------------------------


class LiveCommand:
    """One streamed ``EXECUTE_COMMAND`` on ``candidate`` (a 2.1 connection), as its caller
    drives it: ``await open()``, ``await send()``, then ``await next_event()`` until it
    returns a ``Result`` or ``Failed`` (``Output`` events before), granting credit with
    ``await consumed(output)`` as each output is used; ``cancel()`` at any time;
    ``close()`` at the end (always).

    ``request_id`` is the envelope id the shim sees. ``payload`` is the EXECUTE_COMMAND
    payload (``stream: true`` is added; ``binary``, ``stdin``, ``pipe`` as given).
    ``timeout`` (seconds) bounds the whole operation. ``event_request_id`` is the id the
    events carry (the fan-out's or the pipe's; default ``request_id``). ``on_cancel()`` is
    awaited after an ``OperationCancelMessage`` made it cancel itself (a pipe cancels its
    other end); ``on_stdin_credit(credit_total)`` after the shim granted more stdin credit
    (a pipe grants its source as much stdout credit).
    """

    def __init__(
        self,
        candidate: Candidate,
        *,
        request_id: str,
        session_id: str,
        payload: dict[str, Any],
        timeout: float,
        event_request_id: str | None = None,
        on_cancel: Callable[[], Awaitable[None]] | None = None,
        on_stdin_credit: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        self.candidate = candidate
        self.request_id = request_id
        self.event_request_id = event_request_id or request_id
        self.audit_id: int | None = None  # its AuditRecord, written before it is sent
        self.session_id = session_id
        self.payload = {**payload, "stream": True}
        self.timeout = timeout
        self.on_cancel = on_cancel
        self.on_stdin_credit = on_stdin_credit
        self.window = stream_window(candidate.limits)
        self.subscription = Subscription(
            receives=[MachineOutputMessage, MachineFlowMessage, MachineReplyMessage, OperationCancelMessage]
        )
        self.next_seq = 0
        self.consumed_bytes = {stream: 0 for stream in STREAMS}
        self.granted = {stream: self.window for stream in STREAMS}
        self.bytes = {"stdout": 0, "stderr": 0, "stdin": 0}  # raw bytes seen (stdin: sent)
        self.stdin_credit = self.window
        self._stdin_granted = asyncio.Event()
        self.cancel_sent = False
        self.cancel_requested = False  # an OperationCancelMessage arrived
        self.finished = False
        self.sent = False
        self._deadline = 0.0
        self._checked_at = 0.0

    @property
    def channel(self) -> str:
        """The reply channel (where an ``OperationCancelMessage`` reaches this caller)."""
        return self.subscription.channel or ""

    def started(self) -> Started:
        """The ``Started`` event of this command."""
        return Started(request_id=self.event_request_id, machine_id=self.candidate.machine_id, name=self.candidate.name)

    def failed(self, code: str, message: str, details: dict[str, Any] | None = None) -> Failed:
        """A ``Failed`` event of this command (ends it)."""
        self.finished = True
        return Failed(
            request_id=self.event_request_id,
            machine_id=self.candidate.machine_id,
            name=self.candidate.name,
            code=code,
            message=message,
            details=details or {},
        )

    async def open(self) -> None:
        """Make the reply channel (raises what the layer raises)."""
        await self.subscription.open()

    async def send(self) -> Failed | None:
        """Send the operation to the shim consumer; a ``Failed`` (``MACHINE_UNREACHABLE``:
        its channel is full) when it could not be sent."""
        message = MachineOpMessage(
            op="EXECUTE_COMMAND",
            payload=self.payload,
            request_id=self.request_id,
            session_id=self.session_id,
            timeout=self.timeout,
            relay=True,
            reply_channel=self.channel,
        )
        try:
            await layer_send(self.candidate.channel_name, message)
        except ChannelFull:
            return self.failed("MACHINE_UNREACHABLE", f"machine '{self.candidate.name}' is not taking requests")
        loop = asyncio.get_running_loop()
        self._deadline = self._checked_at = loop.time()
        self._deadline += self.timeout
        self.sent = True
        return None

    async def next_event(self) -> Output | Result | Failed:
        """The next event: an ``Output`` (in ``seq`` order), or the end — ``Result`` (the
        shim's response, a cancelled command's included) or ``Failed`` (the shim's ``ERROR``;
        ``OUTPUT_LOST`` on a ``seq`` gap, ``MACHINE_UNREACHABLE``, ``TIMEOUT``). Stdin credit
        and cancel requests are handled on the way."""
        loop = asyncio.get_running_loop()
        interval = float(settings.REMOTE_LIVENESS_INTERVAL)
        while True:
            now = loop.time()
            stalled = await self._stalled(now, interval)
            if stalled is not None:
                return stalled
            message = await self.subscription.wait(min(self._deadline - now, interval))
            if isinstance(message, MachineOutputMessage):
                if message.request_id == self.request_id:
                    return await self._output(message)
            elif isinstance(message, MachineFlowMessage):
                await self._credited(message)
            elif isinstance(message, OperationCancelMessage):
                self.cancel_requested = True
                await self.cancel()
                if self.on_cancel is not None:
                    await self.on_cancel()
            elif isinstance(message, MachineReplyMessage):
                return self._reply(message)

    async def _stalled(self, now: float, interval: float) -> Failed | None:
        """``TIMEOUT`` past the deadline (the command cancelled), ``MACHINE_UNREACHABLE`` when
        the liveness check (every ``interval`` seconds) finds the connection gone."""
        if now >= self._deadline:
            await self.cancel()
            return self.failed(
                "TIMEOUT",
                f"no answer from machine '{self.candidate.name}' within {self.timeout:g}s; the command was cancelled",
            )
        if now - self._checked_at >= interval:
            self._checked_at = now
            if not await connection_alive(self.candidate.connection_id, self.candidate.server_process_id):
                return self.failed("MACHINE_UNREACHABLE", f"machine '{self.candidate.name}' disconnected")
        return None

    async def _output(self, message: MachineOutputMessage) -> Output | Failed:
        """The next ``Output``; ``OUTPUT_LOST`` (the command cancelled) on a ``seq`` gap."""
        if message.seq != self.next_seq:
            await self.cancel()
            return self.failed(
                "OUTPUT_LOST",
                "frames of the command's output were lost; the command was cancelled",
                {"expected_seq": self.next_seq, "received_seq": message.seq},
            )
        self.next_seq += 1
        output = Output(
            request_id=self.event_request_id,
            machine_id=self.candidate.machine_id,
            name=self.candidate.name,
            stream=message.stream,
            data=message.data,
            encoding=message.encoding,
            seq=message.seq,
        )
        self.bytes[message.stream] += output.raw_bytes
        return output

    async def _credited(self, message: MachineFlowMessage) -> None:
        """More stdin credit from the shim: a writer waiting for it goes on."""
        if message.request_id == self.request_id and message.stream == "stdin":
            if message.credit_total > self.stdin_credit:
                self.stdin_credit = message.credit_total
                self._stdin_granted.set()
                if self.on_stdin_credit is not None:
                    await self.on_stdin_credit(message.credit_total)

    def _reply(self, message: MachineReplyMessage) -> Result | Failed:
        """The command's end: its response, or its ``ERROR`` as ``Failed``."""
        self.finished = True
        self._stdin_granted.set()  # a writer waiting for credit stops
        if message.response_type == "ERROR":
            error = message.payload
            code = str(error.get("code") or "MACHINE_ERROR")
            details = error.get("details") if isinstance(error.get("details"), dict) else {}
            return self.failed(code, str(error.get("message") or code), details)
        return Result(
            request_id=self.event_request_id,
            machine_id=self.candidate.machine_id,
            name=self.candidate.name,
            type=message.response_type,
            payload=message.payload,
        )

    async def consumed(self, output: Output) -> None:
        """``output`` was used: grant its stream more credit when a quarter window has been
        consumed since the last grant (``FLOW credit_total`` = consumed + window)."""
        stream: Literal["stdout", "stderr"] = "stderr" if output.stream == "stderr" else "stdout"
        self.consumed_bytes[stream] += output.raw_bytes
        target = self.consumed_bytes[stream] + self.window
        if target - self.granted[stream] >= max(1, self.window // 4):
            await self.grant(stream, target)

    async def grant(self, stream: Literal["stdout", "stderr"], credit_total: int) -> None:
        """Send ``FLOW {stream, credit_total}`` (cumulative; a smaller one than already
        granted is not sent)."""
        if credit_total <= self.granted[stream] or self.finished:
            return
        self.granted[stream] = credit_total
        await self._to_shim(MachineFlowMessage(request_id=self.request_id, stream=stream, credit_total=credit_total))

    async def write(self, data: bytes, *, eof: bool = False) -> bool:
        """Send ``data`` to the command's stdin (``COMMAND_INPUT``, base64, in pieces of at
        most 64 KiB), each piece waiting for stdin credit; ``eof`` closes stdin after it.
        Returns ``False`` when the command ended first (the rest is dropped)."""
        offset = 0
        while offset < len(data) or eof:
            piece = data[offset : offset + STREAM_FLUSH_BYTES]
            while not self.finished and self.bytes["stdin"] + len(piece) > self.stdin_credit:
                self._stdin_granted.clear()
                await self._stdin_granted.wait()
            if self.finished:
                return False
            offset += len(piece)
            last = offset >= len(data)
            self.bytes["stdin"] += len(piece)
            await self._to_shim(
                MachineInputMessage(
                    request_id=self.request_id,
                    data=base64.b64encode(piece).decode(),
                    encoding="base64",
                    eof=eof and last,
                )
            )
            if last:
                break
        return True

    async def write_base64(self, data: str, *, eof: bool = False) -> bool:
        """Send base64 ``data`` (at most 64 KiB raw, e.g. a binary ``COMMAND_OUTPUT`` frame
        of another command) to stdin as it is, after waiting for its credit; ``eof`` closes
        stdin after it. Returns ``False`` when the command ended first."""
        size = base64_length(data)
        while not self.finished and self.bytes["stdin"] + size > self.stdin_credit:
            self._stdin_granted.clear()
            await self._stdin_granted.wait()
        if self.finished:
            return False
        self.bytes["stdin"] += size
        await self._to_shim(MachineInputMessage(request_id=self.request_id, data=data, encoding="base64", eof=eof))
        return True

    async def cancel(self) -> None:
        """Send ``CANCEL`` once (the command still ends with its own ``COMMAND_RESULT
        {cancelled: true}``); nothing when it already ended or was never sent."""
        if self.finished or self.cancel_sent or not self.sent:
            return
        self.cancel_sent = True
        await self._to_shim(MachineCancelMessage(request_id=self.request_id))

    async def close(self) -> None:
        """End the reply channel (always, at the end)."""
        await self.subscription.close()

    async def _to_shim(self, message: MachineFlowMessage | MachineInputMessage | MachineCancelMessage) -> None:
        try:
            await layer_send(self.candidate.channel_name, message)
        except ChannelFull:
            logger.warning("could not send %s to machine %s: channel full", message.type, self.candidate.name)
