"""A local HTTP receiver for notification tests: it stands for an Apprise webhook target
(``json://``) or a browser's push service, records every request and answers with the
status the test sets."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from agents.models import Agent


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    port: int
    requests: list[Received] = field(default_factory=list)
    status: int = 201  # what the next requests are answered with
    arrived: threading.Event = field(default_factory=threading.Event)

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait(self, timeout: float = 10.0) -> Received:
        """The first request, waiting up to ``timeout`` seconds for it."""
        assert self.arrived.wait(timeout), "the receiver got nothing"
        return self.requests[0]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """An HTTP server on a free port of 127.0.0.1, in a thread, for the test only."""
    state = Receiver(port=0)

    class Handler(BaseHTTPRequestHandler):
        def _record(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            state.requests.append(
                Received(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body)
            )
            state.arrived.set()
            self.send_response(state.status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_POST = _record
        do_PUT = _record

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def cli_agent(owner: Any) -> Agent:
    """A running CLI agent of ``owner`` (rows only; no tmux)."""
    return Agent.objects.create(owner=owner, name="builder", type="claude", status=Agent.Status.RUNNING, cwd="/tmp")
