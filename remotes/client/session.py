"""Low-level client for a Dispatch ``/ws`` session (docs/ws-protocol.md).

A :class:`Session` is one websocket connection authenticated with an API token in the
``Authorization`` header. It sends requests in the action envelope
``{"action", "nonce", "body"}``, matches replies by their echoed ``nonce``, and hands
every frame without a nonce (an event) to an event handler.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

logger = logging.getLogger("remotes.client")

MAX_MESSAGE_BYTES = 1024 * 1024
"""Largest frame either side may send (``DISPATCH_WS_MAX_MESSAGE_BYTES`` default, docs/ws-protocol.md#limits)."""

DEFAULT_URL = "ws://127.0.0.1:8000/ws"
"""The ``/ws`` URL used when neither ``--server``/``--url``, ``$DISPATCH_URL`` nor a
Remote's own ``url`` names one: a server started by ``make run`` on this computer."""

KEEPALIVE_INTERVAL = 5.0
KEEPALIVE_TIMEOUT = 5.0
CLOSE_TIMEOUT = 2.0
"""Websocket pings every ``KEEPALIVE_INTERVAL`` seconds, each answered within
``KEEPALIVE_TIMEOUT``, and ``CLOSE_TIMEOUT`` seconds for the closing handshake: a server
that stops answering (a frozen process behind nginx, whose TCP connection stays up) ends
the session 7-12 s after it stopped, within about ``DISPATCH_PROCESS_TTL``, so that
``Remote.serve`` reconnects through the load balancer to a live process
(docs/ws-protocol.md#limits). The server answers pings by itself; nothing changes on the wire."""

REFUSED_CLOSE_CODES = {4401: "authentication failed", 4408: "authentication timed out"}
"""Close codes by which the server refuses the session (docs/ws-protocol.md#close-codes); reconnecting cannot help."""

EventHandler = Callable[["Session", dict[str, Any]], None]
"""Called on the event loop with the session and each event (a frame without a nonce)."""


def websocket_url(server: str) -> str:
    """``http(s)://host:port[/prefix]`` → ``ws(s)://host:port[/prefix]/ws``: the ``/ws``
    session URL of the instance whose base URL is ``server`` (the shim derives its own
    ``/ws/shim/`` the same way, docs/shim-protocol.md#connecting).

    The one place the client turns a user's URL into a session URL: ``--server``,
    ``--url``, ``$DISPATCH_URL`` (which Dispatch sets to its http(s) base URL for its
    agents) and ``Remote(url=…)`` all go through it. ``ws(s)://`` URLs are accepted too; a
    URL already ending in ``/ws`` is kept. Raises ``ValueError`` for another scheme or a
    URL without a host.
    """
    parts = urllib.parse.urlsplit(server.strip())
    schemes = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}
    if parts.scheme not in schemes or not parts.netloc:
        raise ValueError(
            f"expected the server's base URL, http(s)://host:port (or its ws(s)://host:port/ws), got {server!r}"
        )
    path = parts.path.rstrip("/")
    if not path.endswith("/ws"):
        path += "/ws"
    return urllib.parse.urlunsplit((schemes[parts.scheme], parts.netloc, path, "", ""))


class RemoteCallError(Exception):
    """A reply carried an ``error``; the message is the server's error string (docs/ws-protocol.md#frames)."""


class AuthenticationError(Exception):
    """The server closed the session with 4401 or 4408 (docs/ws-protocol.md#authentication): the token was refused."""


class MessageTooLarge(ValueError):
    """An outgoing frame would exceed :data:`MAX_MESSAGE_BYTES`; it was not sent."""


