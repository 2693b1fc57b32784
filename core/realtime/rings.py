"""Rings and sends: ``ring_on_commit`` / ``send_on_commit`` once the transaction commits,
``ring`` from async code, ``layer_send`` now (docs/architecture.md#how-the-code-is-written).

A ring made on the database thread of ``database_sync_to_async`` is handed to its event
loop (``_RingQueue``) rather than waited for, so that thread is not held for a layer round
trip. A failed ring is logged, never raised; ``layer_send`` raises what the layer raises.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import weakref
from collections import deque
from typing import Any

from asgiref.sync import AsyncToSync, SyncToAsync, async_to_sync
from channels.exceptions import ChannelFull
from channels.layers import get_channel_layer
from django.db import transaction

from core import outage
from core.errors import database_unavailable
from core.protocol import ChannelMessage
from core.realtime.local import LOCAL_REPLY_PREFIX, _put_local, _running_loop
from core.realtime.loop_health import _outage

logger = logging.getLogger("core.realtime")  # the package's one logger, as before its split into modules

PEERS_MIRROR_GROUP = "peers.mirror"
"""The mirroring loop's doorbell (``peers.mirror``), rung by ``peers.services.pairing`` (below it)
after a link changes (``peers.protocol.MirrorRescanMessage``, ``MirrorResnapshotMessage``)."""


def _ring_failed(target: str, message: ChannelMessage, exc: Exception) -> None:
    kind = message.type
    if isinstance(exc, ChannelFull):
        logger.warning("ring %s to %s dropped: channel full", kind, target)
    elif _outage(exc):
        # One WARNING per outage (core.outage), not one per ring: listeners poll anyway.
        outage.tracker.failed("database" if database_unavailable(exc) else "channel_layer", exc)
        logger.debug("ring %s to %s dropped: %s: %s", kind, target, type(exc).__name__, str(exc)[:300])
    else:
        logger.exception("ring %s to %s failed", kind, target)


async def ring(group: str, message: ChannelMessage) -> None:
    """Send ``message`` to ``group`` now, from async code outside a transaction. Never
    raises: a failure (a value with no JSON form included) is logged (the layer is
    at-most-once, so listeners poll anyway)."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        await layer.group_send(group, message.for_layer())
    except Exception as exc:
        _ring_failed(group, message, exc)


RING_QUEUE_LIMIT = 10_000  # rings waiting for the event loop, per process; more are dropped (logged)


class _RingQueue:
    """Rings made by sync code that runs for an event loop (the database thread of
    ``database_sync_to_async``): the thread hands each one over and goes on, and one task
    of that loop sends them, in the order they were made (among themselves: a message the
    caller sends after the service returned may arrive first). Waiting for each send (as
    ``async_to_sync`` does) held the one database thread of the process for a layer round
    trip per ring. Lives on its loop; ``put`` is called there (``call_soon_threadsafe``)."""

    def __init__(self) -> None:
        self.waiting: deque[tuple[str, ChannelMessage, dict[str, Any], bool]] = deque()
        self.sender: asyncio.Task[None] | None = None

    def put(self, ring: tuple[str, ChannelMessage, dict[str, Any], bool]) -> None:
        if len(self.waiting) >= RING_QUEUE_LIMIT:
            logger.warning("ring %s to %s dropped: %d rings wait already", ring[1].type, ring[0], RING_QUEUE_LIMIT)
            return
        self.waiting.append(ring)
        if self.sender is None:
            self.sender = asyncio.get_running_loop().create_task(self._send_all())

    async def _send_all(self) -> None:
        layer = get_channel_layer()
        try:
            while self.waiting:
                target, message, payload, group = self.waiting.popleft()
                try:
                    await (layer.group_send if group else layer.send)(target, payload)
                except Exception as exc:
                    _ring_failed(target, message, exc)
        except asyncio.CancelledError:
            if self.waiting:  # the loop is stopping: what waits is lost, as on a dead layer
                logger.warning("%d ring(s) not sent: the event loop stopped", len(self.waiting))
                self.waiting.clear()
            raise
        finally:
            self.sender = None


