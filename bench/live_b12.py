"""B12 of bench/live.py: a fan-out to 50 shims (``live.py shims``, one asyncio process of
``machines.shim.Shim`` instances) against the same command on one of them.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from typing import Any

from common import CpuPerOp, percentile, process_cpu_seconds, with_timeout
from live_common import FANOUT_SESSION, Rig, Sizes, Skip, _refused

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
