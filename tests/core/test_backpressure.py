"""core.backpressure: reading a websocket's unsent backlog off daphne's objects, the marks,
and the channel-layer queue of a closed consumer (docs/operating.md#bounds).

That the backlog is the real one under a real ``serve`` is shown in
tests/integration/test_memory_ws.py."""

from __future__ import annotations

import asyncio
import functools
from types import SimpleNamespace
from typing import Any

from channels.sessions import InstanceSessionWrapper

from core.backpressure import (
    ReadThrottle,
    SendPressure,
    release_channel_buffer,
    transport_protocol,
    unsent_bytes,
)
from tests.infra import eventually


class FakeProtocol:
    """daphne's WebSocketProtocol as far as the backlog goes: a Twisted transport."""

    def __init__(self, buffered: bytes = b"", offset: int = 0, temp: int = 0) -> None:
        self.transport = SimpleNamespace(dataBuffer=buffered, offset=offset, _tempDataLen=temp, transport=None)
        self.send_queue: list[tuple[bytes, bool]] = []


async def handle_reply(protocol: Any, message: dict[str, Any]) -> None:
    """daphne's ``Server.handle_reply`` (its ASGI send is a partial of it)."""


def test_the_protocol_is_found_behind_the_session_middleware(settings):
    protocol = FakeProtocol()
    daphne_send = functools.partial(handle_reply, protocol)
    wrapper = InstanceSessionWrapper({"type": "websocket", "cookies": {}}, daphne_send)
    # What AuthMiddlewareStack hands the consumer: the wrapper's bound send.
    assert transport_protocol(wrapper.send) is protocol
    assert transport_protocol(daphne_send) is protocol


def test_another_server_has_no_backlog():
    async def plain_send(message: dict[str, Any]) -> None:
        pass

    assert transport_protocol(plain_send) is None
    assert transport_protocol(None) is None
    assert unsent_bytes(None) == 0


def test_the_backlog_counts_the_transport_buffers_and_autobahns_queue():
    protocol = FakeProtocol(buffered=b"x" * 1000, offset=200, temp=50)
    protocol.send_queue.append((b"y" * 30, False))
    assert unsent_bytes(protocol) == 800 + 50 + 30


def test_room_ends_at_the_high_water_mark_but_an_idle_socket_takes_a_big_frame():
    backlog = [0]
    pressure = SendPressure(lambda: backlog[0], high_water=100, hard_limit=200, grace=10)
    assert pressure.has_room(1000)  # idle: one frame over the mark still goes
    backlog[0] = 60
    assert pressure.has_room(40)
    assert not pressure.has_room(41)


def test_over_the_hard_mark_counts_from_the_first_check_and_resets_below_it(monkeypatch):
    backlog = [500]
    now = [100.0]
    monkeypatch.setattr("core.backpressure.time.monotonic", lambda: now[0])
    pressure = SendPressure(lambda: backlog[0], high_water=100, hard_limit=200, grace=10)
    assert not pressure.over_hard_too_long()
    assert pressure.over_hard_since == 100.0
    now[0] = 110.0
    assert not pressure.over_hard_too_long()  # exactly the grace: not yet
    now[0] = 110.5
    assert pressure.over_hard_too_long()
    backlog[0] = 150
    assert not pressure.over_hard_too_long()
    assert pressure.over_hard_since is None


async def test_a_closed_consumers_buffered_messages_are_dropped_now_and_after_the_expiry(monkeypatch):
    monkeypatch.setattr("core.backpressure.SWEEP_INTERVAL", 0.02)  # read by the sweeper before each pass
    buffers: dict[str, asyncio.Queue[dict[str, Any]]] = {"specific.a!b": asyncio.Queue()}
    for index in range(3):
        buffers["specific.a!b"].put_nowait({"type": "remote.call", "index": index})
    layer = SimpleNamespace(receive_buffer=buffers)
    assert release_channel_buffer(layer, "specific.a!b", again_after=0.1) == 3
    assert buffers["specific.a!b"].empty()  # emptied, the entry left to its receiver
    # A message that was still in Redis arrives after the close: the next sweep drops it...
    buffers["specific.a!b"].put_nowait({"type": "remote.call", "index": 3})
    # ...and the entry goes once the layer's expiry has passed.
    await eventually(lambda: "specific.a!b" not in buffers, timeout=5, interval=0.01, what="the sweeper's last pass")


def test_a_layer_without_buffers_is_left_alone():
    assert release_channel_buffer(SimpleNamespace(), "x") == 0


def test_reading_pauses_while_too_many_frames_wait_and_resumes_at_half():
    calls: list[str] = []
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    transport = SimpleNamespace(
        pauseProducing=lambda: calls.append("pause"), resumeProducing=lambda: calls.append("resume")
    )
    throttle = ReadThrottle(SimpleNamespace(application_queue=queue, transport=transport), limit=4)
    for _ in range(4):
        queue.put_nowait({"type": "websocket.receive"})
    throttle.frame_taken()
    assert calls == ["pause"]
    queue.get_nowait()
    throttle.frame_taken()  # 3 still wait: still paused
    assert calls == ["pause"]
    queue.get_nowait()
    throttle.frame_taken()  # 2 = half
    assert calls == ["pause", "resume"]
    ReadThrottle(None, limit=4).frame_taken()  # another server: nothing to do
