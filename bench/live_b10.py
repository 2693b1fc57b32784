"""B10 of bench/live.py: the first output byte of a streamed command over REST (SSE), MCP
(``notifications/progress``) and the bare relay, then its cancel; interleaved samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from common import CpuPerOp, encode, latency_summary, with_timeout
from live_common import FIRST_BYTE_COMMAND, MAX_MESSAGE, PROBE_SECONDS, SESSION, Rig, Sizes, Skip, _refused

# --- clients --------------------------------------------------------------------------------


@dataclass
class Sse:
    event: str
    data: Any


async def sse_events(response: Any) -> AsyncIterator[Sse]:
    """The events of a ``text/event-stream`` body (``event:``/``data:`` lines; ``data`` JSON)."""
    event, data = "message", list[str]()
    async for line in response.aiter_lines():
        if line == "":
            if data:
                text = "\n".join(data)
                try:
                    parsed: Any = json.loads(text)
                except ValueError:
                    parsed = text
                yield Sse(event, parsed)
            event, data = "message", list[str]()
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))


async def _read_body(response: Any) -> str:
    with contextlib.suppress(Exception):
        await response.aread()
        return str(response.text)
    return ""


@dataclass
class FirstByte:
    """One B10 sample: ms to the first output, ms from the cancel to the end."""

    first_ms: float
    cancel_ms: float


async def rest_first_byte(http: Any, machine: str) -> FirstByte:
    """REST: a streamed command, time to its first ``output`` event, then the cancel route."""
    request_id = str(uuid.uuid4())
    body = {
        "op": "EXECUTE_COMMAND",
        "target_machine": machine,
        "stream": True,
        "request_id": request_id,
        "payload": {"argv": FIRST_BYTE_COMMAND, "timeout_seconds": 30},
    }
    clock = time.perf_counter
    started = clock()
    try:
        async with asyncio.timeout(PROBE_SECONDS):
            response = await http.send(
                http.build_request("POST", f"/api/v1/sessions/{SESSION}/ops", json=body), stream=True
            )
    except TimeoutError:
        raise Skip(f"POST /ops {{stream: true}} did not start answering within {PROBE_SECONDS:g} s") from None
    async with contextlib.aclosing(response):
        kind = response.headers.get("content-type", "")
        if response.status_code != 200 or not kind.startswith("text/event-stream"):
            await _read_body(response)
            raise Skip(_refused(response, "POST /ops {stream: true}"))
        events = sse_events(response)
        first = None
        async for event in events:
            if event.event == "output":
                first = clock()
                break
            if event.event in ("result", "error"):
                raise RuntimeError(f"the streamed command ended before any output: {event.data}")
        if first is None:
            raise RuntimeError("the event stream ended before any output")
        cancelled_at = clock()
        answer = await http.post(f"/api/v1/sessions/{SESSION}/ops/{request_id}/cancel")
        if answer.status_code == 404 and "OPERATION_NOT_FOUND" not in answer.text:
            raise Skip(_refused(answer, "POST /ops/{request_id}/cancel"))
        if answer.status_code != 202:
            raise RuntimeError(_refused(answer, "POST /ops/{request_id}/cancel"))
        async for event in events:
            if event.event == "result":
                if not event.data["payload"].get("cancelled"):
                    raise RuntimeError(f"the command was not cancelled: {event.data}")
                break
            if event.event == "error":
                raise RuntimeError(f"the cancelled command ended with an error: {event.data}")
        else:
            raise RuntimeError("the event stream ended without a result")
        ended = clock()
    return FirstByte((first - started) * 1000, (ended - cancelled_at) * 1000)


MCP_HEADERS = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-11-25"}


async def mcp_first_byte(http: Any, machine: str, call_id: int) -> FirstByte:
    """MCP: ``tools/call local_pc_execute_command`` with a ``progressToken``; time to the first
    ``notifications/progress``; then ``notifications/cancelled`` and the rest of the stream."""
    token = f"bench-{uuid.uuid4().hex[:12]}"
    call = {
        "jsonrpc": "2.0",
        "id": call_id,
        "method": "tools/call",
        "params": {
            "name": "local_pc_execute_command",
            "arguments": {
                "argv": FIRST_BYTE_COMMAND,
                "timeout_seconds": 30,
                "target_machine": machine,
                "session_id": SESSION,
            },
            "_meta": {"progressToken": token},
        },
    }
    clock = time.perf_counter
    started = clock()
    try:
        async with asyncio.timeout(PROBE_SECONDS):
            response = await http.send(http.build_request("POST", "/mcp", json=call, headers=MCP_HEADERS), stream=True)
    except TimeoutError:
        raise Skip(
            f"tools/call did not start answering within {PROBE_SECONDS:g} s (a JSON answer at the end: "
            "no progress notifications)"
        ) from None
    try:
        kind = response.headers.get("content-type", "")
        if response.status_code != 200 or not kind.startswith("text/event-stream"):
            await _read_body(response)
            raise Skip(_refused(response, "tools/call") + " (no event stream: no progress notifications)")
        events = sse_events(response)
        first = None
        try:
            async with asyncio.timeout(PROBE_SECONDS):
                async for event in events:
                    message = event.data if isinstance(event.data, dict) else {}
                    if message.get("method") == "notifications/progress":
                        if message["params"].get("progressToken") != token:
                            raise RuntimeError(f"progress for another token: {message}")
                        first = clock()
                        break
                    if message.get("id") == call_id:
                        raise Skip(f"the call ended without a progress notification: {str(message)[:200]}")
        except TimeoutError:
            raise Skip(f"no notifications/progress within {PROBE_SECONDS:g} s") from None
        if first is None:
            raise Skip("the event stream ended without a progress notification")
        cancelled_at = clock()
        cancel = {
            "jsonrpc": "2.0",
            "method": "notifications/cancelled",
            "params": {"requestId": call_id, "reason": "bench"},
        }
        answer = await http.post("/mcp", json=cancel, headers=MCP_HEADERS)
        if answer.status_code != 202:
            raise RuntimeError(_refused(answer, "notifications/cancelled"))
        try:
            async with asyncio.timeout(PROBE_SECONDS):
                async for event in events:
                    message = event.data if isinstance(event.data, dict) else {}
                    if message.get("id") == call_id:
                        break
        except TimeoutError:
            raise Skip(
                f"notifications/cancelled did not end the call within {PROBE_SECONDS:g} s (the command runs on)"
            ) from None
        ended = clock()
    finally:
        await response.aclose()
    return FirstByte((first - started) * 1000, (ended - cancelled_at) * 1000)


class RelayStreamCaller:
    """A websocket caller of the bare relay for B10."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws

    @classmethod
    async def open(cls, base_url: str) -> RelayStreamCaller:
        from websockets.asyncio.client import connect

        url = base_url.replace("http://", "ws://") + "/caller"
        return cls(await connect(url, compression=None, max_size=MAX_MESSAGE, open_timeout=10))

    async def first_byte(self, machine: str) -> FirstByte:
        request_id = str(uuid.uuid4())
        frame = {
            "type": "EXECUTE_COMMAND",
            "id": request_id,
            "target_machine": machine,
            "payload": {"argv": FIRST_BYTE_COMMAND, "timeout_seconds": 30, "stream": True},
        }
        clock = time.perf_counter
        started = clock()
        await self.ws.send(encode(frame))
        try:
            async with asyncio.timeout(PROBE_SECONDS):
                while True:
                    reply = json.loads(await self.ws.recv())
                    if reply.get("id") != request_id:
                        continue
                    if reply["type"] == "COMMAND_OUTPUT":
                        break
                    raise Skip(
                        f"the shim answered {reply['type']} without any COMMAND_OUTPUT (no streamed output): "
                        f"{str(reply['payload'])[:200]}"
                    )
        except TimeoutError:
            raise Skip(f"the shim sent no COMMAND_OUTPUT within {PROBE_SECONDS:g} s") from None
        first = clock()
        await self.ws.send(encode({"type": "CANCEL", "id": str(uuid.uuid4()), "payload": {"request_id": request_id}}))
        async with asyncio.timeout(PROBE_SECONDS):
            while True:
                reply = json.loads(await self.ws.recv())
                if reply.get("id") == request_id and reply["type"] in ("COMMAND_RESULT", "ERROR"):
                    if reply["type"] == "ERROR" or not reply["payload"].get("cancelled"):
                        raise RuntimeError(f"the relay's command was not cancelled: {reply}")
                    break
        return FirstByte((first - started) * 1000, (clock() - first) * 1000)

    async def close(self) -> None:
        await self.ws.close()


