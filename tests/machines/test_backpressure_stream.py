"""An event stream (a streamed command's output over REST) is held back while its client
does not read (docs/live-operations.md "Back-pressure"): ``dispatch.sse`` waits after each
chunk until the connection's unsent bytes are under ``DISPATCH_WS_HIGH_WATER``, so the
view's iterator — whose pulling grants the command its output credit — is not pulled.

daphne hands an application ``functools.partial(server.handle_reply, protocol)`` as its
``send``; here a stand-in protocol whose Twisted-like transport keeps what it was given in
``dataBuffer`` until the test "reads" it.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from dispatch.sse import unbuffered_event_streams


class Transport:
    def __init__(self) -> None:
        self.dataBuffer = b""
        self.offset = 0
        self._tempDataLen = 0


class Protocol:
    def __init__(self) -> None:
        self.transport = Transport()


async def handle_reply(protocol: Protocol, message: dict[str, Any]) -> None:
    protocol.transport.dataBuffer += message.get("body", b"")


def streaming_app(pulled: list[int], *, content_type: bytes, chunks: int, size: int) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]})
        for index in range(chunks):
            pulled.append(index)  # what a view's iterator would have produced (and granted credit for)
            await send({"type": "http.response.body", "body": b"x" * size, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


async def test_an_event_stream_whose_client_does_not_read_stops_being_pulled_and_resumes_when_it_reads(settings):
    settings.WS_HIGH_WATER = 256 * 1024
    protocol = Protocol()
    pulled: list[int] = []
    app = unbuffered_event_streams(streaming_app(pulled, content_type=b"text/event-stream", chunks=64, size=64 * 1024))
    send = functools.partial(handle_reply, protocol)
    task = asyncio.ensure_future(app({"type": "http"}, None, send))
    for _ in range(50):  # let it run as far as it goes
        await asyncio.sleep(0.01)
    held = len(protocol.transport.dataBuffer)
    assert not task.done(), "the whole stream was pushed into a socket nobody reads"
    assert held <= 256 * 1024 + 64 * 1024, held
    assert len(pulled) <= 5

    while not task.done():  # the client reads: the stream goes on to its end
        protocol.transport.dataBuffer = b""
        await asyncio.sleep(0.03)
    await task
    assert len(pulled) == 64


async def test_other_responses_are_not_held_back(settings):
    settings.WS_HIGH_WATER = 256 * 1024
    protocol = Protocol()
    pulled: list[int] = []
    app = unbuffered_event_streams(streaming_app(pulled, content_type=b"application/json", chunks=8, size=64 * 1024))
    await asyncio.wait_for(app({"type": "http"}, None, functools.partial(handle_reply, protocol)), 5)
    assert len(pulled) == 8
