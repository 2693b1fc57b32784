"""``GET /mcp``: the server-sent-event stream of MCP 2025-11-25 (docs/mcp.md#tool-list-changes).

The SDK cannot serve this stream in stateless mode, so Dispatch answers it itself — a
plain ASGI response that holds no database connection while it streams. The stream is
keyed by the caller's credential, not by a session, so any process can hold it:

- ``retry: 1000`` first (the TypeScript SDK reconnects after that many milliseconds), then
  one ``notifications/tools/list_changed`` at once: a client that missed a change while
  (re)connecting lists its tools again;
- one more each time the user's tool list changes (``dispatch.mcp.relay``, fed by the
  channel layer, so a change committed by any process arrives);
- a keep-alive comment every ``KEEPALIVE_SECONDS``;
- events carry no ``id``: nothing is replayed (a reconnect gets the list_changed instead).

It ends when the client goes, when its credential stops being valid or its process shuts
down (``dispatch.mcp.streams``). Refusals: 406 without ``Accept: text/event-stream``, 429
past ``STREAMS_PER_USER`` open streams (authentication happened before, in ``app``).
"""

from __future__ import annotations

import asyncio
import logging

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from core.errors import DispatchError
from dispatch.mcp.relay import user_feed
from dispatch.mcp.server import Caller
from dispatch.mcp.streams import OpenStream, stream_close, stream_open
from dispatch.sse import KEEP_ALIVE, sse_event, sse_json

logger = logging.getLogger(__name__)

KEEPALIVE_SECONDS = 15.0
RETRY_MILLISECONDS = 1000
LIST_CHANGED = sse_event(
    event="message", data=sse_json({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
).encode()
KEEPALIVE = KEEP_ALIVE.encode()
RETRY = sse_event(retry=RETRY_MILLISECONDS).encode()
HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]


def accepts_event_stream(headers: Headers) -> bool:
    """Whether ``Accept`` names ``text/event-stream`` (MCP 2025-11-25 "Listening for Messages
    from the Server": the client MUST; a bare ``*/*`` is not enough)."""
    accepted = {part.split(";", 1)[0].strip().lower() for part in headers.get("accept", "").split(",")}
    return "text/event-stream" in accepted


async def event_stream(scope: Scope, receive: Receive, send: Send, *, caller: Caller, raw_token: str) -> None:
    """Answer an authenticated ``GET /mcp``: refuse (406, 429) or stream until it ends."""
    if not accepts_event_stream(Headers(scope=scope)):
        body = DispatchError("INVALID_REQUEST", "GET /mcp is an event stream: send Accept: text/event-stream")
        await JSONResponse(body.as_dict(), status_code=406)(scope, receive, send)
        return
    try:
        stream = await stream_open(user=caller.user, raw_token=raw_token, oauth_token_id=caller.oauth_token_id)
    except DispatchError as exc:
        headers = {"Retry-After": "5"} if exc.http_status == 429 else None
        await JSONResponse(exc.as_dict(), status_code=exc.http_status, headers=headers)(scope, receive, send)
        return
    try:
        await _stream(stream, receive, send)
    finally:
        await stream_close(stream)


async def _stream(stream: OpenStream, receive: Receive, send: Send) -> None:
    wake = asyncio.Event()
    changes = 0
    gone = False

    def on_event(event: object) -> None:
        nonlocal changes
        changes += 1
        wake.set()

    async def watch_client() -> None:
        nonlocal gone
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone = True
                wake.set()
                return

    async def watch_end() -> None:
        await stream.ended.wait()
        wake.set()

    watchers = [asyncio.create_task(watch_client()), asyncio.create_task(watch_end())]
    try:
        async with user_feed(stream.user_id).held() as bus:
            unsubscribe = bus.subscribe(on_event)
            try:
                await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
                await send(
                    {
                        "type": "http.response.body",
                        "body": RETRY + LIST_CHANGED,
                        "more_body": True,
                    }
                )
                loop = asyncio.get_running_loop()
                keepalive_at = loop.time() + KEEPALIVE_SECONDS
                while True:
                    try:
                        async with asyncio.timeout_at(keepalive_at):
                            await wake.wait()
                    except TimeoutError:
                        pass
                    wake.clear()
                    if gone:
                        return
                    if stream.ended.is_set():
                        logger.info("ending MCP event stream %s: %s", stream.stream_id, stream.reason)
                        break
                    if changes:
                        changes = 0
                        await send({"type": "http.response.body", "body": LIST_CHANGED, "more_body": True})
                        keepalive_at = loop.time() + KEEPALIVE_SECONDS
                    elif loop.time() >= keepalive_at:
                        await send({"type": "http.response.body", "body": KEEPALIVE, "more_body": True})
                        keepalive_at = loop.time() + KEEPALIVE_SECONDS
            finally:
                unsubscribe()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
