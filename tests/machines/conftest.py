"""Shared pieces of the machines server tests: ``FakeShim`` (docs/shim-protocol.md).

A ``FakeShim`` is a ``WebsocketCommunicator`` on ``/ws/shim/`` through the real ASGI
application, authenticated by an ``Authorization: Bearer`` header. It sends ``HELLO``,
keeps the ``HELLO_ACK`` and then answers the platform's operations from ``handler``
(by default a small in-memory machine: files under its allowed roots and an echoing
``EXECUTE_COMMAND``). Nothing here touches the database unless a test asks for a shim,
so the shim engineer's tests in ``shim/`` are unaffected.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import posixpath
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest_asyncio
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator

from machines.protocol import OPERATIONS

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any] | None]]
SHIM_PATH = "/ws/shim/"


def hello_payload(**overrides: Any) -> dict[str, Any]:
    """A valid HELLO payload with ``overrides`` applied."""
    payload: dict[str, Any] = {
        "shim_version": "0.1.0",
        "protocol_version": "2.0",
        "machine_id": str(uuid.uuid4()),
        "hostname": "laptop",
        "display_name": None,
        "platform": "linux",
        "arch": "x86_64",
        "capabilities": ["shell", "files"],
        "allowed_roots": ["/home/alice"],
        "sessions": ["*"],
        "hardware_devices": [],
    }
    payload.update(overrides)
    return payload


def frame(message_type: str, payload: Any, *, message_id: str | None = None) -> dict[str, Any]:
    """A shim → platform frame in the protocol's envelope."""
    return {
        "type": message_type,
        "id": message_id or str(uuid.uuid4()),
        "ts": time.time(),
        "version": "2.0",
        "session_id": None,
        "target_machine": None,
        "payload": payload,
    }


async def until(predicate: Callable[[], Any], timeout: float = 3.0, what: str = "condition") -> Any:
    """Poll ``predicate`` every 10 ms until it is truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


class ShimFailure(Exception):
    """Raised by a handler to answer with ``ERROR {code, message}``."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(message or code)
        self.code = code


