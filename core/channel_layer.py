"""Dispatch's channel layers: Redis with a bounded, *waiting* connection pool, and the
in-memory layer of a single process with a sweep that does not grow with the connections.

channels-redis builds a plain ``redis.asyncio.ConnectionPool`` per host and event loop.
Since redis-py 8 that pool holds at most 100 connections and *raises*
``MaxConnectionsError("Too many connections")`` when a 101st send needs one — so a
process with a few hundred remote calls or broadcasts in flight at once lost some of
them (found by CI: 200 concurrent calls to one serving session on Redis).

:class:`RedisChannelLayer` gives each pool a ``redis.asyncio.BlockingConnectionPool``
instead: at most ``DISPATCH_REDIS_MAX_CONNECTIONS`` connections per process and event
loop (default 200), and a send that finds them all busy *waits* for one for up to
``DISPATCH_REDIS_POOL_TIMEOUT`` seconds (default 10) before failing with
``redis.exceptions.ConnectionError("No connection available.")``.

It also gives the calls a request waits on — ``send``, ``group_send``, ``group_add``,
``group_discard`` — a deadline, ``DISPATCH_DEPENDENCY_TIMEOUT`` seconds (default 2): a
frozen Redis (SIGSTOP, a paused VM) still accepts connections and never answers, so
without it a call waited for the connections' 30 s socket timeout (which the layer's own
blocking ``receive`` needs, so it stays). A call past its deadline raises
:class:`LayerDeadlineExceeded`, a ``redis.exceptions.TimeoutError`` the edges answer
503 ``TEMPORARILY_UNAVAILABLE`` ("the channel layer (Redis) did not answer within 2s").
Each call's outcome is reported to ``core.outage.tracker`` (one WARNING per outage).
Everything else is channels-redis unchanged.

:class:`InMemoryChannelLayer` (the layer without ``DISPATCH_REDIS_URL``) is Channels' own,
except for when it sweeps: Channels walks every channel with a queue and every group
member on *each* ``receive`` and ``group_send``. Each connected consumer waits in a
``receive``, so that walk costs O(connections) per message and O(n²) to open n
connections (bench B6: a third of the event loop at 2,000 idle connections).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from channels.layers import InMemoryChannelLayer as _ChannelsInMemoryLayer
from channels_redis.core import RedisChannelLayer as _ChannelsRedisLayer
from redis.asyncio import BlockingConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from core.errors import ChannelLayerTimeout, dependency_timed_out
from core.outage import tracker

Result = TypeVar("Result")


class LayerDeadlineExceeded(ChannelLayerTimeout, RedisTimeoutError):
    """A channel-layer call that got no answer within its deadline (``seconds``)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(dependency_timed_out("channel_layer", seconds))
        self.seconds = seconds


async def within_deadline(call: Awaitable[Result], deadline: float | None) -> Result:
    """Await ``call`` for at most ``deadline`` seconds (``None``: no limit) and report its
    outcome to ``core.outage.tracker`` as the channel layer's. Raises
    :class:`LayerDeadlineExceeded` past the deadline, and what the call raises (a Redis
    ``ConnectionError`` or ``TimeoutError`` is reported first)."""
    try:
        async with asyncio.timeout(deadline):
            result = await call
    except TimeoutError as exc:
        if isinstance(exc, RedisTimeoutError):  # the socket's own timeout
            tracker.failed("channel_layer", exc)
            raise
        assert deadline is not None
        late = LayerDeadlineExceeded(deadline)
        tracker.failed("channel_layer", late)
        raise late from None
    except (RedisConnectionError, RedisTimeoutError) as exc:
        tracker.failed("channel_layer", exc)
        raise
    tracker.ok("channel_layer")
    return result


