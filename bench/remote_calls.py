"""Remote-call benchmarks B1, B2, B3 (goals: bench/README.md#goals), beside baselines.

Usage: ``.venv/bin/python bench/remote_calls.py [--quick]`` (``make bench``).

Starts real servers on loopback and drives them with real ``websockets`` clients:

- B1  remote-call round trip (caller ws -> server -> serving ws -> server -> caller), 1 KiB
      args and result, one ``manage.py serve`` on SQLite with the in-memory channel layer;
      sequential calls after a warm-up; p50/p95/p99.
- B2  the same through two ``serve`` processes on PostgreSQL + Redis, caller on one and
      the remote on the other.
- B3  throughput: 64 caller sessions, each keeping one call in flight (64 in flight),
      one process, for a fixed window; every call id checked (none lost or duplicated).

In the same run, interleaved with Dispatch so machine noise hits all alike, the same
client code drives (a) a bare ``websockets`` relay and (b) a minimal Channels relay
consumer under daphne (bench/baseline.py). The serving side everywhere is a raw client
that answers each downstream call at once, so the numbers measure the servers.

Prints a table and writes bench/results/remote_calls.json. Stops by itself within ~3 minutes
(``--quick``: well under one) and cleans up every process it started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))

from common import (  # noqa: E402
    REMOTENAME,
    Caller,
    CpuMeter,
    CpuPerOp,
    FastRemote,
    ThroughputTally,
    bench_row,
    finish_report,
    free_port,
    latency_summary,
    print_table,
    process_rss_mib,
    sequential_latencies,
    stop_process,
    wait_for_port,
    with_timeout,
)

from tests.infra import instance  # noqa: E402

RESULTS = BENCH / "results" / "remote_calls.json"
HARD_LIMIT = 240  # seconds: the whole run is aborted (and cleaned up) past this

# Goals: bench/README.md#goals (where the floor each must stay above is printed too).
B1_MAX_RATIO = 2.0
B2_MAX_RATIO = 4.0
B3_MAX_CPU_RATIO = 3.0  # server CPU per call / the bare relay's, none lost
B3_MIN_SHARE = 0.33  # of the bare relay's calls/s: what the CPU goal allows when the relay's side is CPU-bound

# The server environment of the bench: production intervals (tests/infra.py shortens
# them for tests) and the per-connection request limit raised, since a sequential
# caller does several hundred calls a second and the default (100/s, bursts of 500)
# would refuse most of them. The token bucket is still consulted on every call.
SERVER_ENV: dict[str, Any] = {
    "DISPATCH_WS_RATE": "1000000",
    "DISPATCH_WS_BURST": "1000000",
    "DISPATCH_HEARTBEAT_INTERVAL": "2",
    "DISPATCH_PROCESS_TTL": "10",
    "DISPATCH_REAP_INTERVAL": "2",
    "DISPATCH_REMOTE_LIVENESS_INTERVAL": "2",
    "DISPATCH_REMOTE_CALL_TIMEOUT": "30",
    "DISPATCH_LOG_LEVEL": "WARNING",
}


@dataclass
class Sizes:
    """How much to measure: calls per server (B1/B2), caller sessions and seconds (B3)."""

    warmup: int
    calls: int
    rounds: int
    callers: int
    seconds: float
    b3_windows: int = 2


@dataclass
class Target:
    """One server under test and how to reach it."""

    name: str
    caller_url: str
    remote_url: str
    token: str | None
    pids: dict[str, int]
    remotename: str = REMOTENAME
    remote: FastRemote | None = None
    caller: Caller | None = None
    samples: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)
    cpu_per_call: CpuPerOp = field(default_factory=CpuPerOp)  # its server processes (``pids``), ms per call


@contextlib.contextmanager
def baseline_server(kind: str, *options: str) -> Iterator[tuple[str, int]]:
    """Run bench/baseline.py ``kind`` (with ``options``) on a free port; yields (ws url, pid)."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix=f"bench-{kind}-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / "baseline.py"), kind, "--port", str(port), *options],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    try:
        wait_for_port(port, proc)
        yield f"ws://127.0.0.1:{port}/ws", proc.pid
    finally:
        stop_process(proc)
        log.close()
        os.unlink(log.name)


@contextlib.contextmanager
def logs_on_failure(inst: Any) -> Iterator[None]:
    """Print the end of each Dispatch server's log when a phase fails, then re-raise."""
    try:
        yield
    except Exception:
        for server in inst.servers:
            print(f"--- last lines of {server.log_path} ---", file=sys.stderr)
            print("\n".join(server.log().splitlines()[-30:]), file=sys.stderr)
        raise


