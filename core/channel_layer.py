"""The Redis channel layer with a bounded, *waiting* connection pool.

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
"""

from __future__ import annotations

from typing import Any

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
