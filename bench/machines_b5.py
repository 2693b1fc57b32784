"""B5 of bench/machines.py: a 100 MiB copy between two real shims through Dispatch
(``POST /api/v1/sessions/bench/copy``) and through the bare relay, interleaved; MiB/s and
the server's RSS growth.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from common import CpuMeter, CpuPerOp, percentile, with_timeout
from machines_common import SESSION, MiB, Rig, RssSampler, Sizes, sha256_of
from machines_relay import RelayCaller

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
