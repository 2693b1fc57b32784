"""Live-operation benchmarks B10, B11, B12 (goals: bench/README.md#goals), each beside a baseline
measured in the same run.

Usage: ``.venv/bin/python bench/live.py [--quick]`` (``make bench``, after bench/machines.py).
``bench/live.py relay --port P`` runs the bare relay alone; ``bench/live.py shims …`` runs
the in-process shim fleet of B12 alone (the driver starts both itself).

- B10  time to the first output byte of a streamed command (``sh -c 'echo ready; exec sleep
       30'``) through one ``manage.py serve`` (SQLite, in-memory channel layer) and a real
       shim (``python -m machines.shim run``), then cancel it, so each sample is short:
       * REST: ``POST /api/v1/sessions/bench/ops {stream: true, request_id}``, read the event
         stream until the first ``output`` event; then ``POST …/ops/{request_id}/cancel`` and
         read on until the ``result`` (it must say ``cancelled: true``).
       * MCP: ``POST /mcp tools/call local_pc_execute_command`` with a ``progressToken``,
         read the event stream until the first ``notifications/progress``; then ``POST /mcp
         notifications/cancelled`` with the call's JSON-RPC id and read on until the result.
       Baseline: a bare ``websockets`` relay (``relay`` below) that the **same real shim
       program** connects to (HELLO → HELLO_ACK at 2.1): a websocket caller sends the same
       ``EXECUTE_COMMAND {stream: true}``; the relay forwards it and relays the shim's
       ``COMMAND_OUTPUT`` frames back (parsing and re-serialising each); the time is the
       first ``COMMAND_OUTPUT`` at the caller, then the caller sends ``CANCEL`` and reads
       until the ``COMMAND_RESULT``. Target: p95 ≤ 200 ms (both Dispatch paths).
- B11  ``POST /api/v1/sessions/bench/pipe``: ``head -c N /dev/zero`` on machine ``src`` →
       ``sha256sum`` on machine ``dst`` (two real shims), N = 200 MiB; MiB/s, the server's
       RSS growth (peak during the pipe minus before, sampled every 20 ms from /proc) and the
       hash checked against the one computed here. Baseline: a cross-machine copy of a file
       of the same size between the same two shims (``POST …/copy``), in the same run,
       interleaved. Target: pipe ≥ 50 % of the copy's rate; growth ≤ 32 MiB; hash correct.
- B12  fan-out: 50 shims in one asyncio process (the shim's own ``Shim`` class, 50
       instances; ``shims`` below), attached to session ``fanout``;
       ``POST …/ops {target_machines: "*", EXECUTE_COMMAND sleep 1}`` against the same
       command on one of them (``target_machine``), interleaved rounds, medians. Target:
       time(50) ≤ 2 × time(1); the overhead time(50) − time(1) is printed.

A row whose feature the server does not offer yet (a 400/404 for the new fields or routes,
a JSON answer where an event stream was asked for, a shim that sends no ``COMMAND_OUTPUT``)
prints ``SKIP`` with the reason — never a number it did not measure.

Prints a table and writes bench/results/live.json. Bounded (aborts itself after
HARD_LIMIT seconds) and stops every process it started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
# The Django app ``machines`` must be imported before bench/ is on the path: bench/machines.py
# has the same name (it is loaded below as ``bench_machines``).
from machines.shim import protocol as shim_protocol  # noqa: E402

sys.path.append(str(BENCH))

from common import (  # noqa: E402
    CpuMeter,
    CpuPerOp,
    bench_row,
    encode,
    finish_report,
    free_port,
    latency_summary,
    percentile,
    print_table,
    process_cpu_seconds,
    stop_process,
    wait_for_port,
    with_timeout,
)


def _load_bench_machines() -> Any:
    spec = importlib.util.spec_from_file_location("bench_machines", BENCH / "machines.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_machines"] = module
    spec.loader.exec_module(module)
    return module


bench_machines = _load_bench_machines()
MachineRelay = bench_machines.MachineRelay
RelayError = bench_machines.RelayError
RssSampler = bench_machines.RssSampler
envelope = bench_machines.envelope
make_source = bench_machines.make_source
start_shim = bench_machines.start_shim

RESULTS = BENCH / "results" / "live.json"
HARD_LIMIT = 600  # seconds: the whole run is aborted (and cleaned up) past this
MiB = 1024 * 1024
SESSION = bench_machines.SESSION  # "bench": the real shims of B10 and B11
FANOUT_SESSION = "fanout"
MAX_MESSAGE = shim_protocol.MAX_MESSAGE_BYTES
LIVE_VERSION = shim_protocol.PROTOCOL_VERSION  # "2.1"
DEFAULT_LIMITS = shim_protocol.Limits()

# Goals: bench/README.md#goals.
B10_MAX_P95_MS = 200.0
B11_MIN_SHARE = 0.50
B11_MAX_GROWTH_MIB = 32.0
B12_MAX_RATIO = 2.0

FIRST_BYTE_COMMAND = ["sh", "-c", "echo ready; exec sleep 30"]
PROBE_SECONDS = 10.0  # a feature that has not answered within this is reported as missing

SERVER_ENV: dict[str, Any] = {**bench_machines.SERVER_ENV}


class Skip(Exception):
    """A row cannot be measured: the feature it needs is not there (the message says which)."""


# --- the baseline: a bare websockets relay that also relays streamed frames --------------


class LiveRelay(MachineRelay):  # type: ignore[misc, valid-type]
    """bench/machines.py's relay, speaking 2.1 to the shims: a caller's ``EXECUTE_COMMAND``
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
        link = bench_machines.ShimLink(
            ws, payload["machine_id"], payload.get("display_name") or "", list(payload["allowed_roots"])
        )
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
    from websockets.asyncio.server import serve

    relay = LiveRelay()
    stop = asyncio.get_running_loop().create_future()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set_result, None)
    async with serve(relay.handle, "127.0.0.1", port, compression=None, max_size=MAX_MESSAGE):
        print(f"listening on {port}", flush=True)
        await stop


