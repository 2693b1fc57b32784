"""The in-memory channel layer sweeps expired messages once per interval, not per message
(core/channel_layer.py ``InMemoryChannelLayer``), and still never delivers one.

Channels' own layer walks every channel and group member on each ``receive`` and
``group_send``: with n consumers waiting that is O(n) per message (bench B6).
"""

from __future__ import annotations

import asyncio

import pytest
from channels.layers import InMemoryChannelLayer as ChannelsLayer
from django.conf import settings

from core.channel_layer import InMemoryChannelLayer


def test_it_is_the_layer_of_a_process_without_redis() -> None:
    wanted = "RedisChannelLayer" if settings.REDIS_URL else "InMemoryChannelLayer"
    assert settings.CHANNEL_LAYERS["default"]["BACKEND"] == f"core.channel_layer.{wanted}"


async def test_many_receives_sweep_once_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    sweeps: list[int] = []
    original = ChannelsLayer._clean_expired

    def counting(self: ChannelsLayer) -> None:
        sweeps.append(1)
        original(self)

    monkeypatch.setattr(ChannelsLayer, "_clean_expired", counting)
    layer = InMemoryChannelLayer(capacity=1000, sweep_interval=60)
    waiting = [asyncio.ensure_future(layer.receive(f"idle.{n}")) for n in range(200)]
    channel = await layer.new_channel()
    for n in range(100):
        await layer.send(channel, {"type": "t", "n": n})
        assert (await layer.receive(channel))["n"] == n
        await layer.group_send("g", {"type": "t"})
    assert len(sweeps) == 1  # Channels' layer: 200 receives + 100 + 100 walks of 200 channels
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_an_expired_message_is_never_delivered_even_between_sweeps() -> None:
    layer = InMemoryChannelLayer(capacity=100, expiry=0.05, sweep_interval=3600)
    channel = await layer.new_channel()
    await layer.group_add("watchers", channel)
    await layer.send(channel, {"type": "t", "n": "old"})
    await asyncio.sleep(0.1)
    await layer.send(channel, {"type": "t", "n": "new"})
    assert (await layer.receive(channel))["n"] == "new"
    # As in Channels: a channel whose message expired unread leaves its groups.
    assert channel not in layer.groups.get("watchers", {})


async def test_the_sweep_still_frees_other_channels_expired_messages() -> None:
    layer = InMemoryChannelLayer(capacity=100, expiry=0.05, sweep_interval=0.05)
    await layer.send("gone.1", {"type": "t"})
    await asyncio.sleep(0.1)
    other = await layer.new_channel()
    await layer.send(other, {"type": "t", "n": 1})
    assert (await layer.receive(other))["n"] == 1
    assert "gone.1" not in layer.channels


async def test_group_send_reaches_every_member() -> None:
    layer = InMemoryChannelLayer(capacity=100)
    members = [await layer.new_channel() for _ in range(5)]
    for member in members:
        await layer.group_add("g", member)
    await layer.group_send("g", {"type": "t", "n": 7})
    assert [(await layer.receive(member))["n"] for member in members] == [7] * 5
