"""The shim's websocket loop: connect, handshake, serve requests, reconnect (docs/shim-protocol.md).

:class:`Shim` connects to ``ws(s)://host:port/ws/shim/`` with ``Authorization: Bearer
<token>``, sends ``HELLO``, waits for ``HELLO_ACK`` and then serves the platform's
requests through a :class:`RequestDispatcher` (one task per operation, so PINGs are
answered while a long command runs; protocol 2.1's CANCEL, FLOW and COMMAND_INPUT reach
running commands at once). When the connection ends it reconnects after
``min(2^n, 60) s + 0–5 s`` of jitter — never after close 4401/4426/4427 or an HTTP
401/403 at the upgrade, which raise :class:`ShimRefused`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import os
import random
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from .audit import AuditLog, operation_details
from .jail import PathJail
from .live import OUTPUT_STREAMS, FrameSender, LiveCommand
from .operations import MachineIdentity, Operations
from .protocol import (
    MAX_MESSAGE_BYTES,
    NO_RECONNECT_CLOSE_CODES,
    PROTOCOL_VERSION,
    SHIM_VERSION,
    Capability,
    CloseCode,
    ErrorCode,
    Limits,
    MessageType,
    ShimError,
    decode,
    encode,
    envelope,
    error_to,
    major_version,
    new_id,
    response_to,
    supports_live_operations,
)

logger = logging.getLogger("machines.shim")

BACKOFF_SCALE_ENV = "DISPATCH_SHIM_BACKOFF_SCALE"
"""Environment variable multiplying every reconnect delay (tests set it to e.g. 0.01)."""

HANDSHAKE_TIMEOUT = 10.0
"""Seconds the shim waits for ``HELLO_ACK`` before it drops the connection and retries."""

KEEPALIVE_INTERVAL = 5.0
KEEPALIVE_TIMEOUT = 5.0
CLOSE_TIMEOUT = 2.0
"""Websocket pings every ``KEEPALIVE_INTERVAL`` seconds, each answered within
``KEEPALIVE_TIMEOUT``, and ``CLOSE_TIMEOUT`` seconds for the closing handshake: a server
that stops answering (a frozen process behind nginx, whose TCP connection stays up) is
left 7-12 s after it stopped, within about ``DISPATCH_PROCESS_TTL``, and the shim
reconnects through the load balancer to a live process (docs/shim-protocol.md#presence-and-takeover).
The server answers pings by itself; nothing changes on the wire."""

BACKOFF_CAP = 60.0
JITTER = 5.0

_UNCOUNTED = frozenset({MessageType.PING, MessageType.MACHINE_LIST_REQUEST})
"""Requests answered at once and not counted against ``max_concurrent``."""

_CONTROL = frozenset({MessageType.CANCEL, MessageType.COMMAND_INPUT, MessageType.FLOW})
"""2.1 frames about a running operation: handled in the receive loop, never
counted against ``max_concurrent``, never ``SHIM_OVERLOADED``, never audited."""

_INPUT_ENCODINGS = ("utf-8", "base64")

SendFrame = Callable[[Mapping[str, Any]], Awaitable[None]]


class ShimRefused(Exception):
    """The platform refused this shim for good: close 4401/4426/4427 or HTTP 401/403 at
    the upgrade. Reconnecting cannot help (docs/shim-protocol.md#close-codes). ``code`` is the close code or the
    HTTP status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def websocket_url(server: str) -> str:
    """``http(s)://host:port[/prefix]`` → ``ws(s)://host:port[/prefix]/ws/shim/``.

    ``ws(s)://`` URLs are accepted too; a URL already ending in ``/ws/shim/`` is kept.
    Raises ``ValueError`` for another scheme or a URL without a host.
    """
    parts = urllib.parse.urlsplit(server.strip())
    schemes = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}
    if parts.scheme not in schemes or not parts.netloc:
        raise ValueError(f"expected the server's base URL, http(s)://host:port, got {server!r}")
    path = parts.path.rstrip("/")
    if not path.endswith("/ws/shim"):
        path += "/ws/shim"
    return urllib.parse.urlunsplit((schemes[parts.scheme], parts.netloc, path + "/", "", ""))


def reconnect_delay(attempt: int, scale: float = 1.0, rng: random.Random | None = None) -> float:
    """Seconds to wait before reconnect number ``attempt`` (0-based): ``(min(2^attempt,
    60) + uniform(0, 5)) * scale`` (docs/shim-protocol.md#presence-and-takeover)."""
    jitter = (rng or random).uniform(0, JITTER)
    return (min(2.0 ** min(attempt, 16), BACKOFF_CAP) + jitter) * scale


def backoff_scale_from_env() -> float:
    """``$DISPATCH_SHIM_BACKOFF_SCALE`` as a non-negative float, else 1.0."""
    text = os.environ.get(BACKOFF_SCALE_ENV, "")
    try:
        scale = float(text)
    except ValueError:
        return 1.0
    return scale if scale >= 0 else 1.0


@dataclass(frozen=True)
class Negotiated:
    """What ``HELLO_ACK`` settled for one connection: the negotiated version, the
    connection id, the usable capabilities (granted ∩ advertised) and the lowered limits."""

    protocol_version: str
    connection_id: str | None
    capabilities: frozenset[str]
    limits: Limits


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


class Shim:
    """A shim's connection to the platform, kept up until refused or stopped.

    ``server`` is the instance's base URL (``http(s)://host:port``); ``capabilities`` are
    what the shim advertises (``shell``, ``files``); ``sessions`` is ``["*"]`` or session
    ids; ``limits`` are the shim's own (lowered further by the platform's).
    ``backoff_scale`` multiplies reconnect delays (default ``$DISPATCH_SHIM_BACKOFF_SCALE``
    or 1). Use :meth:`run`; :meth:`stop` ends it cleanly.
    """

    def __init__(
        self,
        *,
        server: str,
        token: str,
        identity: MachineIdentity,
        jail: PathJail,
        capabilities: Iterable[str] = (Capability.SHELL, Capability.FILES),
        sessions: Sequence[str] = ("*",),
        limits: Limits | None = None,
        audit: AuditLog | None = None,
        backoff_scale: float | None = None,
        open_timeout: float = 10.0,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
    ) -> None:
        self.url = websocket_url(server)
        self.identity = identity
        self.jail = jail
        advertised = set(capabilities)
        self.capabilities = [str(c) for c in (Capability.SHELL, Capability.FILES) if c in advertised]
        self.sessions = list(sessions) or ["*"]
        self.limits = limits or Limits()
        self.audit = audit
        self.backoff_scale = backoff_scale_from_env() if backoff_scale is None else backoff_scale
        self.open_timeout = open_timeout
        self.handshake_timeout = handshake_timeout
        self.negotiated: Negotiated | None = None
        """What the current (or last) connection's HELLO_ACK settled."""
        self.connections = 0
        """Connection attempts so far (for status output and tests)."""
        self._token = token
        self._stopping = asyncio.Event()
        self._connection: ClientConnection | None = None
        self._closing: asyncio.Future[None] | None = None
        self._last_error: dict[str, Any] | None = None
        self._revoked_reason: str | None = None

    def hello_frame(self) -> dict[str, Any]:
        """The ``HELLO`` frame: identity, capabilities, realpath roots, sessions."""
        identity = self.identity
        return envelope(
            MessageType.HELLO,
            {
                "shim_version": SHIM_VERSION,
                "protocol_version": PROTOCOL_VERSION,
                "machine_id": identity.machine_id,
                "hostname": identity.hostname,
                "display_name": identity.display_name,
                "platform": identity.platform,
                "arch": identity.arch,
                "capabilities": list(self.capabilities),
                "allowed_roots": list(self.jail.roots),
                "sessions": list(self.sessions),
                "hardware_devices": list(identity.hardware_devices),
            },
        )

    def stop(self) -> None:
        """Ask :meth:`run` to close the connection (code 1000) and return."""
        self._stopping.set()
        if self._connection is not None:
            self._closing = asyncio.ensure_future(self._connection.close())

    async def run(self) -> None:
        """Connect, serve and reconnect until :meth:`stop` (then return normally).

        Raises ``ShimRefused`` when the platform refuses the shim for good.
        """
        attempt = 0
        while not self._stopping.is_set():
            try:
                if await self.connect_once():
                    attempt = 0
            except ShimRefused:
                raise
            except (OSError, InvalidHandshake, TimeoutError) as error:
                logger.warning("cannot reach %s: %s", self.url, error or type(error).__name__)
            except Exception:  # a bug must not end a daemon that can reconnect
                logger.exception("the connection to %s failed", self.url)
            if self._stopping.is_set():
                break
            delay = reconnect_delay(attempt, self.backoff_scale)
            attempt += 1
            logger.info("reconnecting in %.1f s", delay)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):  # not wait_for: on 3.11 it can swallow a cancel
                    await self._stopping.wait()

    async def connect_once(self) -> bool:
        """One connection, from the upgrade to its close. Returns whether the handshake
        completed (the caller resets its backoff then).

        Raises ``ShimRefused`` (401/403 at the upgrade; close 4401/4426/4427) and lets
        ``OSError``/``InvalidHandshake``/``TimeoutError`` of the upgrade through.
        """
        self.connections += 1
        self._last_error = None
        self._revoked_reason = None
        try:
            connection = await connect(
                self.url,
                additional_headers={"Authorization": f"Bearer {self._token}"},
                max_size=MAX_MESSAGE_BYTES,
                open_timeout=self.open_timeout,
                ping_interval=KEEPALIVE_INTERVAL,
                ping_timeout=KEEPALIVE_TIMEOUT,
                close_timeout=CLOSE_TIMEOUT,
                user_agent_header=f"dispatch-shim/{SHIM_VERSION}",
            )
        except InvalidStatus as error:
            status = error.response.status_code
            if status in (401, 403):
                raise ShimRefused(f"the platform refused the token (HTTP {status} at {self.url})", status) from None
            raise
        self._connection = connection
        handshake_done = False
        try:
            if self._stopping.is_set():
                return False
            hello = self.hello_frame()
            await connection.send(encode(hello))
            negotiated = await self._handshake(connection, hello["id"])
            if negotiated is not None:
                handshake_done = True
                await self._serve(connection, negotiated)
        except ConnectionClosed:
            pass
        finally:
            self._connection = None
            await connection.close()
        self._raise_if_refused(connection.close_code)
        sent = connection.protocol.close_sent
        if sent is not None and sent.reason == "keepalive ping timeout":
            logger.warning("the platform stopped answering pings; reconnecting")
        logger.info("connection closed (code %s)", connection.close_code)
        return handshake_done

    async def _handshake(self, connection: ClientConnection, hello_id: str) -> Negotiated | None:
        """Wait for the ``HELLO_ACK`` answering ``hello_id``; ``None`` if none came in time."""
        try:
            async with asyncio.timeout(self.handshake_timeout):
                while True:
                    frame = await self._receive(connection)
                    if frame is None:
                        continue
                    if frame["type"] == MessageType.HELLO_ACK and frame.get("id") == hello_id:
                        break
                    if frame["type"] == MessageType.PING:
                        await self._send(connection, response_to(frame, MessageType.PONG, {}))
                    else:
                        self._note_server_frame(frame)
        except TimeoutError:
            logger.warning("no HELLO_ACK within %.1f s; reconnecting", self.handshake_timeout)
            await connection.close()
            return None
        return self._negotiate(connection, frame["payload"])

    def _negotiate(self, connection: ClientConnection, ack: Mapping[str, Any]) -> Negotiated | None:
        version = ack.get("protocol_version")
        if major_version(version) != major_version(PROTOCOL_VERSION):
            raise ShimRefused(
                f"the platform acknowledged protocol version {version!r}; this shim speaks {PROTOCOL_VERSION}",
                CloseCode.PROTOCOL_VERSION_MISMATCH,
            )
        granted = ack.get("granted_capabilities")
        granted_set = {str(c) for c in granted} if isinstance(granted, list) else set()
        platform_limits = ack.get("limits")
        connection_id = ack.get("connection_id")
        negotiated = Negotiated(
            protocol_version=str(version),
            connection_id=connection_id if isinstance(connection_id, str) else None,
            capabilities=frozenset(set(self.capabilities) & granted_set),
            limits=self.limits.lower(platform_limits if isinstance(platform_limits, dict) else {}),
        )
        self.negotiated = negotiated
        logger.info(
            "connected to %s as %s (connection %s, protocol %s, capabilities %s, roots %s)",
            self.url,
            self.identity.machine_id,
            negotiated.connection_id,
            negotiated.protocol_version,
            sorted(negotiated.capabilities) or "none",
            list(self.jail.roots),
        )
        return negotiated

    async def _serve(self, connection: ClientConnection, negotiated: Negotiated) -> None:
        operations = Operations(
            jail=self.jail,
            limits=negotiated.limits,
            capabilities=negotiated.capabilities,
            identity=self.identity,
            protocol_version=negotiated.protocol_version,
        )

        async def send(frame: Mapping[str, Any]) -> None:
            await self._send(connection, frame)

        dispatcher = RequestDispatcher(
            operations=operations, send=send, machine_id=self.identity.machine_id, audit=self.audit
        )
        try:
            while True:
                frame = await self._receive(connection)
                if frame is None:
                    continue
                kind = frame["type"]
                if kind in (MessageType.SESSION_REVOKED, MessageType.ERROR, MessageType.HELLO_ACK, MessageType.PONG):
                    self._note_server_frame(frame)
                else:
                    dispatcher.dispatch(frame)
        finally:
            await dispatcher.aclose()

    async def _receive(self, connection: ClientConnection) -> dict[str, Any] | None:
        """The next decoded frame; ``None`` after answering an undecodable one with ERROR.

        Raises ``ConnectionClosed`` when the connection ends.
        """
        text = await connection.recv()
        try:
            return decode(text)
        except ShimError as error:
            logger.warning("undecodable frame from the platform: %s", error.message)
            await self._send(connection, error_to({}, error))
            return None

    def _note_server_frame(self, frame: Mapping[str, Any]) -> None:
        payload = frame["payload"]
        kind = frame["type"]
        if kind == MessageType.SESSION_REVOKED:
            self._revoked_reason = str(payload.get("reason") or "revoked")
            logger.warning("the platform revoked this connection: %s", self._revoked_reason)
        elif kind == MessageType.ERROR:
            self._last_error = dict(payload)
            log = logger.error if payload.get("fatal") else logger.warning
            log("platform error %s: %s", payload.get("code"), payload.get("message"))
        else:
            logger.debug("ignoring a %s frame", kind)

    async def _send(self, connection: ClientConnection, frame: Mapping[str, Any]) -> None:
        text = fit_frame(frame)
        with contextlib.suppress(ConnectionClosed):  # the platform fails what was pending
            await connection.send(text)

    def _raise_if_refused(self, code: int | None) -> None:
        if code is None or code not in NO_RECONNECT_CLOSE_CODES:
            return
        reason = NO_RECONNECT_CLOSE_CODES[code]
        if code == CloseCode.SESSION_REVOKED and self._revoked_reason:
            reason += f" (reason: {self._revoked_reason})"
        elif self._last_error:
            reason += f" ({self._last_error.get('code')}: {self._last_error.get('message')})"
        raise ShimRefused(f"{reason}; close code {code}, not reconnecting", code)


