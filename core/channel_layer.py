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
``redis.exceptions.ConnectionError("No connection available.")``. Everything else is
channels-redis unchanged.

:class:`InMemoryChannelLayer` (the layer without ``DISPATCH_REDIS_URL``) is Channels' own,
except for when it sweeps: Channels walks every channel with a queue and every group
member on *each* ``receive`` and ``group_send``. Each connected consumer waits in a
``receive``, so that walk costs O(connections) per message and O(n²) to open n
connections (bench B6: a third of the event loop at 2,000 idle connections).
"""

from __future__ import annotations

import time
from typing import Any

from channels.layers import InMemoryChannelLayer as _ChannelsInMemoryLayer
from channels_redis.core import RedisChannelLayer as _ChannelsRedisLayer
from redis.asyncio import BlockingConnectionPool


class RedisChannelLayer(_ChannelsRedisLayer):
    """channels-redis' layer; hosts given as ``{"address": url, ...}`` get a blocking pool.

    Extra host keys understood here: ``max_connections`` (int, per process and loop) and
    ``pool_timeout`` (seconds a caller waits for a free connection; ``None`` waits for
    ever). The remaining keys go to each connection, as with channels-redis.
    """

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
    ``redis.exceptions.ConnectionError``.
    """
    import redis
    from django.conf import settings

    return redis.BlockingConnectionPool.from_url(
        url,
        max_connections=settings.REDIS_MAX_CONNECTIONS,
        timeout=settings.REDIS_POOL_TIMEOUT,
        socket_timeout=30,
        socket_connect_timeout=5,
    )
