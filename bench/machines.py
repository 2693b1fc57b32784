"""Machine benchmarks B4, B5, B6 (goals: bench/README.md#goals), beside a bare relay.

Usage: ``.venv/bin/python bench/machines.py [--quick]`` (``make bench``, after
bench/remote_calls.py); ``.venv/bin/python bench/machines.py relay --port P`` runs the
baseline server alone.

- B4  ``FILE_STAT`` round trip through the router: a keep-alive HTTP client POSTs
      ``/api/v1/sessions/bench/ops`` to one ``manage.py serve`` (SQLite, in-memory channel
      layer); the router picks the machine (two attached, the path is under one root) and
      a real shim (``python -m machines.shim run``) answers. Sequential, after a warm-up.
      The same FILE_STAT as an MCP ``tools/call`` of ``local_pc_file_stat`` (``POST /mcp``),
      and, on a PostgreSQL + Redis server of its own, the built-in agent's tool path: the
      ``local_pc_file_stat`` handler called from a second Django process (``tool-driver``
      below, as a ``dispatch_worker`` runs an expert), beside REST on that server. Every
      target is interleaved with the bare relay and ``/healthz``; goals (bench/README.md): tool
      path ≤ 4× bare, REST and MCP ≤ the ``/healthz`` floor + 3× bare; server CPU ms per op.
- B5  ``POST /api/v1/sessions/bench/copy`` of a 100 MiB file between two real shims
      (1 MiB base64 chunks through the platform), MiB/s, and the server's RSS growth
      (peak during the copy minus before it, sampled every 20 ms).
- B6  1,000 idle shims (raw websocket clients doing the HELLO handshake with a user token,
      each with its own ``machine_id``, answering PINGs) and 1,000 idle ``/ws`` sessions on
      one fresh process: all connected, memory per connection, the process heartbeat
      (``ServerProcess.heartbeat_at``) and the shim PINGs on time, ``/healthz`` answering,
      and every connection still alive at the end (each ``/ws`` session answers a ``ping``).
- (B6') information: N shims of one user attached to every session (``"*"``) connect one
        after another; how many ``MACHINE_LIST_REQUEST`` the platform sends.

The baseline, measured in the same run and interleaved with Dispatch, is a bare
``websockets`` server in one process (``relay`` below) that the **same real shims** connect
to: it answers HELLO, then relays the same JSON envelopes between a caller and the shim,
parsing and re-serialising each frame; for B5 it glues the copy itself (the same
FILE_STAT / FILE_READ 1 MiB base64 / FILE_WRITE append / FILE_STAT hash / FILE_MOVE
sequence as machines/services/copy.py). No auth, no database, no channel layer, no HTTP:
its caller speaks websockets, while Dispatch's operations are REST calls, so B4's ratio
includes HTTP (the ``(B4')`` row shows Dispatch's bare HTTP round trip on the same client).

Prints a table and writes bench/results/machines.json. Bounded (aborts itself after
230 s; ``--quick`` takes about a minute) and stops every process it started.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

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
    process_rss_mib,
    stop_process,
    wait_for_port,
    with_timeout,
)

from core.open_files import raise_open_file_limit  # noqa: E402

RESULTS = BENCH / "results" / "machines.json"
HARD_LIMIT = 600  # seconds: the whole run is aborted (and cleaned up) past this
MiB = 1024 * 1024
CHUNK_BYTES = MiB  # machines/services/copy.py
MAX_MESSAGE = 16 * MiB + 64 * 1024  # docs/shim-protocol.md#connecting
SESSION = "bench"

# Goals: bench/README.md#goals (where the floor each must stay above is printed too).
B4_TOOL_MAX_RATIO = 4.0  # the in-process tool path: p50 <= this x bare
B4_REST_MAX_RATIO = 3.0  # REST and MCP: p50 <= the /healthz floor + this x bare
B5_MIN_SHARE = 0.75
B5_MAX_GROWTH_MIB = 32.0
B6_CONNECTIONS = 5000  # shims, and as many /ws sessions
B6_MAX_KIB = 40.0  # server memory per connection
B6_MAX_CPU_MS_PER_SESSION = 1.5  # server CPU to open one /ws session
B6_MAX_CPU_MS_PER_HELLO = 4.0  # server CPU to open one shim connection (its HELLO)
B6_MAX_IDLE_CPU_PERCENT = 15.0  # of one core, with every connection held idle

# Production intervals (tests shorten them), like bench/remote_calls.py.
SERVER_ENV: dict[str, Any] = {
    "DISPATCH_HEARTBEAT_INTERVAL": "2",
    "DISPATCH_PROCESS_TTL": "10",
    "DISPATCH_REAP_INTERVAL": "2",
    "DISPATCH_REMOTE_LIVENESS_INTERVAL": "2",
    "DISPATCH_REMOTE_CALL_TIMEOUT": "30",
    "DISPATCH_LOG_LEVEL": "WARNING",
}
# B6 shortens the shim PING period (production: 30 s) so the run sees a few PINGs per shim,
# keeping the server's PONG stamps (one write each) near 250/s: the period is the shims
# divided by 250, at least 4 s (5,000 shims: 20 s).
B6_STAMPS_PER_SECOND = 250
B6_PONG_TIMEOUT = 5.0


def envelope(message_type: str, payload: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A frame in the shim envelope (docs/shim-protocol.md#the-envelope)."""
    return {
        "type": message_type,
        "id": fields.pop("id", None) or str(uuid.uuid4()),
        "ts": time.time(),
        "version": "2.0",
        "session_id": fields.pop("session_id", None),
        "target_machine": fields.pop("target_machine", None),
        "payload": payload,
    }


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


async def run_relay(port: int) -> None:
    from websockets.asyncio.server import serve

    relay = MachineRelay()
    stop = asyncio.get_running_loop().create_future()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set_result, None)
    # No compression: daphne does not negotiate permessage-deflate, so both move the same bytes.
    async with serve(relay.handle, "127.0.0.1", port, compression=None, max_size=MAX_MESSAGE):
        print(f"listening on {port}", flush=True)
        await stop


@contextlib.contextmanager
def relay_server() -> Iterator[tuple[str, int]]:
    """Run the relay (this file, ``relay`` mode) on a free port; yields (base URL, pid)."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="bench-machine-relay-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "relay", "--port", str(port)],
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


# --- real shims ---------------------------------------------------------------------------


def start_shim(server_url: str, token: str, name: str, root: Path, state_dir: Path) -> Any:
    """A real ``python -m machines.shim run`` attached to SESSION; waits for its HELLO_ACK."""
    from tests.infra import Process, ShimProcess

    env = {k: v for k, v in os.environ.items() if not k.startswith("DISPATCH_")}
    env.update({"PYTHONUNBUFFERED": "1", "DISPATCH_SHIM_BACKOFF_SCALE": "0.05"})
    args = [
        sys.executable,
        "-m",
        "machines.shim",
        "run",
        "--server",
        server_url,
        "--token",
        token,
        "--state-dir",
        str(state_dir),
        "--root",
        str(root),
        "--name",
        name,
        "--session",
        SESSION,
    ]
    started = Process.spawn(env, args, name=f"bench-shim-{name}")
    shim = ShimProcess(proc=started.proc, log_path=started.log_path, state_dir=state_dir, name=name)
    try:
        return shim.wait_connected(timeout=20)
    except BaseException:
        shim.kill()
        raise


@dataclass
class Sizes:
    warmup: int
    calls: int
    rounds: int
    copy_rounds: int
    copy_mib: int
    shims: int
    sessions: int
    idle_seconds: float
    storm_shims: int
    ping_interval: float = 20.0  # B6's DISPATCH_SHIM_PING_INTERVAL (s)
    b6_clients: int = 4  # client processes that open B6's connections
    b6_users: int = 50  # B6's connections are spread over this many users
    one_user_shims: int = 500  # (B6''): shims of one user, in batches of 100
    connect_limit: float = 150.0  # s: each of B6's two phases (shims, sessions) gives up then


@dataclass
class Rig:
    """Everything B4 and B5 drive: Dispatch and the relay, each with a source and a destination shim."""

    dispatch_url: str
    token: str
    relay_url: str
    work: Path
    pids: dict[str, int]
    source_file: Path = field(init=False)
    source_sha256: str = ""
    stat_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.source_file = self.work / "src" / "data.bin"
        self.stat_path = self.work / "src" / "stat-me.txt"


def make_source(path: Path, mib: int) -> str:
    """Write ``mib`` MiB of random bytes to ``path``; returns their SHA-256."""
    digest = hashlib.sha256()
    with path.open("wb") as stream:
        for _ in range(mib):
            block = os.urandom(MiB)
            digest.update(block)
            stream.write(block)
    return digest.hexdigest()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(MiB), b""):
            digest.update(block)
    return digest.hexdigest()


class RssSampler:
    """The peak RSS (MiB) of a process, sampled every ``interval`` seconds in a thread."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.pid, self.interval = pid, interval
        self.before = process_rss_mib(pid)
        self.peak = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.after = process_rss_mib(self.pid)
        self.peak = max(self.peak, self.after)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, process_rss_mib(self.pid))