# One queue per event loop, dropped with its loop; loops of several threads may register.
_ring_queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _RingQueue] = weakref.WeakKeyDictionary()
_ring_queues_lock = threading.Lock()


def _ring_queue_put(ring: tuple[str, ChannelMessage, dict[str, Any], bool]) -> None:
    loop = asyncio.get_running_loop()
    with _ring_queues_lock:
        queue = _ring_queues.get(loop)
        if queue is None:
            queue = _ring_queues[loop] = _RingQueue()
    queue.put(ring)


def _loop_this_thread_works_for() -> asyncio.AbstractEventLoop | None:
    """The event loop whose ``sync_to_async`` call runs on this thread (asgiref records
    it), when that loop still runs and outlives the call: ``None`` in plain sync code (a
    command, a sync test) and for the short-lived loop of an ``async_to_sync`` call, which
    would cancel a ring still waiting when it ends."""
    loop = getattr(SyncToAsync.threadlocal, "main_event_loop", None)
    if loop is None or getattr(SyncToAsync.threadlocal, "main_event_loop_pid", None) != os.getpid():
        return None
    if loop.is_closed() or not loop.is_running() or _running_loop() is loop:
        return None
    if loop in getattr(AsyncToSync, "loop_thread_executors", {}):
        return None
    return loop


def _ring_now(target: str, message: ChannelMessage, *, group: bool) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        payload = message.for_layer()
        # A consumer of this process gets it in memory, behind what this process sent it
        # before (``_put_local``); from this thread the hand-over is thread-safe.
        if not group and _put_local(layer, target, payload):
            return
        loop = _loop_this_thread_works_for()
        if loop is not None:
            # Sent by the loop; this thread does not wait (a failure is logged there).
            loop.call_soon_threadsafe(_ring_queue_put, (target, message, payload, group))
            return
        async_to_sync(layer.group_send if group else layer.send)(target, payload)
    except Exception as exc:
        _ring_failed(target, message, exc)


def ring_on_commit(group: str, message: ChannelMessage) -> None:
    """Send ``message`` to ``group`` once the current transaction commits — at once when
    none is open, never when it rolls back: a ring announces a write that happened
    (docs/architecture.md#how-the-code-is-written).

    Sync code only (it uses ``async_to_sync``). Never raises: a full channel or an
    unreachable layer is logged, and the committed rows stay the truth.
    """
    transaction.on_commit(lambda: _ring_now(group, message, group=True))


def send_on_commit(channel_name: str, message: ChannelMessage) -> None:
    """``ring_on_commit`` for one channel rather than a group: tell one consumer (a served
    remote disconnected, a machine revoked) once the current transaction commits. Never
    raises; sync code only."""
    transaction.on_commit(lambda: _ring_now(channel_name, message, group=False))


async def layer_send(channel_name: str, message: ChannelMessage) -> None:
    """Send ``message`` to one channel now, from async code: an answer on a reply channel
    (the consumers' replies to ``request_reply``), a takeover, a shutdown, a revocation.

    Raises what the layer raises — ``ChannelFull``; a Redis ``ConnectionError`` while it is
    unreachable — and ``TypeError``/``ValueError`` when the message cannot be serialized
    (``ChannelMessage.for_layer``, or msgpack: a lone surrogate); the caller decides, as
    each sender has its own answer to a full channel.

    A message to a consumer of this process, or a reply to a ``request_reply`` of this
    process waiting on a local reply inbox (``LocalChannel``), is handed over without the
    layer, after the same serialization check the layer would make (``ChannelFull`` when
    that inbox is full). A reply to a same-process request whose caller stopped waiting is
    dropped (logged at DEBUG), as the layer drops what nobody reads."""
    layer = get_channel_layer()
    payload = message.for_layer()
    if _put_local(layer, channel_name, payload):
        return
    if channel_name.startswith(LOCAL_REPLY_PREFIX):
        logger.debug("dropped a %s to %s: its caller no longer waits", message.type, channel_name)
        return
    await layer.send(channel_name, payload)