@contextlib.contextmanager
def child(args: list[str], name: str, ready: str, timeout: float = 60) -> Iterator[subprocess.Popen[bytes]]:
    """Run this file in another mode; yields once it printed ``ready``; always stopped."""
    log = tempfile.NamedTemporaryFile(prefix=f"bench-live-{name}-", suffix=".log", delete=False, mode="w+")
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), *args], stdout=log, stderr=subprocess.STDOUT, cwd=REPO
    )
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


# --- the B12 fleet: many shims in one asyncio process ------------------------------------


async def run_fleet(server: str, token: str, count: int, root: str, session: str, prefix: str) -> None:
    """``count`` instances of ``machines.shim.Shim`` in this one event loop, each its own
    ``machine_id`` and display name ``<prefix>-NNN``, attached to ``session``; prints
    ``connected N`` once every one has its HELLO_ACK, and runs until SIGTERM."""
    import logging

    from machines.shim import MachineIdentity, PathJail, Shim

    logging.basicConfig(level=logging.WARNING)
    jail = PathJail([root])
    shims = [
        Shim(
            server=server,
            token=token,
            identity=MachineIdentity.detect(str(uuid.uuid4()), f"{prefix}-{index:03d}"),
            jail=jail,
            capabilities=["shell"],
            sessions=[session],
            backoff_scale=0.05,
        )
        for index in range(count)
    ]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    tasks = [asyncio.create_task(shim.run()) for shim in shims]
    while sum(shim.negotiated is not None for shim in shims) < count:
        if any(task.done() for task in tasks):
            for task in tasks:
                if task.done() and task.exception() is not None:
                    print(f"a shim failed: {task.exception()!r}", flush=True)
            return
        await asyncio.sleep(0.05)
    versions = sorted({shim.negotiated.protocol_version for shim in shims if shim.negotiated is not None})
    print(f"connected {count} (protocol {', '.join(versions)})", flush=True)
    await stop.wait()
    for shim in shims:
        shim.stop()
    await asyncio.gather(*tasks, return_exceptions=True)


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


def _refused(response: Any, what: str) -> str:
    body = response.text if hasattr(response, "text") else ""
    return f"{what} answered {response.status_code} {response.headers.get('content-type', '')}: {body[:200]}"


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


# --- phases -------------------------------------------------------------------------------


@dataclass
class Sizes:
    samples: int
    warmup: int
    pipe_mib: int
    transfer_rounds: int
    fanout: int
    fanout_rounds: int


@dataclass
class Rig:
    dispatch_url: str
    token: str
    relay_url: str
    work: Path
    server_pid: int
    notes: list[str] = field(default_factory=list)
    relay_pid: int = 0


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


