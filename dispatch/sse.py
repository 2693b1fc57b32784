"""Server-sent-event responses pass through a proxy unbuffered (issue 16 "Behind a proxy").

nginx buffers a proxied response unless the response says ``X-Accel-Buffering: no``: an
event stream (``/api/v1/events``, ``/api/v1/peers/events``, ``GET /mcp``, a streamed
operation or copy, an MCP ``tools/call`` answered as events) would reach its client only
when nginx's buffer filled or the stream ended. ``unbuffered_event_streams`` wraps the
whole HTTP application (``dispatch.asgi``), so every ``text/event-stream`` response gets
the header in this one place, whichever view, SDK or future route produced it.

The same wrapper holds an event stream back while its client does not read: after each
chunk it waits until the connection's unsent bytes are under ``DISPATCH_WS_HIGH_WATER``
(``core.backpressure``), so the view's iterator is not pulled — a streamed command's output
credit is granted as the iterator is pulled, so the command pauses at its machine instead
of this process buffering its output (docs/live-operations.md "Back-pressure").
"""

from __future__ import annotations

from collections.abc import Iterable

from django.conf import settings
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.backpressure import SendPressure, transport_protocol, unsent_bytes

ACCEL_BUFFERING = (b"x-accel-buffering", b"no")


def is_event_stream(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether ASGI response ``headers`` (lower- or mixed-case names) carry a
    ``Content-Type`` of ``text/event-stream`` (parameters such as ``charset`` allowed)."""
    for name, value in headers:
        if name.lower() == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"text/event-stream"
    return False


def unbuffered_event_streams(app: ASGIApp) -> ASGIApp:
    """``app`` with ``X-Accel-Buffering: no`` added to the ``http.response.start`` of every
    ``text/event-stream`` response that does not already say it (the MCP SDK's does);
    other responses and non-HTTP scopes pass untouched. After each chunk of an event
    stream it waits while the client has more than ``DISPATCH_WS_HIGH_WATER`` bytes unread
    (the client going away cancels the wait)."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        pressure: SendPressure | None = None  # set for an event stream

        async def send_unbuffered(message: Message) -> None:
            nonlocal pressure
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or ())
                if is_event_stream(headers):
                    pressure = SendPressure(
                        lambda: unsent_bytes(transport_protocol(send)),
                        high_water=settings.WS_HIGH_WATER,
                        hard_limit=settings.WS_HARD_LIMIT,
                        grace=settings.WS_HARD_GRACE,
                    )
                    if not any(name.lower() == ACCEL_BUFFERING[0] for name, _ in headers):
                        message = {**message, "headers": [*headers, ACCEL_BUFFERING]}
            await send(message)
            if pressure is not None and message["type"] == "http.response.body" and message.get("more_body"):
                await pressure.wait_for_room()

        await app(scope, receive, send_unbuffered)

    return wrapped