# --- B4 -------------------------------------------------------------------------------------


async def sequential(send: Callable[[], Awaitable[None]], count: int) -> list[float]:
    samples = []
    clock = time.perf_counter_ns
    for _ in range(count):
        started = clock()
        await send()
        samples.append((clock() - started) / 1e6)
    return samples


MCP_HEADERS = {"Accept": "application/json", "MCP-Protocol-Version": "2025-11-25"}


def mcp_file_stat(path: str, call_id: int) -> dict[str, Any]:
    """The JSON-RPC ``tools/call`` of ``local_pc_file_stat`` (FILE_STAT's tool, docs/mcp.md#tools)."""
    return {
        "jsonrpc": "2.0",
        "id": call_id,
        "method": "tools/call",
        "params": {"name": "local_pc_file_stat", "arguments": {"path": path, "session_id": SESSION}},
    }


def mcp_checked(response: Any) -> str:
    """The machine that served an MCP ``local_pc_file_stat`` answer; raises unless it succeeded."""
    body = response.json() if response.status_code == 200 else {}
    result = body.get("result") or {}
    structured = result.get("structuredContent") or {}
    if not structured and result.get("content"):
        with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
            structured = json.loads(result["content"][0]["text"])
    if result.get("isError") or not structured.get("exists"):
        raise RuntimeError(f"MCP FILE_STAT failed: {response.status_code} {response.text[:300]}")
    return str(structured.get("machine_id"))


