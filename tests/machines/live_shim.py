"""A fake protocol-2.1 shim for the live-operation tests
(docs/shim-protocol.md#live-operations-21).

``LiveMachine(shim)`` replaces a ``FakeShim``'s handler: a streamed ``EXECUTE_COMMAND``
sends its output as ``COMMAND_OUTPUT`` frames, never past the ``FLOW`` credit the platform
granted (the window from its ``HELLO_ACK``), answers a ``CANCEL`` with ``ACK`` to the
CANCEL's id and ends the command ``cancelled``, and takes ``COMMAND_INPUT`` when asked
``stdin: "stream"`` (granting stdin credit as it "writes"). Everything else goes to the
shim's in-memory machine.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Callable
from typing import Any

from tests.machines.conftest import FakeShim, frame

Script = Callable[[dict[str, Any]], AsyncIterator[tuple[str, bytes]]]


async def lines(count: int, *, stream: str = "stdout", pause: float = 0.0) -> AsyncIterator[tuple[str, bytes]]:
    for index in range(count):
        yield stream, f"line {index}\n".encode()
        if pause:
            await asyncio.sleep(pause)


async def endless(chunk: int = 16 * 1024) -> AsyncIterator[tuple[str, bytes]]:
    while True:
        yield "stdout", b"x" * chunk
        await asyncio.sleep(0)


class LiveMachine:
    """The 2.1 behaviour of one fake shim; ``script(payload)`` yields ``(stream, bytes)``."""

    def __init__(self, shim: FakeShim, script: Script | None = None, *, skip_seq: int | None = None) -> None:
        self.shim = shim
        self.script: Script = script or (lambda payload: lines(3))
        self.skip_seq = skip_seq
        self.sent: dict[str, dict[str, int]] = {}  # request id → raw bytes sent per stream
        self.stdin: dict[str, bytearray] = {}
        self.stdin_eof: set[str] = set()
        self.acked: set[str] = set()
        self.running: set[str] = set()
        self.exit_code = 0
        self.stdin_paused = False  # stop taking COMMAND_INPUT (a command that does not read)
        self.ignore_stdin = False  # exit without reading stdin (a destination that ends first)
        self.after_stdin: Callable[[bytes], bytes] | None = None  # stdout written after stdin's EOF
        self.window = int(shim.ack["payload"]["limits"]["stream_window_bytes"])
        shim.handler = self.handle

    # --- what the platform sent ------------------------------------------------------------

    def credit(self, request_id: str, stream: str) -> int:
        totals = [
            f["payload"]["credit_total"]
            for f in self.shim.frames
            if f["type"] == "FLOW" and f["payload"]["request_id"] == request_id and f["payload"]["stream"] == stream
        ]
        return max([self.window, *totals])

    def flows(self, request_id: str) -> list[dict[str, Any]]:
        return [
            f["payload"] for f in self.shim.frames if f["type"] == "FLOW" and f["payload"]["request_id"] == request_id
        ]

    def cancels(self, request_id: str, *, since: int = 0) -> list[dict[str, Any]]:
        """The CANCELs received for ``request_id`` (from frame ``since`` on: a command only
        heeds those that came after it started, as the real shim does)."""
        return [
            f for f in self.shim.frames[since:] if f["type"] == "CANCEL" and f["payload"]["request_id"] == request_id
        ]

    async def _answer_cancels(self) -> None:
        for cancel in [f for f in self.shim.frames if f["type"] == "CANCEL" and f["id"] not in self.acked]:
            self.acked.add(cancel["id"])
            await self.shim.send(frame("ACK", {}, message_id=cancel["id"]))

    async def _take_input(self, request_id: str) -> None:
        if self.stdin_paused:
            return
        for message in [f for f in self.shim.frames if f["type"] == "COMMAND_INPUT" and not f.get("_taken")]:
            if message["payload"]["request_id"] != request_id:
                continue
            message["_taken"] = True
            data = base64.b64decode(message["payload"]["data"])
            self.stdin.setdefault(request_id, bytearray()).extend(data)
            if message["payload"]["eof"]:
                self.stdin_eof.add(request_id)
            total = len(self.stdin[request_id]) + self.window
            flow = {"request_id": request_id, "stream": "stdin", "credit_total": total}
            await self.shim.send(frame("FLOW", flow))

    # --- serving ---------------------------------------------------------------------------

    async def handle(self, request: dict[str, Any]) -> dict[str, Any] | None:
        payload = request["payload"]
        if request["type"] != "EXECUTE_COMMAND" or not payload.get("stream"):
            return await self.shim.memory_handler(request)
        request_id = request["id"]
        started = len(self.shim.frames)  # from now on: an older CANCEL of a reused id is not this command's
        sent = self.sent.setdefault(request_id, {"stdout": 0, "stderr": 0})
        self.running.add(request_id)
        seq = 0
        cancelled = False
        binary = bool(payload.get("binary"))
        try:
            async for stream, data in self.script(payload):
                while True:
                    await self._answer_cancels()
                    await self._take_input(request_id)
                    if self.cancels(request_id, since=started):
                        cancelled = True
                        break
                    if sent[stream] + len(data) <= self.credit(request_id, stream):
                        break
                    await asyncio.sleep(0.005)
                if cancelled:
                    break
                if seq == self.skip_seq:
                    seq += 1  # a frame lost on the way
                encoded = base64.b64encode(data).decode() if binary else data.decode("utf-8", "replace")
                output = {"stream": stream, "data": encoded, "encoding": "base64" if binary else "utf-8", "seq": seq}
                await self.shim.send(frame("COMMAND_OUTPUT", output, message_id=request_id))
                sent[stream] += len(data)
                seq += 1
            if payload.get("stdin") == "stream" and not cancelled and not self.ignore_stdin:
                while request_id not in self.stdin_eof and not self.cancels(request_id, since=started):
                    await self._answer_cancels()
                    await self._take_input(request_id)
                    await asyncio.sleep(0.005)
                cancelled = bool(self.cancels(request_id, since=started))
                if self.after_stdin is not None and not cancelled:
                    written = self.after_stdin(bytes(self.stdin.get(request_id, b"")))
                    output = {"stream": "stdout", "data": written.decode(), "encoding": "utf-8", "seq": seq}
                    await self.shim.send(frame("COMMAND_OUTPUT", output, message_id=request_id))
                    sent["stdout"] += len(written)
            await self._answer_cancels()
        finally:
            self.running.discard(request_id)
        return {
            "type": "COMMAND_RESULT",
            "payload": {
                "stdout": "",
                "stderr": "",
                "exit_code": -15 if cancelled else self.exit_code,
                "timed_out": False,
                "duration_seconds": 0.01,
                "output_truncated": False,
                "stdout_bytes": sent["stdout"],
                "stderr_bytes": sent["stderr"],
                "stream_truncated": False,
                "cancelled": cancelled,
            },
        }
