"""The baseline of bench/live.py's B10: machines_relay.py's ``MachineRelay``, extended to relay
streamed frames (``live.py relay --port P`` runs it alone), and ``child``, which runs
live.py in one of its modes (the relay, B12's fleet).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common import encode, free_port, stop_process, wait_for_port
from live_common import DEFAULT_LIMITS, LIVE_VERSION, REPO, SCRIPT, SESSION
from machines_common import envelope
from machines_relay import MachineRelay, RelayError, ShimLink
from machines_relay import run_relay as serve_relay

# --- the baseline: a bare websockets relay that also relays streamed frames --------------


class LiveRelay(MachineRelay):
    """machines_relay.py's ``MachineRelay``, speaking 2.1 to the shims: a caller's ``EXECUTE_COMMAND``
    with ``stream: true`` gets every frame the shim sends under that id (``COMMAND_OUTPUT``…,
    then ``COMMAND_RESULT`` or ``ERROR``), each parsed and re-serialised; a caller's
    ``CANCEL {request_id}`` goes to the shim running it with a fresh id (its ``ACK`` is
    dropped). No credit is granted: B10's output is far below the initial window."""

    def __init__(self) -> None:
        super().__init__()
        self.streams: dict[str, Any] = {}  # operation id -> the caller's websocket
        self.running_on: dict[str, Any] = {}  # operation id -> ShimLink
        self.cancels: set[str] = set()

    async def serve_shim(self, ws: Any) -> None:
        hello = json.loads(await ws.recv())
        payload = hello["payload"]
        link = ShimLink(ws, payload["machine_id"], payload.get("display_name") or "", list(payload["allowed_roots"]))
        self.shims[link.machine_id] = link
        ack = {
            "protocol_version": LIVE_VERSION,
            "connection_id": f"relay_{uuid.uuid4().hex[:12]}",
            "granted_capabilities": payload["capabilities"],
            "limits": DEFAULT_LIMITS.as_payload(),
        }
        frame = envelope("HELLO_ACK", ack, id=hello["id"])
        frame["version"] = LIVE_VERSION
        await ws.send(encode(frame))
        try:
            async for text in ws:
                frame = json.loads(text)
                frame_id = frame.get("id")
                if frame["type"] == "PING":
                    pong = envelope("PONG", {}, id=frame_id)
                    pong["version"] = LIVE_VERSION
                    await ws.send(encode(pong))
                    continue
                if frame_id in self.cancels:
                    self.cancels.discard(frame_id)
                    continue
                caller = self.streams.get(frame_id)
                if caller is not None:
                    if frame["type"] in ("COMMAND_RESULT", "ERROR"):
                        del self.streams[frame_id]
                        self.running_on.pop(frame_id, None)
                    with contextlib.suppress(Exception):
                        await caller.send(encode({"type": frame["type"], "id": frame_id, "payload": frame["payload"]}))
                    continue
                waiting = self.pending.pop(frame_id, None)
                if waiting is not None and not waiting.done():
                    waiting.set_result(frame)
        finally:
            if self.shims.get(link.machine_id) is link:
                del self.shims[link.machine_id]

    async def answer(self, ws: Any, request: dict[str, Any]) -> None:
        payload = request.get("payload") or {}
        if request["type"] == "EXECUTE_COMMAND" and payload.get("stream"):
            try:
                link = self.choose(request.get("target_machine"), payload)
            except RelayError as error:
                await ws.send(encode({"type": "ERROR", "id": request["id"], "payload": error.payload}))
                return
            frame = envelope("EXECUTE_COMMAND", payload, session_id=SESSION, target_machine=link.machine_id)
            frame["id"] = request["id"]
            frame["version"] = LIVE_VERSION
            self.streams[frame["id"]] = ws
            self.running_on[frame["id"]] = link
            await link.ws.send(encode(frame))
        elif request["type"] == "CANCEL":
            operation = str(payload.get("request_id"))
            link = self.running_on.get(operation)
            if link is not None:
                frame = envelope("CANCEL", {"request_id": operation}, session_id=SESSION)
                frame["version"] = LIVE_VERSION
                self.cancels.add(frame["id"])
                await link.ws.send(encode(frame))
        else:
            await super().answer(ws, request)


async def run_relay(port: int) -> None:
    """The streaming relay on ``port`` (``machines_relay.run_relay`` with a ``LiveRelay``)."""
    await serve_relay(port, LiveRelay())


@contextlib.contextmanager
def child(args: list[str], name: str, ready: str, timeout: float = 60) -> Iterator[subprocess.Popen[bytes]]:
    """Run bench/live.py in another mode; yields once it printed ``ready``; always stopped."""
    log = tempfile.NamedTemporaryFile(prefix=f"bench-live-{name}-", suffix=".log", delete=False, mode="w+")
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + timeout
        while ready not in Path(log.name).read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start:\n{Path(log.name).read_text()[-3000:]}")
            time.sleep(0.05)
        yield proc
    finally:
        stop_process(proc)
        log.close()
        os.unlink(log.name)


@contextlib.contextmanager
def relay_server() -> Iterator[tuple[str, int]]:
    port = free_port()
    with child(["relay", "--port", str(port)], "relay", f"listening on {port}") as proc:
        wait_for_port(port, proc)
        yield f"http://127.0.0.1:{port}", proc.pid
