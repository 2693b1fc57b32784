"""One table of every benchmark row, B1–B12, from ``bench/results/<script>.json``.

Usage: ``.venv/bin/python bench/summary.py [--since EPOCH | --since-file PATH] [--results DIR]``
(the last step of ``make bench``, which passes the time the run began).

Each script (remote_calls, machines, live, agents, peers) writes its rows in the shape of
``common.bench_row``; this prints them together in the shared columns (id | what |
Dispatch | baseline | ratio | CPU ms/op Dispatch / baseline | goal | result), then how
long each script took, and a note for each result file that is missing, unreadable, or
older than the run (its script failed or was not run: its rows are then the old run's,
marked ``(old)``). Exit status 1 when a file is missing or older than ``--since``, else 0
(missed goals do not change it: the table says FAIL).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from common import format_cpu, print_table  # noqa: E402

SCRIPTS = ["remote_calls", "machines", "live", "agents", "peers"]
RESULTS = BENCH / "results"


def _finished_at(report: dict[str, Any], path: Path) -> float:
    """When the script wrote it: ``finished_at`` (epoch s), else the file's mtime."""
    value = report.get("finished_at")
    return float(value) if isinstance(value, (int, float)) else path.stat().st_mtime


def _normalise(row: dict[str, Any]) -> dict[str, Any]:
    """A row of an older result file (``target``, ``bare_relay``…) in today's columns."""
    out = dict(row)
    out.setdefault("goal", row.get("target", "—"))
    if "baseline" not in out:
        out["baseline"] = f"{row['bare_relay']} (bare relay)" if row.get("bare_relay") not in (None, "—") else "—"
    if "cpu" not in out:
        cpu = row.get("cpu_ms_per_op") or {}
        out["cpu"] = format_cpu(cpu.get("dispatch"), cpu.get("baseline"))
    return out


def collect(results: Path, since: float | None) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """(rows, notes, timings): every script's rows in order; a note per file missing, unreadable
    or older than ``since``; one line per script with its elapsed seconds."""
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    timings: list[str] = []
    for script in SCRIPTS:
        path = results / f"{script}.json"
        if not path.exists():
            notes.append(f"{path.name}: missing — bench/{script}.py did not finish (its rows are not in the table)")
            continue
        try:
            report = json.loads(path.read_text())
            table = report["table"]
        except (OSError, ValueError, KeyError) as exc:
            notes.append(f"{path.name}: unreadable ({type(exc).__name__}: {exc})")
            continue
        finished = _finished_at(report, path)
        old = since is not None and finished < since
        if old:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(finished))
            notes.append(
                f"{path.name}: written {stamp}, before this run began — bench/{script}.py failed or was not run; "
                "its rows below are that older run's, marked (old)"
            )
        for row in table:
            row = _normalise(row)
            if old:
                row["id"] = f"{row['id']} (old)"
            rows.append(row)
        timings.append(f"{script} {report.get('elapsed_seconds', '?')} s ({report.get('mode', '?')})")
    return rows, notes, timings


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="the combined table of bench/results/*.json")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the results folder (default bench/results)")
    parser.add_argument("--since", type=float, help="epoch seconds the run began: older files are flagged")
    parser.add_argument("--since-file", type=Path, help="a file holding those epoch seconds (make bench writes one)")
    options = parser.parse_args(argv)
    since = options.since
    if since is None and options.since_file is not None:
        try:
            since = float(options.since_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            print(f"NOTE: {options.since_file} unreadable; not checking the age of the results")
    rows, notes, timings = collect(options.results, since)
    print()
    print("Summary: every benchmark row (CPU = server processes' CPU ms per operation, from /proc)")
    print_table(rows)
    print()
    print("time per script: " + "; ".join(timings))
    if since:
        print(f"the whole run so far: {time.time() - since:.0f} s")
    for note in notes:
        print(f"NOTE: {note}")
    missed = [row["id"] for row in rows if row.get("pass") is False]
    if missed:
        print(f"goals missed: {', '.join(missed)}")
    return 1 if notes else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
