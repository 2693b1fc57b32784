"""The bench's shared row format (bench/common.py ``bench_row``, ``CpuPerOp``) and the
combined table of ``make bench`` (bench/summary.py): every row in the same columns, server
CPU per operation, and a note when a script's result file is missing or older than the run.

No server is started: these check the plumbing, the smoke tests beside them run the scripts.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.infra import REPO

sys.path.insert(0, str(REPO / "bench"))

import common
import summary


def _write(folder: Path, script: str, rows: list[dict[str, Any]], *, finished_at: float) -> None:
    report = {"script": script, "finished_at": finished_at, "elapsed_seconds": 12.5, "mode": "quick", "table": rows}
    (folder / f"{script}.json").write_text(json.dumps(report))


def test_a_row_carries_every_column_and_the_cpu_of_both_sides() -> None:
    tally = common.CpuPerOp().add_seconds(0.5, 1000)
    row = common.bench_row(
        "B1", "remote call", dispatch="1.0 ms", baseline="0.4 ms (bare relay)", ratio="2.5x",
        cpu=(tally, 0.12), goal="p50 <= 2.5x bare", passed=True, numbers={"ratio": 2.5},
    )  # fmt: skip
    assert {key for key, _ in common.TABLE_COLUMNS} <= set(row)
    assert row["cpu_ms_per_op"] == {"dispatch": 0.5, "baseline": 0.12}
    assert row["cpu"] == "0.5 / 0.12"
    assert row["pass"] is True and row["numbers"] == {"ratio": 2.5}
    info = common.bench_row("(B1')", "info", dispatch="x")
    assert info["cpu"] == "—" and info["pass"] is None and info["goal"] == "—"
    assert common.format_cpu(None, 3.0) == "— / 3"


def test_cpu_per_op_counts_only_the_named_server_processes() -> None:
    meter = common.CpuMeter({"server": os.getpid()})
    with meter:
        deadline = time.process_time() + 0.3
        while time.process_time() < deadline:  # burn CPU in this process, the "server"
            pass
    tally = common.CpuPerOp().add(meter, 3, ["server"])
    assert tally.ms is not None and 60 <= tally.ms <= 200  # ~300 ms of CPU over 3 operations
    assert common.CpuPerOp().add(meter, 3, []).ms == 0.0  # no server named: none counted (not the driver's)
    assert common.CpuPerOp().ms is None
    window = common.CpuPerOp()
    with window.window([os.getpid()], ops=2):
        deadline = time.process_time() + 0.2
        while time.process_time() < deadline:
            pass
    assert window.ms is not None and 70 <= window.ms <= 200
    # A sequential phase: 50 % of a core while each op took 4 ms of wall time -> 2 ms of CPU each.
    assert common.CpuPerOp.from_percent(50.0, 4.0).ms == 2.0
    assert common.CpuPerOp.from_percent(None, 4.0).ms is None


def test_summary_prints_every_script_row_and_notes_missing_and_old_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    began = time.time()
    row = common.bench_row("B1", "remote call", dispatch="1.0", cpu=(0.5, 0.1), goal="g", passed=False)
    _write(tmp_path, "remote_calls", [row], finished_at=began + 5)
    _write(tmp_path, "machines", [common.bench_row("B4", "file stat", dispatch="2.0", passed=True)],
           finished_at=began - 3600)  # fmt: skip
    old_style = {"id": "B9", "what": "events", "dispatch": "3", "bare_relay": "1", "ratio": "3x", "target": "t",
                 "pass": True}  # fmt: skip
    _write(tmp_path, "agents", [old_style], finished_at=began + 6)
    (tmp_path / "live.json").write_text("{not json")

    code = summary.main(["--results", str(tmp_path), "--since", str(began)])
    out = capsys.readouterr().out
    assert code == 1  # a result is missing / old / unreadable
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("id "))
    assert "CPU ms/op Dispatch / baseline" in header and "goal" in header and header.rstrip().endswith("result")
    b1 = next(line for line in lines if line.startswith("B1 "))
    assert "0.5 / 0.1" in b1 and b1.rstrip().endswith("FAIL")
    assert any(line.startswith("B4 (old)") for line in lines)
    b9 = next(line for line in lines if line.startswith("B9 "))
    assert "1 (bare relay)" in b9 and " t " in b9 and b9.rstrip().endswith("PASS")
    assert "NOTE: machines.json: written" in out and "before this run began" in out
    assert "NOTE: peers.json: missing" in out
    assert "NOTE: live.json: unreadable" in out
    assert "goals missed: B1" in out
    assert "time per script: remote_calls 12.5 s (quick)" in out


def test_summary_exits_0_when_every_result_is_from_this_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    began = time.time()
    for script in summary.SCRIPTS:
        _write(tmp_path, script, [common.bench_row("B1", script, dispatch="1", passed=True)], finished_at=began + 1)
    assert summary.main(["--results", str(tmp_path), "--since", str(began)]) == 0
    assert "NOTE" not in capsys.readouterr().out
