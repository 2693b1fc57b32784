"""How much a websocket's peer has not read yet, so the server stops handing it more.

A peer that stops reading does not stop the server from writing: every frame sent to it
waits in the process's memory (daphne's Twisted transport, then autobahn's queue) until the
peer reads or the socket dies. Dispatch therefore reads that unsent backlog before it hands
a socket more work, against three marks (docs/operating.md#bounds):

- **high-water mark** (``DISPATCH_WS_HIGH_WATER``, bytes): above it, nothing new is given to
  the socket — a remote call to it fails at once as busy, a machine operation as
  ``MACHINE_BUSY``, streamed output and pipes wait at their source
  (``wait_for_room``) until it drains;
- **hard mark** (``DISPATCH_WS_HARD_LIMIT``, bytes) and its **grace**
  (``DISPATCH_WS_HARD_GRACE``, seconds): a socket still above the hard mark that long after
  it first crossed it is closed with 1013 (try again later).

So one connection holds at most about the high-water mark plus one frame plus the small
frames (replies, pings) sent while it stays above it, for at most the grace.

The backlog is read off daphne's objects: the ASGI ``send`` daphne gives an application is
``functools.partial(server.handle_reply, protocol)``, and the protocol's Twisted transport
keeps the bytes not yet written to the kernel (``dataBuffer`` past ``offset``, plus
``_tempDataLen``). Under any other server (Channels' test communicator included) the
backlog is unknown and counts as 0: nothing is refused.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any

POLL_INTERVAL = 0.02  # seconds between two looks at a draining backlog
MAX_WRAPPERS = 8  # middleware wrappers of ``send`` unwrapped to reach daphne's callable


def transport_protocol(send: Callable[..., Any] | None) -> Any | None:
    """daphne's websocket protocol behind an ASGI ``send`` callable, or ``None`` under
    another server.

    Middleware may stand between: Channels' ``SessionMiddleware`` (in
    ``AuthMiddlewareStack``) hands the consumer its own bound ``send``, which forwards to
    the server's callable kept as ``real_send``; such wrappers are unwrapped (a few deep).
    """
    for _ in range(MAX_WRAPPERS):
        if isinstance(send, functools.partial):
            protocol = send.args[0] if send.args else None
            return protocol if hasattr(protocol, "transport") else None
        inner = getattr(getattr(send, "__self__", None), "real_send", None)
        if inner is None or inner is send:
            return None
        send = inner
    return None


def unsent_bytes(protocol: Any | None) -> int:
    """Bytes written to ``protocol``'s socket by the application and not yet handed to the
    kernel (0 when unknown). Walks wrapped transports (TLS over TCP) and autobahn's own
    send queue."""
    if protocol is None:
        return 0
    total = 0
    for queued in getattr(protocol, "send_queue", ()) or ():
        try:
            total += len(queued[0])
        except (TypeError, IndexError):
            continue
    transport = getattr(protocol, "transport", None)
    seen = 0
    while transport is not None and seen < 4:  # TLS wraps TCP: count every layer
        buffer = getattr(transport, "dataBuffer", None)
        if isinstance(buffer, (bytes, bytearray, memoryview)):
            total += max(0, len(buffer) - int(getattr(transport, "offset", 0) or 0))
            total += int(getattr(transport, "_tempDataLen", 0) or 0)
        transport = getattr(transport, "transport", None)
        seen += 1
    return total


class ReadThrottle:
    """Stops reading a socket whose frames arrive faster than its consumer takes them.

    daphne reads every frame a client sends into the connection's input queue at once,
    however far behind the consumer is: a client writing 1 MB frames without pause grew
    that queue by hundreds of MB. ``frame_taken()``, called as the consumer takes each
    frame, pauses the transport's reading once ``limit`` frames wait behind it and resumes
    when at most half of that wait; meanwhile the client's writes wait in its kernel
    buffers (TCP flow control). So a connection holds at most ``limit`` unread frames
    (each at most ``DISPATCH_WS_MAX_MESSAGE_BYTES``). Under another server: nothing.
    """

    def __init__(self, protocol: Any | None, *, limit: int) -> None:
        self.queue = getattr(protocol, "application_queue", None)
        self.transport = getattr(protocol, "transport", None)
        self.limit = limit
        self.paused = False

    def frame_taken(self) -> None:
        """Pause or resume reading after the consumer took a frame (see the class)."""
        if self.queue is None or self.transport is None:
            return
        waiting = self.queue.qsize()
        if not self.paused and waiting >= self.limit:
            self.paused = True
            self.transport.pauseProducing()
        elif self.paused and waiting <= self.limit // 2:
            self.paused = False
            self.transport.resumeProducing()


class SendPressure:
    """The marks of one websocket connection and the time it crossed the hard one.

    ``high_water`` and ``hard_limit`` are bytes, ``grace`` seconds
    (docs/operating.md#bounds). ``backlog()`` is the connection's unsent bytes now.
    """

    def __init__(self, backlog: Callable[[], int], *, high_water: int, hard_limit: int, grace: float) -> None:
        self.backlog = backlog
        self.high_water = high_water
        self.hard_limit = max(hard_limit, high_water)
        self.grace = grace
        self.over_hard_since: float | None = None  # time.monotonic() it crossed the hard mark

    def has_room(self, size: int = 0) -> bool:
        """Whether the socket may be handed a new unit of work of ``size`` bytes: its
        backlog is below the high-water mark (a single frame larger than the mark still
        goes to an idle socket)."""
        backlog = self.backlog()
        return backlog == 0 or backlog + size <= self.high_water

    def over_hard_too_long(self) -> bool:
        """Check after a send: ``True`` once the backlog has stayed above the hard mark for
        longer than the grace (the caller closes with 1013)."""
        if self.backlog() <= self.hard_limit:
            self.over_hard_since = None
            return False
        now = time.monotonic()
        if self.over_hard_since is None:
            self.over_hard_since = now
            return False
        return now - self.over_hard_since > self.grace

    async def wait_for_room(self, timeout: float | None = None) -> None:
        """Wait until the backlog is below the high-water mark.

        Raises ``TimeoutError`` after ``timeout`` seconds (``None``: no limit; the caller's
        own cancellation ends the wait)."""
        if self.has_room():
            return
        async with asyncio.timeout(timeout):
            # Polled: daphne's transport tells no one when it drains (only a Twisted producer
            # registered on it would hear, and that is the protocol's own business).
            while not self.has_room():  # noqa: ASYNC110
                await asyncio.sleep(POLL_INTERVAL)


def release_channel_buffer(layer: Any, channel_name: str, *, again_after: float | None = None) -> int:
    """Drop what the channel layer holds in this process for a channel no one will read
    again (a closed consumer's); return how many messages were dropped now.

    channels-redis moves every message for this process's channels from Redis into a
    per-channel queue in memory (``receive_buffer``, up to the layer's capacity) and never
    empties the queue of a channel whose reader is gone: calls still arriving for a closed
    remote's session (1 MB each) stayed in the process until a restart. Messages already in
    Redis may still arrive after the close, so with ``again_after`` (seconds: the layer's
    ``expiry``, after which Redis has dropped them) the channel is swept again every
    ``SWEEP_INTERVAL`` until then (one sweeper task per process). Other layers have no
    such queue: nothing happens.
    """
    buffers = getattr(layer, "receive_buffer", None)
    if not isinstance(buffers, dict):
        return 0
    dropped = _empty(buffers, channel_name)
    if again_after is not None:
        _CLOSED[channel_name] = (buffers, time.monotonic() + again_after)
        global _sweeper
        loop = asyncio.get_running_loop()
        if _sweeper is None or _sweeper.done() or _sweeper.get_loop() is not loop:
            _sweeper = loop.create_task(_sweep_closed_channels())
    return dropped


SWEEP_INTERVAL = 0.5  # seconds between two sweeps of closed channels' queues
_CLOSED: dict[str, tuple[dict[str, Any], float]] = {}  # channel → (its layer's buffers, sweep until)
_sweeper: asyncio.Task[None] | None = None


def _empty(buffers: dict[str, Any], channel_name: str) -> int:
    # Emptied, not removed: the consumer's own receive may still be waiting on the queue,
    # and channels-redis deletes the entry itself when that receive is cancelled.
    queue = buffers.get(channel_name)
    dropped = 0
    while queue is not None and not queue.empty():
        queue.get_nowait()
        dropped += 1
    return dropped


async def _sweep_closed_channels() -> None:
    """Empty closed channels' queues until their sweep time is over, then forget them."""
    while _CLOSED:
        await asyncio.sleep(SWEEP_INTERVAL)
        now = time.monotonic()
        for channel_name, (buffers, until) in list(_CLOSED.items()):
            _empty(buffers, channel_name)
            if now >= until:
                buffers.pop(channel_name, None)
                del _CLOSED[channel_name]
