"""A recording reverse proxy for the real OAuth clients' runs (docs/mcp.md#oauth).

``manage.py serve`` writes no access log, and the clients under test (a browser, the
TypeScript SDK, mcp-remote) are black boxes: to know which requests each one made, and in
what order, the test puts this proxy at the server's public URL and reads ``exchanges``.

One request per connection: the proxy turns every request and response into
``Connection: close`` so that a connection's first lines are its request line and its
status line. Streams (SSE) pass through unbuffered.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

HEAD_LIMIT = 64 * 1024  # bytes: a request or response head larger than this is refused


@dataclass
class Exchange:
    """One proxied request: its method, path (with query), ``User-Agent``, the response
    status (0 until the status line arrived) and when it started (monotonic seconds)."""

    method: str
    path: str
    user_agent: str
    status: int = 0
    started: float = 0.0

    @property
    def client(self) -> str:
        """``browser`` for Chromium, else the first word of the ``User-Agent`` (``node``…)."""
        if "Mozilla" in self.user_agent:
            return "browser"
        return self.user_agent.split("/")[0] or "-"

    def __str__(self) -> str:
        path = self.path if len(self.path) <= 90 else self.path[:87] + "..."
        return f"{self.client}: {self.method} {path} -> {self.status}"


def _read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    """``(head up to and including the blank line, bytes read past it)``; ``(b"", b"")``
    when the peer closed first."""
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        if not chunk or len(buffer) > HEAD_LIMIT:
            return b"", b""
        buffer += chunk
    end = buffer.index(b"\r\n\r\n") + 4
    return buffer[:end], buffer[end:]


def _closing(head: bytes) -> bytes:
    """``head`` with its ``Connection`` header replaced by ``Connection: close``."""
    lines = head[:-4].split(b"\r\n")
    kept = [line for line in lines if not line.lower().startswith(b"connection:")]
    return b"\r\n".join([*kept, b"Connection: close"]) + b"\r\n\r\n"


def _header(head: bytes, name: bytes) -> str:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip().decode("latin-1")
    return ""


def _pipe(source: socket.socket, target: socket.socket) -> None:
    try:
        while chunk := source.recv(65536):
            target.sendall(chunk)
    except OSError:
        pass
    finally:
        for sock in (source, target):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class RecordingProxy:
    """Listens on ``127.0.0.1:port`` (a free port) and forwards to ``127.0.0.1:upstream_port``.

    ``exchanges`` lists every request in the order it arrived. ``close()`` stops accepting.
    """

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = int(self.listener.getsockname()[1])
        self.upstream_port = 0
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, upstream_port: int) -> RecordingProxy:
        """Start forwarding to ``upstream_port`` (the server is started after the proxy's
        port is known: its public URL is the proxy's)."""
        self.upstream_port = upstream_port
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def close(self) -> None:
        self.listener.close()

    def since(self, mark: int) -> list[Exchange]:
        """The exchanges from index ``mark`` on."""
        with self._lock:
            return list(self.exchanges[mark:])

    def _accept(self) -> None:
        while True:
            try:
                client, _address = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with client:
            head, rest = _read_head(client)
            if not head:
                return
            method, path, *_version = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            exchange = Exchange(method, path, _header(head, b"user-agent"), started=time.monotonic())
            with self._lock:
                self.exchanges.append(exchange)
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=10)
            except OSError:
                client.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                exchange.status = 502
                return
            with upstream:
                upstream.settimeout(None)
                upstream.sendall(_closing(head) + rest)
                threading.Thread(target=_pipe, args=(client, upstream), daemon=True).start()
                answer, body = _read_head(upstream)
                if not answer:
                    return
                exchange.status = int(answer.split(b" ", 2)[1])
                client.sendall(_closing(answer) + body)
                _pipe(upstream, client)
