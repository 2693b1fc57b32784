"""Live-operation benchmarks B10, B11, B12 (goals: bench/README.md#goals), each beside a baseline
measured in the same run.

Usage: ``.venv/bin/python bench/live.py [--quick]`` (``make bench``, after bench/machines.py).
``bench/live.py relay --port P`` runs the bare relay alone; ``bench/live.py shims …`` runs
the in-process shim fleet of B12 alone (the driver starts both itself).

- B10  time to the first output byte of a streamed command (``sh -c 'echo ready; exec sleep
       30'``) through one ``manage.py serve`` (SQLite, in-memory channel layer) and a real
       shim (``python -m machines.shim run``), then cancel it, so each sample is short:
       * REST: ``POST /api/v1/sessions/bench/ops {stream: true, request_id}``, read the event
         stream until the first ``output`` event; then ``POST …/ops/{request_id}/cancel`` and
         read on until the ``result`` (it must say ``cancelled: true``).
       * MCP: ``POST /mcp tools/call local_pc_execute_command`` with a ``progressToken``,
         read the event stream until the first ``notifications/progress``; then ``POST /mcp
         notifications/cancelled`` with the call's JSON-RPC id and read on until the result.
       Baseline: a bare ``websockets`` relay (live_relay.py) that the **same real shim
       program** connects to (HELLO → HELLO_ACK at 2.1): a websocket caller sends the same
       ``EXECUTE_COMMAND {stream: true}``; the relay forwards it and relays the shim's
       ``COMMAND_OUTPUT`` frames back (parsing and re-serialising each); the time is the
       first ``COMMAND_OUTPUT`` at the caller, then the caller sends ``CANCEL`` and reads
       until the ``COMMAND_RESULT``. Target: p95 ≤ 200 ms (both Dispatch paths).
- B11  ``POST /api/v1/sessions/bench/pipe``: ``head -c N /dev/zero`` on machine ``src`` →
       ``sha256sum`` on machine ``dst`` (two real shims), N = 200 MiB; MiB/s, the server's
       RSS growth (peak during the pipe minus before, sampled every 20 ms from /proc) and the
       hash checked against the one computed here. Baseline: a cross-machine copy of a file
       of the same size between the same two shims (``POST …/copy``), in the same run,
       interleaved. Target: pipe ≥ 50 % of the copy's rate; growth ≤ 32 MiB; hash correct.
- B12  fan-out: 50 shims in one asyncio process (the shim's own ``Shim`` class, 50
       instances; live_b12.py), attached to session ``fanout``;
       ``POST …/ops {target_machines: "*", EXECUTE_COMMAND sleep 1}`` against the same
       command on one of them (``target_machine``), interleaved rounds, medians. Target:
       time(50) ≤ 2 × time(1); the overhead time(50) − time(1) is printed.

A row whose feature the server does not offer yet (a 400/404 for the new fields or routes,
a JSON answer where an event stream was asked for, a shim that sends no ``COMMAND_OUTPUT``)
prints ``SKIP`` with the reason — never a number it did not measure.

This file starts the servers and the shims, runs the phases and writes the report, and is
the entry point of the child processes they start (``relay``, ``shims``); the phases are
live_b10.py, live_b11.py and live_b12.py, the relay live_relay.py, the rows live_table.py,
what they share live_common.py (bench/README.md#live-operations-livepy-b10-b11-b12).

Prints a table and writes bench/results/live.json. Bounded (aborts itself after
HARD_LIMIT seconds) and stops every process it started.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
# bench/ goes last: the Django app ``machines`` (live_common.py imports ``machines.shim``) must
# win over bench/machines.py, which has the same name.
sys.path.append(str(BENCH))

from common import CpuMeter, finish_report, print_table  # noqa: E402
from live_b10 import b10  # noqa: E402
from live_b11 import b11  # noqa: E402
from live_b12 import b12, run_fleet  # noqa: E402
from live_common import FANOUT_SESSION, SERVER_ENV, Rig, Sizes  # noqa: E402
from live_relay import child, relay_server, run_relay  # noqa: E402
from live_table import rows  # noqa: E402
from machines_common import start_shim  # noqa: E402

RESULTS = BENCH / "results" / "live.json"
HARD_LIMIT = 600  # seconds: the whole run is aborted (and cleaned up) past this


# --- the run --------------------------------------------------------------------------------


def run(sizes: Sizes) -> dict[str, Any]:
    from remote_calls import logs_on_failure

    from tests.infra import instance

    report: dict[str, Any] = {"notes": []}
    with tempfile.TemporaryDirectory(prefix="bench-live-") as scratch, relay_server() as (relay_url, relay_pid):
        work = Path(scratch)
        for directory in ("src", "dst", "fan", "relay-src"):
            (work / directory).mkdir()
        print("· starting Dispatch (SQLite, in-memory channel layer), two real shims and one on the relay…", flush=True)
        with instance(**SERVER_ENV) as inst, logs_on_failure(inst):
            server = inst.serve()
            token = inst.admin_token
            shims = [
                start_shim(server.url, token, "src", work / "src", work / "state-src"),
                start_shim(server.url, token, "dst", work / "dst", work / "state-dst"),
                start_shim(relay_url, "relay", "src", work / "relay-src", work / "state-relay-src"),
            ]
            rig = Rig(dispatch_url=server.url, token=token, relay_url=relay_url, work=work, server_pid=server.proc.pid,
                      relay_pid=relay_pid)  # fmt: skip
            try:
                print(
                    f"· B10: {sizes.warmup} warm-up + {sizes.samples} samples each (relay, REST, MCP), interleaved…",
                    flush=True,
                )
                names = ("src", "dst", "relay")
                shim_pids = {f"shim.{name}": shim.pid for name, shim in zip(names, shims, strict=True)}
                with CpuMeter({"server": server.proc.pid, "relay": relay_pid, **shim_pids}) as meter:
                    report["b10"] = asyncio.run(b10(rig, sizes))
                report["cpu"] = {"b10": meter.percent}
                print(
                    f"· B11: {sizes.transfer_rounds} x ({sizes.pipe_mib} MiB pipe, {sizes.pipe_mib} MiB copy)…",
                    flush=True,
                )
                with CpuMeter({"server": server.proc.pid, **shim_pids}) as meter:
                    report["b11"] = asyncio.run(b11(rig, sizes))
                report["cpu"]["b11"] = meter.percent
            finally:
                for shim in shims:
                    shim.stop()
            print(f"· B12: {sizes.fanout} in-process shims; {sizes.fanout_rounds} rounds of one vs all…", flush=True)
            fleet_args = [
                "shims", "--server", server.url, "--token", token, "--count", str(sizes.fanout),
                "--root", str(work / "fan"), "--session", FANOUT_SESSION, "--prefix", "fan",
            ]  # fmt: skip
            with child(fleet_args, "fleet", "connected ", timeout=120) as fleet:
                with CpuMeter({"server": server.proc.pid, "fleet": fleet.pid}) as meter:
                    report["b12"] = asyncio.run(b12(rig, sizes))
                report["cpu"]["b12"] = meter.percent
                report["b12"]["fleet_pid"] = fleet.pid
    return report


def main(argv: list[str]) -> int:
    if argv[:1] == ["relay"]:
        parser = argparse.ArgumentParser(description="the bare websockets relay with streamed frames (baseline)")
        parser.add_argument("kind", choices=["relay"])
        parser.add_argument("--port", type=int, required=True)
        asyncio.run(run_relay(parser.parse_args(argv).port))
        return 0
    if argv[:1] == ["shims"]:
        parser = argparse.ArgumentParser(description="many in-process shims (B12)")
        parser.add_argument("kind", choices=["shims"])
        for name in ("--server", "--token", "--root", "--session", "--prefix"):
            parser.add_argument(name, required=True)
        parser.add_argument("--count", type=int, required=True)
        options = parser.parse_args(argv)
        asyncio.run(
            run_fleet(options.server, options.token, options.count, options.root, options.session, options.prefix)
        )
        return 0
    parser = argparse.ArgumentParser(description="Live-operation benchmarks B10-B12 beside baselines.")
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--samples", type=int, help="B10 samples per path (default 100; quick 30)")
    parser.add_argument("--pipe-mib", type=int, help="B11 pipe and copy size in MiB (default 200; quick 64)")
    parser.add_argument("--rounds", type=int, help="B11 rounds (default 1)")
    parser.add_argument("--fanout", type=int, help="B12 in-process shims (default 50)")
    parser.add_argument("--fanout-rounds", type=int, help="B12 rounds (default 3)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument(
        "--output", type=Path, default=RESULTS, help=f"JSON results (default {RESULTS.relative_to(REPO)})"
    )
    options = parser.parse_args(argv)
    sizes = (
        Sizes(samples=30, warmup=3, pipe_mib=64, transfer_rounds=1, fanout=50, fanout_rounds=3)
        if options.quick
        else Sizes(samples=100, warmup=5, pipe_mib=200, transfer_rounds=1, fanout=50, fanout_rounds=3)
    )
    for option, name in (
        ("samples", "samples"),
        ("pipe_mib", "pipe_mib"),
        ("rounds", "transfer_rounds"),
        ("fanout", "fanout"),
        ("fanout_rounds", "fanout_rounds"),
    ):
        if getattr(options, option):
            setattr(sizes, name, getattr(options, option))

    def abort(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    def too_long(signum: int, frame: Any) -> None:
        raise TimeoutError(f"benchmark exceeded {HARD_LIMIT} s; aborted")

    signal.signal(signal.SIGTERM, abort)
    signal.signal(signal.SIGALRM, too_long)
    signal.alarm(HARD_LIMIT)
    from remote_calls import machine

    info = machine()
    started = time.monotonic()
    print(
        f"Live-operation benchmarks ({'quick' if options.quick else 'full'} run) on {info['cpus']} CPU(s), "
        f"{info['cpu_model']}.\nNOTE: the server, the relay, the shims and this client share these "
        f"{info['cpus']} cores; compare ratios, not absolutes.",
        flush=True,
    )
    try:
        report = run(sizes)
    except (KeyboardInterrupt, TimeoutError) as exc:
        print(f"aborted ({exc}); every process it started has been stopped", file=sys.stderr)
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        signal.alarm(0)
    report["sizes_fanout"] = sizes.fanout
    table = rows(report)
    print()
    print_table(table)
    print()
    for row in table:
        if row.get("skipped"):
            report["notes"].append(f"{row['id']} not measured: {row['why']}")
    print("CPU, % of one core, over each phase ('others': the rest of the machine, the shims' commands included):")
    for phase, cpu in report["cpu"].items():
        print(f"  {phase.upper()}: " + ", ".join(f"{name} {value:.0f}%" for name, value in cpu.items()))
    busiest = max(cpu.get("others", 0.0) for cpu in report["cpu"].values())
    if busiest > 50:
        report["notes"].append(
            f"other processes used up to {busiest:.0f}% of a core during a phase: absolute numbers are inflated, "
            "ratios less so"
        )
    settle = report["b12"].get("settle")
    if settle:
        report["notes"].append(
            f"B12: after the {sizes.fanout} shims attached, the server stayed busy for {settle['seconds']:g} s "
            f"({settle['cpu_seconds']:g} CPU s) before it was idle and the fan-out was measured"
        )
    for name, why in report["b10"]["skipped"].items():
        if name == "relay":
            report["notes"].append(f"B10 baseline (bare relay) not measured: {why}")
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
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