def zeros_sha256(size: int) -> str:
    digest = hashlib.sha256()
    block = bytes(MiB)
    left = size
    while left:
        take = min(left, MiB)
        digest.update(block[:take])
        left -= take
    return digest.hexdigest()


async def b11(rig: Rig, sizes: Sizes) -> dict[str, Any]:
    import httpx

    http = httpx.AsyncClient(
        base_url=rig.dispatch_url, headers={"Authorization": f"Bearer {rig.token}"}, timeout=httpx.Timeout(600)
    )
    size = sizes.pipe_mib * MiB
    expected_hash = zeros_sha256(size)
    source_file = rig.work / "src" / "copy-source.bin"
    source_sha256 = await asyncio.to_thread(make_source, source_file, sizes.pipe_mib)
    runs: dict[str, list[dict[str, Any]]] = {"pipe": [], "copy": []}

    async def pipe(round_index: int) -> dict[str, Any]:
        body = {
            "source": {"machine": "src", "argv": ["head", "-c", str(size), "/dev/zero"]},
            "destination": {"machine": "dst", "argv": ["sha256sum"]},
            "timeout_seconds": 600,
        }
        with RssSampler(rig.server_pid) as rss:
            started = time.perf_counter()
            response = await http.post(f"/api/v1/sessions/{SESSION}/pipe", json=body)
            seconds = time.perf_counter() - started
        if response.status_code in (404, 405) and "MACHINE_NOT_ATTACHED" not in response.text:
            raise Skip(_refused(response, "POST /api/v1/sessions/bench/pipe"))
        if response.status_code != 200:
            raise RuntimeError(_refused(response, "POST /pipe"))
        answer = response.json()
        stdout = str(answer.get("destination", {}).get("stdout", ""))
        return {
            "seconds": seconds,
            "bytes": answer.get("bytes"),
            "hash_ok": stdout.split()[:1] == [expected_hash],
            "destination_stdout": stdout[:100],
            "source_exit": answer.get("source", {}).get("exit_code"),
            "destination_exit": answer.get("destination", {}).get("exit_code"),
            "rss_before_mib": rss.before,
            "rss_peak_mib": rss.peak,
            "rss_after_mib": rss.after,
        }

    async def copy(round_index: int) -> dict[str, Any]:
        destination = rig.work / "dst" / f"copy-{round_index}.bin"
        with RssSampler(rig.server_pid) as rss:
            started = time.perf_counter()
            response = await http.post(
                f"/api/v1/sessions/{SESSION}/copy",
                json={
                    "source_machine": "src",
                    "source_path": str(source_file),
                    "destination_machine": "dst",
                    "destination_path": str(destination),
                },
            )
            seconds = time.perf_counter() - started
        if response.status_code != 200 or response.json().get("sha256") != source_sha256:
            raise RuntimeError(_refused(response, "POST /copy"))
        destination.unlink()
        return {"seconds": seconds, "rss_before_mib": rss.before, "rss_peak_mib": rss.peak}

    skipped = ""
    try:
        for round_index in range(sizes.transfer_rounds):
            order = ["copy", "pipe"] if round_index % 2 == 0 else ["pipe", "copy"]
            for name in order:
                if name == "pipe" and skipped:
                    continue
                server_cpu = CpuPerOp()
                try:
                    with server_cpu.window([rig.server_pid], sizes.pipe_mib):
                        run = await with_timeout(({"pipe": pipe, "copy": copy}[name])(round_index), 300, f"B11 {name}")
                except Skip as why:
                    skipped = str(why)
                    continue
                run["mib_per_second"] = sizes.pipe_mib / run["seconds"]
                run["cpu_ms_per_mib"] = server_cpu.ms
                runs[name].append(run)
    finally:
        await http.aclose()
        source_file.unlink(missing_ok=True)

    def median(name: str) -> float:
        return percentile(sorted(run["mib_per_second"] for run in runs[name]), 0.5)

    report: dict[str, Any] = {"mib": sizes.pipe_mib, "runs": runs, "expected_sha256": expected_hash}
    report["copy_mib_per_second"] = median("copy")
    report["cpu_ms_per_mib"] = {
        name: percentile(sorted(run["cpu_ms_per_mib"] for run in runs[name]), 0.5) if runs[name] else None
        for name in runs
    }
    if skipped:
        report["skipped"] = skipped
        return report
    report["pipe_mib_per_second"] = median("pipe")
    report["rss_growth_peak_mib"] = round(max(run["rss_peak_mib"] - run["rss_before_mib"] for run in runs["pipe"]), 1)
    report["hash_ok"] = all(run["hash_ok"] for run in runs["pipe"])
    report["bytes_ok"] = all(run["bytes"] == sizes.pipe_mib * MiB for run in runs["pipe"])
    return report


