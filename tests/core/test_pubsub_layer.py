"""The PUBLISH/SUBSCRIBE channel layer (core.pubsub_layer; docs/operating.md#channel-layer).

Two layer instances stand for two processes. They run against the machine's Redis
(database 1, a unique prefix); the restart test starts and kills its own ``redis-server``
on a free port, never the shared one.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from channels.exceptions import ChannelFull
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from core import pubsub_layer
from core.pubsub_layer import PubSubChannelLayer
from tests.backends import free_port, redis_answers, start_redis_server, unavailable
from tests.infra import base_env, eventually

pytestmark = [pytest.mark.redis]

REDIS = "redis://127.0.0.1:6379/1"


def make_layer(url: str = REDIS, *, prefix: str, **config: Any) -> PubSubChannelLayer:
    return PubSubChannelLayer(hosts=[{"address": url}], prefix=prefix, deadline=2.0, **config)


@pytest.fixture
def prefix() -> str:
    if not redis_answers(REDIS):
        unavailable("no Redis on 127.0.0.1:6379")
    return f"test-pubsub-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def two_processes(prefix: str) -> AsyncIterator[tuple[PubSubChannelLayer, PubSubChannelLayer]]:
    a, b = make_layer(prefix=prefix), make_layer(prefix=prefix)
    try:
        yield a, b
    finally:
        await a.flush()
        await a.close()
        await b.close()


def record_commands(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the Redis commands this process sends from now on (single commands
    and pipelines)."""
    sent: list[str] = []
    single = Redis.execute_command

    async def execute_command(self: Redis, *args: Any, **options: Any) -> Any:
        sent.append(str(args[0]).upper())
        return await single(self, *args, **options)

    monkeypatch.setattr(Redis, "execute_command", execute_command)
    from redis.asyncio.client import Pipeline

    batch: Callable[..., Any] = Pipeline.execute

    async def execute(self: Pipeline, *args: Any, **options: Any) -> Any:
        sent.extend(str(command[0][0]).upper() for command in self.command_stack)
        return await batch(self, *args, **options)

    monkeypatch.setattr(Pipeline, "execute", execute)
    return sent