# --- phases -----------------------------------------------------------------------------


async def open_target(target: Target) -> None:
    target.remote = await with_timeout(
        FastRemote.open(target.remote_url, target.token, target.remotename), 15, f"{target.name}: remote-connect"
    )
    target.caller = await with_timeout(
        Caller.open(target.caller_url, target.token, target.remotename), 15, f"{target.name}: caller connect"
    )


async def close_target(target: Target) -> None:
    if target.caller is not None:
        await target.caller.close()
    if target.remote is not None:
        await target.remote.close()


async def latency_phase(targets: list[Target], sizes: Sizes) -> None:
    """Warm up each target, then sequential calls in interleaved rounds (same noise for all)."""
    for target in targets:
        await open_target(target)
    try:
        for target in targets:
            assert target.caller is not None
            await with_timeout(
                sequential_latencies(target.caller, count=sizes.warmup, label=f"warm-{target.name}"),
                60,
                f"{target.name}: warm-up",
            )
        per_round = max(1, sizes.calls // sizes.rounds)
        for round_index in range(sizes.rounds):
            order = targets[round_index % len(targets) :] + targets[: round_index % len(targets)]
            for target in order:
                assert target.caller is not None
                with CpuMeter(target.pids) as meter:
                    samples = await with_timeout(
                        sequential_latencies(target.caller, count=per_round, label=f"b1-{target.name}-{round_index}"),
                        60,
                        f"{target.name}: sequential calls",
                    )
                target.samples.extend(samples)
                target.cpu_per_call.add(meter, len(samples), target.pids)
                _merge_cpu(target.cpu, meter.percent, weight=1 / sizes.rounds)
    finally:
        for target in targets:
            await close_target(target)


async def throughput_phase(targets: list[Target], sizes: Sizes) -> dict[str, dict[str, Any]]:
    """``sizes.callers`` caller sessions per target against one remote, windows interleaved."""
    sessions: dict[str, tuple[FastRemote, list[Caller]]] = {}
    try:
        for target in targets:
            remote = await with_timeout(
                FastRemote.open(target.remote_url, target.token), 15, f"{target.name}: remote-connect"
            )
            sessions[target.name] = (remote, [])
            callers = await with_timeout(
                asyncio.gather(*(Caller.open(target.caller_url, target.token) for _ in range(sizes.callers))),
                30,
                f"{target.name}: {sizes.callers} caller connections",
            )
            sessions[target.name] = (remote, list(callers))
            # One call per session first, so connection setup is not in the windows.
            await with_timeout(
                asyncio.gather(*(c.call(f"warm3-{i}", "x") for i, c in enumerate(callers))),
                30,
                f"{target.name}: warm-up",
            )
        tallies = {target.name: ThroughputTally(f"b3-{target.name}") for target in targets}
        cpu: dict[str, dict[str, float]] = {target.name: {} for target in targets}
        per_call = {target.name: CpuPerOp() for target in targets}
        for round_index in range(sizes.b3_windows):
            shift = round_index % len(targets)
            for target in targets[shift:] + targets[:shift]:
                tally = tallies[target.name]
                answered = sum(tally.answered.values())
                with CpuMeter(target.pids) as meter:
                    await tally.window(sessions[target.name][1], seconds=sizes.seconds / sizes.b3_windows)
                per_call[target.name].add(meter, sum(tally.answered.values()) - answered, target.pids)
                _merge_cpu(cpu[target.name], meter.percent, weight=1 / sizes.b3_windows)
        return {
            target.name: {
                **tallies[target.name].result(sessions[target.name][0], sizes.callers),
                "cpu": cpu[target.name],
                "cpu_ms_per_call": per_call[target.name].ms,
            }
            for target in targets
        }
    finally:
        for remote, callers in sessions.values():
            await asyncio.gather(*(c.close() for c in callers), return_exceptions=True)
            await remote.close()


def _merge_cpu(total: dict[str, float], sample: dict[str, float], *, weight: float) -> None:
    for name, value in sample.items():
        total[name] = round(total.get(name, 0.0) + value * weight, 1)


# --- the run ----------------------------------------------------------------------------


def run(sizes: Sizes, *, skip_b2: bool) -> dict[str, Any]:
    """Every phase, with both baselines up throughout; returns the report."""
    report: dict[str, Any] = {"b1": {}, "b3": {}, "b2": {}, "cpu": {}, "notes": []}
    with (
        baseline_server("relay") as (relay_url, relay_pid),
        baseline_server("channels") as (channels_url, channels_pid),
    ):
        print("· starting Dispatch (SQLite, in-memory channel layer)…", flush=True)
        with instance(**SERVER_ENV) as inst, logs_on_failure(inst):
            server = inst.serve()
            token = inst.token("admin")
            targets = [
                Target("relay", relay_url, relay_url, None, {"server": relay_pid}),
                Target("channels", channels_url, channels_url, None, {"server": channels_pid}),
                Target("dispatch", server.ws_url, server.ws_url, token, {"server": server.proc.pid}),
            ]
            print(
                f"· B1: {sizes.warmup} warm-up + {sizes.calls} sequential calls on each server, "
                f"{sizes.rounds} interleaved rounds…",
                flush=True,
            )
            asyncio.run(latency_phase(targets, sizes))
            for target in targets:
                report["b1"][target.name] = {
                    **latency_summary(target.samples),
                    "cpu_ms_per_call": target.cpu_per_call.ms,
                }
                report["cpu"][f"b1.{target.name}"] = target.cpu
            print(
                f"· B3: {sizes.callers} caller sessions x {sizes.seconds:g} s on each server, "
                f"{sizes.b3_windows} interleaved windows…",
                flush=True,
            )
            for name, entry in asyncio.run(throughput_phase(targets, sizes)).items():
                report["cpu"][f"b3.{name}"] = entry.pop("cpu")
                report["b3"][name] = entry
            report["dispatch_rss_mib_after_b3"] = round(process_rss_mib(server.proc.pid), 1)
        if skip_b2:
            report["notes"].append("B2 skipped (--skip-b2)")
            return report
        print("· B2: two Dispatch processes on PostgreSQL + Redis, interleaved with the bare relay…", flush=True)
        try:
            run_b2(sizes, Target("relay", relay_url, relay_url, None, {"server": relay_pid}), report)
        except BaseException as exc:  # tests.infra skips (a BaseException) when a service is missing
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            report["notes"].append(f"B2 not measured: {type(exc).__name__}: {exc}")
    return report


def run_b2(sizes: Sizes, relay: Target, report: dict[str, Any]) -> None:
    """B2 (caller on A, remote on B) and, for the notes, both on A; beside the bare relay again."""
    with instance(postgres=True, redis=True, **SERVER_ENV) as inst, logs_on_failure(inst):
        first, second = inst.serve(), inst.serve()
        token = inst.token("admin")
        pids = {"server_a": first.proc.pid, "server_b": second.proc.pid}
        across = Target("across", first.ws_url, second.ws_url, token, pids)
        same = Target("same_process", first.ws_url, first.ws_url, token, pids, remotename="bench-a")
        redis_options = ("--redis", inst.env["REDIS_URL"], "--prefix", f"bench-relay-{uuid.uuid4().hex[:8]}")
        with (
            baseline_server("redis-relay", *redis_options) as (url_a, pid_a),
            baseline_server("redis-relay", *redis_options) as (url_b, pid_b),
        ):
            # The floor of any relay crossing processes through Redis: the bare relay's work
            # plus one PUBLISH each way (bench/baseline.py).
            redis_relay = Target("redis_relay", url_a, url_b, None, {"relay_a": pid_a, "relay_b": pid_b})
            asyncio.run(latency_phase([relay, across, same, redis_relay], sizes))
        for target in (relay, across, same, redis_relay):
            report["b2"][target.name] = {**latency_summary(target.samples), "cpu_ms_per_call": target.cpu_per_call.ms}
            report["cpu"][f"b2.{target.name}"] = target.cpu


# --- the table --------------------------------------------------------------------------


def _lat(summary: dict[str, float] | None) -> str:
    if not summary:
        return "—"
    return f"{summary['p50_ms']:.2f} / {summary['p95_ms']:.2f} / {summary['p99_ms']:.2f}"


def _cpu(entry: dict[str, Any] | None) -> float | None:
    return entry.get("cpu_ms_per_call") if entry else None


def rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The B1–B3 rows (common.bench_row); CPU is the server processes' ms per call."""
    b1, b2, b3 = report["b1"], report["b2"], report["b3"]
    relay_p50 = b1["relay"]["p50_ms"]
    out: list[dict[str, Any]] = []
    ratio = b1["dispatch"]["p50_ms"] / relay_p50
    out.append(
        bench_row(
            "B1",
            "remote-call round trip, 1 KiB, 1 process, in-memory layer (ms p50/p95/p99)",
            dispatch=_lat(b1["dispatch"]),
            baseline=f"{_lat(b1['relay'])} (bare relay)",
            ratio=f"{ratio:.1f}x (Channels relay {b1['channels']['p50_ms'] / relay_p50:.1f}x)",
            cpu=(_cpu(b1["dispatch"]), _cpu(b1["relay"])),
            goal=f"p50 <= {B1_MAX_RATIO:g}x bare",
            passed=ratio <= B1_MAX_RATIO,
            numbers={"dispatch_p50_ms": b1["dispatch"]["p50_ms"], "baseline_p50_ms": relay_p50, "ratio": ratio,
                     "channels_p50_ms": b1["channels"]["p50_ms"]},
        )
    )  # fmt: skip
    out.append(
        bench_row(
            "(B1')",
            "info: the Channels relay (AsyncWebsocketConsumer under daphne), same calls (ms)",
            dispatch=_lat(b1["channels"]),
            baseline=f"{_lat(b1['relay'])} (bare relay)",
            ratio=f"{b1['channels']['p50_ms'] / relay_p50:.1f}x",
            cpu=(_cpu(b1["channels"]), _cpu(b1["relay"])),
        )
    )
    if b2.get("across"):
        relay2_p50 = b2["relay"]["p50_ms"]
        ratio2 = b2["across"]["p50_ms"] / relay2_p50
        out.append(
            bench_row(
                "B2",
                "same, 2 processes, PostgreSQL + Redis, caller on A, remote on B (ms)",
                dispatch=_lat(b2["across"]),
                baseline=f"{_lat(b2['relay'])} (bare relay)",
                ratio=f"{ratio2:.1f}x",
                cpu=(_cpu(b2["across"]), _cpu(b2["relay"])),
                goal=f"p50 <= {B2_MAX_RATIO:g}x bare",
                passed=ratio2 <= B2_MAX_RATIO,
                numbers={"dispatch_p50_ms": b2["across"]["p50_ms"], "baseline_p50_ms": relay2_p50, "ratio": ratio2},
            )
        )
        out.append(
            bench_row(
                "(B2')",
                "info: caller and remote both on A, PostgreSQL + Redis (ms)",
                dispatch=_lat(b2["same_process"]),
                baseline=f"{_lat(b2['relay'])} (bare relay)",
                ratio=f"{b2['same_process']['p50_ms'] / relay2_p50:.1f}x",
                cpu=(_cpu(b2["same_process"]), _cpu(b2["relay"])),
            )
        )
        if b2.get("redis_relay"):
            floor = b2["redis_relay"]["p50_ms"]
            out.append(
                bench_row(
                    "(B2'')",
                    "info: the bare relay across 2 processes, one Redis PUBLISH each way (ms; B2 against it)",
                    dispatch=_lat(b2["redis_relay"]),
                    baseline=f"{_lat(b2['relay'])} (bare relay)",
                    ratio=f"{floor / relay2_p50:.1f}x (B2 {b2['across']['p50_ms'] / floor:.1f}x this)",
                    cpu=(_cpu(b2["redis_relay"]), _cpu(b2["relay"])),
                )
            )
    else:
        out.append(bench_row("B2", "not measured (see notes)", dispatch="—", goal=f"p50 <= {B2_MAX_RATIO:g}x bare"))
    dispatch3, channels3, relay3 = b3["dispatch"], b3["channels"], b3["relay"]

    def rate(entry: dict[str, Any]) -> str:
        flag = "" if entry["intact"] else " (!)"
        return f"{entry['calls_per_second']:,.0f}/s{flag}"

    share = dispatch3["calls_per_second"] / relay3["calls_per_second"]
    # Judged by CPU per call: the calls/s ratio flatters a fast server, since the relay's side
    # is bound by the Python driver (bench/README.md).
    cpu3, relay_cpu3 = dispatch3.get("cpu_ms_per_call"), relay3.get("cpu_ms_per_call")
    cpu_ratio3 = cpu3 / relay_cpu3 if cpu3 is not None and relay_cpu3 else None
    out.append(
        bench_row(
            "B3",
            f"throughput, {dispatch3['callers']} caller sessions x 1 in flight, 1 process (calls/s)",
            dispatch=rate(dispatch3),
            baseline=f"{rate(relay3)} (bare relay)",
            ratio=f"{share:.2f}x (Channels relay {channels3['calls_per_second'] / relay3['calls_per_second']:.2f}x)",
            cpu=(cpu3, relay_cpu3),
            goal=f"CPU/call <= {B3_MAX_CPU_RATIO:g}x bare (capacity >= {B3_MIN_SHARE:g}x), none lost/dup",
            # Not judged without both CPU figures; the capacity share must hold as well.
            passed=None if cpu_ratio3 is None
            else cpu_ratio3 <= B3_MAX_CPU_RATIO and share >= B3_MIN_SHARE and dispatch3["intact"],
            numbers={"dispatch_calls_per_s": dispatch3["calls_per_second"],
                     "baseline_calls_per_s": relay3["calls_per_second"], "ratio": share,
                     "channels_calls_per_s": channels3["calls_per_second"], "lost": dispatch3["lost"],
                     "cpu_ratio": cpu_ratio3},
        )
    )  # fmt: skip
    return out


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": os.getloadavg(),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Remote-call benchmarks B1-B3 beside baselines.")
    parser.add_argument("--quick", action="store_true", help="a short run: 300 calls, 3 s throughput windows")
    parser.add_argument("--calls", type=int, help="sequential calls per server for B1/B2 (default 1500)")
    parser.add_argument("--seconds", type=float, help="B3 window per server (default 8)")
    parser.add_argument("--callers", type=int, default=64, help="B3 caller sessions (default 64)")
    parser.add_argument("--skip-b2", action="store_true", help="skip B2 (needs PostgreSQL and Redis)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument(
        "--output", type=Path, default=RESULTS, help=f"JSON results (default {RESULTS.relative_to(REPO)})"
    )
    options = parser.parse_args(argv)
    sizes = (
        Sizes(warmup=50, calls=300, rounds=3, callers=options.callers, seconds=3.0, b3_windows=2)
        if options.quick
        else Sizes(warmup=200, calls=1500, rounds=5, callers=options.callers, seconds=8.0, b3_windows=2)
    )
    if options.calls:
        sizes.calls = options.calls
    if options.seconds:
        sizes.seconds = options.seconds

    def abort(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    def too_long(signum: int, frame: Any) -> None:
        raise TimeoutError(f"benchmark exceeded {HARD_LIMIT} s; aborted")

    signal.signal(signal.SIGTERM, abort)
    signal.signal(signal.SIGALRM, too_long)
    signal.alarm(HARD_LIMIT)

    info = machine()
    started = time.monotonic()
    print(
        f"Remote-call benchmarks ({'quick' if options.quick else 'full'} run) "
        f"on {info['cpus']} CPU(s), {info['cpu_model']}.\n"
        f"NOTE: servers, baselines and this client all share these {info['cpus']} cores; "
        "compare ratios, not absolutes.",
        flush=True,
    )
    try:
        report = run(sizes, skip_b2=options.skip_b2)
    except (KeyboardInterrupt, TimeoutError) as exc:
        print(f"aborted ({exc}); every server it started has been stopped", file=sys.stderr)
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        signal.alarm(0)
    table = rows(report)
    print()
    print_table(table)
    print()
    print(
        "B1/B2: sequential calls, ms p50 / p95 / p99. B3: calls/s, each caller session keeps one call in flight "
        f"({sizes.callers} sessions = {sizes.callers} calls in flight); (!) = a call lost, duplicated or failed."
    )
    for name, entry in report["b3"].items():
        print(
            f"  B3 {name}: {entry['completed']} answered of {entry['sent']} sent in {entry['seconds']} s; "
            f"lost {entry['lost']}, duplicated {entry['duplicated_replies'] + entry['remote_duplicates']}, "
            f"errors {entry['errors']}{' ' + str(entry['error_samples']) if entry['error_samples'] else ''}; "
            f"latency p50 {entry['latency']['p50_ms']:.1f} ms, p99 {entry['latency']['p99_ms']:.1f} ms"
        )
    print(
        "CPU, % of one core, while each was measured: the server process(es), this driver (callers and the "
        "remote), and every other process on the machine (PostgreSQL and Redis in B2; anything else is noise):"
    )
    for phase, cpu in report["cpu"].items():
        print(f"  {phase}: " + ", ".join(f"{k} {v:.0f}%" for k, v in cpu.items()))
    loads = [" ".join(f"{x:.2f}" for x in load) for load in (info["load_average_at_start"], os.getloadavg())]
    print(f"load average (1, 5, 15 min) at start {loads[0]}, at end {loads[1]}")
    busy = [cpu.get("others", 0.0) for cpu in report["cpu"].values()]
    if busy and max(busy) > 30:
        report["notes"].append(
            f"other processes used up to {max(busy):.0f}% of a core while measuring (see 'others'): "
            "the machine was not quiet, so absolute numbers are inflated and noisy; the interleaved ratios less so"
        )
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
        footer="per-connection rate limit raised for the bench, production intervals otherwise",
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
