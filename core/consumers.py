"""The base of Dispatch's websocket consumers: presence, and a cleanup that runs on every exit.

A consumer can end five ways: the client closes (``websocket.disconnect``), a handler
raises, the channel layer's receive fails (Redis went away), the server cancels it
(daphne's ``application_close_timeout``), or the process shuts it down. Channels only
calls ``disconnect()`` on the first, so ``DispatchConsumer`` runs its own cleanup from
``__call__``'s ``finally`` — once, however the consumer ends — in this order (what clients
see during an outage: docs/operating.md#health):

1. ``delete_rows()`` — the subclass deletes this connection's database rows (ws session,
   remotes, machine connection). First, because it needs no channel layer, and a
   consumer cancelled half-way through must not leave ghosts;
2. ``release_layer()`` — the subclass's channel-layer work (answer pending callers, leave
   groups), each operation through ``layer_quietly`` so one failure skips nothing else.

While the channel layer cannot be reached (``core.errors.channel_layer_unavailable``)
a new socket is accepted and closed with 1013 (try again later) and an open one closes
with 1012 (service restart) after its rows are gone, so clients reconnect and register
again once Redis is back.

A channel-layer handler is declared with ``@receives(<its message model>)``: the method
named after the model's ``type`` gets the message validated as that model, and one that
does not fit — or a message of a type the consumer has no handler for — is logged and
dropped, never raised (``core.realtime.message_received``).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from channels.consumer import get_handler_name
from channels.exceptions import StopConsumer
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from core import presence
from core.backpressure import (
    POLL_INTERVAL,
    ReadThrottle,
    SendPressure,
    release_channel_buffer,
    transport_protocol,
    unsent_bytes,
)
from core.errors import channel_layer_unavailable, database_unavailable
from core.http import scope_bearer_token
from core.protocol import ChannelMessage, CredentialEndedMessage, ServerShutdownMessage
from core.realtime import LocalChannel, consumer_channel, layer_send, message_received

logger = logging.getLogger(__name__)

Consumer = TypeVar("Consumer", bound="DispatchConsumer")
Message = TypeVar("Message", bound=ChannelMessage)
ChannelHandler = Callable[[Consumer, dict[str, Any]], Awaitable[None]]

CLOSE_INTERNAL_ERROR = 1011
CLOSE_SERVICE_RESTART = 1012  # an open socket whose process lost the channel layer
CLOSE_TRY_AGAIN_LATER = 1013  # a new socket while the channel layer (or database) is down


def outage(exc: BaseException) -> bool:
    """Whether ``exc`` is the channel layer or the database being unreachable."""
    return channel_layer_unavailable(exc) or database_unavailable(exc)


# The credential's close code, 4401 on both /ws and /ws/shim/ (docs/ws-protocol.md#close-codes,
# docs/shim-protocol.md#close-codes).
CLOSE_CREDENTIAL_ENDED = 4401


def receives(
    model: type[Message],
) -> Callable[[Callable[[Consumer, Message], Awaitable[None]]], ChannelHandler[Consumer]]:
    """Declare a consumer method the handler of ``model``'s channel-layer messages.

    The method must bear the name Channels dispatches ``model``'s ``type`` to
    (``"remote.call"`` → ``remote_call``; a ``TypeError`` at import otherwise); it is
    called with the message validated as ``model``. A message that does not validate is
    logged and dropped (``core.realtime.message_received``). The handler keeps ``model``
    as its ``channel_message`` attribute (the tests enumerate them).
    """

    def decorate(method: Callable[[Consumer, Message], Awaitable[None]]) -> ChannelHandler[Consumer]:
        expected = get_handler_name({"type": model.message_type()})
        if method.__name__ != expected:
            raise TypeError(f"the handler of {model.__name__} must be named {expected}, not {method.__name__}")

        @functools.wraps(method)
        async def handler(self: Consumer, event: dict[str, Any]) -> None:
            message = message_received(model, event, receiver=type(self).__name__)
            if message is not None:
                await method(self, message)

        handler.channel_message = model  # type: ignore[attr-defined]
        return handler

    return decorate


class DispatchConsumer(AsyncWebsocketConsumer):
    """A websocket consumer known to its process (for shutdown), cleaned up on every exit,
    without Channels' per-message database hop.

    Subclasses implement ``delete_rows()`` and ``release_layer()`` (both optional) instead
    of ``disconnect()``. Channels ≥ 4.2 runs ``aclose_old_connections()`` on the process's
    one sync thread before every handler. Dispatch consumers never touch the ORM outside
    ``database_sync_to_async`` (which closes stale connections itself), so that hop —
    about a third of a remote call's cost — is skipped here.
    """

    # Set by the pump when the consumer starts (None without a configured layer); typed as
    # Channels' untyped attribute so subclasses use it as before.
    channel_layer: Any
    _accepted = False
    _connected = False  # the connect handler finished
    _socket_closed = False  # a close was sent or the client went away
    _cleaned_up = False
    _send_pressure: SendPressure | None = None
    _read_throttle: ReadThrottle | None = None
    _hard_watch: asyncio.Future[None] | None = None  # core.backpressure: the close after the grace
    _local_inbox: LocalChannel | None = None  # the channel's same-process inbox (core.realtime)

    # --- back-pressure (core.backpressure; docs/operating.md#bounds) ----------------------

    @property
    def send_pressure(self) -> SendPressure:
        """This connection's unsent backlog against the process's marks: ``has_room()``
        before handing the socket new work, ``wait_for_room()`` to pause a stream."""
        if self._send_pressure is None:
            self._send_pressure = SendPressure(
                self.unsent_bytes,
                high_water=settings.WS_HIGH_WATER,
                hard_limit=settings.WS_HARD_LIMIT,
                grace=settings.WS_HARD_GRACE,
            )
        return self._send_pressure

    async def websocket_receive(self, message: dict[str, Any]) -> None:
        """A frame from the client: first, stop reading the socket while too many more
        wait behind it (``core.backpressure.ReadThrottle``)."""
        if self._read_throttle is None:
            protocol = transport_protocol(getattr(self, "base_send", None))
            self._read_throttle = ReadThrottle(protocol, limit=settings.WS_INBOUND_FRAMES)
        self._read_throttle.frame_taken()
        await super().websocket_receive(message)

    def unsent_bytes(self) -> int:
        """Bytes sent to this socket that its peer has not read yet and the process still
        holds (0 when the server does not say: not daphne)."""
        return unsent_bytes(transport_protocol(getattr(self, "base_send", None)))

    async def send(
        self, text_data: str | None = None, bytes_data: bytes | None = None, close: bool | int = False
    ) -> None:
        """Send a frame, then close with 1013 a peer whose unread backlog has stayed above
        the hard mark for longer than the grace (``core.backpressure``).

        A socket that has just crossed the hard mark gets a watch that checks again once
        the grace is over: the close must not wait for a next send that may never come."""
        await super().send(text_data=text_data, bytes_data=bytes_data, close=close)
        if close or self._socket_closed:
            return
        if self.send_pressure.over_hard_too_long():
            await self._close_over_hard_mark()
        elif self.send_pressure.over_hard_since is not None and self._hard_watch is None:
            self._hard_watch = asyncio.ensure_future(self._watch_hard_mark())

    async def _watch_hard_mark(self) -> None:
        """Re-check the backlog after the grace (and every grace after that) while it stays
        above the hard mark; close the socket once it has been there too long."""
        try:
            pressure = self.send_pressure
            while not self._socket_closed and pressure.over_hard_since is not None:
                await asyncio.sleep(pressure.grace + POLL_INTERVAL)
                if self._socket_closed:
                    return
                if pressure.over_hard_too_long():
                    await self._close_over_hard_mark()
                    return
        finally:
            self._hard_watch = None

    async def _close_over_hard_mark(self) -> None:
        logger.warning(
            "%s: the peer has not read %d bytes for over %gs; closing (1013)",
            type(self).__name__,
            self.unsent_bytes(),
            self.send_pressure.grace,
        )
        await self.close(code=CLOSE_TRY_AGAIN_LATER)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        try:
            await self._serve(scope, receive, send)
        except Exception as exc:
            if not outage(exc):
                raise
            # The layer's receive failed (every consumer of the process shares it).
            logger.warning("%s: channel layer lost (%s); closing", type(self).__name__, _describe(exc))
            await self._cleanup()
            await self._close_for_outage()
        finally:
            await self._cleanup()

    async def _serve(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Channels' ``AsyncConsumer.__call__``, with the pump in place of
        ``await_many_dispatch`` (which makes a Task and an ``asyncio.wait`` for every
        message): ends quietly on ``StopConsumer``, raises what a handler or a receive
        raises."""
        self.scope = scope
        sources: list[Callable[[], Awaitable[dict[str, Any]]]] = [receive]
        channel = await consumer_channel(self.channel_layer_alias)
        if channel is None:
            self.channel_layer = None
        else:
            self.channel_layer, self.channel_name, self.channel_receive, self._local_inbox = channel
            sources.append(self.channel_receive)
            if self._local_inbox is not None:
                # What this process sends this consumer, without the layer (core.realtime).
                sources.append(self._local_inbox.take)
        self.base_send = send
        try:
            await self._pump(sources)
        except StopConsumer:
            pass

    async def _pump(self, sources: list[Callable[[], Awaitable[dict[str, Any]]]]) -> None:
        """Read each source (the socket, then the channel, then the channel's same-process
        inbox) in its own long-lived task and dispatch what arrives under one lock: one
        message at a time, in arrival order per source, as Channels does — but without a
        task and an ``asyncio.wait`` per message.

        The first failure ends the pump: a handler raising (``StopConsumer`` included) or
        a source raising (the channel layer lost), the latter only once the message being
        handled is done. The other readers are stopped before they handle anything more,
        all tasks are cancelled and awaited, and that failure is raised here. The readers
        run in one copy of the caller's context, as the handlers shared Channels' one task."""
        lock = asyncio.Lock()
        stopped = False

        async def read(source: Callable[[], Awaitable[dict[str, Any]]]) -> None:
            nonlocal stopped
            while True:
                failure: Exception | None = None
                try:
                    message = await source()
                except Exception as exc:  # raised once the message in hand is handled
                    failure = exc
                async with lock:
                    if stopped:
                        return
                    if failure is not None:
                        stopped = True
                        raise failure
                    try:
                        await self.dispatch(message)
                    except BaseException:
                        stopped = True
                        raise

        if len(sources) == 1:
            await read(sources[0])
            return
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        readers = [loop.create_task(read(source), context=context) for source in sources]
        try:
            ended, _ = await asyncio.wait(readers, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for reader in readers:
                reader.cancel()
            # Awaited, and every outcome retrieved: none is left "never retrieved".
            await asyncio.gather(*readers, return_exceptions=True)
        for reader in (reader for reader in readers if reader in ended):  # the socket's first
            if reader.cancelled():  # a handler raised CancelledError itself
                raise asyncio.CancelledError()
            failure = reader.exception()
            if failure is not None:
                raise failure

    # --- cleanup hooks (subclasses) -------------------------------------------------------

    async def delete_rows(self) -> None:
        """Stop this connection's local work and delete its database rows (no layer I/O)."""

    async def release_layer(self) -> None:
        """Channel-layer work of closing: answer pending callers, leave groups (each
        operation through ``layer_quietly``)."""

    async def layer_quietly(self, operation: Awaitable[Any], what: str) -> None:
        """Await one channel-layer ``operation`` of a cleanup; a failure is logged (one
        line, naming ``what``) and swallowed so the next operation still runs."""
        try:
            await operation
        except Exception as exc:
            logger.warning("%s: could not %s: %s", type(self).__name__, what, _describe(exc))

    async def _cleanup(self) -> None:
        if self._cleaned_up:
            return
        self._cleaned_up = True
        self._close_local_inbox()
        presence.connection_closed(self)
        if self._hard_watch is not None:
            self._hard_watch.cancel()
        try:
            await self.delete_rows()
        except Exception as exc:
            # Outage: the rows stay until the reaper or a takeover probe removes them.
            logger.warning("%s: could not delete its rows: %s", type(self).__name__, _describe(exc))
        try:
            await self.release_layer()
        except Exception as exc:
            logger.warning("%s: cleanup on the channel layer failed: %s", type(self).__name__, _describe(exc))
        self._release_channel_buffer()

    def _close_local_inbox(self) -> None:
        """First thing on every exit: no request of this process reaches this consumer any
        more, and the ones waiting in its inbox are dropped, as a dead channel's are (each
        caller's liveness check ends its wait; docs/operating.md#channel-layer)."""
        inbox, self._local_inbox = self._local_inbox, None
        if inbox is None:
            return
        dropped = inbox.close()
        if dropped:
            logger.info("%s: dropped %d unread same-process messages", type(self).__name__, dropped)

    def _release_channel_buffer(self) -> None:
        """What the layer buffered for this consumer's channel goes with it (and what
        arrives for it until Redis expires it): no one reads that channel again."""
        layer = getattr(self, "channel_layer", None)
        channel_name = getattr(self, "channel_name", None)
        if layer is None or not channel_name:
            return
        dropped = release_channel_buffer(layer, channel_name, again_after=float(getattr(layer, "expiry", 60)) + 1)
        if dropped:
            logger.info("%s: dropped %d unread channel-layer messages", type(self).__name__, dropped)

    async def _close_for_outage(self) -> None:
        """Close with 1013 (a socket still connecting) or 1012 (an open one), accepting first:
        a close code needs an accepted socket."""
        if self._socket_closed:
            return
        try:
            if not self._accepted:
                await self.accept()
            await self.close(code=CLOSE_SERVICE_RESTART if self._connected else CLOSE_TRY_AGAIN_LATER)
        except Exception as exc:
            logger.info("%s: could not close the socket: %s", type(self).__name__, _describe(exc))

    # --- Channels' websocket handlers ------------------------------------------------------

    async def accept(self, subprotocol: str | None = None, headers: Any = None) -> None:
        self._accepted = True
        await super().accept(subprotocol, headers)

    async def close(self, code: int | bool | None = None, reason: str | None = None) -> None:
        self._socket_closed = True
        await super().close(code, reason)

    async def websocket_connect(self, message: dict[str, Any]) -> None:
        presence.connection_opened(self)
        await super().websocket_connect(message)
        self._connected = True

    async def websocket_disconnect(self, message: dict[str, Any]) -> None:
        self._socket_closed = True
        await self.disconnect(message.get("code", 1005))
        raise StopConsumer()

    async def disconnect(self, code: int) -> None:
        """The socket closed: run the cleanup now (``__call__`` would run it anyway)."""
        await self._cleanup()

    async def dispatch(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        try:
            handler = getattr(self, get_handler_name(message), None)
        except (ValueError, AttributeError):  # no type, not text, a leading underscore
            handler = None
        websocket = isinstance(kind, str) and kind.startswith("websocket.")
        # From the channel layer, only a handler declared with @receives takes a message.
        if handler is None or not (websocket or hasattr(handler, "channel_message")):
            if websocket:
                raise ValueError(f"no handler for message type {kind}")
            logger.warning("%s dropped a message of type %r: no handler", type(self).__name__, kind)
            return
        try:
            await handler(message)
        except StopConsumer:
            raise
        except Exception as exc:
            if outage(exc):
                logger.warning(
                    "%s: %s failed, a service is unreachable (%s); closing",
                    type(self).__name__,
                    message["type"],
                    _describe(exc),
                )
                await self._cleanup()
                await self._close_for_outage()
                raise StopConsumer() from None
            # A consumer that dies never receives websocket.disconnect: clean up here, or
            # its rows (remotes, machines) would outlive the socket as ghosts.
            logger.exception("%s failed on %s; closing the connection", type(self).__name__, message["type"])
            await self._cleanup()
            if not self._socket_closed:
                await self.close(code=CLOSE_INTERNAL_ERROR)
            raise StopConsumer() from None

    def bearer_token(self) -> str | None:
        """The token of the upgrade request's ``Authorization: Bearer`` header, if any."""
        return scope_bearer_token(self.scope)

    @receives(ServerShutdownMessage)
    async def server_shutdown(self, message: ServerShutdownMessage) -> None:
        """``server.shutdown``: close with 1012 (service restart); subclasses fail work first."""
        await self.close(code=CLOSE_SERVICE_RESTART)

    @receives(CredentialEndedMessage)
    async def credential_ended(self, message: CredentialEndedMessage) -> None:
        """``credential.ended`` (``core.revocation``): the token, user or session this
        connection stands on ended: close 4401; the usual disconnect path cleans up."""
        await self.close(code=CLOSE_CREDENTIAL_ENDED)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


async def shutdown_local_connections() -> int:
    """Tell every consumer of this process to fail its pending work and close.

    Returns how many were told.
    """
    names = presence.local_channel_names()
    for name in names:
        try:
            await layer_send(name, ServerShutdownMessage())
        except Exception:  # a full channel must not stop the others from closing
            logger.warning("could not tell %s to shut down", name, exc_info=True)
    return len(names)
