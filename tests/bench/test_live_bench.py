"""Smoke test of bench/live.py (B10, B11, B12): the live-operation rows run end to end on
small sizes against a real ``manage.py serve``, real shims, the bare relay and a fleet of
in-process shims, and every row is measured (none skipped for a missing feature).

Only correctness is asserted — each streamed command's first output arrived and the
cancel ended it, the pipe moved every byte and the hash is right, every fanned-out machine
answered — never a latency, a rate or a ratio (a benchmark, not a test).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench import assert_rows_in_the_shared_format
from tests.infra import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(200)]  # the run itself is cut at 180 s


def test_the_live_bench_measures_first_output_a_pipe_and_a_fan_out(tmp_path: Path) -> None:
    output = tmp_path / "live.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "live.py"),
            "--quick",
            "--samples", "3",
            "--pipe-mib", "8",
            "--rounds", "1",
            "--fanout", "5",
            "--fanout-rounds", "1",
            "--output", str(output),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(output.read_text())
    skipped = [f"{row['id']}: {row['why']}" for row in report["table"] if row.get("skipped")]
    assert skipped == [], "rows not measured:\n" + "\n".join(skipped)
    assert [row["id"] for row in report["table"]] == ["B10", "B10", "(B10')", "B11", "B12"]
    both = (True, True)
    assert_rows_in_the_shared_format(report["table"], {"B10": both, "B11": both, "B12": both})

    # B10: every path (bare relay, REST, MCP) got its first output and its cancel, each sample.
    b10 = report["b10"]
    assert b10["skipped"] == {}
    for path in ("relay", "rest", "mcp"):
        assert b10[path]["first_output"]["n"] == 3, path
        assert b10[path]["cancel_to_end"]["n"] == 3, path

    # B11: the pipe moved all 8 MiB and sha256sum on the destination printed the right hash.
    b11 = report["b11"]
    assert b11["hash_ok"] and b11["bytes_ok"], b11["runs"]["pipe"]
    (pipe,) = b11["runs"]["pipe"]
    assert pipe["bytes"] == 8 * 1024 * 1024 and (pipe["source_exit"], pipe["destination_exit"]) == (0, 0)
    assert len(b11["runs"]["copy"]) == 1

    # B12: the fan-out reached all 5 in-process shims (checked inside the run), and one machine alone too.
    b12 = report["b12"]
    assert b12["machines"] == 5
    assert len(b12["samples_s"]["many"]) == len(b12["samples_s"]["one"]) == 1
    assert b12["many_s"] >= 1.0 and b12["one_s"] >= 1.0  # `sleep 1` ran
