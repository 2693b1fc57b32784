"""Throughput with processes: B3's load through nginx, spread over three
``serve`` processes, beside the same load on one ``serve`` process through nginx.

Usage: ``.venv/bin/python bench/cluster.py [--quick] [--seconds S] [--callers N]``.

One topology (``tests.cluster``: PostgreSQL + Redis, ``serve --no-background`` processes
with ``DISPATCH_BEHIND_PROXY``, nginx with least-connections balancing) and, in the same
run, a second private nginx whose only upstream is the first of those processes, so both
sides share the database, Redis, code and settings and differ only in the processes the
load reaches:

- ``three``: a ``FastRemote`` and ``--callers`` (64) caller sessions open ``/ws`` through
  the topology's nginx and land where least-connections puts them (a call between sessions
  on two processes crosses Redis);
- ``one``: the same through the one-upstream nginx: every session on the first process;
- ``direct``: the same straight to the first process (no nginx), to show nginx's share.

Each caller session keeps one ``remote-call`` in flight (B3, bench/remote_calls.py); the
windows alternate between the two sides (same machine noise for both). Every call id is
checked (lost, duplicated, failed). CPU is measured per process over each window: every
``serve``, nginx (master and workers), Redis, PostgreSQL (all its processes), this driver
(callers and remote) and everything else.

Prints a table and writes bench/results/cluster.json. Needs nginx, PostgreSQL and Redis
(as the cluster tests do); stops every process it started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO))

from common import (  # noqa: E402
    Caller,
    FastRemote,
    ThroughputTally,
    finish_report,
    print_rows,
    process_cpu_seconds,
    system_busy_seconds,
    with_timeout,
)

from deploy.cluster import Nginx, body_cap, free_port  # noqa: E402

RESULTS = BENCH / "results" / "cluster.json"
HARD_LIMIT = 300  # seconds: the whole run is aborted (and cleaned up) past this

# As B3 (bench/remote_calls.py): the per-connection request limit raised, since each
# caller session sends hundreds of calls a second; the topology's own presence timing.
SERVER_ENV: dict[str, Any] = {
    "DISPATCH_WS_RATE": "1000000",
    "DISPATCH_WS_BURST": "1000000",
    "DISPATCH_REMOTE_CALL_TIMEOUT": "30",
    "DISPATCH_LOG_LEVEL": "WARNING",
}


@dataclass
class Sizes:
    callers: int
    seconds: float  # per side, over all its windows
    windows: int


@dataclass
class Side:
    """One side of the comparison: where its sessions connect, what they opened."""

    name: str
    ws_url: str
    remotename: str
    remote: FastRemote | None = None
    callers: list[Caller] = field(default_factory=list)
    tally: ThroughputTally | None = None
    cpu: dict[str, float] = field(default_factory=dict)
    spread: dict[str, int] = field(default_factory=dict)


# --- CPU of process groups ---------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            text = (task / "children").read_text().split()
            found.extend(int(child) for child in text)
    return found


def _fixed(pid: int) -> Callable[[], list[int]]:
    return lambda: [pid]


def _named(command: str) -> list[int]:
    """Every process whose ``comm`` is ``command`` (PostgreSQL's backends, Redis)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (entry / "comm").read_text().strip() == command:
                    pids.append(int(entry.name))
    return pids


class GroupCpuMeter:
    """CPU over a window in % of one core, per named group of processes (each group's pids
    are read when the window starts), this driver, and everything else (``others``)."""

    def __init__(self, groups: dict[str, Callable[[], list[int]]]) -> None:
        self.groups = groups

    def __enter__(self) -> GroupCpuMeter:
        self.pids = {name: find() for name, find in self.groups.items()}
        self.wall = time.perf_counter()
        self.own = time.process_time()
        self.system = system_busy_seconds()
        self.start = {name: {pid: process_cpu_seconds(pid) for pid in pids} for name, pids in self.pids.items()}
        return self

    @staticmethod
    def _used(start: dict[int, float]) -> float:
        """CPU seconds since ``start`` of the processes alive at both ends (NaN: gone)."""
        deltas = (process_cpu_seconds(pid) - before for pid, before in start.items())
        return sum(delta for delta in deltas if delta == delta and delta >= 0)

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self.wall
        used = {name: self._used(start) for name, start in self.start.items()}
        used["driver"] = time.process_time() - self.own
        others = system_busy_seconds() - self.system - sum(used.values())
        self.percent = {name: round(100 * value / wall, 1) for name, value in used.items()}
        self.percent["others"] = round(max(0.0, 100 * others / wall), 1)
        self.percent["all"] = round(100 * (system_busy_seconds() - self.system) / wall, 1)


# --- the run -----------------------------------------------------------------------------------


@contextlib.contextmanager
def one_upstream_nginx(topo: Any) -> Iterator[Nginx]:
    """A second private nginx, same config, whose only upstream is ``topo.servers[0]``."""
    workdir = Path(tempfile.mkdtemp(prefix="bench-nginx-one-"))
    nginx = Nginx.start(workdir, port=free_port(), upstreams=[topo.servers[0].port], max_body_bytes=body_cap(topo.env))
    try:
        yield nginx
    finally:
        nginx.stop()
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)


