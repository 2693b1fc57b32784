"""B7 of bench/peers.py: the mirroring lag of an agent's status change on B to its shadow's
``agent.upsert`` on A's event stream, beside B's own stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

from common import CpuMeter, CpuPerOp, latency_summary
from peers_common import Peers, Rest, Sizes, create_experts, shadows_of

# --- B7 ------------------------------------------------------------------------------------------


class UpsertWatch:
    """Reads one instance's ``GET /api/v1/events`` and stamps each ``agent.upsert`` of one
    agent: ``wait(status)`` returns the ``perf_counter`` time of the first upsert with
    ``status`` after ``arm()``."""

    def __init__(self, url: str, token: str, agent_id: str) -> None:
        self.url, self.token, self.agent_id = url, token, agent_id
        self.expected: str | None = None
        self.future: asyncio.Future[float] | None = None
        self.upserts = 0
        self.opened = asyncio.Event()
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        import httpx
        from httpx_sse import aconnect_sse

        timeout = httpx.Timeout(10, read=None)
        async with (
            httpx.AsyncClient(timeout=timeout) as client,
            aconnect_sse(
                client, "GET", f"{self.url}/api/v1/events", headers={"Authorization": f"Bearer {self.token}"}
            ) as events,
        ):
            events.response.raise_for_status()
            self.opened.set()
            async for sse in events.aiter_sse():
                if sse.event != "agent.upsert":
                    continue
                now = time.perf_counter()
                data = json.loads(sse.data)
                if data.get("id") != self.agent_id:
                    continue
                self.upserts += 1
                future = self.future
                if future is not None and not future.done() and data.get("status") == self.expected:
                    future.set_result(now)

    def arm(self, status: str) -> None:
        self.expected = status
        self.future = asyncio.get_running_loop().create_future()

    async def wait(self, timeout: float = 15) -> float:
        assert self.future is not None
        return await asyncio.wait_for(self.future, timeout)

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task


async def run_b7(peers: Peers, sizes: Sizes) -> dict[str, Any]:
    """B7: ``sizes.changes`` stop/start changes of one agent on B; lag to A's shadow upsert
    and (baseline) to B's own upsert, in ms."""
    rest_a = Rest(peers.server_a.url, peers.a.admin_token)
    rest_b = Rest(peers.server_b.url, peers.b.admin_token)
    watches: list[UpsertWatch] = []
    try:
        (remote,) = await create_experts(rest_b, ["b7-mirrored"])
        (shadow,) = await shadows_of(rest_a, [remote])
        on_a = UpsertWatch(peers.server_a.url, peers.a.admin_token, shadow)
        on_b = UpsertWatch(peers.server_b.url, peers.b.admin_token, remote)
        watches = [on_a, on_b]
        await asyncio.wait_for(asyncio.gather(on_a.opened.wait(), on_b.opened.wait()), 15)
        status = (await rest_b.call("GET", f"/api/v1/agents/{remote}"))["status"]
        mirror_ms: list[float] = []
        local_ms: list[float] = []
        rest_ms: list[float] = []
        with CpuMeter({"A": peers.server_a.pid, "B": peers.server_b.pid}) as meter:
            for index in range(sizes.warmup_changes + sizes.changes):
                action, status = ("stop", "stopped") if status == "running" else ("start", "running")
                on_a.arm(status)
                on_b.arm(status)
                started = time.perf_counter()
                answer = await rest_b.call("POST", f"/api/v1/agents/{remote}/{action}")
                answered = time.perf_counter()
                if answer["status"] != status:
                    raise RuntimeError(f"{action} answered status {answer['status']}")
                seen_a, seen_b = await asyncio.gather(on_a.wait(), on_b.wait())
                if index >= sizes.warmup_changes:
                    mirror_ms.append((seen_a - started) * 1000)
                    local_ms.append((seen_b - started) * 1000)
                    rest_ms.append((answered - started) * 1000)
        final = (await rest_a.call("GET", f"/api/v1/agents/{shadow}"))["status"]
        if final != status:
            raise RuntimeError(f"the shadow ended {final}, B's agent {status}")
        return {
            "changes": sizes.changes,
            "mirror": latency_summary(mirror_ms),
            "local": latency_summary(local_ms),
            "rest_on_b": latency_summary(rest_ms),
            "upserts_seen": {"A": on_a.upserts, "B": on_b.upserts},
            "cpu": meter.percent,
            "cpu_ms_per_change": CpuPerOp().add(meter, sizes.warmup_changes + sizes.changes, ["A", "B"]).ms,
        }
    finally:
        for watch in watches:
            await watch.close()
        await rest_a.close()
        await rest_b.close()
