"""Each user's tool-change doorbell, relayed into this process (docs/mcp.md#tool-list-changes).

``core.tool_changes`` rings the channel-layer group ``tools_group(user_id)`` after a
change of the user's remotes or machines commits. While at least one MCP event stream of
the user is open in this process (a ``GET /mcp`` stream or a ``subscriptions/listen``
stream), one relay task holds a channel in that group and publishes each ring as a
``ToolsListChanged`` event on the user's in-process bus, which every open stream of the
user subscribes to. The relay leaves the group when the user's last stream closes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from mcp.server.subscriptions import InMemorySubscriptionBus, ToolsListChanged

from core.protocol import ToolsChangedMessage
from core.realtime import LoopHealth, Subscription
from core.tool_changes import tools_group

logger = logging.getLogger(__name__)

FEED_RETRY_SECONDS = 1.0  # pause after a channel-layer failure before joining again (seconds)
GROUP_REJOIN_SECONDS = 3600.0  # group memberships expire (channels_redis: a day)


class UserFeed:
    """One user's relay in this process: the bus, and the task feeding it while streams are open."""

    def __init__(self, user_id: int) -> None:
        self.user_id = user_id
        self.loop = asyncio.get_running_loop()
        self.bus = InMemorySubscriptionBus()
        self.streams = 0
        self.joined: asyncio.Future[None] = self.loop.create_future()
        self.task: asyncio.Task[None] | None = None

    @asynccontextmanager
    async def held(self) -> AsyncIterator[InMemorySubscriptionBus]:
        """Hold the relay open for one stream; yields the bus once the relay is in the group
        (so a change committed after this returns is not missed)."""
        self.streams += 1
        try:
            if self.task is None or self.task.done():
                self.joined = self.loop.create_future()
                self.task = self.loop.create_task(self._relay())
            await asyncio.shield(self.joined)
            yield self.bus
        finally:
            self.streams -= 1
            if self.streams == 0:
                if _feeds.get(self.user_id) is self:
                    del _feeds[self.user_id]
                if self.task is not None:
                    self.task.cancel()

    async def _relay(self) -> None:
        # One subscription for the relay's life (core.realtime: one receive, never
        # cancelled before the end); a layer outage is logged once, retried every
        # FEED_RETRY_SECONDS, and the streams are served meanwhile (events may come once
        # the layer is back).
        changes = Subscription(
            tools_group(self.user_id),
            receives=[ToolsChangedMessage],
            health=LoopHealth(
                f"the tool-change relay of user {self.user_id}",
                metric_name="tool-change relay",
                base=FEED_RETRY_SECONDS,
                cap=FEED_RETRY_SECONDS,
                log=logger,
            ),
            rejoin_every=GROUP_REJOIN_SECONDS,
        )
        try:
            await changes.open()
            await changes.joined()
            if not self.joined.done():
                self.joined.set_result(None)
            while True:
                message = await changes.wait(None)
                if isinstance(message, ToolsChangedMessage):
                    await self.bus.publish(ToolsListChanged())
        finally:
            await asyncio.shield(changes.close())


_feeds: dict[int, UserFeed] = {}


def user_feed(user_id: int) -> UserFeed:
    """The relay of ``user_id`` on the running event loop (made on first use)."""
    loop = asyncio.get_running_loop()
    feed = _feeds.get(user_id)
    if feed is None or feed.loop is not loop:
        feed = _feeds[user_id] = UserFeed(user_id)
    return feed