async def interleaved(
    targets: dict[str, Callable[[], Awaitable[None]]], sizes: Sizes, pids: dict[str, int], label: str
) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    """Each target warmed up, then ``sizes.calls`` sequential calls each in ``sizes.rounds``
    rounds, the order rotated every round; samples (ms) and CPU (% of a core) per target."""
    samples: dict[str, list[float]] = {name: [] for name in targets}
    cpu: dict[str, dict[str, float]] = {name: {} for name in targets}
    cpu_seconds: dict[str, dict[str, float]] = {name: {} for name in targets}
    for send in targets.values():
        await with_timeout(sequential(send, sizes.warmup), 60, f"{label} warm-up")
    per_round = max(1, sizes.calls // sizes.rounds)
    names = list(targets)
    for round_index in range(sizes.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            before = {key: process_cpu_seconds(pid) for key, pid in pids.items()}
            with CpuMeter(pids) as meter:
                samples[name] += await with_timeout(sequential(targets[name], per_round), 90, f"{label} {name}")
            for key, pid in pids.items():
                cpu_seconds[name][key] = cpu_seconds[name].get(key, 0.0) + process_cpu_seconds(pid) - before[key]
            for key, value in meter.percent.items():
                cpu[name][key] = round(cpu[name].get(key, 0.0) + value / sizes.rounds, 1)
    for name, used in cpu_seconds.items():
        # CPU milliseconds per operation of each process (steadier than wall times on a shared machine).
        cpu[name].update(
            {f"{key}_ms_per_op": round(1000 * value / len(samples[name]), 3) for key, value in used.items()}
        )
    return samples, cpu


async def b4(rig: Rig, sizes: Sizes) -> dict[str, Any]:
    """B4 over REST and over MCP on the SQLite / in-memory-layer server, interleaved with the
    bare relay and the ``/healthz`` floor on the same keep-alive client."""
    import httpx

    http = httpx.AsyncClient(base_url=rig.dispatch_url, headers={"Authorization": f"Bearer {rig.token}"}, timeout=30)
    caller = await RelayCaller.open(rig.relay_url)
    stat = {"path": str(rig.stat_path)}
    served: dict[str, set[str]] = {"dispatch": set(), "mcp": set(), "relay": set()}
    mcp_ids = iter(range(1, 1 << 62))

    async def dispatch_once() -> None:
        response = await http.post(f"/api/v1/sessions/{SESSION}/ops", json={"op": "FILE_STAT", "payload": stat})
        body = response.json()
        if response.status_code != 200 or not body["payload"]["exists"]:
            raise RuntimeError(f"Dispatch FILE_STAT failed: {response.status_code} {response.text[:300]}")
        served["dispatch"].add(body["machine_id"])

    async def mcp_once() -> None:
        response = await http.post("/mcp", json=mcp_file_stat(stat["path"], next(mcp_ids)), headers=MCP_HEADERS)
        served["mcp"].add(mcp_checked(response))

    async def relay_once() -> None:
        reply = await caller.request("FILE_STAT", stat)
        if reply["type"] != "FILE_STAT_RESPONSE" or not reply["payload"]["exists"]:
            raise RuntimeError(f"relay FILE_STAT failed: {reply}")
        served["relay"].add(reply["machine_id"])

    async def healthz_once() -> None:
        response = await http.get("/healthz")
        if response.status_code != 200:
            raise RuntimeError(f"/healthz answered {response.status_code}")

    targets: dict[str, Callable[[], Awaitable[None]]] = {
        "relay": relay_once,
        "dispatch": dispatch_once,
        "mcp": mcp_once,
        "http_floor": healthz_once,
    }
    try:
        samples, cpu = await interleaved(targets, sizes, rig.pids, "B4")
    finally:
        await caller.close()
        await http.aclose()
    return {
        **{name: latency_summary(values) for name, values in samples.items()},
        "machines_used": {name: len(ids) for name, ids in served.items()},
        "cpu": cpu,
    }


class ToolDriver:
    """``bench/machines.py tool-driver``, a process of its own that imports Django with the
    server's settings (PostgreSQL, the Redis channel layer) and calls the
    ``local_pc_file_stat`` tool's handler (``machines.tools.machine_tools``: the handler the
    built-in agent runs, ``machine_op`` under it) as a ``dispatch_worker`` running an expert
    run does: the operation crosses to the serving process's shim consumer over Redis.
    One line ``<count>`` on its stdin → that many sequential calls → one JSON line of ms."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, env: dict[str, str], path: str) -> ToolDriver:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(Path(__file__).resolve()),
            "tool-driver",
            "--path",
            path,
            env=env,
            cwd=REPO,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=16 * MiB,
        )
        driver = cls(proc)
        await with_timeout(driver.calls(1), 60, "the tool driver's first call")
        return driver

    async def calls(self, count: int) -> list[float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{count}\n".encode())
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the tool driver exited ({await self.proc.wait()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"tool driver: {answer['error']}")
        return [float(ms) for ms in answer["ms"]]

    async def stop(self) -> None:
        if self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


def run_tool_driver(path: str) -> None:
    """The ``tool-driver`` process (see ``ToolDriver``): Django set up from the environment."""
    import django

    # bench/ (first on sys.path) has modules named like the project's apps (agents.py).
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != BENCH]
    ours = [name for name, module in sys.modules.items() if str(getattr(module, "__file__", "")).startswith(str(BENCH))]
    for name in ours:
        if name != "__main__":
            del sys.modules[name]
    django.setup()

    async def main() -> None:
        from channels.db import database_sync_to_async
        from django.contrib.auth.models import User

        from machines.tools import machine_tools

        user = await database_sync_to_async(User.objects.get)(username="admin")
        tools = {t.name: t for t in await machine_tools(user=user, session_id=SESSION, caller="bench:tool-driver")}
        handler = tools["local_pc_file_stat"].handler
        loop = asyncio.get_running_loop()
        clock = time.perf_counter_ns
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            samples = []
            try:
                for _ in range(int(line)):
                    started = clock()
                    result = await handler({"path": path})
                    samples.append((clock() - started) / 1e6)
                    if not result.get("exists"):
                        raise RuntimeError(f"FILE_STAT answered {result}")
            except Exception as exc:
                print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
                continue
            print(json.dumps({"ms": samples}), flush=True)

    asyncio.run(main())


async def b4_tool(rig: Rig, sizes: Sizes, work: Path) -> dict[str, Any]:
    """B4 on the built-in agent's path: a fresh PostgreSQL + Redis instance, one
    ``manage.py serve`` with two real shims (src holds the path, dst does not), the tool
    called from a second Django process (``ToolDriver``) — interleaved with the bare relay,
    REST ``…/ops`` and ``/healthz`` on that server."""
    import httpx

    from tests.infra import instance

    (work / "dst-tool").mkdir(exist_ok=True)
    with instance(postgres=True, redis=True, database_prefix="dispatch_bench_", **SERVER_ENV) as inst:
        server = inst.serve(wait=False).wait_healthy(timeout=120)  # a busy machine starts it slowly
        shims = {
            "src": start_shim(server.url, inst.admin_token, "src", work / "src", work / "state-t-src"),
            "dst": start_shim(server.url, inst.admin_token, "dst", work / "dst-tool", work / "state-t-dst"),
        }
        http = httpx.AsyncClient(
            base_url=server.url, headers={"Authorization": f"Bearer {inst.admin_token}"}, timeout=30
        )
        caller = await RelayCaller.open(rig.relay_url)
        try:
            driver = await ToolDriver.start(inst.env, str(rig.stat_path))
        except BaseException:
            await caller.close()
            await http.aclose()
            for shim in shims.values():
                shim.stop()
            raise
        stat = {"path": str(rig.stat_path)}
        tool_batches: list[float] = []

        async def tool_once() -> None:
            tool_batches.extend(await driver.calls(1))

        async def rest_once() -> None:
            response = await http.post(f"/api/v1/sessions/{SESSION}/ops", json={"op": "FILE_STAT", "payload": stat})
            if response.status_code != 200 or not response.json()["payload"]["exists"]:
                raise RuntimeError(f"Dispatch FILE_STAT failed: {response.status_code} {response.text[:300]}")

        async def relay_once() -> None:
            reply = await caller.request("FILE_STAT", stat)
            if reply["type"] != "FILE_STAT_RESPONSE":
                raise RuntimeError(f"relay FILE_STAT failed: {reply}")

        async def healthz_once() -> None:
            if (await http.get("/healthz")).status_code != 200:
                raise RuntimeError("/healthz failed")

        pids = {
            "dispatch": server.proc.pid,
            "tool_driver": driver.proc.pid,
            **{k: v for k, v in rig.pids.items() if k == "relay" or k.startswith("shim.relay")},
        }
        try:
            samples, cpu = await interleaved(
                {"relay": relay_once, "tool": tool_once, "dispatch": rest_once, "http_floor": healthz_once},
                sizes,
                pids,
                "B4 tool",
            )
        finally:
            await driver.stop()
            await caller.close()
            await http.aclose()
            for shim in shims.values():
                shim.stop()
    # The tool's own clock (in the driver, around the handler) beside the bench's (a pipe
    # round trip more): the row reports the driver's.
    samples["tool_pipe"] = samples.pop("tool")
    samples["tool"] = tool_batches[-len(samples["tool_pipe"]) :]
    return {**{name: latency_summary(values) for name, values in samples.items()}, "cpu": cpu}


# --- B5 -------------------------------------------------------------------------------------


async def b5(rig: Rig, sizes: Sizes, server_pid: int) -> dict[str, Any]:
    import httpx

    http = httpx.AsyncClient(base_url=rig.dispatch_url, headers={"Authorization": f"Bearer {rig.token}"}, timeout=300)
    caller = await RelayCaller.open(rig.relay_url)
    runs: dict[str, list[dict[str, float]]] = {"dispatch": [], "relay": []}
    expected = {"size_bytes": sizes.copy_mib * MiB, "sha256": rig.source_sha256}

    async def dispatch_copy(destination: Path) -> dict[str, float]:
        with RssSampler(server_pid) as rss:
            started = time.perf_counter()
            response = await http.post(
                f"/api/v1/sessions/{SESSION}/copy",
                json={
                    "source_machine": "src",
                    "source_path": str(rig.source_file),
                    "destination_machine": "dst",
                    "destination_path": str(destination),
                },
            )
            seconds = time.perf_counter() - started
        if response.status_code != 200 or response.json() != expected:
            raise RuntimeError(f"Dispatch copy failed: {response.status_code} {response.text[:300]}")
        return {"seconds": seconds, "rss_before_mib": rss.before, "rss_peak_mib": rss.peak, "rss_after_mib": rss.after}

    async def relay_copy(destination: Path) -> dict[str, float]:
        started = time.perf_counter()
        reply = await caller.request(
            "COPY",
            {
                "source_machine": "src",
                "source_path": str(rig.source_file),
                "destination_machine": "dst",
                "destination_path": str(destination),
            },
        )
        seconds = time.perf_counter() - started
        if reply["type"] != "COPY_RESULT" or reply["payload"] != expected:
            raise RuntimeError(f"relay copy failed: {reply}")
        return {"seconds": seconds}

    copies = {"dispatch": (dispatch_copy, rig.work / "dst-dispatch"), "relay": (relay_copy, rig.work / "dst-relay")}
    try:
        for round_index in range(sizes.copy_rounds):
            order = ["relay", "dispatch"] if round_index % 2 == 0 else ["dispatch", "relay"]
            for name in order:
                copy, directory = copies[name]
                destination = directory / f"copy-{round_index}.bin"
                with CpuMeter(rig.pids) as meter:
                    run = await with_timeout(copy(destination), 150, f"B5 {name} copy")
                run["cpu_ms_per_mib"] = CpuPerOp().add(meter, sizes.copy_mib, [name]).ms
                if await asyncio.to_thread(sha256_of, destination) != rig.source_sha256:
                    raise RuntimeError(f"B5 {name}: the copy on disk differs from the source")
                if list(directory.glob("*.dispatch-partial")):
                    raise RuntimeError(f"B5 {name}: a partial file was left behind")
                destination.unlink()
                run["mib_per_second"] = sizes.copy_mib / run["seconds"]
                runs[name].append(run)
    finally:
        await caller.close()
        await http.aclose()

    def best(name: str) -> float:
        return max(run["mib_per_second"] for run in runs[name])

    def median(name: str) -> float:
        return percentile(sorted(run["mib_per_second"] for run in runs[name]), 0.5)

    growth = max(run["rss_peak_mib"] - run["rss_before_mib"] for run in runs["dispatch"])
    return {
        "file_mib": sizes.copy_mib,
        "runs": runs,
        "dispatch_mib_per_second": median("dispatch"),
        "relay_mib_per_second": median("relay"),
        "dispatch_best": best("dispatch"),
        "relay_best": best("relay"),
        "rss_growth_peak_mib": round(growth, 1),
        "cpu_ms_per_mib": {name: percentile(sorted(run["cpu_ms_per_mib"] for run in runs[name]), 0.5) for name in runs},
    }


# --- B6 -------------------------------------------------------------------------------------


def hello_frame(machine_id: str, sessions: list[str]) -> dict[str, Any]:
    return envelope(
        "HELLO",
        {
            "shim_version": "bench",
            "protocol_version": "2.0",
            "machine_id": machine_id,
            "hostname": "bench-host",
            "display_name": f"idle-{machine_id[:8]}",
            "platform": "linux",
            "arch": "x86_64",
            "capabilities": ["files"],
            "allowed_roots": ["/nonexistent/bench"],
            "sessions": sessions,
            "hardware_devices": [],
        },
    )


class IdleShim:
    """A raw shim client: HELLO, then answers PING and MACHINE_LIST_REQUEST, noting when they come."""

    def __init__(self, ws: Any, machine_id: str, acked_at: float) -> None:
        self.ws = ws
        self.machine_id = machine_id
        self.acked_at = acked_at
        self.pings: list[float] = []
        self.list_requests = 0
        self.task = asyncio.create_task(self._serve())

    @classmethod
    async def open(cls, ws_base: str, token: str, sessions: list[str]) -> IdleShim:
        from websockets.asyncio.client import connect

        ws = await connect(
            f"{ws_base}/ws/shim/",
            additional_headers={"Authorization": f"Bearer {token}"},
            compression=None,
            max_size=MAX_MESSAGE,
            open_timeout=60,
        )
        machine_id = str(uuid.uuid4())
        hello = hello_frame(machine_id, sessions)
        await ws.send(encode(hello))
        ack = json.loads(await asyncio.wait_for(ws.recv(), 60))
        if ack["type"] != "HELLO_ACK" or ack["id"] != hello["id"]:
            await ws.close()
            raise RuntimeError(f"no HELLO_ACK: {ack}")
        return cls(ws, machine_id, time.monotonic())

    async def _serve(self) -> None:
        with contextlib.suppress(Exception):
            async for text in self.ws:
                frame = json.loads(text)
                if frame["type"] == "PING":
                    self.pings.append(time.monotonic())
                    await self.ws.send(encode(envelope("PONG", {}, id=frame["id"])))
                elif frame["type"] == "MACHINE_LIST_REQUEST":
                    self.list_requests += 1
                    payload = {
                        "machine_id": self.machine_id,
                        "hostname": "bench-host",
                        "display_name": None,
                        "platform": "linux",
                        "arch": "x86_64",
                        "capabilities": ["files"],
                        "hardware_devices": [],
                    }
                    await self.ws.send(encode(envelope("MACHINE_LIST_RESPONSE", payload, id=frame["id"])))

    @property
    def alive(self) -> bool:
        return not self.task.done()

    async def close(self) -> None:
        await self.ws.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.task, 5)


class IdleSession:
    """A raw ``/ws`` session authenticated by its bearer header (docs/ws-protocol.md#authentication)."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws

    @classmethod
    async def open(cls, ws_base: str, token: str) -> IdleSession:
        from websockets.asyncio.client import connect

        ws = await connect(
            f"{ws_base}/ws", additional_headers={"Authorization": f"Bearer {token}"}, compression=None, open_timeout=60
        )
        return cls(ws)

    async def ping(self) -> float:
        """One ``ping`` request; its round trip in ms (raises unless it answers ``pong``)."""
        started = time.perf_counter()
        await self.ws.send(encode({"action": "ping", "nonce": 1, "body": {}}))
        while True:
            reply = json.loads(await asyncio.wait_for(self.ws.recv(), 30))
            if reply.get("nonce") == 1:
                break
        if reply.get("pong") is not True:
            raise RuntimeError(f"ping answered {reply}")
        return (time.perf_counter() - started) * 1000

    async def close(self) -> None:
        await self.ws.close()


def heartbeat_age(database: Path, process_id: str) -> float:
    """Seconds since ``ServerProcess.heartbeat_at`` of ``process_id`` (read from SQLite)."""
    with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=5)) as db:
        row = db.execute("SELECT heartbeat_at FROM dispatch_serverprocess WHERE id = ?", (process_id,)).fetchone()
    if row is None:
        return float("inf")
    stamp = datetime.fromisoformat(str(row[0]))
    stamp = stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)
    return (datetime.now(UTC) - stamp).total_seconds()