async def open_side(side: Side, token: str, callers: int) -> None:
    side.remote = await with_timeout(
        FastRemote.open(side.ws_url, token, side.remotename), 15, f"{side.name}: remote-connect"
    )
    opened = await with_timeout(
        asyncio.gather(*(Caller.open(side.ws_url, token, side.remotename) for _ in range(callers))),
        60,
        f"{side.name}: {callers} caller connections",
    )
    side.callers = list(opened)
    # One call per session first, so connection setup is not in the windows.
    await with_timeout(
        asyncio.gather(*(c.call(f"warm-{side.name}-{i}", "x") for i, c in enumerate(side.callers))),
        60,
        f"{side.name}: warm-up",
    )
    side.tally = ThroughputTally(f"c5-{side.name}")


async def close_side(side: Side) -> None:
    await asyncio.gather(*(c.close() for c in side.callers), return_exceptions=True)
    if side.remote is not None:
        await side.remote.close()


def spread_of(topo: Any) -> dict[str, int]:
    """Live ``/ws`` sessions per serve process (``serve-0``…), from the database."""
    index = topo.process_index()
    counts: dict[str, int] = {}
    for process_id, count in topo.rows(
        "SELECT server_process_id, count(*) FROM remotes_wssession GROUP BY server_process_id"
    ):
        name = f"serve-{index[process_id]}" if process_id in index else f"other-{process_id[:6]}"
        counts[name] = int(count)
    return dict(sorted(counts.items()))


def remote_process(topo: Any, remotename: str) -> str:
    index = topo.process_index()
    rows = topo.rows("SELECT server_process_id FROM remotes_remote WHERE name = %s", remotename)
    return ", ".join(f"serve-{index.get(row[0], '?')}" for row in rows) or "?"


async def measure(topo: Any, sides: list[Side], sizes: Sizes, groups: dict[str, Callable[[], list[int]]]) -> None:
    token = topo.token
    try:
        for side in sides:
            before = spread_of(topo)
            await open_side(side, token, sizes.callers)
            after = spread_of(topo)
            side.spread = {name: after.get(name, 0) - before.get(name, 0) for name in after}
            side.spread["remote on"] = remote_process(topo, side.remotename)  # type: ignore[assignment]
        for round_index in range(sizes.windows):
            shift = round_index % len(sides)
            for side in sides[shift:] + sides[:shift]:
                assert side.tally is not None
                with GroupCpuMeter(groups) as meter:
                    await side.tally.window(side.callers, seconds=sizes.seconds / sizes.windows)
                for name, value in meter.percent.items():
                    side.cpu[name] = round(side.cpu.get(name, 0.0) + value / sizes.windows, 1)
    finally:
        for side in sides:
            await close_side(side)


def run(sizes: Sizes) -> dict[str, Any]:
    from tests.cluster import cluster

    report: dict[str, Any] = {"sides": {}, "notes": []}
    print("· starting the topology: 3 × serve --no-background, nginx, PostgreSQL + Redis…", flush=True)
    with cluster(servers=3, tls=False, worker=False, **SERVER_ENV) as topo, one_upstream_nginx(topo) as nginx_one:
        sides = [
            Side("one", nginx_one.ws_url, "bench-one"),
            Side("three", topo.ws_url, "bench-three"),
            Side("direct", topo.servers[0].ws_url, "bench-direct"),  # one process, no nginx: nginx's share
        ]
        groups: dict[str, Callable[[], list[int]]] = {
            f"serve-{i}": _fixed(server.pid) for i, server in enumerate(topo.servers)
        }
        nginx_pids = [topo.nginx.proc.pid, nginx_one.proc.pid]
        groups["nginx"] = lambda: [p for pid in nginx_pids for p in [pid, *_children(pid)]]
        groups["redis"] = lambda: _named("redis-server")
        groups["postgres"] = lambda: _named("postgres")
        print(
            f"· {sizes.callers} caller sessions + 1 remote per side; {sizes.windows} interleaved windows, "
            f"{sizes.seconds:g} s per side…",
            flush=True,
        )
        asyncio.run(measure(topo, sides, sizes, groups))
        for side in sides:
            assert side.tally is not None and side.remote is not None
            result = side.tally.result(side.remote, sizes.callers)
            serve_share = sum(value for name, value in side.cpu.items() if name.startswith("serve-")) / 100
            completed = result["completed"] or 1
            report["sides"][side.name] = {
                **result,
                "cpu": side.cpu,
                # CPU seconds of every serve process (and of the whole machine) per answered call, ms.
                "serve_cpu_ms_per_call": round(1000 * serve_share * result["seconds"] / completed, 2),
                "machine_cpu_ms_per_call": round(10 * side.cpu.get("all", 0.0) * result["seconds"] / completed, 2),
                "sessions_per_process": side.spread,
            }
    return report


def rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    one, three, direct = report["sides"]["one"], report["sides"]["three"], report["sides"]["direct"]

    def rate(entry: dict[str, Any]) -> str:
        return f"{entry['calls_per_second']:,.0f}/s{'' if entry['intact'] else ' (!)'}"

    ratio = three["calls_per_second"] / one["calls_per_second"] if one["calls_per_second"] else 0.0
    return [
        {
            "id": "C5",
            "what": f"B3 load ({three['callers']} callers x 1 in flight) through nginx: 3 serve vs 1 serve",
            "three": rate(three),
            "one": rate(one),
            "direct": rate(direct),
            "ratio": f"{ratio:.2f}x",
            "target": "none lost/dup (report, no rate goal: 2 cores)",
            "pass": three["intact"] and one["intact"],
        }
    ]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="B3 through nginx: three serve processes beside one.")
    parser.add_argument("--quick", action="store_true", help="a short run: 2 windows of 3 s per side")
    parser.add_argument("--seconds", type=float, help="measured seconds per side (default 20)")
    parser.add_argument("--windows", type=int, help="interleaved windows per side (default 4)")
    parser.add_argument("--callers", type=int, default=64, help="caller sessions per side (default 64)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a call is lost, duplicated or failed")
    parser.add_argument(
        "--output", type=Path, default=RESULTS, help=f"JSON results (default {RESULTS.relative_to(REPO)})"
    )
    options = parser.parse_args(argv)
    sizes = Sizes(callers=options.callers, seconds=6.0, windows=2) if options.quick else Sizes(options.callers, 20.0, 4)
    if options.seconds:
        sizes.seconds = options.seconds
    if options.windows:
        sizes.windows = options.windows

    def abort(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    def too_long(signum: int, frame: Any) -> None:
        raise TimeoutError(f"benchmark exceeded {HARD_LIMIT} s; aborted")

    signal.signal(signal.SIGTERM, abort)
    signal.signal(signal.SIGALRM, too_long)
    signal.alarm(HARD_LIMIT)
    info = {"cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()}
    started = time.monotonic()
    print(
        f"Cluster throughput ({'quick' if options.quick else 'full'} run) on {info['cpus']} CPU(s): every serve, "
        "nginx, Redis, PostgreSQL and this driver share them; compare the two sides, not absolutes.",
        flush=True,
    )
    try:
        report = run(sizes)
    except (KeyboardInterrupt, TimeoutError) as exc:
        print(f"aborted ({exc}); every process it started has been stopped", file=sys.stderr)
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    except BaseException as exc:  # tests.infra skips (a BaseException) without nginx/PostgreSQL/Redis
        if isinstance(exc, SystemExit):
            raise
        print(f"not measured: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.alarm(0)
    table = rows(report)
    print()
    print_rows(
        table,
        [
            ("id", "id"),
            ("what", "what"),
            ("three", "3 processes"),
            ("one", "1 process"),
            ("direct", "1, no nginx"),
            ("ratio", "ratio 3/1"),
            ("target", "goal"),
        ],
    )
    print()
    for name, entry in report["sides"].items():
        print(
            f"  {name}: {entry['completed']} answered of {entry['sent']} sent in {entry['seconds']} s; lost "
            f"{entry['lost']}, duplicated {entry['duplicated_replies'] + entry['remote_duplicates']}, errors "
            f"{entry['errors']}{' ' + str(entry['error_samples']) if entry['error_samples'] else ''}; latency p50 "
            f"{entry['latency']['p50_ms']:.1f} ms, p99 {entry['latency']['p99_ms']:.1f} ms; CPU per call: serve "
            f"{entry['serve_cpu_ms_per_call']:.2f} ms, machine {entry['machine_cpu_ms_per_call']:.2f} ms; sessions "
            f"{json.dumps(entry['sessions_per_process'])}"
        )
    print("CPU while each side was measured, % of one core (200% = both cores):")
    for name, entry in report["sides"].items():
        print(f"  {name}: " + ", ".join(f"{k} {v:.0f}%" for k, v in entry["cpu"].items()))
    return finish_report(
        report=report,
        table=table,
        info=info,
        sizes=sizes,
        server_env=SERVER_ENV,
        output=options.output,
        quick=options.quick,
        strict=options.strict,
        started=started,
        footer="per-connection rate limit raised for the bench; topology timing (6 s TTL, 1 s heartbeat)",
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