class FakeShim:
    """One shim connection driven by the test.

    ``requests`` holds every platform → shim request (operations, ``PING``), ``frames``
    everything else (``ERROR``, ``SESSION_REVOKED`` …). ``handler(request)`` returns the
    response ``{"type", "payload"}`` or ``None`` to leave the request unanswered; the
    default is ``memory_handler``. ``files`` is the in-memory file system.
    """

    def __init__(self, communicator: WebsocketCommunicator, hello: dict[str, Any]) -> None:
        self.communicator = communicator
        self.hello = hello
        self.machine_id: str = hello["machine_id"]
        self.ack: dict[str, Any] = {}
        self.requests: list[dict[str, Any]] = []
        self.frames: list[dict[str, Any]] = []
        self.files: dict[str, bytes] = {}
        self.handler: Handler = self.memory_handler
        self.answer_pings = True
        self.close_code: int | None = None
        self.closed = False
        self._pump_task: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        self.problems: list[str] = []

    # --- lifecycle -----------------------------------------------------------------------

    async def handshake(self) -> None:
        connected, _ = await self.communicator.connect(timeout=5)
        assert connected
        hello = frame("HELLO", self.hello)
        await self.send(hello)
        message = await self.communicator.receive_output(5)
        assert message["type"] == "websocket.send", f"shim closed during the handshake: {message}"
        ack = json.loads(message["text"])
        assert ack["type"] == "HELLO_ACK", f"expected HELLO_ACK, got {ack}"
        assert ack["id"] == hello["id"]
        self.ack = ack
        self._pump_task = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        while True:
            message = await self.communicator.output_queue.get()
            if message["type"] == "websocket.close":
                self.close_code = message.get("code")
                self.closed = True
                return
            try:
                message["text"].encode("utf-8")  # a real server must be able to send it
            except UnicodeEncodeError as exc:
                self.problems.append(f"the platform sent a frame UTF-8 cannot carry: {exc}")
            received = json.loads(message["text"])
            if received.get("type") in OPERATIONS:
                self.requests.append(received)
                if received["type"] == "PING" and not self.answer_pings:
                    continue
                task = asyncio.ensure_future(self._serve(received))
                self._serving.add(task)
                task.add_done_callback(self._serving.discard)
            else:
                self.frames.append(received)

    async def _serve(self, request: dict[str, Any]) -> None:
        if request["type"] == "PING":
            await self.send(frame("PONG", {}, message_id=request["id"]))
            return
        try:
            response = await self.handler(request)
        except ShimFailure as failure:
            response = {"type": "ERROR", "payload": {"code": failure.code, "message": str(failure), "fatal": False}}
        if response is not None and not self.closed:
            await self.send(frame(response["type"], response["payload"], message_id=request["id"]))

    async def disconnect(self) -> None:
        """Close the socket from the shim's side and wait for the consumer to finish."""
        if self._pump_task is not None:
            self._pump_task.cancel()
        for task in list(self._serving):
            task.cancel()
        self.closed = True
        await self.communicator.disconnect(timeout=3)

    # --- talking -----------------------------------------------------------------------

    async def send(self, message: Any) -> None:
        await self.communicator.send_to(text_data=message if isinstance(message, str) else json.dumps(message))

    def ops(self, op: str | None = None) -> list[dict[str, Any]]:
        """The requests received, optionally only those of type ``op``."""
        return [r for r in self.requests if op is None or r["type"] == op]

    async def next_request(self, op: str, count: int = 1, timeout: float = 3.0) -> dict[str, Any]:
        """Wait until ``count`` requests of type ``op`` arrived; return the last of them."""
        found = await until(lambda: len(self.ops(op)) >= count and self.ops(op), timeout, f"{count} {op}")
        return found[count - 1]

    async def next_frame(self, message_type: str, timeout: float = 3.0) -> dict[str, Any]:
        """Wait for a non-request frame of ``message_type`` (``ERROR``, ``SESSION_REVOKED``)."""
        found = await until(
            lambda: [f for f in self.frames if f["type"] == message_type], timeout, f"a {message_type} frame"
        )
        return found[0]

    async def closed_with(self, timeout: float = 3.0) -> int | None:
        await until(lambda: self.closed, timeout, "the platform to close the socket")
        return self.close_code

    def consumer_alive(self) -> bool:
        """Whether the consumer task is still running (it has not crashed)."""
        future = self.communicator.future
        if future.done() and not future.cancelled() and future.exception() is not None:
            raise future.exception()  # type: ignore[misc]
        return not future.done()

    # --- the default machine -------------------------------------------------------------

    def inside_roots(self, path: Any) -> bool:
        if not isinstance(path, str) or not path.startswith("/"):
            return False
        path = posixpath.normpath(path)
        return any(path == root or path.startswith(root.rstrip("/") + "/") for root in self.hello["allowed_roots"])

    def _jail(self, *paths: Any) -> None:
        for path in paths:
            if not self.inside_roots(path):
                raise ShimFailure("PATH_OUTSIDE_ALLOWED_ROOT", f"{path} is outside the allowed roots")

    async def memory_handler(self, request: dict[str, Any]) -> dict[str, Any] | None:
        """Serve an operation from ``files`` (the protocol's payloads; ``size_bytes`` of a read is the
        whole file's size, as the real shim reports it)."""
        op, payload = request["type"], request["payload"]
        if op == "MACHINE_LIST_REQUEST":
            keys = ("machine_id", "hostname", "display_name", "platform", "arch", "capabilities", "hardware_devices")
            return {"type": "MACHINE_LIST_RESPONSE", "payload": {k: self.hello.get(k) for k in keys}}
        if op == "EXECUTE_COMMAND":
            output = " ".join(payload.get("argv") or [payload.get("command", "")])
            return {
                "type": "COMMAND_RESULT",
                "payload": {
                    "stdout": output,
                    "stderr": "",
                    "exit_code": 0,
                    "timed_out": False,
                    "duration_seconds": 0.01,
                    "output_truncated": False,
                },
            }
        if op == "FILE_STAT":
            self._jail(payload["path"])
            data = self.files.get(payload["path"])
            result: dict[str, Any] = {
                "exists": data is not None,
                "is_file": data is not None,
                "is_dir": False,
                "is_symlink": False,
                "size_bytes": len(data) if data is not None else None,
                "mtime": 1.0 if data is not None else None,
                "mode": 420 if data is not None else None,
            }
            if payload.get("hash"):
                result["sha256"] = hashlib.sha256(data).hexdigest() if data is not None else None
            return {"type": "FILE_STAT_RESPONSE", "payload": result}
        if op == "FILE_READ":
            self._jail(payload["path"])
            if payload["path"] not in self.files:
                raise ShimFailure("PATH_NOT_FOUND", f"{payload['path']} does not exist")
            data = self.files[payload["path"]]
            offset = payload.get("offset") or 0
            length = payload.get("length")
            chunk = data[offset : offset + length] if length is not None else data[offset:]
            encoding = payload.get("encoding", "utf-8")
            content = base64.b64encode(chunk).decode() if encoding == "base64" else chunk.decode()
            return {
                "type": "FILE_CONTENTS",
                "payload": {
                    "content": content,
                    "encoding": encoding,
                    "size_bytes": len(data),
                    "offset": offset,
                    "truncated": offset + len(chunk) < len(data),
                },
            }
        if op == "FILE_WRITE":
            self._jail(payload["path"])
            content = payload["content"]
            data = base64.b64decode(content) if payload.get("encoding") == "base64" else content.encode()
            if payload.get("append"):
                self.files[payload["path"]] = self.files.get(payload["path"], b"") + data
            else:
                self.files[payload["path"]] = data
            return {"type": "ACK", "payload": {"size_bytes_written": len(data)}}
        if op == "FILE_MOVE":
            self._jail(payload["src"], payload["dst"])
            if payload["src"] not in self.files:
                raise ShimFailure("PATH_NOT_FOUND", f"{payload['src']} does not exist")
            if payload["dst"] in self.files and not payload.get("overwrite"):
                raise ShimFailure("PATH_EXISTS", f"{payload['dst']} exists")
            self.files[payload["dst"]] = self.files.pop(payload["src"])
            return {"type": "ACK", "payload": {}}
        if op == "FILE_DELETE":
            self._jail(payload["path"])
            if payload["path"] not in self.files and not payload.get("missing_ok"):
                raise ShimFailure("PATH_NOT_FOUND", f"{payload['path']} does not exist")
            self.files.pop(payload["path"], None)
            return {"type": "ACK", "payload": {}}
        if op == "FILE_LIST":
            self._jail(payload["path"])
            prefix = payload["path"].rstrip("/") + "/"
            entries = [
                {"name": posixpath.basename(p), "path": p, "is_dir": False, "size_bytes": len(d), "mtime": 1.0}
                for p, d in sorted(self.files.items())
                if p.startswith(prefix)
            ]
            return {"type": "FILE_LIST_RESPONSE", "payload": {"entries": entries, "truncated": False}}
        raise ShimFailure("UNSUPPORTED_OPERATION", op)


