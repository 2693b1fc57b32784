"""B6 of bench/machines.py: idle shims and ``/ws`` sessions on one fresh process, opened
by client processes of their own (``machines.py b6-clients``), and the (B6') and (B6'')
probes of one user's many shims.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from common import encode, latency_summary, percentile, process_cpu_seconds, process_rss_mib, with_timeout
from machines_common import B6_PONG_TIMEOUT, MAX_MESSAGE, REPO, SCRIPT, SERVER_ENV, MiB, Sizes, envelope

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
            sys.executable, str(SCRIPT), "b6-clients", "--ws-base", ws_base, "--token", token,
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
