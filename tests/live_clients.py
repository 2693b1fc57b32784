"""Clients of a live server for tests, and helpers for the processes they drive.

``LiveSession`` is a raw client of ``/ws`` (docs/ws-protocol.md#frames); ``MachineApi`` a
client of the machines REST API (README.md#http-api), with ``api_error``, ``InFlight`` (an
operation pending in a thread) and ``children_of`` / ``wait_for_child`` / ``kill_quietly``
for the processes a shim starts. The servers they talk to come from ``tests.infra``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from tests.infra import wait_until

# --- raw /ws clients ---------------------------------------------------------------------


class LiveSession:
    """A raw ``websockets`` client of a live server's ``/ws`` (docs/ws-protocol.md#frames).

    A reader task decodes every frame into ``frames`` (in arrival order); a frame with a
    ``nonce`` resolves ``reply(nonce)`` (``reply_counts`` counts them, to catch duplicates),
    any other frame (events, auth replies, nonce-less errors) queues for ``next_event()``.
    Open one with ``async with LiveSession.open(ws_url, token) as session``.
    """

    def __init__(self, connection: ClientConnection) -> None:
        self.connection = connection
        self.frames: list[Any] = []
        self.reply_counts: Counter[Any] = Counter()
        self._nonces = itertools.count(1)
        self._replies: dict[Any, asyncio.Future[dict[str, Any]]] = {}
        self._events: asyncio.Queue[Any] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    @asynccontextmanager
    async def open(cls, url: str, token: str | None = None, **connect_options: Any) -> AsyncIterator[LiveSession]:
        """Connect to ``url``; ``token`` goes in ``Authorization: Bearer`` (none: authenticate by first frame).

        ``connect_options`` go to ``websockets.asyncio.client.connect`` (e.g. ``max_size``).
        """
        headers = {"Authorization": f"Bearer {token}"} if token is not None else None
        async with connect(url, additional_headers=headers, open_timeout=10, **connect_options) as connection:
            session = cls(connection)
            try:
                yield session
            finally:
                session._reader.cancel()

    async def send(self, message: dict[str, Any] | str) -> None:
        """Send a message (a dict is JSON-encoded; a string goes as is, as one text frame)."""
        await self.connection.send(message if isinstance(message, str) else json.dumps(message))

    async def send_request(self, action: str, body: dict[str, Any] | None = None) -> int:
        """Send ``{"action", "nonce", "body"}`` without waiting; return the nonce."""
        nonce = next(self._nonces)
        await self.send({"action": action, "nonce": nonce, "body": body or {}})
        return nonce

    async def request(self, action: str, body: dict[str, Any] | None = None, timeout: float = 10) -> dict[str, Any]:
        """Send a request and return the whole reply frame (``timeout`` in seconds)."""
        return await self.reply(await self.send_request(action, body), timeout)

    async def reply(self, nonce: Any, timeout: float = 10) -> dict[str, Any]:
        """The first frame carrying ``nonce`` (already received or within ``timeout`` seconds)."""
        future = self._replies.setdefault(nonce, asyncio.get_running_loop().create_future())
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            raise AssertionError(f"no reply to nonce {nonce!r} within {timeout:g}s; {self._seen()}") from None

    async def next_event(self, timeout: float = 10) -> Any:
        """The next frame without a nonce, within ``timeout`` seconds."""
        try:
            return await asyncio.wait_for(self._events.get(), timeout)
        except TimeoutError:
            raise AssertionError(f"no event within {timeout:g}s; {self._seen()}") from None

    def _seen(self) -> str:
        state = f"closed with {self.connection.close_code}" if self.is_closed else "open"
        return f"connection {state}; last frames: {self.frames[-3:]!r}"

    async def closed(self, timeout: float = 10) -> int | None:
        """Wait until the connection closes (``timeout`` seconds); return the close code."""
        await asyncio.wait_for(asyncio.shield(self._reader), timeout)
        return self.connection.close_code

    @property
    def is_closed(self) -> bool:
        return self._reader.done()

    async def _read(self) -> None:
        try:
            async for frame in self.connection:
                message = json.loads(frame)
                self.frames.append(message)
                if isinstance(message, dict) and "nonce" in message:
                    nonce = message["nonce"]
                    self.reply_counts[nonce] += 1
                    future = self._replies.setdefault(nonce, asyncio.get_running_loop().create_future())
                    if not future.done():
                        future.set_result(message)
                else:
                    self._events.put_nowait(message)
        except ConnectionClosed:
            pass


# --- machines: REST client, processes ------------------------------------------------------


@dataclass
class MachineApi:
    """A keep-alive client of the machines REST API (README.md#http-api) of one server, as one user."""

    url: str
    token: str
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=120)

    def op(self, session: str, op: str, payload: dict[str, Any], target: str | None = None) -> httpx.Response:
        body: dict[str, Any] = {"op": op, "payload": payload}
        if target is not None:
            body["target_machine"] = target
        return self.client.post(f"/api/v1/sessions/{session}/ops", json=body)

    def ok(self, session: str, op: str, payload: dict[str, Any], target: str | None = None) -> dict[str, Any]:
        """The response of an operation that must succeed: ``{machine_id, type, payload}``."""
        response = self.op(session, op, payload, target)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def run(self, session: str, argv: list[str], target: str | None = None) -> dict[str, Any]:
        """``EXECUTE_COMMAND argv`` that must exit 0."""
        answer = self.ok(session, "EXECUTE_COMMAND", {"argv": argv}, target)
        assert answer["type"] == "COMMAND_RESULT"
        assert answer["payload"]["exit_code"] == 0, answer
        return answer

    def machines(self, session: str) -> dict[str, dict[str, Any]]:
        """``GET /api/v1/sessions/{session}/machines``, by ``machine_id``."""
        response = self.client.get(f"/api/v1/sessions/{session}/machines")
        assert response.status_code == 200, response.text
        return {entry["machine_id"]: entry for entry in response.json()["machines"]}

    def my_machines(self) -> dict[str, dict[str, Any]]:
        """``GET /api/v1/machines``, by ``machine_id``."""
        response = self.client.get("/api/v1/machines")
        assert response.status_code == 200, response.text
        return {entry["machine_id"]: entry for entry in response.json()["machines"]}

    def copy(self, session: str, **body: Any) -> httpx.Response:
        return self.client.post(f"/api/v1/sessions/{session}/copy", json=body)

    def set_default(self, machine_id: str | None) -> httpx.Response:
        return self.client.put("/api/v1/machines/default", json={"machine_id": machine_id})