async def test_a_message_to_another_process_is_one_publish(
    two_processes: tuple[PubSubChannelLayer, PubSubChannelLayer], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = two_processes
    channel = await b.new_channel()
    await a.new_channel()  # a's own connections exist before counting
    await a.send(channel, {"type": "warm.up"})
    assert await b.receive(channel) == {"type": "warm.up"}

    sent = record_commands(monkeypatch)
    await a.send(channel, {"type": "call.request", "arguments": {"city": "Oslo"}, "n": 1})
    assert await b.receive(channel) == {"type": "call.request", "arguments": {"city": "Oslo"}, "n": 1}
    assert sent == ["PUBLISH"]


async def test_messages_arrive_in_the_order_they_were_sent(
    two_processes: tuple[PubSubChannelLayer, PubSubChannelLayer],
) -> None:
    a, b = two_processes
    channel = await b.new_channel()
    for n in range(50):
        await a.send(channel, {"type": "tick", "n": n})
    assert [(await b.receive(channel))["n"] for _ in range(50)] == list(range(50))


async def test_a_full_local_channel_refuses_the_send_at_once(prefix: str) -> None:
    layer = make_layer(prefix=prefix, capacity=2)
    try:
        channel = await layer.new_channel()
        await layer.send(channel, {"type": "one"})
        await layer.send(channel, {"type": "two"})
        await eventually(lambda: len(layer.receive_buffer[channel].messages) == 2, timeout=5, what="both arrived")
        with pytest.raises(ChannelFull):
            await layer.send(channel, {"type": "three"})
        assert await layer.receive(channel) == {"type": "one"}
        await layer.send(channel, {"type": "four"})  # room again
        assert await layer.receive(channel) == {"type": "two"}
        assert await layer.receive(channel) == {"type": "four"}
    finally:
        await layer.close()


async def test_the_receiving_process_drops_what_overflows_its_inbox(prefix: str) -> None:
    a, b = make_layer(prefix=prefix), make_layer(prefix=prefix, capacity=3)
    try:
        channel = await b.new_channel()
        fence = await b.new_channel()
        for n in range(5):
            await a.send(channel, {"type": "tick", "n": n})  # a cannot know b's inbox
        await a.send(fence, {"type": "fence"})  # published after the five: they were handled
        assert await b.receive(fence) == {"type": "fence"}
        inbox = b.receive_buffer[channel]
        assert [inbox.get_nowait()["n"] for _ in range(3)] == [0, 1, 2]
        assert inbox.empty()
    finally:
        await a.close()
        await b.close()


async def test_only_the_owning_process_receives_from_a_channel(
    two_processes: tuple[PubSubChannelLayer, PubSubChannelLayer],
) -> None:
    a, b = two_processes
    channel = await b.new_channel()
    with pytest.raises(ValueError, match="another process"):
        await a.receive(channel)
    with pytest.raises(ValueError, match="not a channel of this layer"):
        await a.send("plain-channel", {"type": "x"})


async def test_a_group_send_reaches_every_member_in_both_processes_once(
    two_processes: tuple[PubSubChannelLayer, PubSubChannelLayer], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = two_processes
    a1, a2, b1 = await a.new_channel(), await a.new_channel(), await b.new_channel()
    for layer, channel in ((a, a1), (a, a2), (b, b1)):
        await layer.group_add("room", channel)
    sent = record_commands(monkeypatch)
    await b.group_send("room", {"type": "room.news", "text": "hi"})
    assert sorted(sent).count("PUBLISH") == 2  # one per process, not one per member
    for layer, channel in ((a, a1), (a, a2), (b, b1)):
        assert await layer.receive(channel) == {"type": "room.news", "text": "hi"}

    await a.group_discard("room", a2)
    await a.group_send("room", {"type": "room.news", "text": "again"})
    assert await a.receive(a1) == {"type": "room.news", "text": "again"}
    assert await b.receive(b1) == {"type": "room.news", "text": "again"}
    fence = await a.new_channel()
    await b.send(fence, {"type": "fence"})  # published after the group message
    assert await a.receive(fence) == {"type": "fence"}
    assert a2 not in a.receive_buffer or a.receive_buffer[a2].empty()


async def test_a_receive_cancelled_after_its_wake_up_loses_no_message(
    two_processes: tuple[PubSubChannelLayer, PubSubChannelLayer], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = two_processes
    channel = await b.new_channel()
    first = asyncio.ensure_future(b.receive(channel))
    second = asyncio.ensure_future(b.receive(channel))
    await eventually(
        lambda: channel in b.receive_buffer and len(b.receive_buffer[channel].waiters) == 2,
        timeout=5,
        interval=0.005,
        what="both receives waiting",
    )
    first_waiter = b.receive_buffer[channel].waiters[0]
    wake = pubsub_layer._wake

    def wake_then_cancel(waiter: asyncio.Future[None]) -> None:
        # The message woke the first receive and it is cancelled before it runs: the
        # wake-up is all the second receive gets.
        wake(waiter)
        if waiter is first_waiter:
            first.cancel()

    monkeypatch.setattr(pubsub_layer, "_wake", wake_then_cancel)
    await a.send(channel, {"type": "only"})
    assert await asyncio.wait_for(second, 5) == {"type": "only"}
    assert first.cancelled()


async def test_messages_nobody_receives_are_swept_after_their_expiry(prefix: str) -> None:
    layer = make_layer(prefix=prefix, expiry=1, sweep_interval=0)
    try:
        unread, other = await layer.new_channel(), await layer.new_channel()
        await layer.send(unread, {"type": "stale"})
        await eventually(lambda: unread in layer.receive_buffer, timeout=5, what="arrived")
        await asyncio.sleep(1.1)
        await layer.send(other, {"type": "fresh"})  # an arrival runs the sweep
        await eventually(lambda: unread not in layer.receive_buffer, timeout=5, what="swept")
        assert await layer.receive(other) == {"type": "fresh"}
    finally:
        await layer.close()


def test_settings_pick_the_pubsub_layer_for_redis_unless_told_list(tmp_path: Path) -> None:
    def backend(**env: str) -> str:
        code = "import django; django.setup(); from django.conf import settings; "
        code += "print(settings.CHANNEL_LAYERS['default']['BACKEND'])"
        environment = base_env(REDIS_URL=REDIS, DISPATCH_DATA_DIR=str(tmp_path), **env)
        out = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip().splitlines()[-1]

    # base_env passes on this run's DISPATCH_CHANNEL_LAYER: the default is seen without it.
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("DISPATCH_CHANNEL_LAYER", raising=False)
        assert backend() == "core.pubsub_layer.PubSubChannelLayer"
    assert backend(DISPATCH_CHANNEL_LAYER="list") == "core.channel_layer.RedisChannelLayer"


async def delivered(a: PubSubChannelLayer, b: PubSubChannelLayer, channel: str) -> bool:
    """Whether a message ``a`` sends to ``channel`` of ``b`` arrives within 0.5 s."""
    try:
        await a.send(channel, {"type": "after"})
        return await asyncio.wait_for(b.receive(channel), 0.5) == {"type": "after"}
    except (RedisConnectionError, TimeoutError):
        return False


async def test_the_reader_subscribes_again_after_redis_restarts() -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}"
    redis = start_redis_server(port)
    a, b = make_layer(url, prefix="restart"), make_layer(url, prefix="restart")
    try:
        channel = await b.new_channel()
        await a.send(channel, {"type": "before"})
        assert await b.receive(channel) == {"type": "before"}

        waiting = asyncio.ensure_future(b.receive(channel))
        redis.kill()
        redis.wait(5)
        with pytest.raises(RedisConnectionError):  # the consumers close 1012
            await asyncio.wait_for(waiting, 10)
        with pytest.raises(RedisConnectionError):
            await b.receive(channel)

        redis = start_redis_server(port)

        await eventually(lambda: delivered(a, b, channel), timeout=20, interval=0.2, what="a message after the restart")
    finally:
        await a.close()
        await b.close()
        redis.kill()
        redis.wait(5)


async def test_a_subscription_that_goes_silent_is_found_by_its_heartbeat(monkeypatch: pytest.MonkeyPatch) -> None:
    """A subscription whose connection stops answering without closing (here: its own
    ``redis-server`` frozen with SIGSTOP; in production a NAT dropping the idle flow) is
    PINGed after a quiet heartbeat and counted lost when not even the PONG comes back, so
    the waiting receives fail (their consumers close 1012) instead of hanging for TCP
    keepalive's two hours; it subscribes again once Redis answers."""
    import signal

    import core.pubsub_layer

    monkeypatch.setattr(core.pubsub_layer, "SUBSCRIPTION_HEARTBEAT", 0.5, raising=False)
    port = free_port()
    url = f"redis://127.0.0.1:{port}"
    redis = start_redis_server(port)
    a, b = make_layer(url, prefix="silent"), make_layer(url, prefix="silent")
    try:
        channel = await b.new_channel()
        await a.send(channel, {"type": "before"})
        assert await b.receive(channel) == {"type": "before"}

        waiting = asyncio.ensure_future(b.receive(channel))
        redis.send_signal(signal.SIGSTOP)
        with pytest.raises(RedisConnectionError):
            await asyncio.wait_for(waiting, 10)
        redis.send_signal(signal.SIGCONT)

        await eventually(
            lambda: delivered(a, b, channel), timeout=20, interval=0.2, what="a message after Redis answers again"
        )
    finally:
        redis.send_signal(signal.SIGCONT)
        await a.close()
        await b.close()
        redis.kill()
        redis.wait(5)
