"""A Redis channel layer with one PUBLISH per message: each process subscribes once.

channels-redis' list layer pushes each message onto a Redis list, keeps a sorted set for
expiry and has every receiving process poll (BZPOPMIN) its own lists: a remote call
across two processes took 16 Redis round trips (docs/operating.md#channel-layer).
Here each process SUBSCRIBEs once to its own Redis channel, ``<prefix>.<random>``; the
channels it makes (:meth:`PubSubChannelLayer.new_channel`) are named
``<process channel>!<local id>``, so a ``send`` is one PUBLISH to the owning process and
its reader task hands the message to the channel's in-memory inbox.

Guarantees, as with the list layer:

* At most once. A message for a process that is gone (PUBLISH reached no subscriber), or
  published while the receiving process was not subscribed, is lost; Dispatch keeps what
  must not be lost in rows (the layer is a doorbell).
* Capacity is enforced by the receiving process: an inbox holds at most ``capacity``
  messages (``channel_capacity`` per pattern); one more is dropped there with a warning.
  A sender in the same process learns it at once: ``send`` raises ``ChannelFull`` when
  the inbox is full (the user-visible "remote 'x' is busy"). A sender in another process
  cannot (one PUBLISH has no answer from the inbox): its caller sees the call's timeout.
* Messages nobody takes expire after ``expiry`` seconds; other channels' expired
  messages and empty inboxes are swept at most once per ``sweep_interval`` seconds, so
  memory stays bounded by the live channels' capacity.
* A send through this layer to a channel of the same process also goes through Redis (one
  PUBLISH to this process's own channel), not straight into the inbox: ``/healthz``'s
  probe then measures Redis, and a frozen or stopped Redis is noticed by the next send,
  as with the list layer. (A request/reply between two consumers of one process does not
  reach this layer at all: ``core.realtime`` hands it over in memory,
  docs/operating.md#channel-layer.)
* Groups are Redis sorted sets as in channels-redis (members expire after
  ``group_expiry``); ``group_send`` reads the members and publishes once per owning
  process (two round trips, whatever the group's size).
* While the subscription is lost (Redis stopped or unreachable), every ``receive`` of
  this process raises :class:`SubscriptionLost` (a ``redis.exceptions.ConnectionError``)
  once its inbox is empty — consumers close 1012 and clients reconnect — and the reader
  subscribes again with back-off (0.1 s doubling to 2 s). The outage is reported to ``core.outage.tracker``
  (one WARNING per outage, one INFO when it ends), never one traceback per retry.

``send``, ``group_send``, ``group_add`` and ``group_discard`` get ``deadline`` seconds
(:class:`core.channel_layer.LayerDeadlineExceeded` after it), as with the list layer.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from typing import Any

import msgpack
from channels.exceptions import ChannelFull
from channels.layers import BaseChannelLayer
from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from core.channel_layer import within_deadline
from core.outage import tracker

logger = logging.getLogger(__name__)

RETRY_FIRST = 0.1  # seconds before the first re-subscribe after the subscription is lost
RETRY_MAX = 2.0  # seconds between re-subscribes at most
# A quiet subscription is PINGed after this many seconds without a message, and counted
# lost when nothing (not even the PONG) came for twice as long: a connection dropped on the
# way (a NAT or conntrack timeout, a Redis host gone without a FIN) would otherwise wait for
# TCP keepalive, about two hours, delivering nothing.
SUBSCRIPTION_HEARTBEAT = 15.0


class SubscriptionLost(RedisConnectionError):
    """This process's subscription to Redis is lost; raised by ``receive`` until the
    reader subscribes again (an outage: consumers close 1012)."""


class _Inbox:
    """One local channel's messages (``(arrived at, message)``, oldest first) and the
    receives waiting on it. ``empty()``/``get_nowait()`` let
    ``core.backpressure.release_channel_buffer`` empty a closed consumer's inbox."""

    __slots__ = ("messages", "waiters")

    def __init__(self) -> None:
        self.messages: collections.deque[tuple[float, dict[str, Any]]] = collections.deque()
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def empty(self) -> bool:
        return not self.messages

    def get_nowait(self) -> dict[str, Any]:
        return self.messages.popleft()[1]


def _wake(waiter: asyncio.Future[None]) -> None:
    if waiter.done():
        return
    loop = waiter.get_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if loop is running:
        waiter.set_result(None)
    elif not loop.is_closed():
        loop.call_soon_threadsafe(_wake, waiter)