class RedisChannelLayer(_ChannelsRedisLayer):
    """channels-redis' layer; hosts given as ``{"address": url, ...}`` get a blocking pool,
    and the calls a request waits on get a deadline.

    ``deadline``: seconds ``send``, ``group_send``, ``group_add`` and ``group_discard`` may
    take (``None``: no deadline), then :class:`LayerDeadlineExceeded`. Extra host keys
    understood here: ``max_connections`` (int, per process and loop) and ``pool_timeout``
    (seconds a caller waits for a free connection; ``None`` waits for ever). The remaining
    keys go to each connection, as with channels-redis.
    """

    def __init__(self, *args: Any, deadline: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deadline = deadline

    async def _within_deadline(self, call: Awaitable[Result]) -> Result:
        return await within_deadline(call, self.deadline)

    async def receive(self, channel: str) -> dict[str, Any]:
        """channels-redis' ``receive`` (no deadline: it blocks by design); its outcome is
        reported to ``core.outage.tracker`` (a consumer's socket closes on its failure)."""
        try:
            message: dict[str, Any] = await super().receive(channel)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            tracker.failed("channel_layer", exc)
            raise
        tracker.ok("channel_layer")
        return message

    async def send(self, channel: str, message: dict[str, Any]) -> None:
        """channels-redis' ``send`` within ``deadline``."""
        await self._within_deadline(super().send(channel, message))

    async def group_send(self, group: str, message: dict[str, Any]) -> None:
        """channels-redis' ``group_send`` within ``deadline``."""
        await self._within_deadline(super().group_send(group, message))

    async def group_add(self, group: str, channel: str) -> None:
        """channels-redis' ``group_add`` within ``deadline``."""
        await self._within_deadline(super().group_add(group, channel))

    async def group_discard(self, group: str, channel: str) -> None:
        """channels-redis' ``group_discard`` within ``deadline``."""
        await self._within_deadline(super().group_discard(group, channel))

    def create_pool(self, index: int) -> Any:
        host = dict(self.hosts[index])
        if "address" not in host:  # sentinel or keyword hosts: channels-redis as is
            return super().create_pool(index)
        address = host.pop("address")
        max_connections = host.pop("max_connections", 200)
        timeout = host.pop("pool_timeout", 10.0)
        return BlockingConnectionPool.from_url(address, max_connections=max_connections, timeout=timeout, **host)


class InMemoryChannelLayer(_ChannelsInMemoryLayer):
    """Channels' in-memory layer with its expiry sweep run at most once per ``sweep_interval``
    seconds (CONFIG key, default 1.0) instead of on every ``receive`` and ``group_send``.

    Delivery is unchanged: ``receive(channel)`` first drops *that* channel's expired
    messages (older than ``expiry`` seconds, removing the channel from its groups as
    Channels does), so an expired message is never delivered. Only the freeing of other
    channels' expired messages and of group memberships older than ``group_expiry`` may
    come up to ``sweep_interval`` seconds later.
    """

    def __init__(self, sweep_interval: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sweep_interval = float(sweep_interval)
        self._swept_at = float("-inf")

    def _clean_expired(self) -> None:
        now = time.monotonic()
        if now - self._swept_at < self.sweep_interval:
            return
        self._swept_at = now
        super()._clean_expired()

    def _drop_expired(self, channel: str) -> None:
        queue = self.channels.get(channel)
        if queue is None:
            return
        now = time.time()
        while not queue.empty() and queue._queue[0][0] < now:
            queue.get_nowait()
            self._remove_from_groups(channel)

    async def receive(self, channel: str) -> dict[str, Any]:
        """The first message on ``channel`` that has not expired (Channels' ``receive``)."""
        self.require_valid_channel_name(channel)
        self._drop_expired(channel)
        message: dict[str, Any] = await super().receive(channel)
        return message


def sync_redis_pool(url: str) -> Any:
    """A synchronous ``redis.BlockingConnectionPool`` for ``url`` with the same bounds.

    For the router's default-machine cache and the password/device-code rate limiter:
    at most ``settings.REDIS_MAX_CONNECTIONS`` connections, a caller waits up to
    ``settings.REDIS_POOL_TIMEOUT`` seconds for one, then gets
    ``redis.exceptions.ConnectionError``. Connecting and each command's answer get
    ``settings.DEPENDENCY_TIMEOUT`` seconds, then ``redis.exceptions.TimeoutError`` (these
    calls run on the process's one shared database thread: a frozen Redis must not hold it
    up for longer; none of them blocks on the server side).
    """
    import redis
    from django.conf import settings

    return redis.BlockingConnectionPool.from_url(
        url,
        max_connections=settings.REDIS_MAX_CONNECTIONS,
        timeout=settings.REDIS_POOL_TIMEOUT,
        socket_timeout=settings.DEPENDENCY_TIMEOUT,
        socket_connect_timeout=settings.DEPENDENCY_TIMEOUT,
    )
