"""A fake Dispatch ``/ws`` endpoint speaking the remotes protocol (docs/ws-protocol.md), for the
client tests. No Django: a bare ``websockets`` server on 127.0.0.1, port 0."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, NoReturn

import pytest
import pytest_asyncio
from websockets.asyncio.server import ServerConnection, serve

from remotes.client import Remote


class FakeDispatch:
    """Authenticates by header, answers ``remote-connect``/``-list``/``-call`` and ``ping``,
    sends ``remote-call`` events and collects the ``remote-call-result`` messages."""

    token = "test-token"  # the only API token it accepts

    def __init__(self) -> None:
        self.url = ""
        self.refusal_close_code = 4401
        # The refusal frame before the close: Dispatch's (no action) or an older server's.
        self.refusal_frame: dict[str, Any] = {"error": "authentication failed"}
        self.still_connected = 0  # how many remote-connects to refuse as "already connected"
        self.connect_error: str | None = None  # refuse every remote-connect with this
        self.attempts = 0  # connections opened, authenticated or not
        self.registrations: list[dict[str, Any]] = []  # remote-connect bodies accepted
        self.calls: list[dict[str, Any]] = []  # remote-call bodies from callers
        self.serving: dict[str, ServerConnection] = {}
        self._pending: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._request_ids = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()

    async def wait_registered(self, count: int = 1) -> dict[str, Any]:
        """Wait (at most 5 s) for the ``count``-th registration; return its body."""
        async with asyncio.timeout(5):
            while len(self.registrations) < count:
                await asyncio.sleep(0.01)
        return self.registrations[count - 1]

    async def call(self, remotename: str, function: str, args: Any) -> dict[str, Any]:
        """Send a ``remote-call`` event; return the whole ``remote-call-result`` frame."""
        request_id = f"{remotename}#{next(self._request_ids)}"
        result: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = result
        event = {
            "action": "remote-call",
            "requestId": request_id,
            "remotename": remotename,
            "function": function,
            "args": args,
        }
        await self.serving[remotename].send(json.dumps(event))
        async with asyncio.timeout(5):
            return await result

    async def disconnect(self, remotename: str, reason: str) -> None:
        """Another session disconnected ``remotename``: drop it and tell its holder."""
        holder = self.serving.pop(remotename)
        event = {"action": "remote-disconnected", "remotename": remotename, "reason": reason}
        await holder.send(json.dumps(event))

    async def handle(self, connection: ServerConnection) -> None:
        self.attempts += 1
        assert connection.request is not None
        if connection.request.headers.get("Authorization") != f"Bearer {self.token}":
            await connection.send(json.dumps(self.refusal_frame))
            await connection.close(self.refusal_close_code)
            return
        try:
            async for frame in connection:
                await self._receive(connection, json.loads(frame))
        finally:
            for name, serving in list(self.serving.items()):
                if serving is connection:
                    del self.serving[name]

    async def _receive(self, connection: ServerConnection, message: dict[str, Any]) -> None:
        action, body = message.get("action"), message.get("body", {})
        if action == "remote-call-result":
            assert "nonce" not in message
            self._pending.pop(message["requestId"]).set_result(message)
        elif action == "remote-call":  # answered later: the reader must keep reading
            task = asyncio.create_task(self._forward(connection, message["nonce"], body))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            reply = self._answer(connection, action, body)
            await connection.send(json.dumps(reply | {"nonce": message["nonce"]}))

    def _answer(self, connection: ServerConnection, action: Any, body: dict[str, Any]) -> dict[str, Any]:
        if action == "ping":
            return {"pong": True}
        if action == "remote-list":
            return {
                "remotes": [
                    {"remotename": registration["remotename"], **tool}
                    for registration in self.registrations
                    if registration["remotename"] in self.serving
                    for tool in registration["tools"]
                ]
            }
        if action != "remote-connect":
            return {"error": f"unknown action '{action}'"}
        name = body["remotename"]
        if self.still_connected or name in self.serving:
            self.still_connected = max(0, self.still_connected - 1)
            return {"error": f"remote '{name}' is already connected"}
        if self.connect_error:
            return {"error": self.connect_error}
        self.serving[name] = connection
        self.registrations.append(body)
        return {"message": "remote connected", "remotename": name}

    async def _forward(self, caller: ServerConnection, nonce: Any, body: dict[str, Any]) -> None:
        self.calls.append(body)
        name = body["remotename"]
        if name in self.serving:
            result = await self.call(name, body["function"], body["args"])
            reply = {key: result[key] for key in ("result", "error") if key in result}
        else:
            reply = {"error": f"no connected remote named '{name}'"}
        await caller.send(json.dumps(reply | {"nonce": nonce}))


@pytest_asyncio.fixture
async def dispatch() -> AsyncIterator[FakeDispatch]:
    fake = FakeDispatch()
    async with serve(fake.handle, "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        fake.url = f"ws://127.0.0.1:{port}/ws"
        yield fake


@pytest_asyncio.fixture
async def start_serving() -> AsyncIterator[Callable[[Remote], asyncio.Task[NoReturn]]]:
    """Start ``remote.serve()`` as a task; every task is cancelled after the test."""
    tasks: list[asyncio.Task[NoReturn]] = []

    def start(remote: Remote) -> asyncio.Task[NoReturn]:
        tasks.append(asyncio.create_task(remote.serve()))
        return tasks[-1]

    yield start
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.fixture(autouse=True)
def _quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reconnect and re-register after 10 ms instead of 0.5 s."""
    monkeypatch.setattr("remotes.client.remote.RECONNECT_DELAY", 0.01)


ROOT = Path(__file__).resolve().parents[3]


async def serve_weather_example(dispatch: FakeDispatch) -> asyncio.subprocess.Process:
    """``python -m remotes.client serve examples/weather_service.py:remote`` against
    ``dispatch``, as a user runs it (stderr piped for the test to read)."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "remotes.client", "serve", "examples/weather_service.py:remote",
        "--url", dispatch.url, "--token", dispatch.token,
        cwd=ROOT,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