class PubSubChannelLayer(BaseChannelLayer):
    """Channels' layer API over Redis PUBLISH/SUBSCRIBE, one subscription per process.

    ``hosts``: one host, ``[{"address": "redis://…", …}]`` (a URL string also works);
    extra keys ``max_connections`` (int, per process and event loop) and ``pool_timeout``
    (seconds a sender waits for a free connection), the rest go to each connection.
    ``prefix``: names this instance's Redis channels and group keys. ``expiry`` (seconds
    a message waits for its receive), ``group_expiry`` (seconds), ``capacity`` and
    ``channel_capacity`` as in Channels; ``deadline`` (seconds, ``None``: none) for
    ``send`` and the group calls; ``sweep_interval`` (seconds between expiry sweeps).

    ``receive`` takes only channels this instance made (``ValueError`` otherwise).
    """

    extensions = ["groups", "flush"]

    def __init__(
        self,
        hosts: list[Any] | None = None,
        prefix: str = "asgi",
        expiry: int = 60,
        group_expiry: int = 86400,
        capacity: int = 100,
        channel_capacity: dict[str, int] | None = None,
        deadline: float | None = None,
        sweep_interval: float = 1.0,
    ) -> None:
        super().__init__(expiry=expiry, capacity=capacity, channel_capacity=channel_capacity)
        host = (hosts or [{"address": "redis://127.0.0.1:6379"}])[0]
        self.host: dict[str, Any] = {"address": host} if isinstance(host, str) else dict(host)
        self.prefix = prefix
        self.group_expiry = group_expiry
        self.deadline = deadline
        self.sweep_interval = float(sweep_interval)
        # This process's Redis channel; the part of a channel name before "!".
        self.process_channel = f"{prefix}.{uuid.uuid4().hex[:12]}"
        self.receive_buffer: dict[str, _Inbox] = {}
        self._clients: dict[asyncio.AbstractEventLoop, Redis] = {}
        self._reader: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()
        self._lost: Exception | None = None
        self._swept_at = time.monotonic()
        self._dropped_full = 0

    # --- Redis connections ------------------------------------------------------------------

    def _client(self) -> Redis:
        """The publishing client of the running loop (a pool per loop, as in channels-redis)."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            for other in [known for known in self._clients if known.is_closed()]:
                del self._clients[other]
            options = dict(self.host)
            address = options.pop("address")
            max_connections = options.pop("max_connections", 200)
            timeout = options.pop("pool_timeout", 10.0)
            pool = BlockingConnectionPool.from_url(address, max_connections=max_connections, timeout=timeout, **options)
            client = self._clients[loop] = Redis(connection_pool=pool)
        return client

    async def _call(self, call: Any) -> Any:
        """Await ``call`` within ``deadline``; report its outcome to the outage tracker."""
        return await within_deadline(call, self.deadline)

    # --- the reader ---------------------------------------------------------------------------

    def _ensure_reader(self) -> None:
        reader = self._reader
        if reader is not None and not reader.done() and not reader.get_loop().is_closed():
            return
        loop = asyncio.get_running_loop()
        self._subscribed = asyncio.Event()
        self._reader = loop.create_task(self._read(), name=f"channel layer reader {self.process_channel}")

    async def _read(self) -> None:
        """Subscribe to this process's channel and hand each message to its inboxes; after
        a lost subscription, fail the waiting receives and subscribe again with back-off."""
        backoff = RETRY_FIRST
        while True:
            client: Redis | None = None
            pubsub: Any = None
            try:
                options = dict(self.host)
                address = options.pop("address")
                for pool_only in ("max_connections", "pool_timeout"):
                    options.pop(pool_only, None)
                pool = ConnectionPool.from_url(address, socket_keepalive=True, **options)
                # The subscription waits for messages for as long as none come: no read timeout
                # (the senders' one, from the host or the URL, is not for it); the heartbeat
                # below finds a dead connection instead.
                pool.connection_kwargs["socket_timeout"] = None
                client = Redis(connection_pool=pool)
                pubsub = client.pubsub()
                async with asyncio.timeout(self.deadline):
                    await pubsub.subscribe(self.process_channel)
                    # The confirmation: messages published from now on reach this process.
                    while await pubsub.get_message(timeout=None) is None:
                        pass
                if self._lost is not None:
                    logger.info("channel layer: subscribed again to %s", self.process_channel)
                self._lost = None
                self._subscribed.set()
                tracker.ok("channel_layer")
                backoff = RETRY_FIRST
                heard = time.monotonic()
                while True:
                    event = await pubsub.get_message(ignore_subscribe_messages=True, timeout=SUBSCRIPTION_HEARTBEAT)
                    if event is None:
                        silent = time.monotonic() - heard
                        if silent >= 2 * SUBSCRIPTION_HEARTBEAT:
                            raise SubscriptionLost(f"no answer from Redis on the subscription for {silent:.0f} s")
                        async with asyncio.timeout(self.deadline):
                            await pubsub.ping()
                        continue
                    heard = time.monotonic()
                    if event.get("type") == "message":
                        self._arrived(event["data"])
            except GeneratorExit:
                # The reader is being garbage-collected with its event loop already gone (a
                # test's loop closed under it): nothing can be awaited to close the client.
                pubsub = client = None
                raise
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError, TimeoutError) as exc:
                lost = exc if isinstance(exc, RedisError) else SubscriptionLost(f"{type(exc).__name__}: {exc}")
                self._subscription_lost(lost)
            except Exception:
                # A bug here must not end the process's deliveries; its traceback once per outage.
                if self._lost is None:
                    logger.exception("channel layer reader failed; subscribing again")
                self._subscription_lost(SubscriptionLost("the channel layer's reader failed"))
            finally:
                try:
                    if pubsub is not None:
                        await asyncio.shield(pubsub.aclose())
                    if client is not None:
                        await asyncio.shield(client.aclose())
                except Exception as exc:  # a connection already gone
                    logger.debug("channel layer: closing the subscription: %s", exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RETRY_MAX)

    def _subscription_lost(self, exc: Exception) -> None:
        tracker.failed("channel_layer", exc)
        self._subscribed.clear()
        self._lost = exc
        for inbox in self.receive_buffer.values():
            for waiter in inbox.waiters:
                _wake(waiter)

    def _arrived(self, payload: bytes) -> None:
        try:
            local_ids, message = msgpack.unpackb(payload, raw=False)
        except Exception as exc:
            logger.warning("channel layer: dropped an unreadable message (%s)", type(exc).__name__)
            return
        now = time.monotonic()
        for local_id in local_ids:
            channel = f"{self.process_channel}!{local_id}"
            inbox = self.receive_buffer.get(channel)
            if inbox is None:
                inbox = self.receive_buffer[channel] = _Inbox()
            if len(inbox.messages) >= self.get_capacity(channel):
                self._dropped_full += 1
                if self._dropped_full == 1:
                    logger.warning("channel layer: %s is full; dropping messages for it", channel)
                continue
            if local_ids[0] != local_id:  # a group's other members get their own copy
                message = msgpack.unpackb(payload, raw=False)[1]
            inbox.messages.append((now, message))
            if inbox.waiters:
                _wake(inbox.waiters[0])
        self._sweep(now)

    def _sweep(self, now: float) -> None:
        if now - self._swept_at < self.sweep_interval:
            return
        self._swept_at = now
        if self._dropped_full > 1:
            logger.warning("channel layer: dropped %d messages for full channels", self._dropped_full)
        self._dropped_full = 0
        oldest = now - self.expiry
        for channel, inbox in list(self.receive_buffer.items()):
            while inbox.messages and inbox.messages[0][0] < oldest:
                inbox.messages.popleft()
            if not inbox.messages and not inbox.waiters:
                del self.receive_buffer[channel]

    # --- Channels' API ------------------------------------------------------------------------

    async def new_channel(self, prefix: str = "specific") -> str:
        """A fresh channel of this process, ``"<process channel>!<prefix>.<random>"``; the
        reader starts (subscribes) with the first one."""
        self._ensure_reader()
        await self._first_subscription()
        return f"{self.process_channel}!{prefix}.{uuid.uuid4().hex[:12]}"

    async def _first_subscription(self) -> None:
        """Wait (up to ``deadline``) until the reader has subscribed once: a reply
        published before that would reach no one. Not during a known outage (``receive``
        raises then) nor from another loop than the reader's."""
        reader = self._reader
        if self._subscribed.is_set() or self._lost is not None or reader is None:
            return
        if reader.get_loop() is not asyncio.get_running_loop():
            return
        try:
            async with asyncio.timeout(self.deadline):
                await self._subscribed.wait()
        except TimeoutError:
            pass

    def _owner(self, channel: str) -> tuple[str, str]:
        self.require_valid_channel_name(channel)
        if "!" not in channel:
            raise ValueError(f"{channel!r} is not a channel of this layer (made by new_channel)")
        owner, local_id = channel.split("!", 1)
        return owner, local_id

    async def send(self, channel: str, message: dict[str, Any]) -> None:
        """Publish ``message`` (a dict with a ``type``; msgpack-serializable, else
        ``TypeError``/``ValueError``) to ``channel``'s process: one PUBLISH.

        Raises ``ChannelFull`` when ``channel`` is this process's and its inbox is full;
        ``redis.exceptions.ConnectionError``/``TimeoutError`` (or ``LayerDeadlineExceeded``
        past ``deadline``) when Redis cannot take it.
        """
        assert isinstance(message, dict), "message is not a dict"
        owner, local_id = self._owner(channel)
        if owner == self.process_channel:
            inbox = self.receive_buffer.get(channel)
            if inbox is not None and len(inbox.messages) >= self.get_capacity(channel):
                raise ChannelFull()
        payload = msgpack.packb([[local_id], message], use_bin_type=True)
        await self._call(self._client().publish(owner, payload))

    async def receive(self, channel: str) -> dict[str, Any]:
        """The next message on ``channel`` (one this process made), waiting for it.

        Raises ``ValueError`` for another process's channel, and :class:`SubscriptionLost`
        (a ``redis.exceptions.ConnectionError``) while the subscription is lost and the
        inbox is empty.
        """
        owner, _ = self._owner(channel)
        if owner != self.process_channel:
            raise ValueError(f"{channel!r} belongs to another process; only its owner receives from it")
        self._ensure_reader()
        inbox = self.receive_buffer.get(channel)
        if inbox is None:
            inbox = self.receive_buffer[channel] = _Inbox()
        while True:
            oldest = time.monotonic() - self.expiry
            while inbox.messages and inbox.messages[0][0] < oldest:
                inbox.messages.popleft()
            if inbox.messages and not inbox.waiters:
                return inbox.get_nowait()
            if self._lost is not None and not inbox.messages:
                # A fresh exception each time: re-raising one instance grows its traceback.
                raise SubscriptionLost(f"the channel layer's subscription is lost: {self._lost}")
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            inbox.waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                inbox.waiters.remove(waiter)
                # Woken, then cancelled: hand the wake-up on, or a message would wait for ever.
                if not waiter.cancelled() and inbox.messages and inbox.waiters:
                    _wake(inbox.waiters[0])
                raise
            inbox.waiters.remove(waiter)
            if self.receive_buffer.get(channel) is not inbox:  # flushed while waiting
                self.receive_buffer.setdefault(channel, inbox)
            if inbox.messages:
                message = inbox.get_nowait()
                if inbox.messages and inbox.waiters:
                    _wake(inbox.waiters[0])
                return message

    # --- groups -------------------------------------------------------------------------------

    def _group_key(self, group: str) -> str:
        return f"{self.prefix}:group:{group}"

    async def group_add(self, group: str, channel: str) -> None:
        """Add ``channel`` to ``group`` (for ``group_expiry`` seconds); one ZADD."""
        self.require_valid_group_name(group)
        self._owner(channel)
        key = self._group_key(group)
        async with self._client().pipeline(transaction=False) as pipe:
            pipe.zadd(key, {channel: time.time()})
            pipe.expire(key, self.group_expiry)
            await self._call(pipe.execute())

    async def group_discard(self, group: str, channel: str) -> None:
        """Remove ``channel`` from ``group``; one ZREM."""
        self.require_valid_group_name(group)
        self._owner(channel)
        await self._call(self._client().zrem(self._group_key(group), channel))

    async def group_send(self, group: str, message: dict[str, Any]) -> None:
        """Send ``message`` to every member of ``group``: one PUBLISH per owning process
        (a full inbox drops it there, silently to the sender, as in Channels)."""
        assert isinstance(message, dict), "message is not a dict"
        self.require_valid_group_name(group)
        key = self._group_key(group)
        client = self._client()

        async def members() -> list[Any]:
            async with client.pipeline(transaction=False) as pipe:
                pipe.zremrangebyscore(key, min=0, max=int(time.time()) - self.group_expiry)
                pipe.zrange(key, 0, -1)
                return list(await pipe.execute())

        found = (await self._call(members()))[1]
        by_owner: dict[str, list[str]] = {}
        for member in found:
            name = member.decode() if isinstance(member, bytes) else str(member)
            owner, _, local_id = name.partition("!")
            by_owner.setdefault(owner, []).append(local_id)
        if not by_owner:
            return
        payloads = {owner: msgpack.packb([ids, message], use_bin_type=True) for owner, ids in by_owner.items()}

        async def publish() -> None:
            async with client.pipeline(transaction=False) as pipe:
                for owner, payload in payloads.items():
                    pipe.publish(owner, payload)
                await pipe.execute()

        await self._call(publish())

    # --- housekeeping -------------------------------------------------------------------------

    async def flush(self) -> None:
        """Forget every local message and delete this prefix's group keys (tests)."""
        self.receive_buffer.clear()
        client = self._client()
        keys = [key async for key in client.scan_iter(match=f"{self.prefix}:group:*")]
        if keys:
            await client.delete(*keys)

    async def close(self) -> None:
        """Stop the reader and close this loop's connections."""
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        self._reader = None
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()
