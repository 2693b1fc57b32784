"""Server-sent events: the one encoder every ``text/event-stream`` body is written with, and
the proxy header every such response carries (docs/operating.md#behind-a-proxy).

The streams: ``GET /api/v1/events`` (docs/agents.md#the-live-event-stream), the peers'
``GET /api/v1/peers/events``, ``GET /mcp`` (``dispatch.mcp.events``) and a streamed machine
operation or copy (docs/live-operations.md#streamed-output). Each writes its events with
``sse_event`` and its keep-alives as the ``KEEP_ALIVE`` comment, so the framing (field
order, line ends, multi-line data) is decided here once, as the WHATWG HTML "Server-sent
events" section reads it.

nginx buffers a proxied response unless the response says ``X-Accel-Buffering: no``: an
event stream would reach its client only when nginx's buffer filled or the stream ended.
``unbuffered_event_streams`` wraps the whole HTTP application (``dispatch.asgi``), so every
``text/event-stream`` response gets the header in this one place, whichever view, SDK or
future route produced it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

ACCEL_BUFFERING = (b"x-accel-buffering", b"no")

# The line ends of the event-stream format: CRLF, a lone CR or a lone LF (and no others:
# str.splitlines would also split on U+2028, form feeds and the like, which are data).
_LINE_END = re.compile(r"\r\n|\r|\n")


def sse_json(value: Any) -> str:
    """``value`` as compact JSON with ASCII escapes: one line, whatever the text holds (a lone
    surrogate from a shim or a pane becomes ``\\ud800``, which a UTF-8 body can carry).
    Raises ``TypeError`` for a value JSON cannot hold."""
    return json.dumps(value, separators=(",", ":"))


def sse_event(
    *, data: str | None = None, event: str | None = None, id: int | str | None = None, retry: int | None = None
) -> str:
    """One event, its fields in the order ``retry``, ``id``, ``event``, ``data``, each only
    when given, then the blank line that dispatches it: ``sse_event(id=3, event="pane",
    data='{"a":1}')`` is ``'id: 3\\nevent: pane\\ndata: {"a":1}\\n\\n'``.

    ``data`` holding line ends (CRLF, CR or LF) is written as one ``data:`` line per line,
    which a client joins back with LF. ``retry`` is the reconnection delay in milliseconds
    (a non-negative integer). Raises ``ValueError`` for an ``id`` or ``event`` holding a line
    end (or an ``id`` holding NUL, which clients ignore), a negative ``retry``, or an event
    with no field at all."""
    lines: list[str] = []
    if retry is not None:
        if isinstance(retry, bool) or not isinstance(retry, int) or retry < 0:
            raise ValueError(f"retry must be a non-negative integer of milliseconds, got {retry!r}")
        lines.append(f"retry: {retry}")
    if id is not None:
        text = str(id)
        if "\0" in text or _LINE_END.search(text):
            raise ValueError("an event id cannot hold NUL or a line end")
        lines.append(f"id: {text}")
    if event is not None:
        if _LINE_END.search(event):
            raise ValueError("an event name cannot hold a line end")
        lines.append(f"event: {event}")
    if data is not None:
        if "\n" in data or "\r" in data:
            lines.extend(f"data: {line}" for line in _LINE_END.split(data))
        else:
            lines.append(f"data: {data}")
    if not lines:
        raise ValueError("an event needs at least one field")
    return "\n".join(lines) + "\n\n"


def sse_comment(text: str = "") -> str:
    """A comment, which clients ignore (a keep-alive): ``: <text>`` per line, then a blank line."""
    return "".join(f": {line}\n" if line else ":\n" for line in _LINE_END.split(text)) + "\n"


KEEP_ALIVE = sse_comment("keep-alive")
"""``": keep-alive\\n\\n"``: what every stream sends after its quiet interval, so proxies and
clients see the connection alive."""


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
