"""``DispatchConsumer``'s pump: the socket and the channel are read by two long-lived tasks
and their messages handled one at a time, in order per source, without a task per message.

The consumer runs as a bare ASGI application fed from a queue (no test communicator, whose
own waits would make tasks too) on an in-memory channel layer of its own, so every task
made while the messages flow is the consumer's.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from typing import Any, Literal

import pytest
from channels.layers import InMemoryChannelLayer, channel_layers
from redis.exceptions import ConnectionError as RedisConnectionError

from core.consumers import DispatchConsumer, receives
from core.protocol import ChannelMessage

ALIAS = "pump-tests"
MESSAGES = 40  # per source


class PumpNote(ChannelMessage):
    type: Literal["pump.note"] = "pump.note"
    n: int


class Recorder(DispatchConsumer):
    """Records what it handles, and whether two handlers ever ran at once."""

    channel_layer_alias = ALIAS
    instances: list[Recorder] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.handled: list[tuple[str, int]] = []
        self.running = 0
        self.most_at_once = 0
        self.expected = 0
        self.all_handled = asyncio.Event()
        self.cleanups = 0
        self.fail_on: tuple[str, int] | None = None
        Recorder.instances.append(self)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        await self._handle("socket", int(text_data or "0"))

    @receives(PumpNote)
    async def pump_note(self, note: PumpNote) -> None:
        await self._handle("channel", note.n)

    async def _handle(self, source: str, n: int) -> None:
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            for _ in range(3):  # yield: the other source's reader gets its chance to run
                await asyncio.sleep(0)
            if self.fail_on == (source, n):
                raise RuntimeError("handler failed")
            self.handled.append((source, n))
        finally:
            self.running -= 1
        if len(self.handled) >= self.expected:
            self.all_handled.set()

    async def delete_rows(self) -> None:
        self.cleanups += 1


class Layer(InMemoryChannelLayer):
    """Channels' in-memory layer whose ``receive`` fails as Redis going away does when it
    takes a ``pump.redis_lost`` message."""

    async def receive(self, channel: str) -> dict[str, Any]:
        message = await super().receive(channel)
        if message.get("type") == "pump.redis_lost":
            raise RedisConnectionError("Connection closed by server.")
        return message


@pytest.fixture
def layer(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemoryChannelLayer]:
    own = Layer(capacity=1000)
    monkeypatch.setitem(channel_layers.backends, ALIAS, own)
    Recorder.instances = []
    yield own


class Socket:
    """The ASGI side of one websocket: frames in through a queue, what is sent kept."""

    def __init__(self) -> None:
        self.incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.sent: list[dict[str, Any]] = []
        self.incoming.put_nowait({"type": "websocket.connect"})

    async def receive(self) -> dict[str, Any]:
        return await self.incoming.get()

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def frame(self, text: str) -> None:
        self.incoming.put_nowait({"type": "websocket.receive", "text": text})


async def _start(layer: InMemoryChannelLayer) -> tuple[Recorder, Socket, asyncio.Task[None]]:
    socket = Socket()
    app = asyncio.ensure_future(Recorder.as_asgi()({"type": "websocket", "path": "/"}, socket.receive, socket.send))
    async with asyncio.timeout(5):
        while not socket.sent:  # the accept
            await asyncio.sleep(0.01)
    return Recorder.instances[-1], socket, app


async def _feed(consumer: Recorder, socket: Socket, layer: InMemoryChannelLayer) -> None:
    """``MESSAGES`` frames and as many channel messages, interleaved, none awaited."""
    consumer.expected = len(consumer.handled) + 2 * MESSAGES
    for n in range(MESSAGES):
        socket.frame(str(n))
        await layer.send(consumer.channel_name, PumpNote(n=n).for_layer())


async def _disconnect(socket: Socket, app: asyncio.Task[None]) -> None:
    socket.incoming.put_nowait({"type": "websocket.disconnect", "code": 1000})
    async with asyncio.timeout(5):
        await app


async def test_it_handles_socket_and_channel_messages_one_at_a_time_in_order(layer: InMemoryChannelLayer) -> None:
    consumer, socket, app = await _start(layer)
    await _feed(consumer, socket, layer)
    async with asyncio.timeout(10):
        await consumer.all_handled.wait()
    await _disconnect(socket, app)

    assert consumer.most_at_once == 1
    assert [n for source, n in consumer.handled if source == "socket"] == list(range(MESSAGES))
    assert [n for source, n in consumer.handled if source == "channel"] == list(range(MESSAGES))
    # Both sources were read while the other's messages waited: they interleave.
    assert consumer.handled[:MESSAGES] != [("socket", n) for n in range(MESSAGES)]
    assert consumer.cleanups == 1


async def test_it_makes_no_task_per_message(layer: InMemoryChannelLayer) -> None:
    loop = asyncio.get_running_loop()
    made: list[asyncio.Task[Any]] = []

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        made.append(task)
        return task

    consumer, socket, app = await _start(layer)
    loop.set_task_factory(factory)
    try:
        await _feed(consumer, socket, layer)
        async with asyncio.timeout(10):
            await consumer.all_handled.wait()
    finally:
        loop.set_task_factory(None)
    await _disconnect(socket, app)

    assert len(consumer.handled) == 2 * MESSAGES
    assert made == []  # Channels' await_many_dispatch made one for every message


async def test_a_failing_handler_ends_both_readers_and_cleans_up_once(
    layer: InMemoryChannelLayer, caplog: pytest.LogCaptureFixture
) -> None:
    consumer, socket, app = await _start(layer)
    consumer.fail_on = ("channel", 3)
    await _feed(consumer, socket, layer)
    async with asyncio.timeout(5):
        await app  # StopConsumer after the 1011 close: the application ends

    assert consumer.cleanups == 1
    assert socket.sent[-1] == {"type": "websocket.close", "code": 1011}
    assert ("channel", 3) not in consumer.handled
    assert consumer.most_at_once == 1
    # Nothing was handled after the failure, from either source.
    failed_at = len(consumer.handled)
    await asyncio.sleep(0.05)
    assert len(consumer.handled) == failed_at
    gc.collect()
    assert "never retrieved" not in caplog.text


async def test_a_channel_receive_that_fails_ends_the_consumer_after_its_cleanup(
    layer: InMemoryChannelLayer, caplog: pytest.LogCaptureFixture
) -> None:
    consumer, socket, app = await _start(layer)
    await layer.send(consumer.channel_name, {"type": "pump.redis_lost"})
    async with asyncio.timeout(5):
        await app

    assert consumer.cleanups == 1
    assert socket.sent[-1] == {"type": "websocket.close", "code": 1012}
    gc.collect()
    assert "never retrieved" not in caplog.text


async def test_a_server_cancel_stops_both_readers_and_cleans_up_once(layer: InMemoryChannelLayer) -> None:
    consumer, _socket, app = await _start(layer)
    before = {task for task in asyncio.all_tasks() if task is not asyncio.current_task()}
    app.cancel()
    with pytest.raises(asyncio.CancelledError):
        await app

    assert consumer.cleanups == 1
    await asyncio.sleep(0)
    left = {task for task in asyncio.all_tasks() if not task.done()} & before
    assert left == set()
