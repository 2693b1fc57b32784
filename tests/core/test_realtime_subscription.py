"""The one doorbell wait (``core.realtime.Subscription``): one long-lived receive per
channel, never cancelled while the channel lives, and a loop that outlives a layer outage
(channels-redis drops a channel's buffered messages when its receive is cancelled, and its
pub/sub layer unsubscribes the channel).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

import pytest
from channels.layers import get_channel_layer
from redis.exceptions import ConnectionError as RedisConnectionError

from core.protocol import ChannelMessage
from core.realtime import LoopHealth, Subscription, ring
from tests.infra import eventually
from tests.outage import LayerOutage

GROUP = "tests.doorbell"


class Ring(ChannelMessage):
    """The tests' doorbell message."""

    type: Literal["test.ring"] = "test.ring"
    n: int | None = None


class Event(ChannelMessage):
    """The tests' event stream message."""

    type: Literal["user.event"] = "user.event"
    n: int


class CountingLayer:
    """A channel layer that counts what is done to it: receives started, receives
    cancelled, group joins. ``ring(message)`` delivers to the one channel."""

    capacity = 100

    def __init__(self) -> None:
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.receives = 0
        self.cancelled = 0
        self.joins = 0
        self.leaves = 0
        self.down = False

    async def new_channel(self) -> str:
        return "specific.test!one"

    async def group_add(self, group: str, channel: str) -> None:
        if self.down:
            raise RedisConnectionError("Connection refused.")
        self.joins += 1

    async def group_discard(self, group: str, channel: str) -> None:
        self.leaves += 1

    async def receive(self, channel: str) -> dict[str, Any]:
        self.receives += 1
        try:
            return await self.queue.get()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    def ring(self, message: dict[str, Any]) -> None:
        self.queue.put_nowait(message)


def _counting_cancels(layer: Any) -> dict[str, int]:
    """Wrap ``layer.receive`` to count its calls and cancellations."""
    counts = {"receives": 0, "cancelled": 0}
    original = layer.receive

    async def receive(channel: str) -> Any:
        counts["receives"] += 1
        try:
            return await original(channel)
        except asyncio.CancelledError:
            counts["cancelled"] += 1
            raise

    layer.receive = receive
    return counts


async def test_many_short_waits_hold_one_receive_and_cancel_it_only_at_close() -> None:
    layer = CountingLayer()
    bell = Subscription(GROUP, receives=[Ring], health=LoopHealth("test doorbell"), layer=layer)
    await bell.open()
    assert await bell.joined()
    for _ in range(50):
        assert await bell.wait(0.005) is None
    assert (layer.receives, layer.cancelled) == (1, 0)
    layer.ring({"type": "test.ring", "n": 1})
    assert await bell.wait(1) == Ring(n=1)
    for _ in range(10):
        assert await bell.wait(0.005) is None
    assert (layer.receives, layer.cancelled) == (2, 0)  # a new receive only after a message
    await bell.close()
    assert (layer.cancelled, layer.leaves) == (1, 1)  # the one cancel: the end of the channel


async def test_a_ring_while_the_loop_is_busy_is_seen_at_the_next_wait() -> None:
    async with Subscription(GROUP, receives=[Ring], health=LoopHealth("test doorbell")) as bell:
        assert await bell.joined()
        await ring(GROUP, Ring(n=1))
        await asyncio.sleep(0.2)  # busy with a pass, awaiting other things
        await ring(GROUP, Ring(n=2))
        started = asyncio.get_running_loop().time()
        assert await bell.wait(5) == Ring(n=1)
        assert await bell.wait(5) == Ring(n=2)
        assert asyncio.get_running_loop().time() - started < 1.0  # at once, not after a timeout
        assert await bell.wait(0.05) is None


async def test_a_ring_during_a_blocking_pass_is_seen_at_the_next_wait() -> None:
    import time

    async with Subscription(GROUP, receives=[Ring], health=LoopHealth("test doorbell")) as bell:
        assert await bell.joined()
        await ring(GROUP, Ring())
        time.sleep(0.1)  # a pass that never yields: the receiver cannot run meanwhile
        assert await bell.wait(5) == Ring()


async def test_against_the_in_memory_layer_no_receive_is_cancelled_before_close() -> None:
    layer = get_channel_layer()
    counts = _counting_cancels(layer)
    async with Subscription(GROUP, receives=[Ring], health=LoopHealth("test doorbell")) as bell:
        assert await bell.joined()
        seen = []
        for n in range(20):
            if n % 4 == 0:
                await ring(GROUP, Ring(n=n))
            message = await bell.wait(0.01)
            while message is None and n % 4 == 0:
                message = await bell.wait(0.01)
            if message is not None:
                seen.append(message.n)
        assert seen == [0, 4, 8, 12, 16]
        assert counts["cancelled"] == 0
        assert counts["receives"] == 6  # one per message, plus the one pending now
    assert counts["cancelled"] == 1


