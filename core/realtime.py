"""Asking a consumer something over the channel layer and waiting for its answer.

A one-shot request/reply: the request carries a fresh ``reply_channel``; the consumer
answers with ``channel_layer.send(reply_channel, {...})``. Used where the answer is short
and the wait bounded (the remote-connect liveness probe, spec/sessions-and-remotes.md §2).
"""

from __future__ import annotations

import asyncio
from typing import Any

from channels.layers import get_channel_layer


async def layer_request(channel_name: str, message: dict[str, Any], *, timeout: float) -> dict[str, Any] | None:
    """Send ``message`` plus ``reply_channel`` to ``channel_name``; return the first reply
    that arrives within ``timeout`` seconds, or ``None`` when none does.

    Raises what the layer raises on send (``ChannelFull``; a Redis ``ConnectionError``
    while the layer is unreachable).
    """
    layer = get_channel_layer()
    reply_channel = await layer.new_channel()
    await layer.send(channel_name, {**message, "reply_channel": reply_channel})
    try:
        async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it can swallow a cancel
            reply: dict[str, Any] = await layer.receive(reply_channel)
    except TimeoutError:
        return None
    return reply
