"""The ``/ws/shim/`` consumer (docs/shim-protocol.md, protocol 2.1).

A thin edge: bearer auth, the HELLO handshake, forwarding routed operations to the shim
and their responses back to the waiting caller's reply channel, PING/PONG presence. Its
own state is only this connection's: the operations pending on it, and the ids of the
``CANCEL`` frames it sent (whose ``ACK`` it swallows).

Live operations (2.1, docs/shim-protocol.md#live-operations-21): an operation sent with ``relay`` also gets the shim's
``COMMAND_OUTPUT`` frames (``MachineOutputMessage``) and its stdin ``FLOW`` grants
(``MachineFlowMessage``) on its reply channel, in the order they came; the caller's
``MachineFlowMessage`` (stdout/stderr credit), ``MachineInputMessage`` and
``MachineCancelMessage`` become ``FLOW``, ``COMMAND_INPUT`` and ``CANCEL`` frames. The
consumer holds no output (flow control is end to end) but enforces it: it counts each
relayed operation's output against the stdout/stderr credit the caller granted (the FLOW
frames it forwards), and a frame over 64 KiB raw, a stream past its credit or the output
past ``max_stream_bytes`` (one frame of slack; not for a pipe), or a malformed frame,
cancels the operation and fails it ``PROTOCOL_ERROR`` — a shim ignoring FLOW cannot flood
the caller.

Back-pressure (docs/shim-protocol.md#back-pressure; ``core.backpressure``): an operation
arriving while the shim's unread backlog is over ``DISPATCH_WS_HIGH_WATER`` is answered
``MACHINE_BUSY`` at once and never queued here; the shim's stdin credit is relayed to the
caller only as far as the ``COMMAND_INPUT`` bytes this consumer handed to the socket plus
one window, and only while the socket is under the mark — a shim that claims credit and
does not read stops the pipe feeding it, not this process's memory.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
from typing import Any

from channels.db import database_sync_to_async
from channels.exceptions import ChannelFull
from django.conf import settings
from pydantic import ValidationError

from core import wire
from core.backpressure import transport_protocol
from core.consumers import DispatchConsumer, receives
from core.protocol import ServerShutdownMessage
from core.realtime import layer_send
from core.validation import describe_validation_error
from core.wire import encode
from machines.pending import PendingOperation, raw_bytes
from machines.protocol import (
    OPERATIONS,
    Hello,
    MachineCancelMessage,
    MachineFlowMessage,
    MachineInputMessage,
    MachineOpMessage,
    MachineOutputMessage,
    MachineReplyMessage,
    MachineRevokedMessage,
    MachineTakeoverMessage,
    negotiate,
)
from machines.services import connections
from machines.services.connections import ShimIdentity
from machines.services.relay import stream_window
from machines.shim.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    CloseCode,
    MessageType,
    envelope,
    error_payload,
    supports_live_operations,
)

logger = logging.getLogger(__name__)

PING_INTERVAL = 30.0  # seconds between the platform's PINGs
PONG_TIMEOUT = 10.0  # seconds a shim has to answer a PING
CANCEL_ACK_SECONDS = 60.0  # how long the id of a CANCEL sent is remembered (its ACK swallowed)


class ShimConsumer(DispatchConsumer):
    """One shim connection."""

    protocol_version: str | None = None  # negotiated in the HELLO
    detached_user_id: int | None = None  # set when closing removed the connection's row

    async def connect(self) -> None:
        await self.accept()  # custom close codes need an accepted socket
        self.identity: ShimIdentity | None = None
        self.connection_id: str | None = None
        self.machine_id: str | None = None
        self.pending: dict[str, PendingOperation] = {}
        self.cancels: dict[str, float] = {}  # id of a CANCEL sent → when to forget it
        self.refused: dict[str, float] = {}  # id of an operation failed for its output → when to forget it
        self.limits: dict[str, Any] = {}
        self.display_name: str | None = None
        self.protocol_version: str | None = None
        self.closing = False
        self.tasks: list[asyncio.Task[None]] = []
        self._drain_task: asyncio.Task[None] | None = None  # relays stdin credit once the socket drains
        self.awaiting_pong: str | None = None
        token = self.bearer_token()
        identity = await connections.shim_identify(token) if token else None
        if identity is None:
            await self._error("AUTH_FAILED", "invalid, expired or revoked token", fatal=True)
            await self._close(CloseCode.AUTH_FAILED)
            return
        self.identity = identity
        self.tasks.append(asyncio.ensure_future(self._hello_deadline()))

    async def delete_rows(self) -> None:
        """Cleanup, first step (``DispatchConsumer``): stop local work, forget the connection
        (the machine shows ``disconnected`` when none is left)."""
        self.closing = True
        for task in getattr(self, "tasks", []):
            task.cancel()
        _drop_unsent(transport_protocol(getattr(self, "base_send", None)))
        if getattr(self, "connection_id", None):
            self.detached_user_id = await database_sync_to_async(connections.shim_disconnected)(
                connection_id=self.connection_id, ring_tools=False
            )

    async def release_layer(self) -> None:
        """Cleanup, second step: fail the operations pending on this shim, ring its user's
        tool list if the first step removed the connection."""
        for request_id in list(getattr(self, "pending", {})):
            await self.layer_quietly(
                self._fail(request_id, "MACHINE_UNREACHABLE", "the machine disconnected"), "fail a pending operation"
            )
        if self.detached_user_id is not None:
            await connections.announce_detachment(self.detached_user_id)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        size = len(bytes_data) if bytes_data is not None else len(text_data or "")
        if size > MAX_FRAME_BYTES or (text_data and len(text_data.encode()) > MAX_FRAME_BYTES):
            await self._close(CloseCode.MESSAGE_TOO_BIG)
            return
        uncarried: str | None = None  # why a JSON object frame was refused (a value out of range, …)
        try:
            frame = wire.loads(text_data) if text_data is not None else None
        except ValueError as exc:
            # An answer Dispatch cannot carry (e.g. an integer outside 64 bits): its
            # operation fails at once, naming why; the shim stays connected.
            refused = wire.lenient_object(text_data or "") if self.connection_id is not None else None
            message_id = wire.lenient_field(refused, "id", nested=False)
            if isinstance(message_id, str) and message_id in self.pending:
                reason = f"the machine answered with a value Dispatch cannot carry: {exc}"
                await self._fail(message_id, "INVALID_RESPONSE", reason)
                return
            if refused is not None:
                uncarried = str(exc)
            frame = None
        if not isinstance(frame, dict) or not isinstance(frame.get("type"), str):
            if self.connection_id is None:
                await self._bad_hello("the first frame must be a JSON HELLO envelope")
            elif uncarried is not None:
                await self._error("INVALID_REQUEST", f"the frame has a value Dispatch cannot carry: {uncarried}")
            else:
                await self._error("INVALID_REQUEST", "frames must be JSON objects with a 'type'")
            return
        if self.connection_id is None:
            await self._hello(frame)
            return
        await self._from_shim(frame)

    # --- handshake ------------------------------------------------------------------

    async def _hello(self, frame: dict[str, Any]) -> None:
        if frame["type"] != MessageType.HELLO or not isinstance(frame.get("payload"), dict):
            await self._bad_hello("the first frame must be HELLO")
            return
        try:
            hello = Hello.model_validate(frame["payload"])
        except ValidationError as exc:
            await self._bad_hello(f"malformed HELLO: {describe_validation_error(exc)}")
            return
        negotiated = negotiate(hello.protocol_version)
        if negotiated is None:
            await self._error(
                "PROTOCOL_VERSION_MISMATCH",
                f"shim speaks {hello.protocol_version}, platform speaks {PROTOCOL_VERSION}",
                fatal=True,
                details={"shim_max": hello.protocol_version, "platform_max": PROTOCOL_VERSION},
            )
            await self._close(CloseCode.PROTOCOL_VERSION_MISMATCH)
            return
        assert self.identity is not None
        if self.identity.machine_id is not None and self.identity.machine_id != hello.machine_id:
            await self._error("AUTH_FAILED", "this token belongs to another machine_id", fatal=True)
            await self._close(CloseCode.AUTH_FAILED)
            return
        attached = await database_sync_to_async(connections.shim_attach)(
            identity=self.identity, hello=hello, channel_name=self.channel_name, protocol_version=negotiated
        )
        self.connection_id = attached.connection_id
        self.machine_id = hello.machine_id
        self.display_name = hello.display_name or hello.hostname
        self.protocol_version = negotiated
        self.limits = dict(attached.limits)
        for task in self.tasks:
            task.cancel()
        self.tasks = [asyncio.ensure_future(self._ping_loop())]
        await self._send(
            envelope(
                MessageType.HELLO_ACK,
                {
                    "protocol_version": negotiated,
                    "connection_id": attached.connection_id,
                    "granted_capabilities": attached.granted_capabilities,
                    "limits": attached.limits,
                },
                frame_id=_answer_id(frame.get("id")),
            )
        )
        await connections.announce_attachment(attached)

    async def _hello_deadline(self) -> None:
        await asyncio.sleep(settings.SHIM_HELLO_TIMEOUT)
        if self.connection_id is None and not self.closing:
            await self._error("HELLO_TIMEOUT", "no HELLO within the deadline", fatal=True)
            await self._close(CloseCode.HELLO_TIMEOUT)

    async def _bad_hello(self, message: str) -> None:
        await self._error("INVALID_HELLO", message, fatal=True)
        await self._close(CloseCode.MALFORMED_HELLO)

    # --- frames after the handshake --------------------------------------------------

    async def _from_shim(self, frame: dict[str, Any]) -> None:
        message_type, message_id = frame["type"], frame.get("id")
        if message_type == MessageType.PING:
            await self._send(envelope(MessageType.PONG, {}, frame_id=_answer_id(message_id)))
            return
        if message_type == MessageType.PONG and message_id == self.awaiting_pong:
            self.awaiting_pong = None
            return
        if isinstance(message_id, str) and self.cancels.pop(message_id, None) is not None:
            return  # the ACK (or ERROR) of a CANCEL this consumer sent
        if isinstance(message_id, str) and message_id in self.refused:
            return  # more of an operation failed for its output (its frames, its result)
        if message_type == MessageType.COMMAND_OUTPUT:
            await self._relay_output(message_id, frame.get("payload"))
            return
        if message_type == MessageType.FLOW:
            await self._relay_flow(frame.get("payload"))
            return
        pending = self.pending.get(message_id) if isinstance(message_id, str) else None
        if pending is None or not isinstance(message_id, str):
            logger.debug("shim %s sent %s for unknown id %r", self.machine_id, message_type, message_id)
            if message_type != MessageType.ERROR:
                await self._error("INVALID_REQUEST", f"no pending request with id {str(message_id)[:64]!r}")
            return
        expected = OPERATIONS[pending.op][1]
        payload = frame.get("payload")
        if message_type not in (expected, MessageType.ERROR) or not isinstance(payload, dict):
            # Rejected without touching the operation: the shim may still answer it.
            refused = f"expected {expected} or ERROR for {pending.op}, got {message_type[:64]!r}"
            await self._error("INVALID_REQUEST", refused)
            return
        del self.pending[message_id]
        await self._answer(pending.reply_channel, MachineReplyMessage(response_type=message_type, payload=payload))
        if pending.op == MessageType.MACHINE_LIST_REQUEST and message_type == expected:
            await database_sync_to_async(connections.machine_snapshot_store)(
                connection_id=self.connection_id, snapshot=payload
            )

    async def _relay_output(self, message_id: Any, payload: Any) -> None:
        """A ``COMMAND_OUTPUT`` frame (2.1) → ``MachineOutputMessage`` to the relayed
        operation's reply channel. A malformed one is refused (``ERROR INVALID_REQUEST``)
        and dropped: the caller sees the ``seq`` gap and ends the operation ``OUTPUT_LOST``.
        Output of an operation not relayed (or already answered) is dropped."""
        pending = self.pending.get(message_id) if isinstance(message_id, str) else None
        if pending is None or not pending.relay:
            logger.debug("shim %s sent output for %r, not relayed", self.machine_id, str(message_id)[:64])
            return
        fields = payload if isinstance(payload, dict) else {}
        try:
            frame: dict[str, Any] = {key: fields.get(key) for key in ("stream", "data", "encoding", "seq")}
            output = MachineOutputMessage(request_id=message_id, **frame)
            if output.encoding == "base64":
                base64.b64decode(output.data, validate=True)
        except (ValidationError, binascii.Error, ValueError) as exc:
            reason = describe_validation_error(exc) if isinstance(exc, ValidationError) else f"data: not base64 ({exc})"
            await self._error("INVALID_REQUEST", f"malformed COMMAND_OUTPUT: {reason}")
            await self._refuse(message_id, f"machine '{self._name()}' sent a malformed COMMAND_OUTPUT: {reason}")
            return
        violation = pending.count_output(output, self._name())
        if violation is not None:
            await self._refuse(message_id, violation)
            return
        await self._relay(pending.reply_channel, output)

    async def _refuse(self, request_id: str, reason: str) -> None:
        """End operation ``request_id`` for the output its shim sent: ``CANCEL`` to the shim,
        ``ERROR PROTOCOL_ERROR`` to the caller; what else the shim sends for it is dropped."""
        logger.warning("shim %s: %s", self.machine_id, reason)
        now = time.monotonic()
        self.refused = {rid: until for rid, until in self.refused.items() if until > now}
        pending = self.pending.get(request_id)
        self.refused[request_id] = now + (pending.expires_at - now if pending else 0) + CANCEL_ACK_SECONDS
        if self._live():
            await self._cancel(request_id)
        await self._fail(request_id, "PROTOCOL_ERROR", reason)

    def _name(self) -> str:
        return self.display_name or self.machine_id or "?"

    async def _relay_flow(self, payload: Any) -> None:
        """A stdin ``FLOW`` grant of the shim (2.1) → ``MachineFlowMessage`` to the relayed
        operation's reply channel (the shim grants no other stream)."""
        fields = payload if isinstance(payload, dict) else {}
        request_id = fields.get("request_id")
        pending = self.pending.get(request_id) if isinstance(request_id, str) else None
        if pending is None or not pending.relay or fields.get("stream") != "stdin":
            return
        try:
            credit: dict[str, Any] = {key: fields.get(key) for key in ("request_id", "credit_total")}
            grant = MachineFlowMessage(stream="stdin", **credit)
        except ValidationError as exc:
            await self._error("INVALID_REQUEST", f"malformed FLOW: {describe_validation_error(exc)}")
            return
        pending.stdin_claimed = max(pending.stdin_claimed, grant.credit_total)
        await self._grant_stdin(grant.request_id, pending)

    async def _grant_stdin(self, request_id: str, pending: PendingOperation) -> None:
        """Relay to the caller the stdin credit the shim granted, capped at the raw bytes of
        ``COMMAND_INPUT`` this consumer handed to the socket plus one window, and only while
        the socket is under its high-water mark (else once it drains): a shim claiming
        credit it does not read makes the caller wait, not this process buffer
        (docs/live-operations.md#cross-machine-pipes)."""
        allowed = min(pending.stdin_claimed, pending.stdin_written + stream_window(self.limits))
        if allowed <= pending.stdin_relayed:
            return
        if not self.send_pressure.has_room():
            self._regrant_when_drained()
            return
        pending.stdin_relayed = allowed
        await self._relay(
            pending.reply_channel, MachineFlowMessage(request_id=request_id, stream="stdin", credit_total=allowed)
        )

    def _regrant_when_drained(self) -> None:
        """Start (once) the task that relays the stdin credit held back once the socket is
        under its high-water mark again."""
        if self._drain_task is not None and not self._drain_task.done():
            return

        async def regrant() -> None:
            await self.send_pressure.wait_for_room()
            for request_id, pending in list(self.pending.items()):
                if pending.relay:
                    await self._grant_stdin(request_id, pending)

        self._drain_task = asyncio.ensure_future(regrant())
        self.tasks = [task for task in self.tasks if not task.done()]  # a long connection drains many times
        self.tasks.append(self._drain_task)

    async def _relay(self, reply_channel: str, message: MachineOutputMessage | MachineFlowMessage) -> None:
        try:
            await layer_send(reply_channel, message)
        except ChannelFull:
            logger.warning("dropping a relayed %s: caller channel full", message.type)

    # --- channel-layer messages ---------------------------------------------------------

    @receives(MachineOpMessage)
    async def machine_op(self, operation: MachineOpMessage) -> None:
        """``machine.op`` (``MachineOpMessage``): send a routed operation to the shim."""
        if self.closing or self.connection_id is None:
            await self._answer(operation.reply_channel, _error_reply("MACHINE_UNREACHABLE", "the machine disconnected"))
            return
        if operation.relay and not supports_live_operations(self.protocol_version):
            # The services refuse first (naming the shim's version); this is the backstop.
            refused = f"this connection speaks protocol {self.protocol_version}; live operations need 2.1"
            await self._answer(operation.reply_channel, _error_reply("UNSUPPORTED_OPERATION", refused))
            return
        if not self.send_pressure.has_room():
            # The shim has not read what it was sent: refused now (before the frame is even
            # encoded), never queued in this process (docs/shim-protocol.md#back-pressure).
            await self._answer(operation.reply_channel, self._busy_reply())
            return
        frame = envelope(
            operation.op,
            operation.payload,
            frame_id=operation.request_id,
            session_id=operation.session_id,
            target_machine=self.machine_id,
        )
        text = encode(frame)
        size = len(text) if text.isascii() else len(text.encode())
        if size > MAX_FRAME_BYTES:
            await self._answer(operation.reply_channel, _error_reply("FILE_TOO_LARGE", "the request is over 16 MiB"))
            return
        if not self.send_pressure.has_room(size):  # this frame would take it past the mark
            await self._answer(operation.reply_channel, self._busy_reply())
            return
        now = time.monotonic()
        self.pending = {rid: p for rid, p in self.pending.items() if p.expires_at > now}
        window = stream_window(self.limits)
        cap = self.limits.get("max_stream_bytes")
        piped = operation.payload.get("pipe") is True
        self.pending[operation.request_id] = PendingOperation(
            op=operation.op,
            reply_channel=operation.reply_channel,
            expires_at=now + operation.timeout + 5,
            relay=operation.relay,
            credit={"stdout": window, "stderr": window},
            max_stream_bytes=None if piped or not isinstance(cap, int) else cap,
        )
        await self.send(text_data=text)

    def _busy_reply(self) -> MachineReplyMessage:
        """``ERROR MACHINE_BUSY``: the shim's socket holds more unread bytes than the
        high-water mark (``details``: ``unsent_bytes``, ``high_water_bytes``)."""
        unsent, high_water = self.unsent_bytes(), self.send_pressure.high_water
        message = (
            f"machine '{self._name()}' is busy: it has not read {unsent} bytes sent to it "
            f"(over the {high_water}-byte high-water mark); try again shortly"
        )
        return _error_reply("MACHINE_BUSY", message, {"unsent_bytes": unsent, "high_water_bytes": high_water})

    @receives(MachineFlowMessage)
    async def machine_flow(self, grant: MachineFlowMessage) -> None:
        """``machine.flow`` (``MachineFlowMessage``, 2.1): the caller's stdout/stderr credit →
        a ``FLOW {request_id, stream, credit_total}`` frame (own id; no answer)."""
        if grant.stream == "stdin" or not self._live():
            return
        pending = self.pending.get(grant.request_id)
        if pending is not None and pending.relay:
            pending.credit[grant.stream] = max(pending.credit.get(grant.stream, 0), grant.credit_total)
        payload = {"request_id": grant.request_id, "stream": grant.stream, "credit_total": grant.credit_total}
        await self._send(envelope(MessageType.FLOW, payload, target_machine=self.machine_id))

    @receives(MachineInputMessage)
    async def machine_input(self, message: MachineInputMessage) -> None:
        """``machine.input`` (``MachineInputMessage``, 2.1) → a ``COMMAND_INPUT {request_id,
        data, encoding, eof}`` frame (own id; no answer; the shim drops input for an
        operation that ended)."""
        if not self._live():
            return
        payload = {
            "request_id": message.request_id,
            "data": message.data,
            "encoding": message.encoding,
            "eof": message.eof,
        }
        await self._send(envelope(MessageType.COMMAND_INPUT, payload, target_machine=self.machine_id))
        pending = self.pending.get(message.request_id)
        if pending is not None and pending.relay:
            pending.stdin_written += raw_bytes(message.data, message.encoding)
            await self._grant_stdin(message.request_id, pending)

    @receives(MachineCancelMessage)
    async def machine_cancel(self, message: MachineCancelMessage) -> None:
        """``machine.cancel`` (``MachineCancelMessage``, 2.1) → a ``CANCEL {request_id}``
        frame under a fresh id, remembered so the shim's ``ACK`` to it is swallowed. The
        operation still ends with its own response (``COMMAND_RESULT {cancelled: true}``,
        or ``ERROR CANCELLED`` for a FILE_* operation)."""
        if self._live():
            await self._cancel(message.request_id)

    async def _cancel(self, request_id: str) -> None:
        now = time.monotonic()
        self.cancels = {cancel_id: until for cancel_id, until in self.cancels.items() if until > now}
        frame = envelope(MessageType.CANCEL, {"request_id": request_id}, target_machine=self.machine_id)
        self.cancels[frame["id"]] = now + CANCEL_ACK_SECONDS
        await self._send(frame)

    @receives(MachineRevokedMessage)
    async def machine_revoked(self, message: MachineRevokedMessage) -> None:
        """``machine.revoked`` (``MachineRevokedMessage``): the machine token was revoked:
        close 4401."""
        await self._error("AUTH_FAILED", "the machine token was revoked", fatal=True)
        await self._close(CloseCode.AUTH_FAILED)

    @receives(MachineTakeoverMessage)
    async def machine_takeover(self, takeover: MachineTakeoverMessage) -> None:
        """``machine.takeover`` (``MachineTakeoverMessage``): the same machine reconnected
        elsewhere: 4427 (docs/shim-protocol.md#presence-and-takeover)."""
        if takeover.connection_id != self.connection_id:
            return
        self.connection_id = None  # the new connection owns the machine's rows now
        await self._send(envelope(MessageType.SESSION_REVOKED, {"reason": "reconnected"}))
        for request_id in list(self.pending):
            await self._fail(request_id, "MACHINE_UNREACHABLE", "the machine reconnected on another socket")
        await self._close(CloseCode.SESSION_REVOKED)

    @receives(ServerShutdownMessage)
    async def server_shutdown(self, message: ServerShutdownMessage) -> None:
        """``server.shutdown``: this process is stopping; the shim reconnects elsewhere."""
        for request_id in list(self.pending):
            await self._fail(request_id, "MACHINE_UNREACHABLE", "the server holding the machine is shutting down")
        await self._close(1012)

    # --- helpers -------------------------------------------------------------------------

    def _live(self) -> bool:
        """Whether this connection is up and speaks 2.1 (a live message for a 2.0 shim, or
        after the socket went, is dropped: the services refuse before sending)."""
        if self.closing or self.connection_id is None:
            return False
        if not supports_live_operations(self.protocol_version):
            version = self.protocol_version
            logger.info("dropping a live-operation message for shim %s (protocol %s)", self.machine_id, version)
            return False
        return True

    async def _ping_loop(self) -> None:
        """PING every ``SHIM_PING_INTERVAL`` seconds (a fixed period); drop the shim if
        the PONG has not come ``SHIM_PONG_TIMEOUT`` seconds after a PING."""
        loop = asyncio.get_running_loop()
        next_ping = loop.time() + settings.SHIM_PING_INTERVAL
        while True:
            await asyncio.sleep(max(0.0, next_ping - loop.time()))
            next_ping += settings.SHIM_PING_INTERVAL
            frame = envelope(MessageType.PING, {})
            self.awaiting_pong = frame["id"]
            await self._send(frame)
            await asyncio.sleep(min(settings.SHIM_PONG_TIMEOUT, settings.SHIM_PING_INTERVAL))
            if self.awaiting_pong == frame["id"]:
                logger.info("machine %s missed a PONG; dropping it", self.machine_id)
                await self._close(1000)
                return
            if self.connection_id:
                connections.shim_seen_soon(self.connection_id)

    async def _fail(self, request_id: str, code: str, message: str) -> None:
        pending = self.pending.pop(request_id, None)
        if pending is not None:
            await self._answer(pending.reply_channel, _error_reply(code, message))

    async def _answer(self, reply_channel: str, reply: MachineReplyMessage) -> None:
        try:
            await layer_send(reply_channel, reply)
        except ChannelFull:
            logger.warning("dropping a machine reply: caller channel full")
        except (TypeError, ValueError, RecursionError) as exc:
            # The layer could not carry it (nested too deeply, not serialisable): the
            # caller still gets an answer now, not a timeout.
            await layer_send(
                reply_channel, _error_reply("INVALID_RESPONSE", f"the machine's response could not be relayed: {exc}")
            )

    async def _error(
        self, code: str, message: str, *, fatal: bool = False, details: dict[str, Any] | None = None
    ) -> None:
        payload = error_payload(code, message, fatal=fatal, details=details or None)
        await self._send(envelope(MessageType.ERROR, payload))

    async def _send(self, frame: dict[str, Any]) -> None:
        if not self.closing:
            await self.send(text_data=encode(frame))

    async def _close(self, code: int) -> None:
        if not self.closing:
            self.closing = True
            await self.close(code=int(code))  # a plain int: the server refuses an IntEnum