async def storm(ws_base: str, token: str, count: int) -> dict[str, Any]:
    """(B6') ``count`` shims of one user on ``"*"``, one after another: MACHINE_LIST_REQUESTs sent."""
    shims = []
    try:
        for _ in range(count):
            shims.append(await IdleShim.open(ws_base, token, ["*"]))
        await asyncio.sleep(2)  # the requests are sent in the background
        return {
            "shims": count,
            "machine_list_requests": sum(shim.list_requests for shim in shims),
            "to_the_first_shim": shims[0].list_requests if shims else 0,
        }
    finally:
        await asyncio.gather(*(shim.close() for shim in shims), return_exceptions=True)


def _gap_summary(values: list[float]) -> dict[str, float | None]:
    values = sorted(values)
    return {
        "p50": round(percentile(values, 0.5), 2) if values else None,
        "p99": round(percentile(values, 0.99), 2) if values else None,
        "max": round(values[-1], 2) if values else None,
    }


async def one_user_probe(ws_base: str, token: str, pid: int, count: int, batch: int = 100) -> dict[str, Any]:
    """(B6'') ``count`` shims of ONE user (each its own session) opened in batches of
    ``batch``, 25 at a time: the server's CPU ms per HELLO in each batch. A HELLO reads every
    connection of its user (machines/services/connections.py ``_snapshot_targets``), so
    the cost per HELLO grows with the user's machines; this shows by how much."""
    shims: list[IdleShim] = []
    per_batch: list[float] = []
    gate = asyncio.Semaphore(25)

    async def one(index: int) -> IdleShim:
        async with gate:
            return await IdleShim.open(ws_base, token, [f"probe-{index}"])

    try:
        for start in range(0, count, batch):
            before = process_cpu_seconds(pid)
            shims += await asyncio.gather(*(one(index) for index in range(start, min(count, start + batch))))
            per_batch.append(round(1000 * (process_cpu_seconds(pid) - before) / batch, 2))
    finally:
        await asyncio.gather(*(shim.close() for shim in shims), return_exceptions=True)
    return {"shims": count, "batch": batch, "cpu_ms_per_hello": per_batch}


async def b6_clients(
    ws_base: str, token: str, tag: str, shim_count: int, session_count: int, concurrency: int, limit: float
) -> None:
    """One B6 client process (``machines.py b6-clients``): its share of idle shims and /ws sessions.

    Talks to the driver by lines: it prints ``{"event": "shims", …}`` (JSON) when its shims
    are connected, opens its sessions on the line ``sessions`` from stdin and prints
    ``{"event": "sessions", …}``; on ``check`` it pings every session and prints
    ``{"event": "report", …}`` (shims alive, sessions answering, PING times); on ``close``
    (or end of input) it closes every connection and exits. A connection that fails to open
    is counted with its error, never retried, and what is not open ``limit`` seconds after a
    phase began is given up: the report says how many the server held.
    """
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[str] = asyncio.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line.strip())
        loop.call_soon_threadsafe(lines.put_nowait, "close")

    threading.Thread(target=read_stdin, daemon=True).start()

    def say(event: str, **fields: Any) -> None:
        print(json.dumps({"event": event, **fields}), flush=True)

    async def open_all(count: int, opener: Callable[[int], Awaitable[Any]]) -> tuple[list[Any], list[str]]:
        gate = asyncio.Semaphore(concurrency)

        async def one(index: int) -> Any:
            async with gate:
                return await opener(index)

        tasks = [asyncio.create_task(one(index)) for index in range(count)]
        _, late = await asyncio.wait(tasks, timeout=limit)
        for task in late:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        opened = [task.result() for task in tasks if not task.cancelled() and task.exception() is None]
        errors = [f"not open within {limit:g} s" for task in tasks if task.cancelled()]
        errors += [f"{type(task.exception()).__name__}: {task.exception()}"[:200]
                   for task in tasks if not task.cancelled() and task.exception() is not None]  # fmt: skip
        return opened, errors

    shims: list[IdleShim] = []
    sessions: list[IdleSession] = []
    try:
        started = time.perf_counter()
        tokens = token.split(",")  # the users' tokens, connection i using the (i mod n)th
        shims, shim_errors = await open_all(
            shim_count, lambda i: IdleShim.open(ws_base, tokens[i % len(tokens)], [f"b6-{tag}-{i}"])
        )
        say("shims", opened=len(shims), errors=len(shim_errors), error_samples=sorted(set(shim_errors))[:3],
            seconds=round(time.perf_counter() - started, 2))  # fmt: skip
        while (command := await lines.get()) not in ("sessions", "close"):
            pass
        if command == "sessions":
            started = time.perf_counter()
            sessions, session_errors = await open_all(
                session_count, lambda i: IdleSession.open(ws_base, tokens[i % len(tokens)])
            )
            seconds = round(time.perf_counter() - started, 2)
            say("sessions", opened=len(sessions), errors=len(session_errors),
                error_samples=sorted(set(session_errors))[:3], seconds=seconds)  # fmt: skip
            while (command := await lines.get()) not in ("check", "close"):
                pass
        if command == "check":
            alive = sum(shim.alive for shim in shims)
            rtts = await asyncio.gather(*(session.ping() for session in sessions), return_exceptions=True)
            answered = [round(rtt, 2) for rtt in rtts if isinstance(rtt, float)]
            say(
                "report",
                shims_alive=alive,
                sessions_answered=answered,
                shims_pinged=sum(1 for shim in shims if shim.pings),
                pings=sum(len(shim.pings) for shim in shims),
                gaps=[round(b - a, 3) for shim in shims for a, b in zip(shim.pings, shim.pings[1:], strict=False)],
                firsts=[round(shim.pings[0] - shim.acked_at, 3) for shim in shims if shim.pings],
                list_requests=sum(shim.list_requests for shim in shims),
            )
            while await lines.get() != "close":
                pass
    finally:
        connections: list[IdleShim | IdleSession] = [*shims, *sessions]
        await asyncio.gather(*(connection.close() for connection in connections), return_exceptions=True)