class Shims:
    """Connect ``FakeShim``s; everything is disconnected at teardown."""

    def __init__(self) -> None:
        self.connected: list[FakeShim] = []

    async def token(self, user: Any, machine_id: str) -> str:
        """A machine token for ``user``'s ``machine_id`` (raw)."""
        from machines.services.device import machine_token_create

        issued = await database_sync_to_async(machine_token_create)(user=user, machine_id=machine_id)
        return issued.raw

    async def connect(self, user: Any = None, *, token: str | None = None, **hello: Any) -> FakeShim:
        """Connect a shim for ``user`` with a fresh machine token (or ``token``) and a
        HELLO built from ``hello`` overrides; returns it after the ``HELLO_ACK``."""
        payload = hello_payload(**hello)
        if token is None:
            token = await self.token(user, payload["machine_id"])
        from dispatch.asgi import application

        communicator = WebsocketCommunicator(
            application, SHIM_PATH, headers=[(b"authorization", f"Bearer {token}".encode())]
        )
        shim = FakeShim(communicator, payload)
        self.connected.append(shim)
        await shim.handshake()
        return shim

    async def close_all(self) -> None:
        from machines.services import audit

        # Let work in flight (snapshot requests, audit records) finish while the shims can
        # still answer; whatever is left fails fast once they are gone.
        if audit._background:
            await asyncio.wait(set(audit._background), timeout=1)
        errors: list[BaseException] = []
        for shim in self.connected:
            try:
                await shim.disconnect()
            except BaseException as exc:  # report the first consumer crash after closing all
                errors.append(exc)
            if shim.problems:
                errors.append(AssertionError(shim.problems[0]))
        pending = set(audit._background)
        if pending:
            _, still = await asyncio.wait(pending, timeout=5)
            for task in still:
                task.cancel()
        if errors:
            raise errors[0]


@pytest_asyncio.fixture
async def shims() -> AsyncIterator[Shims]:
    """``await shims.connect(owner, hostname="laptop")`` → a connected ``FakeShim``."""
    world = Shims()
    try:
        yield world
    finally:
        await world.close_all()


async def settle() -> None:
    """Wait for the audit records (and path recency) written after replies."""
    from machines.services import audit

    pending = set(audit._background)
    if pending:
        await asyncio.wait(pending, timeout=5)


async def eventually(
    read: Callable[[], Awaitable[Any]], check: Callable[[Any], Any] = bool, timeout: float = 3.0
) -> Any:
    """Call the async ``read`` every 20 ms until ``check(value)``; return the value (or
    the last one read, after ``timeout`` seconds, for the test's assertions to judge)."""
    deadline = time.monotonic() + timeout
    while True:
        value = await read()
        if check(value) or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.02)


async def snapshots_stored(user: Any, count: int) -> None:
    """Wait until ``count`` machines of ``user`` have their N = 2 snapshot cached, so the
    consumers' database work is done before a test starts a REST call that waits on a
    shim (see ``test_a_waiting_rest_operation_does_not_block_the_shared_sync_thread``)."""
    from machines.models import Machine

    stored = await eventually(
        database_sync_to_async(lambda: Machine.objects.filter(user=user, snapshot__isnull=False).count()),
        lambda found: found >= count,
    )
    assert stored >= count
