"""Smoke test of bench/machines.py's B4 phases (bench/README.md): REST, MCP and the built-in
agent's tool path (a second Django process over PostgreSQL + Redis) each answer FILE_STAT
through the router on small sizes, beside the bare relay and ``/healthz``, and the rows are
computed. Only correctness is asserted, never a latency or a ratio."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.infra import REPO, instance

pytestmark = [pytest.mark.integration, pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(300)]


def test_b4_measures_rest_mcp_and_the_tool_path(tmp_path: Path) -> None:
    saved = list(sys.path)
    try:  # bench/machines.py, not the machines app (it puts bench/ first on sys.path: undone after)
        spec = importlib.util.spec_from_file_location("bench_machines", REPO / "bench" / "machines.py")
        assert spec is not None and spec.loader is not None
        bench: Any = importlib.util.module_from_spec(spec)
        sys.modules["bench_machines"] = bench  # dataclasses look their module up
        spec.loader.exec_module(bench)
    finally:
        sys.path[:] = saved
    sizes = bench.Sizes(
        warmup=2, calls=6, rounds=2, copy_rounds=0, copy_mib=0, shims=0, sessions=0, idle_seconds=0, storm_shims=0
    )
    for directory in ("src", "dst-dispatch", "dst-relay"):
        (tmp_path / directory).mkdir()
    report: dict[str, Any] = {}
    with bench.relay_server() as (relay_url, relay_pid), instance(**bench.SERVER_ENV) as inst:
        server = inst.serve(wait=False).wait_healthy(timeout=120)
        shims = [
            bench.start_shim(server.url, inst.admin_token, "src", tmp_path / "src", tmp_path / "s1"),
            bench.start_shim(server.url, inst.admin_token, "dst", tmp_path / "dst-dispatch", tmp_path / "s2"),
            bench.start_shim(relay_url, "relay", "src", tmp_path / "src", tmp_path / "s3"),
            bench.start_shim(relay_url, "relay", "dst", tmp_path / "dst-relay", tmp_path / "s4"),
        ]
        try:
            rig = bench.Rig(
                dispatch_url=server.url, token=inst.admin_token, relay_url=relay_url, work=tmp_path, pids={}
            )
            rig.pids = {"dispatch": server.proc.pid, "relay": relay_pid}
            rig.stat_path.write_text("stat me\n")
            report["b4"] = asyncio.run(bench.b4(rig, sizes))
            report["b4_tool"] = asyncio.run(bench.b4_tool(rig, sizes, tmp_path))
        finally:
            for shim in shims:
                shim.stop()
    b4, tool = report["b4"], report["b4_tool"]
    for name in ("relay", "dispatch", "mcp", "http_floor"):
        assert b4[name]["n"] == 6, (name, b4[name])
    assert b4["machines_used"] == {"dispatch": 1, "mcp": 1, "relay": 1}  # the path is under src's root only
    for name in ("relay", "dispatch", "http_floor", "tool", "tool_pipe"):
        assert tool[name]["n"] == 6, (name, tool[name])
    assert "dispatch_ms_per_op" in tool["cpu"]["tool"] and "tool_driver_ms_per_op" in tool["cpu"]["tool"]
    assert [row["id"] for row in bench.b4_rows(report)] == ["B4", "(B4')", "B4 mcp", "B4 tool", "B4 rest/pg"]