async def settled(pid: int, *, busy: float = 0.10, limit: float = 90.0) -> dict[str, float]:
    """Wait until process ``pid`` uses less than ``busy`` of a core over a second (at most
    ``limit`` s). Attaching 50 shims of one user to a session keeps the server busy for tens
    of seconds (the MACHINE_LIST_REQUEST snapshots, bench/machines.py's (B6')); B12 measures
    the fan-out, not that. Returns the seconds waited and the CPU seconds used meanwhile."""
    began, cpu0 = time.monotonic(), process_cpu_seconds(pid)
    while time.monotonic() - began < limit:
        before = process_cpu_seconds(pid)
        await asyncio.sleep(1.0)
        if process_cpu_seconds(pid) - before < busy:
            break
    return {"seconds": round(time.monotonic() - began, 1), "cpu_seconds": round(process_cpu_seconds(pid) - cpu0, 1)}


async def b12(rig: Rig, sizes: Sizes) -> dict[str, Any]:
    import httpx

    http = httpx.AsyncClient(
        base_url=rig.dispatch_url, headers={"Authorization": f"Bearer {rig.token}"}, timeout=httpx.Timeout(120)
    )
    payload = {"argv": ["sleep", "1"], "timeout_seconds": 30}

    async def one() -> float:
        started = time.perf_counter()
        response = await http.post(
            f"/api/v1/sessions/{FANOUT_SESSION}/ops",
            json={"op": "EXECUTE_COMMAND", "target_machine": "fan-000", "payload": payload},
        )
        seconds = time.perf_counter() - started
        if response.status_code != 200 or response.json()["payload"]["exit_code"] != 0:
            raise RuntimeError(_refused(response, "POST /ops (one machine)"))
        return seconds

    async def many() -> float:
        started = time.perf_counter()
        response = await http.post(
            f"/api/v1/sessions/{FANOUT_SESSION}/ops",
            json={"op": "EXECUTE_COMMAND", "target_machines": "*", "payload": payload},
        )
        seconds = time.perf_counter() - started
        if response.status_code == 400 and "target_machines" in response.text:
            raise Skip(_refused(response, "POST /ops {target_machines: '*'}"))
        if response.status_code != 200:
            raise RuntimeError(_refused(response, "POST /ops {target_machines: '*'}"))
        results = response.json().get("results")
        if not isinstance(results, list):
            raise Skip(f"POST /ops {{target_machines: '*'}} answered no 'results' list: {response.text[:200]}")
        good = [entry for entry in results if entry.get("ok") and entry["result"]["payload"].get("exit_code") == 0]
        if len(results) != sizes.fanout or len(good) != sizes.fanout:
            bad = [entry for entry in results if entry not in good][:3]
            raise RuntimeError(f"fan-out: {len(results)} results, {len(good)} ok of {sizes.fanout}: {bad}")
        return seconds

    samples: dict[str, list[float]] = {"one": [], "many": []}
    cpu = {"one": CpuPerOp(), "many": CpuPerOp()}  # the server's CPU ms per fan-out
    settle = await settled(rig.server_pid)
    try:
        await one()  # warm-up
        try:
            await many()
        except Skip as why:
            return {"skipped": str(why), "one": [await one() for _ in range(sizes.fanout_rounds)], "settle": settle}
        for round_index in range(sizes.fanout_rounds):
            order = [("one", one), ("many", many)]
            for name, measure in order if round_index % 2 == 0 else order[::-1]:
                with cpu[name].window([rig.server_pid]):
                    samples[name].append(await with_timeout(measure(), 120, f"B12 {name}"))
    finally:
        await http.aclose()
    one_s = percentile(sorted(samples["one"]), 0.5)
    many_s = percentile(sorted(samples["many"]), 0.5)
    return {
        "machines": sizes.fanout,
        "samples_s": samples,
        "one_s": round(one_s, 3),
        "many_s": round(many_s, 3),
        "overhead_s": round(many_s - one_s, 3),
        "cpu_ms_per_op": {name: tally.ms for name, tally in cpu.items()},
        "settle": settle,
    }


