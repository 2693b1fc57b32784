"""B4 of bench/machines.py: FILE_STAT through the router over REST and MCP on the SQLite
server, and the built-in agent's tool path (``machines.py tool-driver``, a Django process of
its own) on a PostgreSQL + Redis server, each interleaved with the bare relay and ``/healthz``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from common import CpuMeter, latency_summary, process_cpu_seconds, with_timeout
from machines_common import BENCH, REPO, SCRIPT, SERVER_ENV, SESSION, MiB, Rig, Sizes, start_shim
from machines_relay import RelayCaller

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
            str(SCRIPT),
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
