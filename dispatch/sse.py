"""Server-sent-event responses pass through a proxy unbuffered (docs/operating.md#behind-a-proxy).

nginx buffers a proxied response unless the response says ``X-Accel-Buffering: no``: an
event stream (``/api/v1/events``, ``/api/v1/peers/events``, ``GET /mcp``, a streamed
operation or copy, an MCP ``tools/call`` answered as events) would reach its client only
when nginx's buffer filled or the stream ended. ``unbuffered_event_streams`` wraps the
whole HTTP application (``dispatch.asgi``), so every ``text/event-stream`` response gets
the header in this one place, whichever view, SDK or future route produced it.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

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
    other responses and non-HTTP scopes pass untouched."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        async def send_unbuffered(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or ())
                if is_event_stream(headers) and not any(name.lower() == ACCEL_BUFFERING[0] for name, _ in headers):
                    message = {**message, "headers": [*headers, ACCEL_BUFFERING]}
            await send(message)

        await app(scope, receive, send_unbuffered)

    return wrapped
