"""What every benchmark shares: the wire shapes, the clients that drive a server, statistics.

The same client code drives Dispatch, the bare ``websockets`` relay and the Channels relay
(bench/baseline.py): all three speak the ``/ws`` envelope of
docs/ws-protocol.md#frames and #actions (``remote-connect``, ``remote-call`` with a
nonce, the downstream ``remote-call`` event with a ``requestId``, ``remote-call-result``),
so a difference in the numbers is a difference in the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import string
import subprocess
import time
from collections import Counter
from collections.abc import Awaitable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

REMOTENAME = "bench"
FUNCTION = "echo"
BLOB_CHARS = 1000  # args {"id", "blob"} and the result that echoes them are ~1 KiB of JSON each
MAX_FRAME = 16 * 1024 * 1024
TOOLS = [
    {
        "name": FUNCTION,
        "description": "Return the arguments it was given.",
        "parameters": {
            "type": "object",
            "properties": {"id": {"type": "string"}, "blob": {"type": "string"}},
            "required": ["id", "blob"],
        },
    }
]
_ALPHABET = string.ascii_letters + string.digits


def encode(message: dict[str, Any]) -> str:
    """Compact JSON, as Dispatch's ``remotes.protocol.encode`` writes it."""
    return json.dumps(message, separators=(",", ":"), ensure_ascii=False)


def _make_blob(seed: int) -> str:
    return "".join(_ALPHABET[(seed * 7 + i * 13) % len(_ALPHABET)] for i in range(BLOB_CHARS))


# Made once: building a 1,000-character string per call would cost the driver more
# than some of the servers spend on the call.
_BLOBS = [_make_blob(seed) for seed in range(64)]


def blob(seed: int) -> str:
    """A 1,000-character string that needs no JSON escaping (one of 64, chosen by seed)."""
    return _BLOBS[seed % len(_BLOBS)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def open_ws(url: str, token: str | None) -> ClientConnection:
    """A websocket client as programs open ``/ws``: bearer header, no compression.

    Compression is off because daphne (autobahn) does not negotiate permessage-deflate,
    while a bare ``websockets`` server would: every server then moves the same bytes.
    """
    headers = {"Authorization": f"Bearer {token}"} if token else None
    return await connect(url, additional_headers=headers, compression=None, max_size=MAX_FRAME, open_timeout=10)


class ProtocolError(RuntimeError):
    """A server answered something the benchmark did not expect."""


class Caller:
    """One caller session that sends requests one at a time and reads their replies."""

    def __init__(self, ws: ClientConnection, remotename: str = REMOTENAME) -> None:
        self.ws = ws
        self.remotename = remotename
        self.nonce = 0
        self.stray_frames = 0  # frames without our nonce (events) seen while waiting

    @classmethod
    async def open(cls, url: str, token: str | None, remotename: str = REMOTENAME) -> Caller:
        return cls(await open_ws(url, token), remotename)

    async def request(self, action: str, body: dict[str, Any]) -> dict[str, Any]:
        self.nonce += 1
        nonce = self.nonce
        await self.ws.send(encode({"action": action, "nonce": nonce, "body": body}))
        while True:
            reply = json.loads(await self.ws.recv())
            if reply.get("nonce") == nonce:
                return reply  # type: ignore[no-any-return]
            self.stray_frames += 1

    async def call(self, call_id: str, payload: str) -> dict[str, Any]:
        """One ``remote-call`` of the echo function; returns the reply frame."""
        return await self.request(
            "remote-call",
            {"remotename": self.remotename, "function": FUNCTION, "args": {"id": call_id, "blob": payload}},
        )

    async def close(self) -> None:
        await self.ws.close()


@dataclass
class FastRemote:
    """The serving side: a raw client that answers each downstream call at once.

    It echoes ``args`` as the result (so ~1 KiB back) and counts the call ids it saw, so
    a lost or duplicated downstream call shows up in the counts.
    """

    ws: ClientConnection
    seen: Counter[str] = field(default_factory=Counter)
    task: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, url: str, token: str | None, remotename: str = REMOTENAME) -> FastRemote:
        ws = await open_ws(url, token)
        await ws.send(
            encode({"action": "remote-connect", "nonce": "connect", "body": {"remotename": remotename, "tools": TOOLS}})
        )
        reply = json.loads(await asyncio.wait_for(ws.recv(), 10))
        if reply.get("message") != "remote connected":
            await ws.close()
            raise ProtocolError(f"remote-connect refused: {reply}")
        remote = cls(ws)
        remote.task = asyncio.create_task(remote._serve())
        return remote

    async def _serve(self) -> None:
        ws, seen = self.ws, self.seen
        async for frame in ws:
            message = json.loads(frame)
            if message.get("action") != "remote-call":
                continue
            args = message["args"]
            seen[args["id"]] += 1
            await ws.send(encode({"action": "remote-call-result", "requestId": message["requestId"], "result": args}))

    async def close(self) -> None:
        await self.ws.close()
        if self.task is not None:
            try:
                await asyncio.wait_for(self.task, 5)
            except (TimeoutError, Exception):
                self.task.cancel()