class B6Client:
    """The driver's end of one ``b6-clients`` child process."""

    def __init__(self, proc: asyncio.subprocess.Process, tag: str) -> None:
        self.proc, self.tag = proc, tag

    @classmethod
    async def start(
        cls, ws_base: str, token: str, tag: str, shims: int, sessions: int, concurrency: int, limit: float
    ) -> B6Client:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(Path(__file__).resolve()), "b6-clients", "--ws-base", ws_base, "--token", token,
            "--tag", tag, "--shims", str(shims), "--sessions", str(sessions), "--concurrency", str(concurrency),
            "--limit", str(limit),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO, limit=64 * MiB,
        )  # fmt: skip
        return cls(proc, tag)

    async def expect(self, event: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"B6 client {self.tag} exited ({await self.proc.wait()}) before '{event}'")
            with contextlib.suppress(ValueError):
                message: dict[str, Any] = json.loads(line)
                if message.get("event") == event:
                    return message

    def tell(self, command: str) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(Exception):
            self.proc.stdin.write(f"{command}\n".encode())

    async def stop(self) -> None:
        self.tell("close")
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 30)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


async def b6(
    server: Any, tokens: list[str], storm_token: str, probe_token: str, database: Path, sizes: Sizes
) -> dict[str, Any]:
    """B6: ``sizes.shims`` idle shims + ``sizes.sessions`` idle /ws sessions on one fresh
    ``serve`` process, opened by ``sizes.b6_clients`` client processes (each under the
    descriptor limit), then ``sizes.idle_seconds`` idle. Reports memory per connection, the
    process heartbeat's age, the shims' PING gaps, server CPU ms per connection opened and
    its CPU while idle. Connection i belongs to user ``tokens[i mod len(tokens)]``."""
    import httpx

    ws_base = server.url.replace("http://", "ws://")
    pid = server.proc.pid
    http = httpx.AsyncClient(base_url=server.url, timeout=30)
    process_id = (await http.get("/healthz")).json()["process_id"]
    report: dict[str, Any] = {"ping_interval_s": sizes.ping_interval, "pong_timeout_s": B6_PONG_TIMEOUT,
                              "client_processes": sizes.b6_clients, "users": len(tokens)}  # fmt: skip
    report["storm"] = await storm(ws_base, storm_token, sizes.storm_shims)
    await asyncio.sleep(1)
    rss0 = process_rss_mib(pid)
    clients: list[B6Client] = []
    n = sizes.b6_clients
    per_process = max(1, 32 // n)

    def share(total: int, index: int) -> int:
        return total // n + (1 if index < total % n else 0)

    try:
        cpu0 = process_cpu_seconds(pid)
        started = time.perf_counter()
        limit, joined = sizes.connect_limit, ",".join(tokens)
        clients = [
            await B6Client.start(ws_base, joined, str(i), share(sizes.shims, i), share(sizes.sessions, i), per_process,
                                 limit)
            for i in range(n)
        ]  # fmt: skip
        opened = await with_timeout(
            asyncio.gather(*(client.expect("shims") for client in clients)), sizes.connect_limit + 60, "B6 shims"
        )
        report["shims_connect_seconds"] = round(time.perf_counter() - started, 1)
        report["shims_opened"] = sum(item["opened"] for item in opened)
        report["shim_errors"] = sum(item["errors"] for item in opened)
        report["shim_error_samples"] = sorted({e for item in opened for e in item["error_samples"]})[:3]
        cpu1 = process_cpu_seconds(pid)
        rss1 = process_rss_mib(pid)
        started = time.perf_counter()
        for client in clients:
            client.tell("sessions")
        opened = await with_timeout(
            asyncio.gather(*(client.expect("sessions") for client in clients)), sizes.connect_limit + 60, "B6 sessions"
        )
        report["sessions_connect_seconds"] = round(time.perf_counter() - started, 1)
        report["sessions_opened"] = sum(item["opened"] for item in opened)
        report["session_errors"] = sum(item["errors"] for item in opened)
        report["session_error_samples"] = sorted({e for item in opened for e in item["error_samples"]})[:3]
        cpu2 = process_cpu_seconds(pid)
        rss2 = process_rss_mib(pid)

        # Idle: sample the process heartbeat and /healthz while everything stays connected.
        ages: list[float] = []
        healthz: list[float] = []
        window_started = time.monotonic()
        while time.monotonic() - window_started < sizes.idle_seconds:
            ages.append(await asyncio.to_thread(heartbeat_age, database, process_id))
            began = time.perf_counter()
            response = await http.get("/healthz")
            healthz.append((time.perf_counter() - began) * 1000)
            if response.status_code != 200:
                raise RuntimeError(f"/healthz answered {response.status_code} under load")
            await asyncio.sleep(0.5)
        idle_seconds = time.monotonic() - window_started
        cpu3 = process_cpu_seconds(pid)
        rss3 = process_rss_mib(pid)

        for client in clients:
            client.tell("check")
        checks = await with_timeout(asyncio.gather(*(client.expect("report") for client in clients)), 120, "B6 pings")
        answered = [rtt for item in checks for rtt in item["sessions_answered"]]
        gaps = [gap for item in checks for gap in item["gaps"]]
        firsts = [first for item in checks for first in item["firsts"]]
        connections = report["shims_opened"] + report["sessions_opened"]
        report.update(
            {
                "shims": sizes.shims,
                "sessions": sizes.sessions,
                "shims_alive": sum(item["shims_alive"] for item in checks),
                "sessions_answered_ping": len(answered),
                "ws_ping_ms": latency_summary(answered),
                "rss_mib": {"before": rss0, "after_shims": rss1, "after_sessions": rss2, "after_idle": rss3},
                "kib_per_shim": round((rss1 - rss0) * 1024 / max(1, report["shims_opened"]), 1),
                "kib_per_session": round((rss2 - rss1) * 1024 / max(1, report["sessions_opened"]), 1),
                "kib_per_connection": round((rss2 - rss0) * 1024 / max(1, connections), 1),
                "cpu_ms_per_shim_opened": round(1000 * (cpu1 - cpu0) / max(1, report["shims_opened"]), 3),
                "cpu_ms_per_session_opened": round(1000 * (cpu2 - cpu1) / max(1, report["sessions_opened"]), 3),
                "cpu_ms_per_connection_opened": round(1000 * (cpu2 - cpu0) / max(1, connections), 3),
                "idle_cpu_percent": round(100 * (cpu3 - cpu2) / idle_seconds, 1),
                "heartbeat_interval_s": float(SERVER_ENV["DISPATCH_HEARTBEAT_INTERVAL"]),
                "heartbeat_max_age_s": round(max(ages), 2),
                "heartbeat_samples": len(ages),
                "healthz_ms": latency_summary(healthz),
                "ping_period_s": sizes.ping_interval,  # machines/consumers.py _ping_loop: a PING every interval
                "shims_pinged": sum(item["shims_pinged"] for item in checks),
                "pings": sum(item["pings"] for item in checks),
                "ping_gap_s": _gap_summary(gaps),
                "first_ping_after_ack_s": _gap_summary(firsts),
            }
        )
    finally:
        await asyncio.gather(*(client.stop() for client in clients), return_exceptions=True)
        await http.aclose()
    # After B6, so that the memory it frees does not hide what B6's connections take; and
    # once the server has finished closing them (< 10 % of a core over a second, at most 60 s).
    for _ in range(60):
        before = process_cpu_seconds(pid)
        await asyncio.sleep(1.0)
        if process_cpu_seconds(pid) - before < 0.1:
            break
    report["one_user"] = await with_timeout(
        one_user_probe(ws_base, probe_token, pid, sizes.one_user_shims), 180, "(B6'') one user's shims"
    )
    return report


# --- the run --------------------------------------------------------------------------------


def b6_tokens(inst: Any, users: int) -> list[str]:
    """``users`` new users (``b6-0``…) with an API token each, made in one ``manage.py shell``;
    their tokens. B6's connections are spread over them, as machines and sessions of many
    users are: one user's HELLO reads every connection of that user (the N = 2 snapshot
    rule, machines/services/connections.py ``_snapshot_targets``), which the (B6'') probe
    of one user's many shims measures apart."""
    script = (
        "from django.contrib.auth import get_user_model\n"
        "from core.services import api_token_create\n"
        "users = get_user_model().objects\n"
        f"tokens = [api_token_create(user=users.create_user(f'b6-{{i}}'), name='b6').raw "
        f"for i in range({users})]\n"
        "print(','.join(tokens))\n"
    )
    return str(inst.manage("shell", "-c", script).stdout).strip().splitlines()[-1].split(",")


def run(sizes: Sizes) -> dict[str, Any]:
    from remote_calls import logs_on_failure

    from tests.infra import instance

    report: dict[str, Any] = {"notes": []}
    with tempfile.TemporaryDirectory(prefix="bench-machines-") as scratch, relay_server() as (relay_url, relay_pid):
        work = Path(scratch)
        for directory in ("src", "dst-dispatch", "dst-relay"):
            (work / directory).mkdir()
        print("· starting Dispatch (SQLite, in-memory channel layer) and four real shims…", flush=True)
        with instance(**SERVER_ENV) as inst, logs_on_failure(inst):
            server = inst.serve()
            token = inst.admin_token
            shims = {
                "dispatch-src": start_shim(server.url, token, "src", work / "src", work / "state-d-src"),
                "dispatch-dst": start_shim(server.url, token, "dst", work / "dst-dispatch", work / "state-d-dst"),
                "relay-src": start_shim(relay_url, "relay", "src", work / "src", work / "state-r-src"),
                "relay-dst": start_shim(relay_url, "relay", "dst", work / "dst-relay", work / "state-r-dst"),
            }
            try:
                rig = Rig(dispatch_url=server.url, token=token, relay_url=relay_url, work=work, pids={})
                rig.pids = {"dispatch": server.proc.pid, "relay": relay_pid}
                rig.pids.update({f"shim.{name}": shim.pid for name, shim in shims.items()})
                rig.stat_path.write_text("stat me\n")
                rig.source_sha256 = make_source(rig.source_file, sizes.copy_mib)

                print(
                    f"· B4: {sizes.warmup} warm-up + {sizes.calls} sequential FILE_STAT on each, "
                    f"{sizes.rounds} interleaved rounds…",
                    flush=True,
                )
                report["b4"] = asyncio.run(b4(rig, sizes))
                print("· B4 (tool path): PostgreSQL + Redis, serve + a Django tool driver, interleaved…", flush=True)
                report["b4_tool"] = asyncio.run(b4_tool(rig, sizes, work))
                print(f"· B5: {sizes.copy_rounds} x {sizes.copy_mib} MiB copy on each, interleaved…", flush=True)
                report["b5"] = asyncio.run(b5(rig, sizes, server.proc.pid))
                report["b5"]["relay_rss_mib_after"] = round(process_rss_mib(relay_pid), 1)
            finally:
                for shim in shims.values():
                    shim.stop()

            print(
                f"· B6: a fresh process; {sizes.storm_shims} shims on '*' first (B6'), then {sizes.shims} idle shims + "
                f"{sizes.sessions} idle /ws sessions of {sizes.b6_users} users from {sizes.b6_clients} client "
                f"processes, {sizes.idle_seconds:g} s idle; then {sizes.one_user_shims} shims of one user (B6'')…",
                flush=True,
            )
            server.stop()
            inst.create_user("storm")
            storm_token = inst.token("storm")
            b6_server = inst.serve(
                DISPATCH_SHIM_PING_INTERVAL=sizes.ping_interval, DISPATCH_SHIM_PONG_TIMEOUT=B6_PONG_TIMEOUT
            )
            database = Path(inst.env["DISPATCH_DATA_DIR"]) / "dispatch.sqlite3"
            tokens = b6_tokens(inst, sizes.b6_users)
            try:
                report["b6"] = asyncio.run(b6(b6_server, tokens, storm_token, token, database, sizes))
            except (RuntimeError, OSError) as exc:  # B4 and B5 are still reported; the row says why not B6
                report["b6"] = {"failed": f"{type(exc).__name__}: {exc}", "shims": sizes.shims,
                                "sessions": sizes.sessions}  # fmt: skip
                report["notes"].append(f"B6 not measured: {report['b6']['failed']}")
    return report


# --- the table ------------------------------------------------------------------------------


def _lat(summary: dict[str, float]) -> str:
    return f"{summary['p50_ms']:.2f} / {summary['p95_ms']:.2f} / {summary['p99_ms']:.2f}"


def _sequential_cpu(phase: dict[str, Any], cpu: dict[str, float], server: str) -> float | None:
    """Server CPU ms per sequential op: its mean CPU share over the phase × the mean latency."""
    return CpuPerOp.from_percent(cpu.get(server), phase["mean_ms"]).ms


def b4_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The B4 rows (common.bench_row): REST and its /healthz floor (_rest_rows), then the
    goals beyond REST: MCP <= the /healthz floor + 3x bare (same run, SQLite
    server); the built-in agent's tool path <= 4x bare, and REST <= floor + 3x bare on the
    PostgreSQL + Redis server that path uses (server CPU ms per op of the serve process)."""
    b4, tool = report["b4"], report.get("b4_tool")
    relay_p50, floor_p50 = b4["relay"]["p50_ms"], b4["http_floor"]["p50_ms"]
    relay_cpu = b4["cpu"].get("relay", {}).get("relay_ms_per_op")
    mcp_p50 = b4["mcp"]["p50_ms"]
    rows = [
        *_rest_rows(b4),
        bench_row(
            "B4 mcp",
            "MCP tools/call local_pc_file_stat, SQLite server (ms p50/p95/p99)",
            dispatch=f"{_lat(b4['mcp'])} (HTTP)",
            baseline=f"{_lat(b4['relay'])} (bare relay, ws)",
            ratio=f"floor + {(mcp_p50 - floor_p50) / relay_p50:.1f}x bare",
            cpu=(b4["cpu"].get("mcp", {}).get("dispatch_ms_per_op"), relay_cpu),
            goal=f"p50 <= /healthz floor + {B4_REST_MAX_RATIO:g}x bare",
            passed=mcp_p50 <= floor_p50 + B4_REST_MAX_RATIO * relay_p50,
            numbers={"dispatch_p50_ms": mcp_p50, "baseline_p50_ms": relay_p50, "floor_p50_ms": floor_p50},
        ),
    ]
    if tool is None:
        return rows
    t_relay, t_floor = tool["relay"]["p50_ms"], tool["http_floor"]["p50_ms"]
    t_tool, t_rest = tool["tool"]["p50_ms"], tool["dispatch"]["p50_ms"]
    t_relay_cpu = tool["cpu"].get("relay", {}).get("relay_ms_per_op")
    rows += [
        bench_row(
            "B4 tool",
            "the built-in agent's local_pc_file_stat handler in a 2nd Django process, PostgreSQL + Redis",
            dispatch=_lat(tool["tool"]),
            baseline=f"{_lat(tool['relay'])} (bare relay, ws)",
            ratio=f"{t_tool / t_relay:.1f}x",
            cpu=(tool["cpu"].get("tool", {}).get("dispatch_ms_per_op"), t_relay_cpu),
            goal=f"p50 <= {B4_TOOL_MAX_RATIO:g}x bare",
            passed=t_tool <= B4_TOOL_MAX_RATIO * t_relay,
            numbers={"dispatch_p50_ms": t_tool, "baseline_p50_ms": t_relay},
        ),
        bench_row(
            "B4 rest/pg",
            f"REST …/ops on that PostgreSQL + Redis server (/healthz p50 {t_floor:.2f} ms)",
            dispatch=f"{_lat(tool['dispatch'])} (HTTP)",
            baseline=f"{_lat(tool['relay'])} (bare relay, ws)",
            ratio=f"floor + {(t_rest - t_floor) / t_relay:.1f}x bare",
            cpu=(tool["cpu"].get("dispatch", {}).get("dispatch_ms_per_op"), t_relay_cpu),
            goal=f"p50 <= /healthz floor + {B4_REST_MAX_RATIO:g}x bare",
            passed=t_rest <= t_floor + B4_REST_MAX_RATIO * t_relay,
            numbers={"dispatch_p50_ms": t_rest, "baseline_p50_ms": t_relay, "floor_p50_ms": t_floor},
        ),
    ]
    return rows


B6_GOAL = (
    f"{B6_CONNECTIONS:,} + {B6_CONNECTIONS:,}; heartbeats on time; <= {B6_MAX_KIB:g} KiB each; CPU <= "
    f"{B6_MAX_CPU_MS_PER_SESSION:g} ms per /ws session, <= {B6_MAX_CPU_MS_PER_HELLO:g} ms per HELLO; idle CPU <= "
    f"{B6_MAX_IDLE_CPU_PERCENT:g}%"
)


def rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The B4–B6 rows (common.bench_row), goals from bench/README.md "Goals"."""
    b5, b6 = report["b5"], report["b6"]
    if "failed" in b6:
        return [
            *b4_rows(report),
            *_rows_b5(b5),
            bench_row(
                "B6",
                f"{b6['shims']:,} idle shims + {b6['sessions']:,} idle /ws sessions, one process",
                dispatch=f"not measured: {b6['failed'][:200]}",
                goal=B6_GOAL,
                passed=False,
            ),
        ]
    return b4_rows(report) + _rows_b5(b5) + _rows_b6(b6)


def _rest_rows(b4: dict[str, Any]) -> list[dict[str, Any]]:
    relay_p50 = b4["relay"]["p50_ms"]
    floor_p50 = b4["http_floor"]["p50_ms"]
    ratio = b4["dispatch"]["p50_ms"] / relay_p50
    rest_goal = floor_p50 + B4_REST_MAX_RATIO * relay_p50
    relay_cpu = _sequential_cpu(b4["relay"], b4["cpu"]["relay"], "relay")
    return [
        bench_row(
            "B4",
            "FILE_STAT round trip through the router, real shim, REST (ms p50/p95/p99)",
            dispatch=f"{_lat(b4['dispatch'])} (HTTP)",
            baseline=f"{_lat(b4['relay'])} (bare relay, ws)",
            ratio=f"{ratio:.1f}x; floor + {(b4['dispatch']['p50_ms'] - floor_p50) / relay_p50:.1f}x bare",
            cpu=(_sequential_cpu(b4["dispatch"], b4["cpu"]["dispatch"], "dispatch"), relay_cpu),
            goal=f"p50 <= /healthz floor + {B4_REST_MAX_RATIO:g}x bare (= {rest_goal:.2f} ms)",
            passed=b4["dispatch"]["p50_ms"] <= rest_goal,
            numbers={"dispatch_p50_ms": b4["dispatch"]["p50_ms"], "baseline_p50_ms": relay_p50,
                     "floor_p50_ms": floor_p50, "ratio": ratio, "goal_p50_ms": rest_goal},
        ),
        bench_row(
            "(B4')",
            "info: GET /healthz on the same keep-alive client: HTTP + Django + 1 query, no shim (ms)",
            dispatch=_lat(b4["http_floor"]),
            baseline=f"{_lat(b4['relay'])} (bare relay, ws)",
            ratio=f"{floor_p50 / relay_p50:.1f}x",
            cpu=(_sequential_cpu(b4["http_floor"], b4["cpu"]["http_floor"], "dispatch"), relay_cpu),
        ),
    ]  # fmt: skip


def _rows_b5(b5: dict[str, Any]) -> list[dict[str, Any]]:
    share = b5["dispatch_mib_per_second"] / b5["relay_mib_per_second"]
    growth = b5["rss_growth_peak_mib"]
    b5_cpu = b5.get("cpu_ms_per_mib", {})
    return [
        bench_row(
            "B5",
            f"copy of a {b5['file_mib']} MiB file between two shims (MiB/s, median); server RSS growth; CPU per MiB",
            dispatch=f"{b5['dispatch_mib_per_second']:.1f} MiB/s, RSS +{growth:.1f} MiB (peak)",
            baseline=f"{b5['relay_mib_per_second']:.1f} MiB/s (bare relay)",
            ratio=f"{share:.0%}",
            cpu=(b5_cpu.get("dispatch"), b5_cpu.get("relay")),
            goal=f">= {B5_MIN_SHARE:.0%} of bare; growth <= {B5_MAX_GROWTH_MIB:g} MiB",
            passed=share >= B5_MIN_SHARE and growth <= B5_MAX_GROWTH_MIB,
            numbers={"dispatch_mib_per_s": b5["dispatch_mib_per_second"],
                     "baseline_mib_per_s": b5["relay_mib_per_second"], "ratio": share, "rss_growth_mib": growth},
        ),
    ]  # fmt: skip


def _rows_b6(b6: dict[str, Any]) -> list[dict[str, Any]]:
    alive = b6["shims_alive"] + b6["sessions_answered_ping"]
    wanted = b6["shims"] + b6["sessions"]
    ping_max = b6["ping_gap_s"]["max"]
    pings_on_time = b6["shims_pinged"] == b6["shims"] and ping_max is not None and ping_max <= b6["ping_period_s"] + 1.0
    heartbeat_on_time = b6["heartbeat_max_age_s"] <= 2 * b6["heartbeat_interval_s"]
    per_connection = b6["kib_per_connection"]
    per_session, per_hello = b6["cpu_ms_per_session_opened"], b6["cpu_ms_per_shim_opened"]
    storm = b6["storm"]
    one = b6["one_user"]
    return [
        bench_row(
            "B6",
            f"{b6['shims']:,} idle shims + {b6['sessions']:,} idle /ws sessions of {b6['users']} users, one process, "
            f"{b6['client_processes']} client processes; CPU per connection opened",
            dispatch=f"{alive:,}/{wanted:,} alive; {per_connection:.0f} KiB/conn; heartbeat max age "
            f"{b6['heartbeat_max_age_s']:.1f} s; PING gap max {ping_max} s (period {b6['ping_period_s']:g} s); "
            f"idle CPU {b6['idle_cpu_percent']:.0f}%; CPU per /ws session {per_session:g} ms, "
            f"per HELLO {per_hello:g} ms",
            cpu=(b6["cpu_ms_per_connection_opened"], None),
            goal=B6_GOAL,
            passed=alive == wanted and wanted >= 2 * B6_CONNECTIONS and pings_on_time and heartbeat_on_time
            and per_connection <= B6_MAX_KIB and per_session <= B6_MAX_CPU_MS_PER_SESSION
            and per_hello <= B6_MAX_CPU_MS_PER_HELLO and b6["idle_cpu_percent"] <= B6_MAX_IDLE_CPU_PERCENT,
            numbers={"connections_wanted": wanted, "connections_alive": alive, "kib_per_connection": per_connection,
                     "heartbeat_max_age_s": b6["heartbeat_max_age_s"], "ping_gap_max_s": ping_max,
                     "idle_cpu_percent": b6["idle_cpu_percent"], "cpu_ms_per_session_opened": per_session,
                     "cpu_ms_per_shim_opened": per_hello},
        ),
        bench_row(
            "(B6'')",
            f"info: {one['shims']:,} shims of ONE user, {one['batch']} at a time: server CPU ms per HELLO, "
            "first batch -> last",
            dispatch=f"{one['cpu_ms_per_hello'][0]} -> {one['cpu_ms_per_hello'][-1]} ms",
            cpu=(one["cpu_ms_per_hello"][-1], None),
            goal="— (flat if a HELLO's cost did not grow with the user's machines)",
        ),
        bench_row(
            "(B6')",
            f"info: {storm['shims']} shims of one user on '*', one by one: MACHINE_LIST_REQUESTs sent",
            dispatch=f"{storm['machine_list_requests']} ({storm['to_the_first_shim']} to the first shim)",
            goal=f"— (~{storm['shims']} if only newcomers were asked)",
        ),
    ]  # fmt: skip


def _cpu_text(key: str, value: float) -> str:
    return (
        f"{key.removesuffix('_ms_per_op')} {value:.2f} ms/op" if key.endswith("_ms_per_op") else f"{key} {value:.0f}%"
    )


def print_details(report: dict[str, Any], sizes: Sizes) -> None:
    b4, b5, b6 = report["b4"], report["b5"], report["b6"]
    print(
        "B4: Dispatch is driven over HTTP (POST /api/v1/sessions/bench/ops, keep-alive), the bare relay over a "
        "websocket: HTTP is not in the baseline. (B4') is Dispatch's cheapest real HTTP round trip (/healthz: "
        "HTTP, Django, one query, no shim), a floor for any REST operation."
    )
    used = b4["machines_used"]
    print(f"    machines that served: REST {used['dispatch']}, MCP {used['mcp']}, relay {used['relay']}")
    print("    CPU, % of one core, while each was measured (shims listed apart; 'others' is the rest of the machine):")
    for name, cpu in b4["cpu"].items():
        print(f"      {name}: " + ", ".join(_cpu_text(k, v) for k, v in cpu.items()))
    tool = report["b4_tool"]
    print(
        "B4 tool: the local_pc_file_stat handler timed inside the driver process (ms p50/p95/p99 "
        f"{_lat(tool['tool'])}; {_lat(tool['tool_pipe'])} with the bench's pipe to it); on that server "
        f"/healthz {_lat(tool['http_floor'])}, REST {_lat(tool['dispatch'])}, relay {_lat(tool['relay'])}"
    )
    for name, cpu in tool["cpu"].items():
        print(f"      {name}: " + ", ".join(_cpu_text(k, v) for k, v in cpu.items()))
    for name in ("dispatch", "relay"):
        speeds = ", ".join(f"{run['mib_per_second']:.1f}" for run in b5["runs"][name])
        print(f"B5: {name} MiB/s per copy: {speeds}")
    for index, run in enumerate(b5["runs"]["dispatch"]):
        print(
            f"    Dispatch copy {index}: RSS {run['rss_before_mib']:.1f} MiB before, "
            f"{run['rss_peak_mib']:.1f} peak, {run['rss_after_mib']:.1f} after"
        )
    if "failed" in b6:
        print(f"B6: not measured: {b6['failed']}")
        return
    rss = b6["rss_mib"]
    one = b6["one_user"]
    print(
        f"(B6''): {one['shims']:,} shims of one user, {one['batch']} at a time: server CPU ms per HELLO by batch: "
        + ", ".join(f"{value:g}" for value in one["cpu_ms_per_hello"])
    )

    def failed(kind: str) -> str:
        samples = b6[f"{kind}_error_samples"]
        return f"{b6[f'{kind}_errors']} failed" + (": " + "; ".join(samples) if samples else "")

    print(
        f"B6: {b6['client_processes']} client processes; {b6['shims_opened']:,}/{b6['shims']:,} shims opened "
        f"({failed('shim')}) "
        f"in {b6['shims_connect_seconds']} s, {b6['sessions_opened']:,}/{b6['sessions']:,} /ws sessions "
        f"({failed('session')}) "
        f"in {b6['sessions_connect_seconds']} s; server CPU ms per shim opened {b6['cpu_ms_per_shim_opened']}, per "
        f"session {b6['cpu_ms_per_session_opened']}; idle CPU {b6['idle_cpu_percent']}% of a core"
    )
    print(
        f"    RSS {rss['before']:.0f} -> {rss['after_shims']:.0f} (shims) -> {rss['after_sessions']:.0f} (sessions) -> "
        f"{rss['after_idle']:.0f} MiB after {sizes.idle_seconds:g} s idle: "
        f"{b6['kib_per_shim']:.0f} KiB per shim, {b6['kib_per_session']:.0f} KiB per /ws session"
    )
    print(
        f"    process heartbeat every {b6['heartbeat_interval_s']:g} s: max age {b6['heartbeat_max_age_s']} s over "
        f"{b6['heartbeat_samples']} samples; /healthz ms p50/p95/p99 {_lat(b6['healthz_ms'])}"
    )
    print(
        f"    shim PINGs (DISPATCH_SHIM_PING_INTERVAL={b6['ping_period_s']:g}, PONG_TIMEOUT={B6_PONG_TIMEOUT:g}: "
        f"one every {b6['ping_period_s']:g} s): "
        f"{b6['pings']} to {b6['shims_pinged']}/{b6['shims']} shims; "
        f"gap s p50 {b6['ping_gap_s']['p50']}, p99 {b6['ping_gap_s']['p99']}, max {b6['ping_gap_s']['max']}; "
        f"first PING after HELLO_ACK max {b6['first_ping_after_ack_s']['max']} s"
    )
    print(
        f"    /ws sessions answering a ping at the end: {b6['sessions_answered_ping']}/{b6['sessions']} "
        f"(ms p50/p95/p99 {_lat(b6['ws_ping_ms'])}, all sent at once); shims still connected: "
        f"{b6['shims_alive']}/{b6['shims']}"
    )


def machine() -> dict[str, Any]:
    from remote_calls import machine as describe

    return describe()


def main(argv: list[str]) -> int:
    if argv[:1] == ["tool-driver"]:
        parser = argparse.ArgumentParser(description="the B4 tool-path driver (a Django process)")
        parser.add_argument("kind", choices=["tool-driver"])
        parser.add_argument("--path", required=True)
        run_tool_driver(parser.parse_args(argv).path)
        return 0
    if argv[:1] == ["relay"]:
        parser = argparse.ArgumentParser(description="the bare websockets shim relay (baseline)")
        parser.add_argument("kind", choices=["relay"])
        parser.add_argument("--port", type=int, required=True)
        asyncio.run(run_relay(parser.parse_args(argv).port))
        return 0
    if argv[:1] == ["b6-clients"]:
        parser = argparse.ArgumentParser(description="one B6 client process (driven by the B6 phase)")
        parser.add_argument("kind", choices=["b6-clients"])
        for name in ("--ws-base", "--token", "--tag"):
            parser.add_argument(name, required=True)
        for name in ("--shims", "--sessions", "--concurrency"):
            parser.add_argument(name, type=int, required=True)
        parser.add_argument("--limit", type=float, required=True)
        options = parser.parse_args(argv)
        raise_open_file_limit()
        asyncio.run(b6_clients(options.ws_base, options.token, options.tag, options.shims, options.sessions,
                               options.concurrency, options.limit))  # fmt: skip
        return 0
    parser = argparse.ArgumentParser(description="Machine benchmarks B4-B6 beside a bare relay.")
    parser.add_argument("--quick", action="store_true", help="a short run (about a minute)")
    parser.add_argument("--calls", type=int, help="sequential FILE_STATs per target for B4 (default 1000)")
    parser.add_argument(
        "--connections", type=int, help=f"B6 shims, and as many /ws sessions (default {B6_CONNECTIONS})"
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument(
        "--output", type=Path, default=RESULTS, help=f"JSON results (default {RESULTS.relative_to(REPO)})"
    )
    options = parser.parse_args(argv)
    sizes = (
        Sizes(warmup=30, calls=300, rounds=3, copy_rounds=1, copy_mib=100, shims=B6_CONNECTIONS,
              sessions=B6_CONNECTIONS, idle_seconds=10, storm_shims=30, one_user_shims=300)
        if options.quick
        else Sizes(warmup=100, calls=1000, rounds=5, copy_rounds=2, copy_mib=100, shims=B6_CONNECTIONS,
                   sessions=B6_CONNECTIONS, idle_seconds=20, storm_shims=50)
    )  # fmt: skip
    if options.calls:
        sizes.calls = options.calls
    if options.connections:
        sizes.shims = sizes.sessions = options.connections
    sizes.ping_interval = max(4.0, sizes.shims / B6_STAMPS_PER_SECOND)
    fd_limit = raise_open_file_limit()[1]

    def abort(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    def too_long(signum: int, frame: Any) -> None:
        raise TimeoutError(f"benchmark exceeded {HARD_LIMIT} s; aborted")

    signal.signal(signal.SIGTERM, abort)
    signal.signal(signal.SIGALRM, too_long)
    signal.alarm(HARD_LIMIT)
    info = machine()
    started = time.monotonic()
    print(
        f"Machine benchmarks ({'quick' if options.quick else 'full'} run) on {info['cpus']} CPU(s), "
        f"{info['cpu_model']}; open-file limit {fd_limit}.\n"
        f"NOTE: servers, the relay, the shims and this client share these {info['cpus']} cores; "
        "compare ratios, not absolutes.",
        flush=True,
    )
    try:
        report = run(sizes)
    except (KeyboardInterrupt, TimeoutError) as exc:
        print(f"aborted ({exc}); every process it started has been stopped", file=sys.stderr)
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        signal.alarm(0)
    table = rows(report)
    print()
    print_table(table)
    print()
    print_details(report, sizes)
    storm = report["b6"].get("storm")
    if storm and storm["machine_list_requests"] > 2 * storm["shims"]:
        report["notes"].append(
            f"(B6') {storm['shims']} shims of one user on '*' made the platform send "
            f"{storm['machine_list_requests']} MACHINE_LIST_REQUESTs: every new attachment asks every attached "
            "shim again (machines/services/connections.py announce_attachment), so it grows as N^2/2; "
            "docs/shim-protocol.md#machine-sessions asks when a second machine attaches"
        )
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
        footer="",
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