# --- the run --------------------------------------------------------------------------------


def run(sizes: Sizes) -> dict[str, Any]:
    from remote_calls import logs_on_failure

    from tests.infra import instance

    report: dict[str, Any] = {"notes": []}
    with tempfile.TemporaryDirectory(prefix="bench-live-") as scratch, relay_server() as (relay_url, relay_pid):
        work = Path(scratch)
        for directory in ("src", "dst", "fan", "relay-src"):
            (work / directory).mkdir()
        print("· starting Dispatch (SQLite, in-memory channel layer), two real shims and one on the relay…", flush=True)
        with instance(**SERVER_ENV) as inst, logs_on_failure(inst):
            server = inst.serve()
            token = inst.admin_token
            shims = [
                start_shim(server.url, token, "src", work / "src", work / "state-src"),
                start_shim(server.url, token, "dst", work / "dst", work / "state-dst"),
                start_shim(relay_url, "relay", "src", work / "relay-src", work / "state-relay-src"),
            ]
            rig = Rig(dispatch_url=server.url, token=token, relay_url=relay_url, work=work, server_pid=server.proc.pid,
                      relay_pid=relay_pid)  # fmt: skip
            try:
                print(
                    f"· B10: {sizes.warmup} warm-up + {sizes.samples} samples each (relay, REST, MCP), interleaved…",
                    flush=True,
                )
                names = ("src", "dst", "relay")
                shim_pids = {f"shim.{name}": shim.pid for name, shim in zip(names, shims, strict=True)}
                with CpuMeter({"server": server.proc.pid, "relay": relay_pid, **shim_pids}) as meter:
                    report["b10"] = asyncio.run(b10(rig, sizes))
                report["cpu"] = {"b10": meter.percent}
                print(
                    f"· B11: {sizes.transfer_rounds} x ({sizes.pipe_mib} MiB pipe, {sizes.pipe_mib} MiB copy)…",
                    flush=True,
                )
                with CpuMeter({"server": server.proc.pid, **shim_pids}) as meter:
                    report["b11"] = asyncio.run(b11(rig, sizes))
                report["cpu"]["b11"] = meter.percent
            finally:
                for shim in shims:
                    shim.stop()
            print(f"· B12: {sizes.fanout} in-process shims; {sizes.fanout_rounds} rounds of one vs all…", flush=True)
            fleet_args = [
                "shims", "--server", server.url, "--token", token, "--count", str(sizes.fanout),
                "--root", str(work / "fan"), "--session", FANOUT_SESSION, "--prefix", "fan",
            ]  # fmt: skip
            with child(fleet_args, "fleet", "connected ", timeout=120) as fleet:
                with CpuMeter({"server": server.proc.pid, "fleet": fleet.pid}) as meter:
                    report["b12"] = asyncio.run(b12(rig, sizes))
                report["cpu"]["b12"] = meter.percent
                report["b12"]["fleet_pid"] = fleet.pid
    return report


# --- the table ------------------------------------------------------------------------------


def _lat(summary: dict[str, float]) -> str:
    return f"{summary['p50_ms']:.1f} / {summary['p95_ms']:.1f} / {summary['p99_ms']:.1f}"


def _skip(row_id: str, what: str, why: str, goal: str, baseline: str = "—") -> dict[str, Any]:
    return bench_row(
        row_id,
        what,
        dispatch=f"SKIP: {why if len(why) <= 120 else why[:117] + '...'}",
        baseline=baseline,
        goal=goal,
        why=why,
        skipped=True,
    )


def rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The B10–B12 rows (common.bench_row); CPU is the server's (the relay's) ms per sample."""
    table: list[dict[str, Any]] = []
    b10, b11, b12 = report["b10"], report["b11"], report["b12"]
    target10 = f"p95 <= {B10_MAX_P95_MS:g} ms"
    relay = b10.get("relay")
    relay_text = f"{_lat(relay['first_output'])} (bare relay)" if relay else "SKIP (see notes)"
    for name, label in (("rest", "REST (SSE output event)"), ("mcp", "MCP (notifications/progress)")):
        what = f"first output byte of a streamed command via {label}, then cancel (ms p50/p95/p99)"
        if name in b10["skipped"]:
            table.append(_skip("B10", what, b10["skipped"][name], target10, relay_text if relay else "—"))
            continue
        first = b10[name]["first_output"]
        table.append(
            bench_row(
                "B10",
                what,
                dispatch=_lat(first),
                baseline=relay_text,
                ratio=f"{first['p95_ms'] / relay['first_output']['p95_ms']:.1f}x (p95)" if relay else "—",
                cpu=(b10[name].get("cpu_ms_per_sample"), relay.get("cpu_ms_per_sample") if relay else None),
                goal=target10,
                passed=first["p95_ms"] <= B10_MAX_P95_MS,
                numbers={"dispatch_p95_ms": first["p95_ms"],
                         "baseline_p95_ms": relay["first_output"]["p95_ms"] if relay else None},
            )
        )  # fmt: skip
    measured = [name for name in ("relay", "rest", "mcp") if name in b10]
    if measured:
        table.append(
            bench_row(
                "(B10')",
                "info: cancel sent -> the operation's end received (ms p50/p95), " + ", ".join(measured),
                dispatch="; ".join(
                    f"{name} {b10[name]['cancel_to_end']['p50_ms']:.1f} / {b10[name]['cancel_to_end']['p95_ms']:.1f}"
                    for name in measured
                ),
            )
        )
    what11 = f"pipe of {b11['mib']} MiB: head -c on src -> sha256sum on dst (MiB/s median); server RSS growth"
    target11 = f">= {B11_MIN_SHARE:.0%} of the copy; growth <= {B11_MAX_GROWTH_MIB:g} MiB; hash correct"
    cpu11 = b11.get("cpu_ms_per_mib", {})
    if "skipped" in b11:
        table.append(_skip("B11", what11, b11["skipped"], target11, f"copy {b11['copy_mib_per_second']:.1f} MiB/s"))
    else:
        share = b11["pipe_mib_per_second"] / b11["copy_mib_per_second"]
        growth = b11["rss_growth_peak_mib"]
        table.append(
            bench_row(
                "B11",
                what11 + "; CPU per MiB",
                dispatch=f"{b11['pipe_mib_per_second']:.1f} MiB/s, RSS +{growth:.1f} MiB (peak), "
                f"hash {'correct' if b11['hash_ok'] else 'WRONG'}",
                baseline=f"{b11['copy_mib_per_second']:.1f} MiB/s (Dispatch's copy)",
                ratio=f"{share:.0%}",
                cpu=(cpu11.get("pipe"), cpu11.get("copy")),
                goal=target11,
                passed=share >= B11_MIN_SHARE and growth <= B11_MAX_GROWTH_MIB and b11["hash_ok"] and b11["bytes_ok"],
                numbers={"dispatch_mib_per_s": b11["pipe_mib_per_second"],
                         "baseline_mib_per_s": b11["copy_mib_per_second"], "ratio": share, "rss_growth_mib": growth},
            )
        )  # fmt: skip
    what12 = f"fan-out of `sleep 1` to {report['sizes_fanout']} in-process shims (s, median)"
    target12 = f"<= {B12_MAX_RATIO:g}x one machine's"
    if "skipped" in b12:
        one = percentile(sorted(b12["one"]), 0.5)
        table.append(_skip("B12", what12, b12["skipped"], target12, f"{one:.3f} s (one machine)"))
    else:
        ratio = b12["many_s"] / b12["one_s"]
        cpu12 = b12.get("cpu_ms_per_op", {})
        table.append(
            bench_row(
                "B12",
                what12 + "; CPU per fan-out",
                dispatch=f"{b12['many_s']:.3f} s; overhead time({b12['machines']}) - time(1) = "
                f"{b12['overhead_s'] * 1000:.0f} ms",
                baseline=f"{b12['one_s']:.3f} s (one machine)",
                ratio=f"{ratio:.2f}x",
                cpu=(cpu12.get("many"), cpu12.get("one")),
                goal=target12,
                passed=ratio <= B12_MAX_RATIO,
                numbers={"dispatch_s": b12["many_s"], "baseline_s": b12["one_s"], "ratio": ratio},
            )
        )
    return table


def main(argv: list[str]) -> int:
    if argv[:1] == ["relay"]:
        parser = argparse.ArgumentParser(description="the bare websockets relay with streamed frames (baseline)")
        parser.add_argument("kind", choices=["relay"])
        parser.add_argument("--port", type=int, required=True)
        asyncio.run(run_relay(parser.parse_args(argv).port))
        return 0
    if argv[:1] == ["shims"]:
        parser = argparse.ArgumentParser(description="many in-process shims (B12)")
        parser.add_argument("kind", choices=["shims"])
        for name in ("--server", "--token", "--root", "--session", "--prefix"):
            parser.add_argument(name, required=True)
        parser.add_argument("--count", type=int, required=True)
        options = parser.parse_args(argv)
        asyncio.run(
            run_fleet(options.server, options.token, options.count, options.root, options.session, options.prefix)
        )
        return 0
    parser = argparse.ArgumentParser(description="Live-operation benchmarks B10-B12 beside baselines.")
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--samples", type=int, help="B10 samples per path (default 100; quick 30)")
    parser.add_argument("--pipe-mib", type=int, help="B11 pipe and copy size in MiB (default 200; quick 64)")
    parser.add_argument("--rounds", type=int, help="B11 rounds (default 1)")
    parser.add_argument("--fanout", type=int, help="B12 in-process shims (default 50)")
    parser.add_argument("--fanout-rounds", type=int, help="B12 rounds (default 3)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument(
        "--output", type=Path, default=RESULTS, help=f"JSON results (default {RESULTS.relative_to(REPO)})"
    )
    options = parser.parse_args(argv)
    sizes = (
        Sizes(samples=30, warmup=3, pipe_mib=64, transfer_rounds=1, fanout=50, fanout_rounds=3)
        if options.quick
        else Sizes(samples=100, warmup=5, pipe_mib=200, transfer_rounds=1, fanout=50, fanout_rounds=3)
    )
    for option, name in (
        ("samples", "samples"),
        ("pipe_mib", "pipe_mib"),
        ("rounds", "transfer_rounds"),
        ("fanout", "fanout"),
        ("fanout_rounds", "fanout_rounds"),
    ):
        if getattr(options, option):
            setattr(sizes, name, getattr(options, option))

    def abort(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    def too_long(signum: int, frame: Any) -> None:
        raise TimeoutError(f"benchmark exceeded {HARD_LIMIT} s; aborted")

    signal.signal(signal.SIGTERM, abort)
    signal.signal(signal.SIGALRM, too_long)
    signal.alarm(HARD_LIMIT)
    info = bench_machines.machine()
    started = time.monotonic()
    print(
        f"Live-operation benchmarks ({'quick' if options.quick else 'full'} run) on {info['cpus']} CPU(s), "
        f"{info['cpu_model']}.\nNOTE: the server, the relay, the shims and this client share these "
        f"{info['cpus']} cores; compare ratios, not absolutes.",
        flush=True,
    )
    try:
        report = run(sizes)
    except (KeyboardInterrupt, TimeoutError) as exc:
        print(f"aborted ({exc}); every process it started has been stopped", file=sys.stderr)
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        signal.alarm(0)
    report["sizes_fanout"] = sizes.fanout
    table = rows(report)
    print()
    print_table(table)
    print()
    for row in table:
        if row.get("skipped"):
            report["notes"].append(f"{row['id']} not measured: {row['why']}")
    print("CPU, % of one core, over each phase ('others': the rest of the machine, the shims' commands included):")
    for phase, cpu in report["cpu"].items():
        print(f"  {phase.upper()}: " + ", ".join(f"{name} {value:.0f}%" for name, value in cpu.items()))
    busiest = max(cpu.get("others", 0.0) for cpu in report["cpu"].values())
    if busiest > 50:
        report["notes"].append(
            f"other processes used up to {busiest:.0f}% of a core during a phase: absolute numbers are inflated, "
            "ratios less so"
        )
    settle = report["b12"].get("settle")
    if settle:
        report["notes"].append(
            f"B12: after the {sizes.fanout} shims attached, the server stayed busy for {settle['seconds']:g} s "
            f"({settle['cpu_seconds']:g} CPU s) before it was idle and the fan-out was measured"
        )
    for name, why in report["b10"]["skipped"].items():
        if name == "relay":
            report["notes"].append(f"B10 baseline (bare relay) not measured: {why}")
    return finish_report(
        report=report,
        table=table,
        info=info,
        sizes=sizes,
        server_env=SERVER_ENV,
        output=options.output,
        quick=options.quick,
        strict=options.strict,
        started=started,
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
