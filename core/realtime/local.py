"""The same-process fast path: a message to a consumer of this process skips the layer
(docs/operating.md#channel-layer).

Each consumer's channel has a ``LocalChannel`` inbox beside it (``consumer_channel``), and
a same-process ``request_reply`` waits on a local reply inbox; ``_put_local`` is the one
hand-over every point-to-point send of this process tries first, so one sender's
messages keep their order. Same capacity and serialization refusals as the layer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
from channels.exceptions import ChannelFull
from channels.layers import InMemoryChannelLayer, get_channel_layer

logger = logging.getLogger("core.realtime")  # the package's one logger, as before its split into modules


class LocalChannel:
    """A channel's inbox in this process's memory, for messages whose sender and receiver
    both live here (docs/operating.md#channel-layer): a consumer's second inbox beside
    its channel on the layer (``consumer_channel``), or the reply inbox of one
    ``request_reply``.

    Holds at most ``capacity`` messages (plain dicts, each the receiver's own: built by
    ``ChannelMessage.for_layer`` for this one send); ``put`` raises ``ChannelFull`` past it,
    as the layer's ``send`` does. Bound to the event loop that made it: ``put`` from
    another loop hands the message over thread-safely. ``close()`` unregisters it and
    drops what it holds, as a dead channel of the layer keeps nothing for anyone.
    """

    __slots__ = ("_messages", "_registry", "_waiter", "capacity", "closed", "loop", "name")

    def __init__(self, name: str, capacity: int, registry: dict[str, LocalChannel]) -> None:
        self.name = name
        self.capacity = capacity
        self.loop = asyncio.get_running_loop()
        self._registry = registry
        self._messages: deque[dict[str, Any]] = deque()
        self._waiter: asyncio.Future[dict[str, Any]] | None = None
        self.closed = False
        registry[name] = self

    def __len__(self) -> int:
        return len(self._messages)

    def put(self, message: dict[str, Any]) -> None:
        """Hand ``message`` to the receiver (its waiting ``next()``, else the queue); raises
        ``ChannelFull`` when ``capacity`` messages already wait. Once closed, the message
        is dropped silently (a dead channel)."""
        if self.loop is not _running_loop():
            try:
                self.loop.call_soon_threadsafe(self._put_quietly, message)
            except RuntimeError:  # that loop is closed: so is the channel
                pass
            return
        if self.closed:
            return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            self._waiter = None
            waiter.set_result(message)
            return
        if len(self._messages) >= self.capacity:
            raise ChannelFull()
        self._messages.append(message)

    def _put_quietly(self, message: dict[str, Any]) -> None:
        try:
            self.put(message)
        except ChannelFull:
            logger.warning("a message to %s dropped: channel full", self.name)

    def next(self) -> asyncio.Future[dict[str, Any]]:
        """A future of the next message (already done when one waits): ``request_reply``
        waits on it without a task. One at a time: a second call replaces the first."""
        future: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        if self._messages:
            future.set_result(self._messages.popleft())
        else:
            self._waiter = future
        return future

    async def take(self) -> dict[str, Any]:
        """The next message, waiting for it: a consumer's pump reads it as one more source.
        A message handed over just as the wait is cancelled goes back to the queue's head."""
        future = self.next()
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._messages.appendleft(future.result())
            elif self._waiter is future:
                self._waiter = None
            raise

    def close(self) -> int:
        """Unregister; drop the messages still waiting. Returns how many were dropped."""
        if self._registry.get(self.name) is self:
            del self._registry[self.name]
        self.closed = True
        dropped = len(self._messages)
        self._messages.clear()
        # A waiting receive stays pending (never woken): its reader ends with its owner.
        return dropped


LOCAL_REPLY_PREFIX = "dispatch.local-reply!"
"""The reply channels of same-process ``request_reply`` calls: never on the layer (a reply
to one whose caller stopped waiting is dropped, not sent to Redis for nobody)."""

_consumer_inboxes: dict[str, LocalChannel] = {}  # a consumer's channel name -> its local inbox
_reply_inboxes: dict[str, LocalChannel] = {}  # a waiting request_reply's reply channel -> its inbox


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def local_inbox(channel_name: str) -> LocalChannel | None:
    """The same-process inbox of the consumer whose channel is ``channel_name``, when that
    consumer lives in this process and on the running event loop; else ``None`` (the
    message goes through the layer)."""
    inbox = _consumer_inboxes.get(channel_name)
    if inbox is None or inbox.loop is not _running_loop():
        return None
    return inbox


def _refuse_what_the_layer_would(layer: Any, message: dict[str, Any]) -> None:
    """Raise what ``layer``'s own ``send`` would raise serializing ``message``, for a message
    that skips it. The Redis layers (both msgpack) refuse a lone surrogate
    (``UnicodeEncodeError``, a ``ValueError``) and an integer outside 64 bits
    (``OverflowError``); the in-memory layer copies (``deepcopy``) and refuses nothing that
    ``ChannelMessage.for_layer`` let through."""
    if not isinstance(layer, InMemoryChannelLayer):
        msgpack.packb(message, use_bin_type=True)


def _put_local(layer: Any, channel_name: str, payload: dict[str, Any]) -> bool:
    """Hand ``payload`` to ``channel_name``'s inbox in this process, when it has one (a
    waiting ``request_reply``'s reply inbox, or a consumer's); ``False`` otherwise.

    Every point-to-point message from this process to a consumer of this process goes this
    way, not just ``request_reply``'s: one path keeps them in the order they were sent (a
    "remote disconnected" notice is not overtaken by a call sent after it). Raises what the
    layer would refuse to serialize, and ``ChannelFull`` when that inbox is full (from the
    inbox's own event loop; from another one the message is handed over thread-safely and
    a full inbox drops it with a warning, as ``ring_on_commit`` drops a failed send)."""
    inbox = _reply_inboxes.get(channel_name)
    if inbox is None:  # (not ``or``: an empty inbox is falsy, it has a length)
        inbox = _consumer_inboxes.get(channel_name)
    if inbox is None:
        return False
    _refuse_what_the_layer_would(layer, payload)
    inbox.put(payload)
    return True


async def consumer_channel(
    alias: str,
) -> tuple[Any, str, Callable[[], Awaitable[dict[str, Any]]], LocalChannel | None] | None:
    """A new channel for a consumer on the channel layer ``alias``: ``(layer, channel_name,
    reader, local)``, or ``None`` when no layer is configured. ``await reader()`` returns the
    channel's next message (a dict) and raises what the layer raises (a Redis
    ``ConnectionError`` while it is unreachable); ``core.consumers.DispatchConsumer``
    awaits it in one long-lived task, cancelled only when the channel's life ends, as
    ``Subscription`` does. Raises what the layer raises making the channel.

    ``local`` (on the default layer, the one ``request_reply`` uses; ``None`` on another)
    is the channel's same-process inbox, registered under ``channel_name``: what this
    process sends the channel (``request_reply``, ``layer_send``, ``send_on_commit``) goes
    there instead of on the layer. Its capacity is the layer's for the channel. The consumer reads
    ``local.take`` beside ``reader`` and must ``local.close()`` when it ends, on every
    path (docs/operating.md#channel-layer)."""
    layer = get_channel_layer(alias)
    if layer is None:
        return None
    channel_name = await layer.new_channel()
    local = None
    if layer is get_channel_layer():
        local = LocalChannel(channel_name, _capacity(layer, channel_name), _consumer_inboxes)
    return layer, channel_name, functools.partial(layer.receive, channel_name), local


def _capacity(layer: Any, channel_name: str) -> int:
    """The layer's capacity for ``channel_name`` (messages; Channels' default 100)."""
    get_capacity = getattr(layer, "get_capacity", None)
    if get_capacity is not None:
        return int(get_capacity(channel_name))
    return int(getattr(layer, "capacity", 100) or 100)
