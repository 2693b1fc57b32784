"""Smoke test of bench/agents.py (B9): it runs end to end on a small data set, against a
real ``manage.py serve``, and its query counts do not grow with the data.

Latencies are not asserted (a benchmark, not a test); the run only has to produce them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench import assert_rows_in_the_shared_format
from tests.infra import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(200)]  # the bench itself is cut at 170 s


def test_the_b9_bench_runs_and_counts_the_same_queries_for_small_and_large_data(tmp_path: Path) -> None:
    output = tmp_path / "agents.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "agents.py"),
            "--quick",
            "--requests",
            "4",
            "--agents",
            "150",
            "--events",
            "3000",
            "--output",
            str(output),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(output.read_text())
    (run,) = report["runs"]
    assert run["database"] == "SQLite" and (run["agents"], run["events"]) == (150, 3000)
    queries = run["prepared"]["queries"]
    assert set(queries) == {"events_first", "events_deep", "agents_page", "agents_api"}
    for name, counts in queries.items():
        assert counts["small"] == counts["large"] > 0, (name, counts)
    assert run["prepared"]["deep_offset"] == 1500
    for key in ("http_floor", "events_first", "events_deep", "events_oldest", "agents_page", "agents_api"):
        assert run["latency"][key]["n"] == 4, key
    assert [row["id"] for row in report["table"]] == ["B9", "B9", "(B9')", "B9", "(B9')"]
    assert_rows_in_the_shared_format(report["table"], {"B9": (True, True), "(B9')": (True, True)})
    assert "100 per page), 150 agents" in report["table"][3]["what"]
