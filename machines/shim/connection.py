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
import contextlib
import logging
import os
import random
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from .audit import AuditLog
from .dispatcher import RequestDispatcher
from .jail import PathJail
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