# --- measurement ------------------------------------------------------------------------


def percentile(sorted_values: list[float], fraction: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(fraction * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


def latency_summary(samples_ms: list[float]) -> dict[str, float]:
    values = sorted(samples_ms)
    return {
        "n": len(values),
        "p50_ms": percentile(values, 0.50),
        "p95_ms": percentile(values, 0.95),
        "p99_ms": percentile(values, 0.99),
        "max_ms": values[-1] if values else float("nan"),
        "mean_ms": sum(values) / len(values) if values else float("nan"),
    }


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by process ``pid`` (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def process_rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def system_busy_seconds() -> float:
    """CPU seconds all cores spent busy since boot (Linux /proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / _CLOCK_TICKS


class CpuMeter:
    """CPU used over a window, in % of one core: by each of ``pids``, by this driver, and by
    every other process on the machine (``others``: what disturbs the measurement)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids

    def __enter__(self) -> CpuMeter:
        self.wall = time.perf_counter()
        self.own = time.process_time()
        self.system = system_busy_seconds()
        self.start = {name: process_cpu_seconds(pid) for name, pid in self.pids.items()}
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self.wall
        used = {name: process_cpu_seconds(pid) - self.start[name] for name, pid in self.pids.items()}
        used["driver"] = time.process_time() - self.own
        others = system_busy_seconds() - self.system - sum(used.values())
        self.seconds = used  # CPU seconds by name over the window (``driver`` included)
        self.elapsed = wall  # the window, wall-clock seconds
        self.percent = {name: round(100 * value / wall, 1) for name, value in used.items()}
        self.percent["others"] = round(max(0.0, 100 * others / wall), 1)

    def cpu_seconds(self, names: Iterable[str]) -> float:
        """CPU seconds the processes ``names`` (keys of ``pids``) used over the window."""
        return sum(self.seconds[name] for name in names)


class CpuPerOp:
    """Server CPU milliseconds per operation, from /proc, server processes only: the CPU
    column every bench row prints (bench/README.md).

    Add each measured window: ``add(meter, ops, servers)`` with the ``CpuMeter`` of the
    window, the operations it completed and the names (``meter.pids`` keys) of the server
    processes, never the driver, shims or databases. ``ms`` is the total CPU of those
    processes over all windows, in ms, divided by the total operations (``None`` before
    any operation). Every bench script reports its ``cpu`` column through this class.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.ops = 0

    def add(self, meter: CpuMeter, ops: int, servers: Iterable[str]) -> CpuPerOp:
        self.seconds += meter.cpu_seconds(servers)
        self.ops += ops
        return self

    def add_seconds(self, seconds: float, ops: int) -> CpuPerOp:
        """A window measured some other way (``process_cpu_seconds`` before and after)."""
        self.seconds += seconds
        self.ops += ops
        return self

    @contextlib.contextmanager
    def window(self, pids: Iterable[int], ops: int = 1) -> Iterator[None]:
        """Add the CPU that the server processes ``pids`` use inside the ``with`` block, as
        ``ops`` operations (/proc counts in clock ticks, 10 ms: sum many short windows)."""
        pids = list(pids)
        before = sum(process_cpu_seconds(pid) for pid in pids)
        yield
        self.add_seconds(sum(process_cpu_seconds(pid) for pid in pids) - before, ops)

    @classmethod
    def from_percent(cls, percent: float | None, mean_ms: float, ops: int = 1) -> CpuPerOp:
        """From a sequential phase's mean CPU share (``CpuMeter.percent``, % of one core,
        averaged over equal windows) and its mean latency: each op then took ``mean_ms`` of
        wall time, so it used ``percent / 100 * mean_ms`` of CPU."""
        tally = cls()
        if percent is not None and mean_ms == mean_ms:
            tally.add_seconds(percent / 100 * mean_ms / 1000 * ops, ops)
        return tally

    @property
    def ms(self) -> float | None:
        return round(1000 * self.seconds / self.ops, 3) if self.ops else None


async def sequential_latencies(caller: Caller, *, count: int, label: str) -> list[float]:
    """``count`` calls one after the other; each round trip in milliseconds."""
    samples: list[float] = []
    clock = time.perf_counter_ns
    for index in range(count):
        call_id = f"{label}-{index}"
        payload = blob(index)
        started = clock()
        reply = await caller.call(call_id, payload)
        samples.append((clock() - started) / 1e6)
        result = reply.get("result")
        if not isinstance(result, dict) or result.get("id") != call_id or result.get("blob") != payload:
            raise ProtocolError(f"unexpected reply to {call_id}: {str(reply)[:300]}")
    return samples


class ThroughputTally:
    """Every call of a throughput measurement, over one or more windows.

    Each call id is unique; a caller records it as sent before sending, and as answered
    when the reply with its nonce echoes it. A caller still waiting ``grace`` seconds
    after a window ends is cancelled and its call counts as lost.
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self.sent: set[str] = set()
        self.answered: Counter[str] = Counter()
        self.settled: set[str] = set()  # ids whose reply was an error or the wrong echo
        self.errors: list[str] = []
        self.wrong = 0
        self.samples: list[float] = []
        self.seconds = 0.0
        self.windows = 0

    async def window(self, callers: list[Caller], *, seconds: float, grace: float = 15.0) -> None:
        """Each caller session keeps one call in flight for ``seconds``."""
        clock = time.perf_counter_ns
        stop_at = time.perf_counter() + seconds
        window = self.windows
        self.windows += 1

        async def run(index: int, caller: Caller) -> None:
            n = 0
            while time.perf_counter() < stop_at:
                call_id = f"{self.label}-{window}-{index}-{n}"
                payload = blob(n + index)
                n += 1
                self.sent.add(call_id)
                started = clock()
                reply = await caller.call(call_id, payload)
                self.samples.append((clock() - started) / 1e6)
                result = reply.get("result")
                if "error" in reply:
                    self.errors.append(str(reply["error"]))
                    self.settled.add(call_id)
                elif isinstance(result, dict) and result.get("id") == call_id and result.get("blob") == payload:
                    self.answered[call_id] += 1
                else:
                    self.wrong += 1
                    self.settled.add(call_id)

        began = time.perf_counter()
        tasks = [asyncio.create_task(run(index, caller)) for index, caller in enumerate(callers)]
        done, pending = await asyncio.wait(tasks, timeout=seconds + grace)
        self.seconds += time.perf_counter() - began
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in done:
            if task.exception() is not None:
                self.errors.append(f"caller failed: {task.exception()!r}")

    def result(self, remote: FastRemote, callers: int) -> dict[str, Any]:
        """Rate, counts and checks; ``remote``'s tally shows downstream duplicates or gaps."""
        completed = sum(self.answered.values())
        remote_ids = {call_id for call_id in remote.seen if call_id.startswith(f"{self.label}-")}
        lost = len(self.sent - set(self.answered) - self.settled)
        duplicated = sum(count - 1 for count in self.answered.values() if count > 1)
        remote_duplicates = sum(remote.seen[call_id] - 1 for call_id in remote_ids if remote.seen[call_id] > 1)
        remote_missing = len(set(self.answered) - remote_ids)
        return {
            "calls_per_second": round(completed / self.seconds, 1) if self.seconds else 0.0,
            "callers": callers,
            "in_flight": callers,
            "windows": self.windows,
            "seconds": round(self.seconds, 2),
            "completed": completed,
            "sent": len(self.sent),
            "errors": len(self.errors),
            "error_samples": sorted(set(self.errors))[:5],
            "lost": lost,
            "duplicated_replies": duplicated,
            "wrong_replies": self.wrong,
            "remote_duplicates": remote_duplicates,
            "remote_missing": remote_missing,
            "intact": not (self.errors or lost or duplicated or self.wrong or remote_duplicates or remote_missing),
            "latency": latency_summary(self.samples),
        }


# --- subprocesses -----------------------------------------------------------------------


def wait_for_port(port: int, proc: subprocess.Popen[Any], timeout: float = 30.0) -> None:
    """Block until something listens on 127.0.0.1:``port`` (or ``proc`` dies)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listened on port {port} within {timeout:g}s")


def stop_process(proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it does not exit within ``timeout``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


async def with_timeout(awaitable: Awaitable[Any], seconds: float, what: str) -> Any:
    try:
        return await asyncio.wait_for(awaitable, seconds)
    except TimeoutError:
        raise RuntimeError(f"{what} did not finish within {seconds:g}s") from None


def bench_row(
    row_id: str,
    what: str,
    *,
    dispatch: str,
    baseline: str = "—",
    ratio: str = "—",
    cpu: tuple[CpuPerOp | float | None, CpuPerOp | float | None] = (None, None),
    goal: str = "—",
    passed: bool | None = None,
    numbers: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """One row of a bench table, the same shape in every script and in
    ``bench/results/<script>.json``:

    ``id`` (``B1``…``B12``; ``(B4')`` for information rows), ``what``, ``dispatch`` and
    ``baseline`` (text with units; the baseline names itself, e.g. "0.36 (bare relay)"),
    ``ratio`` (text), ``cpu`` (text "Dispatch / baseline" server CPU ms per operation),
    ``cpu_ms_per_op`` ({"dispatch", "baseline"}: numbers or None), ``goal`` (the row's
    target, bench/README.md#goals, or "—"), ``pass`` (True, False, or None for information rows and rows not
    measured) and ``numbers`` (the figures behind the text, each key naming its unit).
    ``extra`` keys (``skipped``, ``why``…) are kept as given.
    """
    ms = tuple(value.ms if isinstance(value, CpuPerOp) else value for value in cpu)
    return {
        "id": row_id,
        "what": what,
        "dispatch": dispatch,
        "baseline": baseline,
        "ratio": ratio,
        "cpu": format_cpu(ms[0], ms[1]),
        "cpu_ms_per_op": {"dispatch": ms[0], "baseline": ms[1]},
        "goal": goal,
        "pass": passed,
        "numbers": numbers or {},
        **extra,
    }


def format_cpu(dispatch: float | None, baseline: float | None) -> str:
    """ "0.52 / 0.12" (ms per operation; "—" for a side not measured)."""

    def one(value: float | None) -> str:
        if value is None or value != value:
            return "—"
        return f"{value:.3g}" if value < 100 else f"{value:,.0f}"

    if dispatch is None and baseline is None:
        return "—"
    return f"{one(dispatch)} / {one(baseline)}"


TABLE_COLUMNS = [
    ("id", "id"),
    ("what", "what"),
    ("dispatch", "Dispatch"),
    ("baseline", "baseline"),
    ("ratio", "ratio"),
    ("cpu", "CPU ms/op Dispatch / baseline"),
    ("goal", "goal"),
]


def result_text(row: dict[str, Any]) -> str:
    if row.get("skipped"):
        return "SKIP"
    return {True: "PASS", False: "FAIL", None: "—"}[row.get("pass")]


def print_table(table: list[dict[str, Any]], *, columns: list[tuple[str, str]] | None = None) -> None:
    """Print rows of ``bench_row`` aligned, in the columns every script shares, and a result
    column (PASS, FAIL, SKIP, or — for information rows)."""
    columns = columns or TABLE_COLUMNS
    headers = [header for _, header in columns] + ["result"]
    lines = [[str(row.get(key, "—")) for key, _ in columns] + [result_text(row)] for row in table]
    widths = [max(len(x) for x in column) for column in zip(headers, *lines, strict=False)]
    print(" | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for line in lines:
        print(" | ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip())


def finish_report(
    *,
    report: dict[str, Any],
    table: list[dict[str, Any]],
    info: dict[str, Any],
    sizes: Any,
    server_env: dict[str, str],
    output: Path,
    quick: bool,
    strict: bool,
    started: float,
    footer: str = "",
) -> int:
    """Print the notes, write ``output`` (JSON) and return the exit code (1 on a missed
    target only with ``strict``)."""
    for note in report["notes"]:
        print(f"NOTE: {note}")
    elapsed = time.monotonic() - started
    print(f"({elapsed:.0f} s{'; ' + footer if footer else ''})")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(
        json.dumps(
            {
                "script": output.stem,
                "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "finished_at": time.time(),
                "mode": "quick" if quick else "full",
                "machine": info,
                "sizes": sizes.__dict__,
                "server_env": server_env,
                "elapsed_seconds": round(elapsed, 1),
                "table": table,
                **report,
            },
            indent=2,
        )
    )
    print(f"wrote {output}")
    missed = [row["id"] for row in table if row["pass"] is False]
    if missed:
        print(f"targets missed: {', '.join(missed)}")
    return 1 if missed and strict else 0


def print_rows(table: list[dict[str, Any]], columns: list[tuple[str, str]]) -> None:
    """``print_table`` with the caller's columns (kept for older callers)."""
    print_table(table, columns=columns)