def api_error(response: httpx.Response) -> dict[str, Any]:
    """The ``{"error": {code, message, details}}`` body of a failed call."""
    body = response.json()
    assert set(body) == {"error"}, body
    return dict(body["error"])


def children_of(pid: int) -> list[tuple[int, str]]:
    """(pid, command name) of the processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if ppid == pid:
            found.append((int(entry.name), name))
    return found


def wait_for_child(pid: int, command: str, timeout: float = 10) -> int:
    """The pid of ``command`` once process ``pid`` has started it."""
    found = wait_until(
        lambda: [child for child, name in children_of(pid) if name == command],
        timeout=timeout,
        what=f"{command} to start under {pid}",
    )
    return int(found[0])


class InFlight:
    """A machine operation sent from a thread, so a test can act while it is pending.

    ``result(timeout)`` joins it; ``answered_at`` is the ``time.monotonic()`` of the answer.
    """

    def __init__(
        self, api: MachineApi, session: str, op: str, payload: dict[str, Any], target: str | None = None
    ) -> None:
        self.response: httpx.Response | None = None
        self.answered_at = 0.0

        def send() -> None:
            body = {"op": op, "payload": payload, **({"target_machine": target} if target else {})}
            self.response = httpx.post(
                f"{api.url}/api/v1/sessions/{session}/ops",
                json=body,
                headers={"Authorization": f"Bearer {api.token}"},
                timeout=120,
            )
            self.answered_at = time.monotonic()

        self.thread = threading.Thread(target=send, daemon=True)
        self.thread.start()

    def result(self, timeout: float) -> httpx.Response:
        self.thread.join(timeout)
        assert self.response is not None, f"no answer within {timeout:g}s"
        return self.response


def kill_quietly(pid: int) -> None:
    """SIGKILL ``pid`` if it still exists."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
