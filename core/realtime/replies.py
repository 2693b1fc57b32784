"""Request/reply over the channel layer: ``request_reply`` sends a request with a fresh
reply channel and waits, bounded, for its one answer, re-checking the answerer's liveness
(docs/ws-protocol.md#remote-call, docs/shim-protocol.md#operations); ``layer_request`` is
its probe form, ``layer_round_trip`` the ``/healthz`` check of the layer.

The remote call's hot path: ``_settled`` waits on one future at a third of
``asyncio.wait``'s cost, and a same-process answerer is reached through ``core.realtime.local``.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from channels.exceptions import ChannelFull
from channels.layers import get_channel_layer
from django.conf import settings

from core.errors import DispatchError
from core.protocol import ChannelMessage, ChannelRequest, HealthProbeMessage
from core.realtime.local import (
    LOCAL_REPLY_PREFIX,
    LocalChannel,
    _capacity,
    _refuse_what_the_layer_would,
    _reply_inboxes,
    local_inbox,
)
from core.realtime.received import message_received
from core.realtime.rings import layer_send
from core.realtime.subscription import Subscription

Reply = TypeVar("Reply", bound=ChannelMessage)


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
