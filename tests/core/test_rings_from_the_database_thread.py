"""A ring made on the database thread (``ring_on_commit`` / ``send_on_commit`` in a service
called through ``database_sync_to_async``) is handed to the event loop, which sends it:
the one database thread of the process does not wait for the channel layer. Rings keep
their order, and a queue that cannot drain is bounded (docs/operating.md#channel-layer)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer

from core import realtime
from core.protocol import ChannelMessage
from core.realtime import rings

pytestmark = pytest.mark.django_db(transaction=True)  # database_sync_to_async tidies connections


class Numbered(ChannelMessage):
    type: Literal["test.numbered"] = "test.numbered"
    n: int


@pytest.fixture
def held_layer(monkeypatch: pytest.MonkeyPatch) -> tuple[asyncio.Event, list[tuple[str, int]]]:
    """The layer's sends wait for ``release``; what they sent is listed in order."""
    layer = get_channel_layer()
    release = asyncio.Event()
    sent: list[tuple[str, int]] = []

    async def held(target: str, message: dict[str, Any]) -> None:
        await release.wait()
        sent.append((target, message["n"]))

    monkeypatch.setattr(layer, "group_send", held)
    monkeypatch.setattr(layer, "send", held)
    return release, sent


async def _settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


async def test_the_database_thread_does_not_wait_for_its_rings(held_layer: Any) -> None:
    release, sent = held_layer

    def service() -> str:
        realtime.ring_on_commit("group-a", Numbered(n=1))  # no transaction open: rung at once
        realtime.send_on_commit("specific.elsewhere!1", Numbered(n=2))
        realtime.ring_on_commit("group-a", Numbered(n=3))
        return "done"

    async with asyncio.timeout(5):  # waiting for each send would never end: the layer is held
        assert await database_sync_to_async(service)() == "done"
    assert sent == []
    release.set()
    await _settle()
    assert sent == [("group-a", 1), ("specific.elsewhere!1", 2), ("group-a", 3)]


async def test_rings_past_the_queue_limit_are_dropped_and_logged(
    held_layer: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    release, sent = held_layer
    monkeypatch.setattr(rings, "RING_QUEUE_LIMIT", 2)

    def service(numbers: range) -> None:
        for n in numbers:
            realtime.ring_on_commit("group-b", Numbered(n=n))

    with caplog.at_level(logging.WARNING, logger="core.realtime"):
        await database_sync_to_async(service)(range(1))
        await _settle()  # the sender took ring 0 and waits on the layer
        await database_sync_to_async(service)(range(1, 5))
        await _settle()
    # The sender took the first ring and waits on it; two more wait in the queue.
    assert sum("rings wait already" in record.getMessage() for record in caplog.records) == 2
    release.set()
    await _settle()
    assert sent == [("group-b", 0), ("group-b", 1), ("group-b", 2)]


async def test_a_failed_send_is_logged_and_the_next_ring_still_goes(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = get_channel_layer()
    sent: list[int] = []

    async def flaky(target: str, message: dict[str, Any]) -> None:
        if message["n"] == 1:
            raise RuntimeError("layer hiccup")
        sent.append(message["n"])

    monkeypatch.setattr(layer, "group_send", flaky)

    def service() -> None:
        for n in (1, 2):
            realtime.ring_on_commit("group-c", Numbered(n=n))

    await database_sync_to_async(service)()
    await _settle()
    assert sent == [2]


def test_a_ring_made_under_async_to_sync_is_sent_before_that_call_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command's ``async_to_sync(...)`` runs its own short loop, ended (its tasks
    cancelled) as soon as the call returns: its rings are sent before, not queued."""
    layer = get_channel_layer()
    sent: list[int] = []

    async def slow(target: str, message: dict[str, Any]) -> None:
        await asyncio.sleep(0.05)  # a Redis send takes a few round trips
        sent.append(message["n"])

    monkeypatch.setattr(layer, "group_send", slow)

    def service() -> None:
        realtime.ring_on_commit("group-d", Numbered(n=7))

    async def command() -> None:
        await database_sync_to_async(service)()

    async_to_sync(command)()
    assert sent == [7]
