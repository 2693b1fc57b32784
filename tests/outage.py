"""A channel-layer outage inside one test process: the in-memory layer made to fail the way
channels-redis fails while Redis is down (``redis.exceptions.ConnectionError``).

``LayerOutage(layer)`` wraps the layer's ``receive``, ``send``, ``group_add`` and
``group_discard``. ``start()`` makes every pending and later call raise; ``end()`` makes
them work again. ``fail_only`` limits the outage to some operations (e.g. only
``group_discard``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

OPERATIONS = ("receive", "send", "group_add", "group_discard")


class LayerOutage:
    """Make ``layer`` fail like an unreachable Redis while the outage lasts."""

    def __init__(self, layer: Any, *, fail_only: Iterable[str] = OPERATIONS) -> None:
        self.layer = layer
        self.failing = set(fail_only)
        self.down = asyncio.Event()
        self.failures = 0
        for name in OPERATIONS:
            setattr(layer, name, self._wrap(name, getattr(layer, name)))

    def start(self) -> None:
        self.down.set()

    def end(self) -> None:
        self.down.clear()

    def _error(self) -> RedisConnectionError:
        self.failures += 1
        return RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    def _wrap(self, name: str, original: Any) -> Any:
        if name not in self.failing:
            return original

        if name != "receive":

            async def operation(*args: Any, **kwargs: Any) -> Any:
                if self.down.is_set():
                    raise self._error()
                return await original(*args, **kwargs)

            return operation

        async def receive(channel: str) -> Any:
            if self.down.is_set():
                raise self._error()
            waiting = asyncio.ensure_future(original(channel))
            outage = asyncio.ensure_future(self.down.wait())
            try:
                done, _ = await asyncio.wait({waiting, outage}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (waiting, outage):
                    if not task.done():
                        task.cancel()
            if waiting in done:
                return waiting.result()
            raise self._error()

        return receive