def encode_message(message: Mapping[str, Any]) -> str:
    """Encode ``message`` as one JSON text frame.

    Raises ``MessageTooLarge`` when the UTF-8 frame exceeds 1 MiB (the server would close
    the connection with 1009), ``TypeError`` for values JSON cannot encode and
    ``ValueError`` for NaN or ±Infinity (``allow_nan=False``: not JSON, Dispatch refuses them).
    """
    frame = json.dumps(message, allow_nan=False)
    size = len(frame.encode())
    if size > MAX_MESSAGE_BYTES:
        raise MessageTooLarge(f"message of {size} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    return frame


class Session:
    """One authenticated ``/ws`` connection; create it with :meth:`Session.connect`.

    A background task reads frames until the connection closes. When it closes, pending
    requests fail with ``AuthenticationError`` (close codes 4401/4408) or the
    ``websockets.exceptions.ConnectionClosed`` describing the close.
    """

    def __init__(self, connection: ClientConnection, on_event: EventHandler | None = None) -> None:
        self._connection = connection
        self._on_event = on_event
        self._nonces = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._server_error: str | None = None
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def connect(
        cls,
        url: str,
        token: str,
        *,
        on_event: EventHandler | None = None,
        open_timeout: float = 10.0,
    ) -> Session:
        """Open a session at ``url`` (``ws://host:port/ws``) with ``Bearer <token>``.

        ``open_timeout`` is in seconds. The session ends (``ConnectionClosed``, code
        1006) when the server leaves a ping unanswered for ``KEEPALIVE_TIMEOUT`` seconds.
        Raises ``OSError`` (including ``TimeoutError``)
        when the server cannot be reached, ``websockets.exceptions.InvalidHandshake``
        when it refuses the upgrade, ``websockets.exceptions.InvalidURI`` for a bad URL.
        A refused token is not seen here: the server accepts, then closes with 4401.
        """
        connection = await connect(
            url,
            additional_headers={"Authorization": f"Bearer {token}"},
            max_size=MAX_MESSAGE_BYTES,
            open_timeout=open_timeout,
            ping_interval=KEEPALIVE_INTERVAL,
            ping_timeout=KEEPALIVE_TIMEOUT,
            close_timeout=CLOSE_TIMEOUT,
        )
        return cls(connection, on_event)

    @property
    def close_code(self) -> int | None:
        """The websocket close code once the connection has closed, else ``None``."""
        return self._connection.close_code

    async def request(
        self,
        action: str,
        body: Mapping[str, Any] | None = None,
        *,
        timeout: float = 30.0,
    ) -> dict[str, Any]:
        """Send ``{"action", "nonce", "body"}`` and return the reply carrying that nonce.

        The reply is the whole frame (result fields at top level plus ``nonce``).
        ``timeout`` is in seconds. Raises ``RemoteCallError`` for a reply with ``error``,
        ``TimeoutError`` when no reply came in time, ``AuthenticationError`` or
        ``ConnectionClosed`` when the connection closed first, and ``MessageTooLarge``.
        """
        nonce = next(self._nonces)
        reply_future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[nonce] = reply_future
        try:
            await self.send({"action": action, "nonce": nonce, "body": dict(body or {})})
            # Not asyncio.wait_for: on Python 3.11 a cancel that comes as the reply arrives
            # is swallowed (the caller, e.g. a cancelled Remote.serve, would go on for ever).
            async with asyncio.timeout(timeout):
                reply = await reply_future
        finally:
            self._pending.pop(nonce, None)
            if reply_future.done() and not reply_future.cancelled():
                reply_future.exception()  # retrieved: the send's own error is what we raise
        if "error" in reply:
            raise RemoteCallError(str(reply["error"]))
        return reply

    async def send(self, message: Mapping[str, Any] | str) -> None:
        """Send one message: a dict, or a frame already made by :func:`encode_message`.

        Raises ``MessageTooLarge`` (nothing is sent), or ``AuthenticationError`` /
        ``ConnectionClosed`` when the connection has closed.
        """
        frame = message if isinstance(message, str) else encode_message(message)
        try:
            await self._connection.send(frame)
        except ConnectionClosed:
            raise self._closed_error() from None

    async def wait_closed(self) -> None:
        """Wait until the connection closes.

        Raises ``AuthenticationError`` when the server closed it with 4401 or 4408.
        """
        await asyncio.shield(self._reader)
        error = self._closed_error()
        if isinstance(error, AuthenticationError):
            raise error

    async def close(self) -> None:
        """Close the connection (idempotent) and wait for the reader to finish."""
        await self._connection.close()
        await asyncio.shield(self._reader)

    def _closed_error(self) -> Exception:
        code = self._connection.close_code
        if code in REFUSED_CLOSE_CODES:
            reason = self._server_error or REFUSED_CLOSE_CODES[code]
            return AuthenticationError(f"the server refused the session: {reason} (close code {code})")
        return self._connection.close_exc

    async def _read(self) -> None:
        try:
            async for frame in self._connection:
                self._receive(frame)
        except ConnectionClosed:
            pass
        finally:
            for reply_future in self._pending.values():
                if not reply_future.done():
                    reply_future.set_exception(self._closed_error())

    def _receive(self, frame: str | bytes) -> None:
        try:
            message = json.loads(frame)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            logger.warning("ignoring a frame that is not a JSON object: %.200r", frame)
            return
        if "nonce" in message:
            reply_future = self._pending.get(message["nonce"])
            if reply_future is not None and not reply_future.done():
                reply_future.set_result(message)
            else:
                logger.debug("ignoring a reply to no pending request: %.200r", message)
            return
        if "error" in message:
            # e.g. {"error": "authentication failed"} before close 4401 (older servers added
            # "action": "auth"; both shapes land here). A refusal is told once, by the
            # AuthenticationError that carries it; anything else is worth a warning.
            self._server_error = str(message["error"])
            refusal = self._server_error in REFUSED_CLOSE_CODES.values()
            logger.log(logging.DEBUG if refusal else logging.WARNING, "server error: %s", self._server_error)
            return
        if self._on_event is not None:
            try:
                self._on_event(self, message)
            except Exception:
                logger.exception("event handler failed on %.200r", message)