def fit_frame(frame: Mapping[str, Any]) -> str:
    """Encode ``frame``, keeping it within the platform's frame cap (16 MiB + 64 KiB).

    An oversized ``COMMAND_RESULT`` loses the ends of its outputs (``output_truncated``
    set); any other oversized response becomes ``ERROR FILE_TOO_LARGE``.
    """
    text = encode(frame)
    if _utf8_size(text) <= MAX_MESSAGE_BYTES:
        return text
    if frame.get("type") == MessageType.COMMAND_RESULT:
        payload = dict(frame["payload"])
        while _utf8_size(text) > MAX_MESSAGE_BYTES:
            payload["stdout"] = payload["stdout"][: len(payload["stdout"]) // 2]
            payload["stderr"] = payload["stderr"][: len(payload["stderr"]) // 2]
            payload["output_truncated"] = True
            text = encode({**frame, "payload": payload})
        return text
    error = ShimError(
        ErrorCode.FILE_TOO_LARGE,
        "the response would exceed the 16 MiB frame limit; read a smaller range or use base64",
        {"max_frame_bytes": MAX_MESSAGE_BYTES},
    )
    return encode(error_to(frame, error))


def _utf8_size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


__all__ = [
    "BACKOFF_SCALE_ENV",
    "Negotiated",
    "RequestDispatcher",
    "Shim",
    "ShimRefused",
    "fit_frame",
    "new_id",
    "reconnect_delay",
    "websocket_url",
]
