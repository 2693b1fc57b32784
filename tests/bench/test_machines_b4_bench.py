"""Smoke test of bench/machines.py's B4 phases (bench/machines_b4.py; bench/README.md): REST,
MCP and the built-in agent's tool path (a second Django process over PostgreSQL + Redis)
each answer FILE_STAT through the router on small sizes, beside the bare relay and
``/healthz``, and the rows are computed. Only correctness is asserted, never a latency or a
ratio."""

from __future__ import annotations

import asyncio
import importlib
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.infra import REPO, instance

pytestmark = [pytest.mark.integration, pytest.mark.postgres, pytest.mark.redis, pytest.mark.timeout(300)]


def test_b4_measures_rest_mcp_and_the_tool_path(tmp_path: Path) -> None:
    saved = list(sys.path)
    try:  # bench/ on sys.path only while its modules are imported (their names are not the apps')
        sys.path.insert(0, str(REPO / "bench"))
        common = importlib.import_module("machines_common")
        phases = importlib.import_module("machines_b4")
        relay = importlib.import_module("machines_relay")
        table = importlib.import_module("machines_table")
    finally:
        sys.path[:] = saved
    sizes = common.Sizes(
        warmup=2, calls=6, rounds=2, copy_rounds=0, copy_mib=0, shims=0, sessions=0, idle_seconds=0, storm_shims=0
    )
    for directory in ("src", "dst-dispatch", "dst-relay"):
        (tmp_path / directory).mkdir()
    report: dict[str, Any] = {}
    with relay.relay_server() as (relay_url, relay_pid), instance(**common.SERVER_ENV) as inst:
        server = inst.serve(wait=False).wait_healthy(timeout=120)
        shims = [
            common.start_shim(server.url, inst.admin_token, "src", tmp_path / "src", tmp_path / "s1"),
            common.start_shim(server.url, inst.admin_token, "dst", tmp_path / "dst-dispatch", tmp_path / "s2"),
            common.start_shim(relay_url, "relay", "src", tmp_path / "src", tmp_path / "s3"),
            common.start_shim(relay_url, "relay", "dst", tmp_path / "dst-relay", tmp_path / "s4"),
        ]
        try:
            rig = common.Rig(
                dispatch_url=server.url, token=inst.admin_token, relay_url=relay_url, work=tmp_path, pids={}
            )
            rig.pids = {"dispatch": server.proc.pid, "relay": relay_pid}
            rig.stat_path.write_text("stat me\n")
            report["b4"] = asyncio.run(phases.b4(rig, sizes))
            report["b4_tool"] = asyncio.run(phases.b4_tool(rig, sizes, tmp_path))
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
    assert [row["id"] for row in table.b4_rows(report)] == ["B4", "(B4')", "B4 mcp", "B4 tool", "B4 rest/pg"]