async def b10(rig: Rig, sizes: Sizes) -> dict[str, Any]:
    import httpx

    http = httpx.AsyncClient(
        base_url=rig.dispatch_url, headers={"Authorization": f"Bearer {rig.token}"}, timeout=httpx.Timeout(60)
    )
    relay = await RelayStreamCaller.open(rig.relay_url)
    call_ids = iter(range(1, 1_000_000))

    async def rest() -> FirstByte:
        return await rest_first_byte(http, "src")

    async def mcp() -> FirstByte:
        return await mcp_first_byte(http, "src", next(call_ids))

    async def bare() -> FirstByte:
        return await relay.first_byte("src")

    targets = {"relay": bare, "rest": rest, "mcp": mcp}
    samples: dict[str, list[FirstByte]] = {name: [] for name in targets}
    cpu = {name: CpuPerOp() for name in targets}  # the server's (the relay's) CPU ms per sample
    server_pid = {"relay": rig.relay_pid, "rest": rig.server_pid, "mcp": rig.server_pid}
    skipped: dict[str, str] = {}
    try:
        for name, sample in targets.items():  # warm-up, and the probe for a missing feature
            try:
                for _ in range(sizes.warmup):
                    await with_timeout(sample(), 60, f"B10 {name} warm-up")
            except Skip as why:
                skipped[name] = str(why)
        names = [name for name in targets if name not in skipped]
        for index in range(sizes.samples):
            shift = index % max(1, len(names))
            for name in names[shift:] + names[:shift]:
                with cpu[name].window([server_pid[name]]):
                    samples[name].append(await with_timeout(targets[name](), 60, f"B10 {name}"))
    finally:
        await relay.close()
        await http.aclose()
    report: dict[str, Any] = {"command": FIRST_BYTE_COMMAND, "skipped": skipped}
    for name, values in samples.items():
        if name in skipped:
            continue
        report[name] = {
            "first_output": latency_summary([value.first_ms for value in values]),
            "cancel_to_end": latency_summary([value.cancel_ms for value in values]),
            "cpu_ms_per_sample": cpu[name].ms,
        }
    return report
