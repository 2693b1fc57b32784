"""The baseline of bench/machines.py (B4, B5) and, extended, of bench/live.py: a bare
``websockets`` server that real shims connect to and that relays the same envelopes
(``machines.py relay --port P`` runs it alone).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from common import encode, free_port, stop_process, wait_for_port
from machines_common import CHUNK_BYTES, MAX_MESSAGE, REPO, SCRIPT, SESSION, MiB, envelope

# --- the baseline: a bare websockets relay between callers and shims ----------------------


@dataclass
class ShimLink:
    """A shim connected to the relay."""

    ws: Any
    machine_id: str
    display_name: str
    roots: list[str]


class RelayError(Exception):
    def __init__(self, payload: dict[str, Any]) -> None:
        super().__init__(payload.get("message"))
        self.payload = payload


class MachineRelay:
    """Shims on ``/ws/shim/`` (HELLO → HELLO_ACK), callers anywhere else.

    A caller sends ``{type, id, payload, target_machine?}`` (an operation, or ``COPY``); the
    relay picks the shim (the target by id or display name, else the one whose root holds
    the path, else the first), stamps ``target_machine``/``session_id``, forwards it, and
    sends the shim's response back with the caller's ``id``. Every frame is parsed and
    re-serialised. ``COPY`` runs the copy sequence of machines/services/copy.py here.
    """

    def __init__(self) -> None:
        self.shims: dict[str, ShimLink] = {}
        self.pending: dict[str, asyncio.Future[dict[str, Any]]] = {}

    async def handle(self, ws: Any) -> None:
        if ws.request.path.startswith("/ws/shim"):
            await self.serve_shim(ws)
        else:
            await self.serve_caller(ws)

    async def serve_shim(self, ws: Any) -> None:
        hello = json.loads(await ws.recv())
        payload = hello["payload"]
        link = ShimLink(ws, payload["machine_id"], payload.get("display_name") or "", list(payload["allowed_roots"]))
        self.shims[link.machine_id] = link
        ack = {
            "protocol_version": "2.0",
            "connection_id": f"relay_{uuid.uuid4().hex[:12]}",
            "granted_capabilities": payload["capabilities"],
            "limits": {
                "max_file_size_bytes": 10 * MiB,
                "command_timeout_seconds": 30,
                "max_command_timeout_seconds": 600,
                "max_concurrent": 4,
            },
        }
        await ws.send(encode(envelope("HELLO_ACK", ack, id=hello["id"])))
        try:
            async for text in ws:
                frame = json.loads(text)
                if frame["type"] == "PING":
                    await ws.send(encode(envelope("PONG", {}, id=frame["id"])))
                    continue
                waiting = self.pending.pop(frame.get("id"), None)
                if waiting is not None and not waiting.done():
                    waiting.set_result(frame)
        finally:
            if self.shims.get(link.machine_id) is link:
                del self.shims[link.machine_id]

    def choose(self, target: str | None, payload: dict[str, Any]) -> ShimLink:
        links = list(self.shims.values())
        if target:
            for link in links:
                if target in (link.machine_id, link.display_name):
                    return link
            raise RelayError({"code": "MACHINE_NOT_ATTACHED", "message": f"no machine {target!r}"})
        path = payload.get("path") or payload.get("src") or ""
        for link in links:
            if any(path == root or path.startswith(root.rstrip("/") + "/") for root in link.roots):
                return link
        if not links:
            raise RelayError({"code": "MACHINE_NOT_ATTACHED", "message": "no machine"})
        return links[0]

    async def op(self, link: ShimLink, message_type: str, payload: dict[str, Any], session_id: str) -> dict[str, Any]:
        """Send one operation to ``link`` and return the shim's response frame (parsed)."""
        frame = envelope(message_type, payload, session_id=session_id, target_machine=link.machine_id)
        answer = asyncio.get_running_loop().create_future()
        self.pending[frame["id"]] = answer
        await link.ws.send(encode(frame))
        return await answer

    async def serve_caller(self, ws: Any) -> None:
        tasks: set[asyncio.Task[None]] = set()
        async for text in ws:
            task = asyncio.create_task(self.answer(ws, json.loads(text)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def answer(self, ws: Any, request: dict[str, Any]) -> None:
        session_id = request.get("session_id") or SESSION
        try:
            if request["type"] == "COPY":
                reply = {"type": "COPY_RESULT", "payload": await self.copy(request["payload"], session_id)}
            else:
                link = self.choose(request.get("target_machine"), request["payload"])
                response = await self.op(link, request["type"], request["payload"], session_id)
                reply = {"type": response["type"], "payload": response["payload"], "machine_id": link.machine_id}
        except RelayError as error:
            reply = {"type": "ERROR", "payload": error.payload}
        await ws.send(encode({**reply, "id": request["id"]}))

    async def copy(self, request: dict[str, Any], session_id: str) -> dict[str, Any]:
        source = self.choose(request["source_machine"], {})
        destination = self.choose(request["destination_machine"], {})
        source_path, destination_path = request["source_path"], request["destination_path"]

        async def op(link: ShimLink, message_type: str, payload: dict[str, Any]) -> dict[str, Any]:
            response = await self.op(link, message_type, payload, session_id)
            if response["type"] == "ERROR":
                raise RelayError(response["payload"])
            result: dict[str, Any] = response["payload"]
            return result

        stat = await op(source, "FILE_STAT", {"path": source_path})
        total = int(stat["size_bytes"])
        if (await op(destination, "FILE_STAT", {"path": destination_path}))["exists"]:
            raise RelayError({"code": "PATH_EXISTS", "message": destination_path})
        partial = destination_path + ".dispatch-partial"
        offset, first = 0, True
        while first or offset < total:
            chunk = await op(
                source,
                "FILE_READ",
                {"path": source_path, "encoding": "base64", "offset": offset, "length": CHUNK_BYTES},
            )
            await op(
                destination,
                "FILE_WRITE",
                {
                    "path": partial,
                    "content": chunk["content"],
                    "encoding": "base64",
                    "append": not first,
                    "create_parents": first,
                },
            )
            try:
                read = len(base64.b64decode(chunk["content"], validate=True))
            except binascii.Error:
                raise RelayError({"code": "INVALID_RESPONSE", "message": "not base64"}) from None
            first = False
            offset += read
            if read == 0:
                break
        source_final = await op(source, "FILE_STAT", {"path": source_path, "hash": True})
        copied = await op(destination, "FILE_STAT", {"path": partial, "hash": True})
        if (copied["size_bytes"], copied["sha256"]) != (source_final["size_bytes"], source_final["sha256"]):
            raise RelayError({"code": "COPY_VERIFICATION_FAILED", "message": "mismatch"})
        await op(destination, "FILE_MOVE", {"src": partial, "dst": destination_path, "overwrite": False})
        return {"size_bytes": source_final["size_bytes"], "sha256": source_final["sha256"]}


async def run_relay(port: int, relay: MachineRelay | None = None) -> None:
    """Serve ``relay`` (a ``MachineRelay``; the live bench passes its own subclass) on
    ``port`` until SIGTERM or SIGINT."""
    from websockets.asyncio.server import serve

    relay = relay or MachineRelay()
    stop = asyncio.get_running_loop().create_future()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set_result, None)
    # No compression: daphne does not negotiate permessage-deflate, so both move the same bytes.
    async with serve(relay.handle, "127.0.0.1", port, compression=None, max_size=MAX_MESSAGE):
        print(f"listening on {port}", flush=True)
        await stop


@contextlib.contextmanager
def relay_server() -> Iterator[tuple[str, int]]:
    """Run the relay (bench/machines.py's ``relay`` mode) on a free port; yields (base URL, pid)."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="bench-machine-relay-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "relay", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    try:
        wait_for_port(port, proc)
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        stop_process(proc)
        log.close()
        os.unlink(log.name)


class RelayCaller:
    """A caller of the relay: one request at a time, replies matched by ``id``."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws

    @classmethod
    async def open(cls, base_url: str) -> RelayCaller:
        from websockets.asyncio.client import connect

        url = base_url.replace("http://", "ws://") + "/caller"
        return cls(await connect(url, compression=None, max_size=MAX_MESSAGE, open_timeout=10))

    async def request(self, message_type: str, payload: dict[str, Any], target: str | None = None) -> dict[str, Any]:
        request_id = str(uuid.uuid4())
        frame = {"type": message_type, "id": request_id, "session_id": SESSION, "payload": payload}
        if target:
            frame["target_machine"] = target
        await self.ws.send(encode(frame))
        while True:
            reply: dict[str, Any] = json.loads(await self.ws.recv())
            if reply.get("id") == request_id:
                return reply

    async def close(self) -> None:
        await self.ws.close()