def _drop_unsent(protocol: Any | None) -> None:
    """Free what a gone peer never read: the bytes left in daphne's Twisted transport (up to
    the hard mark, ``core.backpressure``) once its connection is lost. The transport and its
    protocol refer to each other, so without this they — and those bytes — wait for one of
    the cyclic collector's rare full passes, long after the socket closed. A transport
    still connected (a close frame on its way) is left alone."""
    transport = getattr(protocol, "transport", None)
    while transport is not None:
        if not getattr(transport, "disconnected", False):
            return
        if isinstance(getattr(transport, "dataBuffer", None), bytes | bytearray | memoryview):
            transport.dataBuffer = b""
            transport.offset = 0
        if isinstance(getattr(transport, "_tempDataBuffer", None), list):
            transport._tempDataBuffer = []
            transport._tempDataLen = 0
        transport = getattr(transport, "transport", None)


def _answer_id(request_id: Any) -> str | None:
    """The ``id`` of the platform's answer to a shim frame with ``request_id`` (``HELLO_ACK``,
    ``PONG``): that id as text, or a fresh one when it had none."""
    return str(request_id or "") or None


def _error_reply(code: str, message: str, details: dict[str, Any] | None = None) -> MachineReplyMessage:
    return MachineReplyMessage(
        response_type=str(MessageType.ERROR), payload=error_payload(code, message, details=details)
    )
