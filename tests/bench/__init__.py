"""Smoke tests of the bench scripts, and what they share (``assert_rows_in_the_shared_format``)."""

from __future__ import annotations

from typing import Any


def assert_rows_in_the_shared_format(table: list[dict[str, Any]], measured: dict[str, tuple[bool, bool]]) -> None:
    """Every row has the columns of bench/common.py ``bench_row``; for each id in ``measured``,
    (Dispatch, baseline) say which sides must carry a server CPU ms per operation."""
    columns = {"id", "what", "dispatch", "baseline", "ratio", "cpu", "cpu_ms_per_op", "goal", "pass", "numbers"}
    for row in table:
        assert columns <= set(row), (row["id"], columns - set(row))
        wanted = measured.get(row["id"])
        if wanted:
            cpu = row["cpu_ms_per_op"]
            assert (cpu["dispatch"] is not None, cpu["baseline"] is not None) == wanted, (row["id"], cpu)
            assert all(value is None or value >= 0 for value in cpu.values()), (row["id"], cpu)
