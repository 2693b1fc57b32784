"""Shared pieces of the shim tests: an allowed root, an Operations factory, and a fake
platform speaking ``/ws/shim/`` (docs/shim-protocol.md). No Django, no database."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from machines.shim import AuditLog, Limits, MachineIdentity, Operations, PathJail, Shim, ShimError

TEST_LIMITS = Limits(
    max_file_size_bytes=1024, command_timeout_seconds=5, max_command_timeout_seconds=20, max_concurrent=2
)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The allowed root (a real directory, resolved)."""
    directory = tmp_path / "root"
    directory.mkdir()
    return directory.resolve()


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory next to the root, outside it, with a file in it."""
    directory = tmp_path / "outside"
    directory.mkdir()
    (directory / "secret.txt").write_text("outside secret")
    return directory.resolve()


@pytest.fixture
def identity() -> MachineIdentity:
    return MachineIdentity.detect(str(uuid.uuid4()), "testbox")


@pytest.fixture
def make_operations(root: Path, identity: MachineIdentity) -> Callable[..., Operations]:
    def make(
        *,
        capabilities: tuple[str, ...] = ("shell", "files"),
        limits: Limits = TEST_LIMITS,
        protocol_version: str = "2.1",
    ) -> Operations:
        return Operations(
            jail=PathJail([root]),
            limits=limits,
            capabilities=capabilities,
            identity=identity,
            protocol_version=protocol_version,
        )

    return make


@pytest.fixture
def ops(make_operations: Callable[..., Operations]) -> Operations:
    return make_operations()


Refusal = Callable[[Operations, str, dict[str, Any]], Awaitable[ShimError]]


async def _refusal(operations: Operations, op: str, payload: dict[str, Any]) -> ShimError:
    try:
        response = await operations.perform(op, payload)
    except ShimError as error:
        return error
    raise AssertionError(f"{op} succeeded: {response!r}")


@pytest.fixture
def refusal() -> Refusal:
    """``await refusal(ops, op, payload)``: the ShimError ``op`` fails with (the test
    fails if it succeeds)."""
    return _refusal


class Processes:
    """Looks at processes by pid (a zombie awaiting its reaper counts as gone)."""

    @staticmethod
    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return fields[0] in ("Z", "X")
        return False

    def wait_gone(self, pid: int, within: float = 5.0) -> bool:
        """Whether ``pid`` is gone within ``within`` seconds (a kill takes a moment)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.gone(pid):
                return True
            time.sleep(0.02)
        return self.gone(pid)


@pytest.fixture
def processes() -> Processes:
    return Processes()


class PlatformSide:
    """The platform's end of one shim connection: send requests, await their responses."""

    def __init__(self, connection: ServerConnection, hello: dict[str, Any]) -> None:
        self.connection = connection
        self.hello = hello
        self.frames: list[dict[str, Any]] = []  # every frame received after HELLO
        self._waiting: dict[str, asyncio.Future[dict[str, Any]]] = {}

    def deliver(self, frame: dict[str, Any]) -> None:
        self.frames.append(frame)
        waiter = self._waiting.pop(frame.get("id"), None)
        if waiter is not None and not waiter.done():
            waiter.set_result(frame)

    async def send(
        self,
        frame_type: str,
        payload: dict[str, Any],
        *,
        frame_id: str | None = None,
        session_id: str | None = "agt_test",
    ) -> str:
        frame_id = frame_id or str(uuid.uuid4())
        await self.connection.send(
            json.dumps(
                {
                    "type": frame_type,
                    "id": frame_id,
                    "ts": time.time(),
                    "version": "2.0",
                    "session_id": session_id,
                    "target_machine": self.hello["payload"]["machine_id"],
                    "payload": payload,
                }
            )
        )
        return frame_id

    def expect(self, frame_id: str) -> asyncio.Future[dict[str, Any]]:
        """A future for the response with ``frame_id`` (register before sending)."""
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[frame_id] = future
        return future

    async def request(self, frame_type: str, payload: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        """Send a request and return the whole response frame (at most 10 s)."""
        frame_id = str(uuid.uuid4())
        response = self.expect(frame_id)
        await self.send(frame_type, payload, frame_id=frame_id, **kwargs)
        async with asyncio.timeout(10):
            return await response


class FakePlatform:
    """A bare websockets server playing the platform's ``/ws/shim/`` side: checks the
    bearer token, reads HELLO, answers HELLO_ACK, then hands each connection to the test."""

    token = "shim-test-token"

    def __init__(self) -> None:
        self.url = ""
        self.attempts = 0  # websocket upgrades requested
        self.hellos: list[dict[str, Any]] = []
        self.sides: asyncio.Queue[PlatformSide] = asyncio.Queue()
        self.granted: list[str] = ["shell", "files"]
        self.limits: dict[str, Any] = {
            "max_file_size_bytes": 10 * 1024 * 1024,
            "command_timeout_seconds": 30,
            "max_command_timeout_seconds": 600,
            "max_concurrent": 4,
        }
        self.protocol_version = "2.0"  # what HELLO_ACK negotiates (2.1: live operations)
        self.upgrade_status: int | None = None  # answer the upgrade with this HTTP status
        self.send_ack = True
        self.paths: list[str] = []

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        self.attempts += 1
        self.paths.append(request.path)
        if self.upgrade_status is not None:
            return Response(self.upgrade_status, "refused", Headers(), b"refused\n")
        return None

    async def handle(self, connection: ServerConnection) -> None:
        assert connection.request is not None
        if connection.request.headers.get("Authorization") != f"Bearer {self.token}":
            await connection.send(
                json.dumps(
                    {
                        "type": "ERROR",
                        "id": None,
                        "payload": {"code": "AUTH_FAILED", "message": "bad token", "fatal": True},
                    }
                )
            )
            await connection.close(4401)
            return
        hello = json.loads(await connection.recv())
        self.hellos.append(hello)
        side = PlatformSide(connection, hello)
        if self.send_ack:
            await connection.send(
                json.dumps(
                    {
                        "type": "HELLO_ACK",
                        "id": hello["id"],
                        "ts": time.time(),
                        "version": "2.0",
                        "session_id": None,
                        "target_machine": None,
                        "payload": {
                            "protocol_version": self.protocol_version,
                            "connection_id": f"conn-{len(self.hellos)}",
                            "granted_capabilities": self.granted,
                            "limits": self.limits,
                        },
                    }
                )
            )
        await self.sides.put(side)
        with contextlib.suppress(Exception):
            async for text in connection:
                side.deliver(json.loads(text))

    async def next_side(self, within: float = 10) -> PlatformSide:
        async with asyncio.timeout(within):
            return await self.sides.get()


@pytest_asyncio.fixture
async def platform() -> AsyncIterator[FakePlatform]:
    fake = FakePlatform()
    async with serve(fake.handle, "127.0.0.1", 0, process_request=fake.process_request) as server:
        port = server.sockets[0].getsockname()[1]
        fake.url = f"http://127.0.0.1:{port}"
        yield fake


@pytest.fixture
def make_shim(root: Path, tmp_path: Path, platform: FakePlatform) -> Callable[..., Shim]:
    def make(**overrides: Any) -> Shim:
        options: dict[str, Any] = {
            "server": platform.url,
            "token": platform.token,
            "identity": MachineIdentity.detect(str(uuid.uuid4()), "laptop"),
            "jail": PathJail([root]),
            "audit": AuditLog(tmp_path / "audit.jsonl"),
            "backoff_scale": 0.001,
            "handshake_timeout": 5.0,
        }
        options.update(overrides)
        return Shim(**options)

    return make
