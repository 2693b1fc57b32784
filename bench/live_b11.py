"""B11 of bench/live.py: a 200 MiB pipe between two real shims (``POST …/pipe``) against
Dispatch's own copy of a file of that size, interleaved; MiB/s, RSS growth, the hash.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

from common import CpuPerOp, percentile, with_timeout
from live_common import SESSION, MiB, Rig, Sizes, Skip, _refused
from machines_common import RssSampler, make_source


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
