"""The channel layer, one way for each job (docs/architecture.md#how-the-code-is-written).

The layer is a doorbell, never the only copy of anything (the rows are the truth), and
this module is the only one that sends on it, calls ``group_send`` or ``receive``.
Every message is a typed model (``core.protocol.ChannelMessage``; each app's own in its
``protocol.py``): the functions here take the model, never a dict, and turn it into the
plain dict the layer carries (``ChannelMessage.for_layer``) right before sending; what
arrives is validated with its model, and a message that does not fit is logged and
dropped (``message_received``), never raised into a loop or a consumer.

- **Rings after commit** — ``ring_on_commit(group, message)`` sends ``message`` to
  ``group`` once the current transaction commits (at once outside one), ``send_on_commit``
  to one channel; ``ring`` sends to a group from async code. A ring that fails (a full
  channel, Redis down) is logged, never raised: the change has happened, and whoever
  listens polls anyway. Each doorbell's group name lives in the module that owns it
  (``core.revocation.DOORBELL_GROUP``, ``core.tool_changes.tools_group``,
  ``agents.messages.doorbell_group``, ``agents.services.user_events_group``,
  ``peers.services.outbox.DOORBELL_GROUP``); the one a lower module rings for a higher one is here
  (``PEERS_MIRROR_GROUP``: pairing rings the mirroring loop).
- **Sending now** — ``layer_send(channel, message)``, from async code, raising what the
  layer raises (``ChannelFull``; a message it cannot serialize): a consumer's answer on a
  reply channel, a takeover, a shutdown, a revocation.
- **Listening** — a ``Subscription`` is one channel of this process in some groups, read
  by **one long-lived receive task** that hands each message to ``wait(timeout)``. A
  channel-layer ``receive`` is never cancelled while the channel lives: channels-redis
  drops the messages buffered for a channel whose receive is cancelled, and its pub/sub
  layer unsubscribes the channel. The only cancel is ``close()``, at the end of the
  channel's life. A background loop's doorbell (with a ``LoopHealth``) survives layer
  outages: the receiver reports them, backs off and joins its groups again, while the
  loop's ``wait`` just times out — the loop's periodic pass is the guarantee. An event
  stream's subscription (no ``LoopHealth``) ends instead: ``wait`` raises the layer's
  error and the client reconnects to a fresh snapshot.
- **Request/reply** — ``request_reply`` sends a request (a ``ChannelRequest``) carrying a
  fresh ``reply_channel`` and waits, bounded, for the one answer, validated as the
  caller's reply model (the consumer answers with ``layer_send(reply_channel, <reply>)``),
  re-checking the answerer's liveness while it waits; used by remote calls
  (docs/ws-protocol.md#remote-call) and machine operations (docs/shim-protocol.md#operations).
  ``layer_request`` is its short form for probes (is a name's holder still there?), ``layer_round_trip``
  the ``/healthz`` check of the layer.
- **Same process** — a message to a consumer of this process skips the layer: each
  consumer's channel has a ``LocalChannel`` inbox beside it (``consumer_channel``);
  ``request_reply`` (from the consumer's event loop), ``layer_send`` and
  ``send_on_commit`` put their message there, and a same-process ``request_reply`` waits
  on a local reply inbox, which ``layer_send`` fills. Same capacity (``ChannelFull``:
  busy), same serialization refusals, each message the receiver's own dict, one path so
  one sender's messages keep their order; a consumer that ends closes its inbox and what
  waited there is dropped, as on a dead channel (docs/operating.md#channel-layer).
  Groups and ``layer_round_trip`` (a ``Subscription``, not a consumer) stay on the layer.
- ``LoopHealth``: how a background loop is doing — its backoff after errors and its
  once-per-change-of-state log (docs/operating.md#health).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import random
import threading
import uuid
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
from asgiref.sync import AsyncToSync, SyncToAsync, async_to_sync
from channels.exceptions import ChannelFull
from channels.layers import InMemoryChannelLayer, get_channel_layer
from django.conf import settings
from django.db import transaction
from pydantic import ValidationError

from core import metrics, outage
from core.errors import DispatchError, channel_layer_unavailable, database_unavailable
from core.protocol import ChannelMessage, ChannelRequest, HealthProbeMessage
from core.validation import describe_validation_error

logger = logging.getLogger(__name__)

BACKOFF_JITTER = 0.2  # ± this fraction of a backoff delay, drawn at random
LEAVE_TIMEOUT = 5.0  # seconds ``Subscription.close`` waits to leave its groups
PEERS_MIRROR_GROUP = "peers.mirror"
"""The mirroring loop's doorbell (``peers.mirror``), rung by ``peers.services.pairing`` (below it)
after a link changes (``peers.protocol.MirrorRescanMessage``, ``MirrorResnapshotMessage``)."""

Message = TypeVar("Message", bound=ChannelMessage)
Reply = TypeVar("Reply", bound=ChannelMessage)


def _outage(exc: BaseException) -> bool:
    return channel_layer_unavailable(exc) or database_unavailable(exc)


# --- loop health -------------------------------------------------------------------------------


class LoopHealth:
    """How one background loop is doing: the delay after an error, and its log.

    Every background loop reports each pass: ``ok()`` after one that worked, ``failed(exc)``
    after one that raised, which returns the seconds to wait before the next pass: ``base``
    × 2^(failures − 1), capped at ``cap``, ±20 % jitter (so a loop whose Redis or database
    is down neither spins nor retries in step with every other process). It logs one line
    per change of state — the first failure, with its error (and the traceback when it is
    not an outage), and "recovered" when a pass works again — never one per pass
    (docs/operating.md#health). Each failure is also counted in
    ``dispatch_background_loop_errors_total{loop=metric_name}`` (default: ``name``; give a
    fixed ``metric_name`` when ``name`` carries an id).
    """

    def __init__(
        self,
        name: str,
        *,
        base: float = 1.0,
        cap: float = 30.0,
        log: logging.Logger | None = None,
        rand: Callable[[], float] = random.random,
        metric_name: str | None = None,
    ) -> None:
        self.name = name
        self.metric_name = metric_name or name
        self.base = base
        self.cap = max(cap, base)
        self.log = log or logger
        self.rand = rand
        self.failures = 0  # consecutive failed passes

    def failed(self, exc: BaseException) -> float:
        """Record a failed pass; return the seconds to wait before the next one."""
        self.failures += 1
        metrics.loop_error_counted(self.metric_name)
        delay = min(self.cap, self.base * 2 ** min(self.failures - 1, 30))
        delay *= 1 - BACKOFF_JITTER + 2 * BACKOFF_JITTER * self.rand()
        if self.failures == 1:
            self.log.warning(
                "%s failing: %s: %s; retrying with backoff (up to %gs), logged again when it recovers",
                self.name,
                type(exc).__name__,
                str(exc)[:300],
                self.cap,
                exc_info=None if _outage(exc) else exc,
            )
        else:
            self.log.debug("%s still failing (%d passes): %s", self.name, self.failures, exc)
        return delay

    async def pause(self, exc: BaseException) -> None:
        """``failed(exc)``, then wait its delay."""
        await asyncio.sleep(self.failed(exc))

    def ok(self) -> None:
        """Record a pass that worked (logs "recovered" after failures)."""
        if self.failures:
            self.log.warning("%s recovered after %d failed passes", self.name, self.failures)
            self.failures = 0


# --- receiving ---------------------------------------------------------------------------------


def _kind(message: Any) -> str:
    """The ``type`` of a message off the layer, for a log line (``None`` when it has none)."""
    return repr(message.get("type") if isinstance(message, dict) else None)[:100]


def message_received(model: type[Message], message: Any, *, receiver: str) -> Message | None:
    """``message`` (a dict taken from the layer) validated as ``model``
    (``ChannelMessage.received``), or ``None`` when it does not fit: then one warning names
    the ``receiver``, the message's type and what is wrong, and the message is dropped — a
    malformed message never raises into a consumer or a loop."""
    try:
        return model.received(message)
    except ValidationError as exc:
        logger.warning(
            "%s dropped a malformed message of type %s: %s", receiver, _kind(message), describe_validation_error(exc)
        )
        return None


# --- rings and sends ---------------------------------------------------------------------------


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


def _put_local(layer: Any, channel_name: str, payload: dict[str, Any]) -> bool:
    """Hand ``payload`` to ``channel_name``'s inbox in this process, when it has one (a
    waiting ``request_reply``'s reply inbox, or a consumer's); ``False`` otherwise.

    Every point-to-point message from this process to a consumer of this process goes this
    way, not just ``request_reply``'s: one path keeps them in the order they were sent (a
    "remote disconnected" notice is not overtaken by a call sent after it). Raises what the
    layer would refuse to serialize, and ``ChannelFull`` when that inbox is full (from the
    inbox's own event loop; from another one the message is handed over thread-safely and
    a full inbox drops it with a warning, as ``ring_on_commit`` drops a failed send)."""
    inbox = _reply_inboxes.get(channel_name)
    if inbox is None:  # (not ``or``: an empty inbox is falsy, it has a length)
        inbox = _consumer_inboxes.get(channel_name)
    if inbox is None:
        return False
    _refuse_what_the_layer_would(layer, payload)
    inbox.put(payload)
    return True


# --- same-process channels ---------------------------------------------------------------------


class LocalChannel:
    """A channel's inbox in this process's memory, for messages whose sender and receiver
    both live here (docs/operating.md#channel-layer): a consumer's second inbox beside
    its channel on the layer (``consumer_channel``), or the reply inbox of one
    ``request_reply``.

    Holds at most ``capacity`` messages (plain dicts, each the receiver's own: built by
    ``ChannelMessage.for_layer`` for this one send); ``put`` raises ``ChannelFull`` past it,
    as the layer's ``send`` does. Bound to the event loop that made it: ``put`` from
    another loop hands the message over thread-safely. ``close()`` unregisters it and
    drops what it holds, as a dead channel of the layer keeps nothing for anyone.
    """

    __slots__ = ("_messages", "_registry", "_waiter", "capacity", "closed", "loop", "name")

    def __init__(self, name: str, capacity: int, registry: dict[str, LocalChannel]) -> None:
        self.name = name
        self.capacity = capacity
        self.loop = asyncio.get_running_loop()
        self._registry = registry
        self._messages: deque[dict[str, Any]] = deque()
        self._waiter: asyncio.Future[dict[str, Any]] | None = None
        self.closed = False
        registry[name] = self

    def __len__(self) -> int:
        return len(self._messages)

    def put(self, message: dict[str, Any]) -> None:
        """Hand ``message`` to the receiver (its waiting ``next()``, else the queue); raises
        ``ChannelFull`` when ``capacity`` messages already wait. Once closed, the message
        is dropped silently (a dead channel)."""
        if self.loop is not _running_loop():
            try:
                self.loop.call_soon_threadsafe(self._put_quietly, message)
            except RuntimeError:  # that loop is closed: so is the channel
                pass
            return
        if self.closed:
            return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            self._waiter = None
            waiter.set_result(message)
            return
        if len(self._messages) >= self.capacity:
            raise ChannelFull()
        self._messages.append(message)

    def _put_quietly(self, message: dict[str, Any]) -> None:
        try:
            self.put(message)
        except ChannelFull:
            logger.warning("a message to %s dropped: channel full", self.name)

    def next(self) -> asyncio.Future[dict[str, Any]]:
        """A future of the next message (already done when one waits): ``request_reply``
        waits on it without a task. One at a time: a second call replaces the first."""
        future: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        if self._messages:
            future.set_result(self._messages.popleft())
        else:
            self._waiter = future
        return future

    async def take(self) -> dict[str, Any]:
        """The next message, waiting for it: a consumer's pump reads it as one more source.
        A message handed over just as the wait is cancelled goes back to the queue's head."""
        future = self.next()
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._messages.appendleft(future.result())
            elif self._waiter is future:
                self._waiter = None
            raise

    def close(self) -> int:
        """Unregister; drop the messages still waiting. Returns how many were dropped."""
        if self._registry.get(self.name) is self:
            del self._registry[self.name]
        self.closed = True
        dropped = len(self._messages)
        self._messages.clear()
        # A waiting receive stays pending (never woken): its reader ends with its owner.
        return dropped


LOCAL_REPLY_PREFIX = "dispatch.local-reply!"
"""The reply channels of same-process ``request_reply`` calls: never on the layer (a reply
to one whose caller stopped waiting is dropped, not sent to Redis for nobody)."""

_consumer_inboxes: dict[str, LocalChannel] = {}  # a consumer's channel name -> its local inbox
_reply_inboxes: dict[str, LocalChannel] = {}  # a waiting request_reply's reply channel -> its inbox


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def local_inbox(channel_name: str) -> LocalChannel | None:
    """The same-process inbox of the consumer whose channel is ``channel_name``, when that
    consumer lives in this process and on the running event loop; else ``None`` (the
    message goes through the layer)."""
    inbox = _consumer_inboxes.get(channel_name)
    if inbox is None or inbox.loop is not _running_loop():
        return None
    return inbox


def _refuse_what_the_layer_would(layer: Any, message: dict[str, Any]) -> None:
    """Raise what ``layer``'s own ``send`` would raise serializing ``message``, for a message
    that skips it. The Redis layers (both msgpack) refuse a lone surrogate
    (``UnicodeEncodeError``, a ``ValueError``) and an integer outside 64 bits
    (``OverflowError``); the in-memory layer copies (``deepcopy``) and refuses nothing that
    ``ChannelMessage.for_layer`` let through."""
    if not isinstance(layer, InMemoryChannelLayer):
        msgpack.packb(message, use_bin_type=True)


# --- listening ---------------------------------------------------------------------------------


async def consumer_channel(
    alias: str,
) -> tuple[Any, str, Callable[[], Awaitable[dict[str, Any]]], LocalChannel | None] | None:
    """A new channel for a consumer on the channel layer ``alias``: ``(layer, channel_name,
    reader, local)``, or ``None`` when no layer is configured. ``await reader()`` returns the
    channel's next message (a dict) and raises what the layer raises (a Redis
    ``ConnectionError`` while it is unreachable); ``core.consumers.DispatchConsumer``
    awaits it in one long-lived task, cancelled only when the channel's life ends, as
    ``Subscription`` does. Raises what the layer raises making the channel.

    ``local`` (on the default layer, the one ``request_reply`` uses; ``None`` on another)
    is the channel's same-process inbox, registered under ``channel_name``: what this
    process sends the channel (``request_reply``, ``layer_send``, ``send_on_commit``) goes
    there instead of on the layer. Its capacity is the layer's for the channel. The consumer reads
    ``local.take`` beside ``reader`` and must ``local.close()`` when it ends, on every
    path (docs/operating.md#channel-layer)."""
    layer = get_channel_layer(alias)
    if layer is None:
        return None
    channel_name = await layer.new_channel()
    local = None
    if layer is get_channel_layer():
        local = LocalChannel(channel_name, _capacity(layer, channel_name), _consumer_inboxes)
    return layer, channel_name, functools.partial(layer.receive, channel_name), local


def _capacity(layer: Any, channel_name: str) -> int:
    """The layer's capacity for ``channel_name`` (messages; Channels' default 100)."""
    get_capacity = getattr(layer, "get_capacity", None)
    if get_capacity is not None:
        return int(get_capacity(channel_name))
    return int(getattr(layer, "capacity", 100) or 100)


async def _sleep(timeout: float | None) -> None:
    if timeout is None:
        await asyncio.get_running_loop().create_future()  # for ever (until cancelled)
    else:
        await asyncio.sleep(timeout)


class Subscription:
    """One channel of this process in ``groups``, read by one long-lived receive task.

    ``receives`` names the message models the channel takes (``ChannelMessage``
    subclasses, one per ``type``): each message is validated with the model of its type as
    it arrives, and one of another type, or malformed, is logged and dropped
    (``message_received``). ``await open()`` (or ``async with``) makes the channel;
    ``await wait(timeout)`` returns the next message (one of those models), in arrival
    order, or ``None`` after ``timeout`` seconds
    (``None``: no limit) — a message that arrived while the caller was busy is returned by
    the next ``wait`` at once; ``await close()`` ends it. The receive task holds one
    ``layer.receive`` at a time and never cancels it while the channel lives; ``wait``
    waits on what that task hands over, so its timeout cancels nothing on the layer.
    Messages not yet taken are kept up to the layer's channel capacity (more are dropped,
    as a full channel would).

    With ``health`` (a background loop's doorbell): ``open`` never fails; joining the
    groups happens in the receive task, and a layer error there (joining, receiving) is
    reported to ``health`` (logged once per change of state), waited out for its backoff,
    and followed by joining again, while ``wait`` keeps timing out — the loop polls at its
    own pace. Without ``health`` (an event stream): ``open`` joins the groups and raises
    what the layer raises; a later receive error is raised by ``wait`` and ends the
    subscription. ``rejoin_every`` (seconds; ``None``: never) renews the group memberships
    (groups expire, and a restarted Redis forgets them). Without a channel layer
    (``CHANNEL_LAYERS`` unset) ``wait`` just sleeps its timeout.

    ``layer``: the channel layer to use (default: ``get_channel_layer()`` at ``open``).
    """

    def __init__(
        self,
        *groups: str,
        receives: Iterable[type[ChannelMessage]],
        health: LoopHealth | None = None,
        rejoin_every: float | None = None,
        layer: Any = None,
    ) -> None:
        self.groups = groups
        self.models = {model.message_type(): model for model in receives}
        if not self.models:
            raise TypeError("a Subscription receives at least one message model")
        self.health = health
        self.rejoin_every = rejoin_every
        self._layer = layer
        self._channel: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._pending: deque[ChannelMessage] = deque()
        self._capacity = 100
        self._arrived = asyncio.Event()
        self._joined = asyncio.Event()  # set after the first attempt to join the groups
        self._joined_at: float | None = None
        self._error: Exception | None = None
        self._overflowing = False
        self._opened = False
        self._closed = False

    @property
    def channel(self) -> str | None:
        """The channel's name (``None`` before ``open``, or without a layer)."""
        return self._channel

    async def open(self) -> Subscription:
        """Make the channel (and, without ``health``, join the groups: raises what the
        layer raises). Returns ``self``."""
        if self._opened:
            return self
        self._opened = True
        if self._layer is None:
            self._layer = get_channel_layer()
        if self._layer is None:
            self._joined.set()
            return self
        self._capacity = int(getattr(self._layer, "capacity", 100) or 100)
        if self.health is None:
            self._channel = await self._layer.new_channel()
            for group in self.groups:
                await self._layer.group_add(group, self._channel)
            self._joined_at = asyncio.get_running_loop().time()
            self._joined.set()
        else:
            self._start()
        return self

    async def joined(self) -> bool:
        """Wait until the first attempt to join the groups is over; whether it worked."""
        await self._joined.wait()
        return self._joined_at is not None

    async def wait(self, timeout: float | None = None) -> ChannelMessage | None:
        """The next message (one of the ``receives`` models), or ``None`` when none arrives
        within ``timeout`` seconds.

        Raises the layer's error after a failed receive when there is no ``health``."""
        if not self._opened:
            await self.open()
        if self._closed:
            raise RuntimeError("this subscription is closed")
        if self._layer is None:
            await _sleep(timeout)
            return None
        self._start()
        if not self._pending and self._error is None:
            self._arrived.clear()
            try:
                async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it can swallow a cancel
                    await self._arrived.wait()
            except TimeoutError:
                pass
        if self._pending:
            return self._pending.popleft()
        if self._error is not None:
            raise self._error
        return None

    async def close(self, *, timeout: float = LEAVE_TIMEOUT) -> None:
        """Stop the receive task (the one cancel of the channel's receive) and leave the
        groups, waiting at most ``timeout`` seconds; a failure to leave is logged (the
        memberships expire by themselves)."""
        if self._closed:
            return
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._layer is None or self._channel is None or not self.groups:
            return
        try:
            async with asyncio.timeout(timeout):
                for group in self.groups:
                    await self._layer.group_discard(group, self._channel)
        except Exception as exc:
            logger.info("could not leave %s (%s); the membership expires by itself", ", ".join(self.groups), exc)

    async def __aenter__(self) -> Subscription:
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _start(self) -> None:
        if self._task is None and not self._closed and self._error is None:
            self._task = asyncio.get_running_loop().create_task(self._receive_forever())

    def _deliver(self, message: dict[str, Any]) -> None:
        receiver = f"the subscription to {', '.join(self.groups) or self._channel}"
        kind = message.get("type") if isinstance(message, dict) else None
        model = self.models.get(kind) if isinstance(kind, str) else None
        if model is None:
            logger.warning(
                "%s dropped a message of type %s: it takes %s", receiver, _kind(message), ", ".join(sorted(self.models))
            )
            return
        parsed = message_received(model, message, receiver=receiver)
        if parsed is None:
            return
        if len(self._pending) >= self._capacity:
            if not self._overflowing:  # once per overflow, as a full channel drops silently
                logger.info("messages to %s dropped: %d wait to be taken", self._channel, len(self._pending))
            self._overflowing = True
            return
        self._overflowing = False
        self._pending.append(parsed)
        self._arrived.set()

    async def _receive_forever(self) -> None:
        layer = self._layer
        loop = asyncio.get_running_loop()
        receive: asyncio.Future[dict[str, Any]] | None = None
        try:
            while True:
                try:
                    if receive is not None and receive.done():
                        finished, receive = receive, None
                        self._deliver(finished.result())
                        continue
                    if self._channel is None:
                        self._channel = await layer.new_channel()
                    joined_at = self._joined_at
                    if joined_at is None or (
                        self.rejoin_every is not None and loop.time() - joined_at >= self.rejoin_every
                    ):
                        for group in self.groups:
                            await layer.group_add(group, self._channel)
                        self._joined_at = joined_at = loop.time()
                        self._joined.set()
                        if self.health is not None:
                            self.health.ok()
                    if receive is None:
                        receive = asyncio.ensure_future(layer.receive(self._channel))
                    until_rejoin = None if self.rejoin_every is None else joined_at + self.rejoin_every - loop.time()
                    await asyncio.wait({receive}, timeout=None if until_rejoin is None else max(until_rejoin, 0.0))
                except Exception as exc:
                    if self.health is None:
                        self._error = exc
                        self._arrived.set()
                        return
                    self._joined_at = None  # join again once the backoff is over
                    self._joined.set()
                    await asyncio.sleep(self.health.failed(exc))
        finally:
            if receive is not None:
                if not receive.done():
                    receive.cancel()  # the channel's life ends here
                elif not receive.cancelled():
                    receive.exception()  # retrieved: a failure at shutdown is not news


# --- request / reply ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Gone:
    """A liveness check's verdict that the answerer is gone: ``request_reply`` waits
    ``grace`` more seconds for a reply already on its way, then raises ``error``."""

    error: DispatchError
    grace: float = 0.0


class _NoReply(DispatchError):
    def __init__(self) -> None:
        super().__init__("TIMEOUT", "no reply")


_local_reply_numbers = itertools.count(1)  # a same-process reply channel never leaves the process


def _made(error: DispatchError | Callable[[], DispatchError]) -> DispatchError:
    return error if isinstance(error, BaseException) else error()


def _wake(waiter: asyncio.Future[None], *_: Any) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def _settled(future: asyncio.Future[Any], timeout: float) -> bool:
    """Whether ``future`` is done within ``timeout`` seconds; it is never cancelled here.
    What ``asyncio.wait({future}, timeout=…)`` does for one future, at a third of its cost
    (no sets, no task wrapping, one waiter): a remote call's reply is awaited this way."""
    if future.done():
        return True
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()
    wake = functools.partial(_wake, waiter)
    timer = loop.call_later(timeout, wake)
    future.add_done_callback(wake)
    try:
        await waiter
    finally:
        timer.cancel()
        future.remove_done_callback(wake)
    return future.done()


async def request_reply(
    channel_name: str,
    message: ChannelRequest,
    *,
    reply: type[Reply],
    timed_out: DispatchError | Callable[[], DispatchError],
    timeout: float | None = None,
    deadline: float | None = None,
    busy: DispatchError | Callable[[], DispatchError] | None = None,
    unsendable: Callable[[Exception], DispatchError] | None = None,
    liveness: Callable[[], Awaitable[Gone | None]] | None = None,
    check_every: float | None = None,
    group: bool = False,
) -> Reply:
    """Send ``message`` with a fresh ``reply_channel`` to ``channel_name`` and return the
    reply: the first message on that channel that validates as ``reply`` (one that does not
    is logged and dropped, and the wait goes on).

    The wait ends at ``deadline`` (the running loop's ``time()``) or ``timeout`` seconds
    after the send (exactly one of the two), raising ``timed_out``. While waiting, every
    ``check_every`` seconds (default ``DISPATCH_REMOTE_LIVENESS_INTERVAL``) ``liveness()``
    is asked whether the answerer still lives: ``None`` goes on waiting, a ``Gone`` ends
    the wait (after its grace) with its error. One receive is held at a time and cancelled
    only when the wait is over (the reply channel is used once).

    ``timed_out`` and ``busy`` may be given as the error or as a function making it (the
    hot path builds no error it does not raise).

    Raises ``busy`` when the target channel is full (``ChannelFull`` itself when ``busy``
    is ``None``), ``unsendable(exc)`` when the message cannot be serialized
    (``TypeError``/``ValueError``; raised as is without ``unsendable``), and what the layer
    raises while it is unreachable (a Redis ``ConnectionError``: the edges answer it as
    ``TEMPORARILY_UNAVAILABLE``).

    With ``group``, ``channel_name`` names a group and the request goes to every member
    (``group_send``: a full member channel drops it silently); the first valid reply wins.

    When ``channel_name`` is a consumer of this process (``local_inbox``), the request goes
    into its local inbox and the reply comes back through a local reply inbox, neither
    through the layer: same errors (``busy`` when that inbox is full, ``unsendable`` for
    what the layer would refuse), same wait.
    """
    if (timeout is None) == (deadline is None):
        raise TypeError("request_reply takes exactly one of timeout and deadline")
    layer = get_channel_layer()
    local = None if group else local_inbox(channel_name)
    if local is not None:
        reply_channel = f"{LOCAL_REPLY_PREFIX}{next(_local_reply_numbers)}"
    else:
        reply_channel = await layer.new_channel()
    replies: LocalChannel | None = None
    receive: asyncio.Future[dict[str, Any]] | None = None
    try:
        try:
            request = message.for_layer()
            request["reply_channel"] = reply_channel
            if local is None:
                await (layer.group_send if group else layer.send)(channel_name, request)
            else:
                # Same process: straight into the consumer's inbox, the reply into ours.
                # ``request`` is a fresh dict (``for_layer``) the receiver alone holds.
                _refuse_what_the_layer_would(layer, request)
                replies = LocalChannel(reply_channel, _capacity(layer, reply_channel), _reply_inboxes)
                local.put(request)
        except ChannelFull:
            if busy is None:
                raise
            raise _made(busy) from None
        except (TypeError, ValueError) as exc:
            if unsendable is None:
                raise
            raise unsendable(exc) from None
        loop = asyncio.get_running_loop()
        if deadline is None:
            assert timeout is not None
            deadline = loop.time() + timeout
        interval = settings.REMOTE_LIVENESS_INTERVAL if check_every is None else check_every

        def next_reply() -> asyncio.Future[dict[str, Any]]:
            if replies is not None:
                return replies.next()
            return asyncio.ensure_future(layer.receive(reply_channel))

        receive = next_reply()
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise _made(timed_out)
            done = await _settled(receive, remaining if liveness is None else min(remaining, interval))
            if not done and liveness is not None:
                gone = await liveness()
                if gone is not None:
                    if gone.grace > 0:
                        done = await _settled(receive, gone.grace)
                    if not done:
                        raise gone.error
            if not done:
                continue
            answer = message_received(reply, receive.result(), receiver=f"the {message.type} request")
            if answer is not None:
                return answer
            receive = next_reply()  # the malformed one is dropped
    finally:
        if receive is not None and not receive.done():
            receive.cancel()  # the reply channel's life ends here
        if replies is not None:
            replies.close()


async def layer_request(
    channel_name: str, message: ChannelRequest, *, reply: type[Reply], timeout: float, group: bool = False
) -> Reply | None:
    """Send ``message`` plus ``reply_channel`` to ``channel_name``; return the first reply
    (validated as ``reply``) that arrives within ``timeout`` seconds, or ``None`` when none
    does (a probe: "do you still serve this?", docs/ws-protocol.md#remote-connect).
    With ``group``, ``channel_name`` is a group (a process's presence ping).

    Raises what the layer raises on send (``ChannelFull``; a Redis ``ConnectionError``
    while the layer is unreachable).
    """
    try:
        return await request_reply(
            channel_name, message, reply=reply, timeout=timeout, timed_out=_NoReply(), group=group
        )
    except _NoReply:
        return None


async def layer_round_trip(*, timeout: float) -> bool:
    """Whether this process's channel layer works: a probe sent to a fresh channel of this
    process comes back within ``timeout`` seconds (``/healthz``). Never raises."""
    probe = uuid.uuid4().hex
    try:
        async with Subscription(receives=[HealthProbeMessage]) as echo:
            if echo.channel is None:
                return False  # no channel layer configured
            await layer_send(echo.channel, HealthProbeMessage(probe=probe))
            message = await echo.wait(timeout)
    except Exception:
        return False
    return isinstance(message, HealthProbeMessage) and message.probe == probe
