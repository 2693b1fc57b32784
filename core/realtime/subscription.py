"""Listening: a ``Subscription`` is one channel of this process in some groups, read by
one long-lived receive task that is never cancelled while the channel lives
(docs/architecture.md#how-the-code-is-written); a background loop's doorbell survives
layer outages (``LoopHealth``), an event stream's ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable
from typing import Any

from channels.layers import get_channel_layer

from core.protocol import ChannelMessage
from core.realtime.loop_health import LoopHealth
from core.realtime.received import _kind, message_received

logger = logging.getLogger("core.realtime")  # the package's one logger, as before its split into modules

LEAVE_TIMEOUT = 5.0  # seconds ``Subscription.close`` waits to leave its groups


async def _sleep(timeout: float | None) -> None:
    if timeout is None:
        await asyncio.get_running_loop().create_future()  # for ever (until cancelled)
    else:
        await asyncio.sleep(timeout)


class Subscription:
    """One channel of this process in ``groups``, read by one long-lived receive task.

    ``receives`` names the message models the channel takes (``ChannelMessage``
    subclasses, one per ``type``): each message is validated with the model of its type as
    it arrives, and one of another type, or malformed, is logged and dropped
    (``message_received``). ``await open()`` (or ``async with``) makes the channel;
    ``await wait(timeout)`` returns the next message (one of those models), in arrival
    order, or ``None`` after ``timeout`` seconds
    (``None``: no limit) — a message that arrived while the caller was busy is returned by
    the next ``wait`` at once; ``await close()`` ends it. The receive task holds one
    ``layer.receive`` at a time and never cancels it while the channel lives; ``wait``
    waits on what that task hands over, so its timeout cancels nothing on the layer.
    Messages not yet taken are kept up to the layer's channel capacity (more are dropped,
    as a full channel would).

    With ``health`` (a background loop's doorbell): ``open`` never fails; joining the
    groups happens in the receive task, and a layer error there (joining, receiving) is
    reported to ``health`` (logged once per change of state), waited out for its backoff,
    and followed by joining again, while ``wait`` keeps timing out — the loop polls at its
    own pace. Without ``health`` (an event stream): ``open`` joins the groups and raises
    what the layer raises; a later receive error is raised by ``wait`` and ends the
    subscription. ``rejoin_every`` (seconds; ``None``: never) renews the group memberships
    (groups expire, and a restarted Redis forgets them). Without a channel layer
    (``CHANNEL_LAYERS`` unset) ``wait`` just sleeps its timeout.

    ``layer``: the channel layer to use (default: ``get_channel_layer()`` at ``open``).
    """

    def __init__(
        self,
        *groups: str,
        receives: Iterable[type[ChannelMessage]],
        health: LoopHealth | None = None,
        rejoin_every: float | None = None,
        layer: Any = None,
    ) -> None:
        self.groups = groups
        self.models = {model.message_type(): model for model in receives}
        if not self.models:
            raise TypeError("a Subscription receives at least one message model")
        self.health = health
        self.rejoin_every = rejoin_every
        self._layer = layer
        self._channel: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._pending: deque[ChannelMessage] = deque()
        self._capacity = 100
        self._arrived = asyncio.Event()
        self._joined = asyncio.Event()  # set after the first attempt to join the groups
        self._joined_at: float | None = None
        self._error: Exception | None = None
        self._overflowing = False
        self._opened = False
        self._closed = False

    @property
    def channel(self) -> str | None:
        """The channel's name (``None`` before ``open``, or without a layer)."""
        return self._channel

    async def open(self) -> Subscription:
        """Make the channel (and, without ``health``, join the groups: raises what the
        layer raises). Returns ``self``."""
        if self._opened:
            return self
        self._opened = True
        if self._layer is None:
            self._layer = get_channel_layer()
        if self._layer is None:
            self._joined.set()
            return self
        self._capacity = int(getattr(self._layer, "capacity", 100) or 100)
        if self.health is None:
            self._channel = await self._layer.new_channel()
            for group in self.groups:
                await self._layer.group_add(group, self._channel)
            self._joined_at = asyncio.get_running_loop().time()
            self._joined.set()
        else:
            self._start()
        return self

    async def joined(self) -> bool:
        """Wait until the first attempt to join the groups is over; whether it worked."""
        await self._joined.wait()
        return self._joined_at is not None

    async def wait(self, timeout: float | None = None) -> ChannelMessage | None:
        """The next message (one of the ``receives`` models), or ``None`` when none arrives
        within ``timeout`` seconds.

        Raises the layer's error after a failed receive when there is no ``health``."""
        if not self._opened:
            await self.open()
        if self._closed:
            raise RuntimeError("this subscription is closed")
        if self._layer is None:
            await _sleep(timeout)
            return None
        self._start()
        if not self._pending and self._error is None:
            self._arrived.clear()
            try:
                async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it can swallow a cancel
                    await self._arrived.wait()
            except TimeoutError:
                pass
        if self._pending:
            return self._pending.popleft()
        if self._error is not None:
            raise self._error
        return None

    async def close(self, *, timeout: float = LEAVE_TIMEOUT) -> None:
        """Stop the receive task (the one cancel of the channel's receive) and leave the
        groups, waiting at most ``timeout`` seconds; a failure to leave is logged (the
        memberships expire by themselves)."""
        if self._closed:
            return
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._layer is None or self._channel is None or not self.groups:
            return
        try:
            async with asyncio.timeout(timeout):
                for group in self.groups:
                    await self._layer.group_discard(group, self._channel)
        except Exception as exc:
            logger.info("could not leave %s (%s); the membership expires by itself", ", ".join(self.groups), exc)

    async def __aenter__(self) -> Subscription:
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _start(self) -> None:
        if self._task is None and not self._closed and self._error is None:
            self._task = asyncio.get_running_loop().create_task(self._receive_forever())

    def _deliver(self, message: dict[str, Any]) -> None:
        receiver = f"the subscription to {', '.join(self.groups) or self._channel}"
        kind = message.get("type") if isinstance(message, dict) else None
        model = self.models.get(kind) if isinstance(kind, str) else None
        if model is None:
            logger.warning(
                "%s dropped a message of type %s: it takes %s", receiver, _kind(message), ", ".join(sorted(self.models))
            )
            return
        parsed = message_received(model, message, receiver=receiver)
        if parsed is None:
            return
        if len(self._pending) >= self._capacity:
            if not self._overflowing:  # once per overflow, as a full channel drops silently
                logger.info("messages to %s dropped: %d wait to be taken", self._channel, len(self._pending))
            self._overflowing = True
            return
        self._overflowing = False
        self._pending.append(parsed)
        self._arrived.set()

    async def _receive_forever(self) -> None:
        layer = self._layer
        loop = asyncio.get_running_loop()
        receive: asyncio.Future[dict[str, Any]] | None = None
        try:
            while True:
                try:
                    if receive is not None and receive.done():
                        finished, receive = receive, None
                        self._deliver(finished.result())
                        continue
                    if self._channel is None:
                        self._channel = await layer.new_channel()
                    joined_at = self._joined_at
                    if joined_at is None or (
                        self.rejoin_every is not None and loop.time() - joined_at >= self.rejoin_every
                    ):
                        for group in self.groups:
                            await layer.group_add(group, self._channel)
                        self._joined_at = joined_at = loop.time()
                        self._joined.set()
                        if self.health is not None:
                            self.health.ok()
                    if receive is None:
                        receive = asyncio.ensure_future(layer.receive(self._channel))
                    until_rejoin = None if self.rejoin_every is None else joined_at + self.rejoin_every - loop.time()
                    await asyncio.wait({receive}, timeout=None if until_rejoin is None else max(until_rejoin, 0.0))
                except Exception as exc:
                    if self.health is None:
                        self._error = exc
                        self._arrived.set()
                        return
                    self._joined_at = None  # join again once the backoff is over
                    self._joined.set()
                    await asyncio.sleep(self.health.failed(exc))
        finally:
            if receive is not None:
                if not receive.done():
                    receive.cancel()  # the channel's life ends here
                elif not receive.cancelled():
                    receive.exception()  # retrieved: a failure at shutdown is not news
