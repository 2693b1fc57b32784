"""A per-process budget of request-body bytes being read (docs/operating.md#bounds).

daphne reads each HTTP request's whole body before the application runs — into a
temporary file, then into the application's queue in 8 KiB chunks, from where Django or
the MCP endpoint reads it into memory — so a burst of large posts, authenticated or not,
is held by the process at once: 30 concurrent 16 MB posts grew a ``serve`` process by
300-450 MB, kept after the burst. ``DISPATCH_MAX_REQUEST_BYTES`` bounds one body; this
bounds their sum.

``budget_request_bodies(total, max_request_bytes)`` hooks daphne's request (as
``serve``'s ``cap_request_bodies`` does): when a request's headers are in, its declared
``Content-Length`` is taken from the budget (a chunked body's bytes as they arrive); a
request that would take the total over ``total`` bytes is answered at once — 503
``TEMPORARILY_UNAVAILABLE`` in the API's error shape, ``Retry-After: 1``,
``Connection: close`` — before any of its body is read, and the rest of what its client
sends is dropped. The bytes are given back when the request's response is finished or
its client goes away. A body over ``max_request_bytes`` is left to the 413 of
``cap_request_bodies``. Refusing rather than waiting keeps a flood from holding
connections open; the budget frees as soon as the requests in flight are answered.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

RETRY_AFTER_SECONDS = 1
"""``Retry-After`` of a refused body: the budget frees as the requests being read are answered."""
REFUSED_LINGER = 2.0
"""Seconds a refused request's connection keeps reading (and dropping) what its client still
sends, so the client reads the 503 before the socket closes (closing with unread data
would reset the connection and could discard the answer)."""


class BodyBudget:
    """Bytes of request bodies this process is reading, at most ``total``.

    Used from the event loop's thread only (twisted runs on it), so no lock."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0

    def take(self, size: int) -> bool:
        """Reserve ``size`` bytes; False (nothing reserved) when that would pass ``total``."""
        if self.used + size > self.total:
            return False
        self.used += size
        return True

    def give_back(self, size: int) -> None:
        """Return ``size`` bytes reserved with ``take``."""
        self.used = max(0, self.used - size)


budget: BodyBudget | None = None
"""This process's budget, once ``budget_request_bodies`` installed it (``/metrics``, tests)."""


def budget_request_bodies(total: int, max_request_bytes: int) -> BodyBudget:
    """Make daphne take every HTTP request body from one budget of ``total`` bytes (see the
    module's docstring); bodies over ``max_request_bytes`` are left to the 413 refusal.
    Idempotent: a second call returns the installed budget. Returns it."""
    global budget
    from daphne.http_protocol import WebRequest

    if getattr(WebRequest.gotLength, "dispatch_budgeted", False):
        assert budget is not None
        return budget
    installed = budget = BodyBudget(total)
    got_length = WebRequest.gotLength
    handle_content_chunk = WebRequest.handleContentChunk
    request_received = WebRequest.requestReceived
    finish = WebRequest.finish
    connection_lost = WebRequest.connectionLost

    def budgeted_got_length(self: Any, length: int | None) -> None:
        self.dispatch_budget_held = 0
        self.dispatch_budget_refused = False
        self.dispatch_budget_chunked = length is None
        if length is not None and 0 < length <= max_request_bytes:
            if not installed.take(length):
                _refuse(self, installed)
                return
            self.dispatch_budget_held = length
        got_length(self, length)

    def budgeted_chunk(self: Any, data: bytes) -> None:
        if getattr(self, "dispatch_budget_refused", False):
            return
        if getattr(self, "dispatch_budget_chunked", False) and data:
            # A chunked body: taken as it arrives (one over the cap is refused 413 inside).
            if not installed.take(len(data)):
                _release(self, installed)
                _refuse(self, installed)
                return
            self.dispatch_budget_held = getattr(self, "dispatch_budget_held", 0) + len(data)
        handle_content_chunk(self, data)

    def budgeted_received(self: Any, command: bytes, path: bytes, version: bytes) -> None:
        if getattr(self, "dispatch_budget_refused", False):
            return
        request_received(self, command, path, version)

    def budgeted_finish(self: Any) -> Any:
        _release(self, installed)
        return finish(self)

    def budgeted_connection_lost(self: Any, reason: Any) -> Any:
        _release(self, installed)
        return connection_lost(self, reason)

    budgeted_got_length.dispatch_budgeted = True  # type: ignore[attr-defined]
    WebRequest.gotLength = budgeted_got_length
    WebRequest.handleContentChunk = budgeted_chunk
    WebRequest.requestReceived = budgeted_received
    WebRequest.finish = budgeted_finish
    WebRequest.connectionLost = budgeted_connection_lost
    return installed


def _release(request: Any, budget: BodyBudget) -> None:
    held = getattr(request, "dispatch_budget_held", 0)
    if held:
        request.dispatch_budget_held = 0
        budget.give_back(held)


def _refuse(request: Any, budget: BodyBudget) -> None:
    """Answer 503 on ``request``'s connection, drop what its client still sends, close."""
    request.dispatch_budget_refused = True
    # No "100 Continue" after the refusal (twisted sends it once the length is known).
    request.requestHeaders.removeHeader(b"Expect")
    channel = request.channel
    transport = channel.transport if channel is not None else None
    if transport is None:
        return
    body = json.dumps(
        {
            "error": {
                "code": "TEMPORARILY_UNAVAILABLE",
                "message": f"this server process is reading {budget.total} bytes of request bodies already "
                "(DISPATCH_REQUEST_BODY_BUDGET); retry in a moment",
                "details": {"service": "request_bodies", "budget_bytes": budget.total},
            }
        }
    ).encode()
    head = (
        b"HTTP/1.1 503 Service Unavailable\r\n"
        b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n".encode()
        + f"Retry-After: {RETRY_AFTER_SECONDS}\r\n".encode()
        + b"Connection: close\r\n\r\n"
    )

    def drop(data: bytes) -> None:
        return None

    # Stop parsing this connection: what the client still sends is read and dropped.
    channel.persistent = False
    channel.dataReceived = drop
    channel.rawDataReceived = drop
    channel.lineReceived = drop
    transport.write(head + body)
    if hasattr(transport, "loseWriteConnection"):
        transport.loseWriteConnection()
    else:
        transport.loseConnection()
    abort = getattr(transport, "abortConnection", transport.loseConnection)
    asyncio.get_event_loop().call_later(REFUSED_LINGER, abort)  # twisted runs on asyncio under serve