async def test_a_layer_outage_during_the_wait_does_not_raise_and_the_doorbell_comes_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    layer = get_channel_layer()
    outage = LayerOutage(layer)
    health = LoopHealth("test doorbell", base=0.05, cap=0.1, log=logging.getLogger("tests.doorbell"))
    with caplog.at_level(logging.WARNING, logger="tests.doorbell"):
        async with Subscription(GROUP, receives=[Ring], health=health, rejoin_every=0.2) as bell:
            assert await bell.joined()
            outage.start()  # the pending receive fails, then every join
            for _ in range(10):
                assert await bell.wait(0.05) is None  # no error reaches the loop
            assert outage.failures >= 2  # it kept retrying, with backoff
            assert health.failures >= 2
            outage.end()
            for _ in range(100):  # joined again after the backoff
                if health.failures == 0:
                    break
                await bell.wait(0.02)
            assert health.failures == 0
            await ring(GROUP, Ring())
            assert await bell.wait(2) == Ring()
    warnings = [r.getMessage() for r in caplog.records if r.name == "tests.doorbell"]
    assert len(warnings) == 2, warnings  # once per change of state, not once per retry
    assert warnings[0].startswith("test doorbell failing: ConnectionError")
    assert warnings[1].startswith("test doorbell recovered after")


async def test_a_doorbell_whose_layer_is_down_from_the_start_only_times_out() -> None:
    layer = CountingLayer()
    layer.down = True
    health = LoopHealth("test doorbell", base=0.05, cap=0.05)
    bell = Subscription(GROUP, receives=[Ring], health=health, layer=layer)
    await bell.open()
    assert await bell.joined() is False
    assert await bell.wait(0.2) is None
    assert health.failures >= 2 and layer.receives == 0
    layer.down = False
    layer.ring({"type": "test.ring"})
    assert await bell.wait(2) == Ring()
    await bell.close()


async def test_memberships_are_renewed_without_a_new_receive() -> None:
    layer = CountingLayer()
    bell = Subscription(GROUP, receives=[Ring], health=LoopHealth("test doorbell"), rejoin_every=0.02, layer=layer)
    await bell.open()
    for _ in range(10):
        await bell.wait(0.02)
    await bell.close()
    assert layer.joins >= 4
    assert (layer.receives, layer.cancelled) == (1, 1)


async def test_a_streams_subscription_ends_with_the_layers_error() -> None:
    layer = get_channel_layer()
    outage = LayerOutage(layer)
    live = await Subscription(GROUP, receives=[Event]).open()  # no health: an event stream's
    assert live.channel is not None
    await ring(GROUP, Event(n=1))
    assert await live.wait(2) == Event(n=1)
    outage.start()
    with pytest.raises(RedisConnectionError):
        await live.wait(2)
    outage.end()
    await live.close()


async def test_a_streams_subscription_refuses_to_open_while_the_layer_is_down() -> None:
    LayerOutage(get_channel_layer()).start()
    with pytest.raises(RedisConnectionError):
        await Subscription(GROUP, receives=[Event]).open()


async def test_without_a_channel_layer_the_wait_is_a_sleep(settings: Any) -> None:
    from channels.layers import channel_layers

    settings.CHANNEL_LAYERS = {}
    channel_layers.backends.clear()
    async with Subscription(GROUP, receives=[Ring], health=LoopHealth("test doorbell")) as bell:
        started = asyncio.get_running_loop().time()
        assert await bell.wait(0.1) is None
        assert asyncio.get_running_loop().time() - started >= 0.09
        assert bell.channel is None


async def test_messages_not_taken_are_kept_up_to_the_channel_capacity() -> None:
    layer = CountingLayer()
    layer.capacity = 3
    async with Subscription(GROUP, receives=[Ring], health=LoopHealth("test doorbell"), layer=layer) as bell:
        for n in range(5):
            layer.ring({"type": "test.ring", "n": n})
        # The receiver takes all five while this task is away: the sixth receive has begun.
        await eventually(lambda: layer.receives == 6, timeout=5, interval=0.005, what="five messages taken")
        taken = []
        while (message := await bell.wait(0.05)) is not None:
            taken.append(message.n)
    assert taken == [0, 1, 2]  # the rest dropped, as a full channel drops them


async def test_a_message_of_another_type_or_malformed_is_logged_and_dropped(caplog: pytest.LogCaptureFixture) -> None:
    layer = CountingLayer()
    with caplog.at_level(logging.WARNING, logger="core.realtime"):
        async with Subscription(GROUP, receives=[Ring], health=LoopHealth("test doorbell"), layer=layer) as bell:
            layer.ring({"type": "test.other"})  # a type it does not take
            layer.ring({"type": "test.ring", "n": "many"})  # a field of the wrong type
            layer.ring({"type": "test.ring", "n": 1, "extra": True})  # a field the model does not declare
            layer.ring({"n": 1})  # no type
            layer.ring({"type": "test.ring", "n": 2})
            assert await bell.wait(1) == Ring(n=2)
            assert await bell.wait(0.05) is None
    dropped = [r.getMessage() for r in caplog.records if r.name == "core.realtime"]
    assert len(dropped) == 4, dropped
    assert "dropped a message of type 'test.other': it takes test.ring" in dropped[0]
    assert "dropped a malformed message of type 'test.ring': invalid n" in dropped[1]
    assert "dropped a malformed message of type 'test.ring': invalid extra" in dropped[2]
    assert "dropped a message of type None" in dropped[3]


def test_a_subscription_names_the_messages_it_takes() -> None:
    with pytest.raises(TypeError):
        Subscription(GROUP, receives=[])
