"""Machine benchmarks B4, B5, B6 (goals: bench/README.md#goals), beside a bare relay.

Usage: ``.venv/bin/python bench/machines.py [--quick]`` (``make bench``, after
bench/remote_calls.py); ``.venv/bin/python bench/machines.py relay --port P`` runs the
baseline server alone.

- B4  ``FILE_STAT`` round trip through the router: a keep-alive HTTP client POSTs
      ``/api/v1/sessions/bench/ops`` to one ``manage.py serve`` (SQLite, in-memory channel
      layer); the router picks the machine (two attached, the path is under one root) and
      a real shim (``python -m machines.shim run``) answers. Sequential, after a warm-up.
      The same FILE_STAT as an MCP ``tools/call`` of ``local_pc_file_stat`` (``POST /mcp``),
      and, on a PostgreSQL + Redis server of its own, the built-in agent's tool path: the
      ``local_pc_file_stat`` handler called from a second Django process (``tool-driver``
      below, as a ``dispatch_worker`` runs an expert), beside REST on that server. Every
      target is interleaved with the bare relay and ``/healthz``; goals (bench/README.md): tool
      path ≤ 4× bare, REST and MCP ≤ the ``/healthz`` floor + 3× bare; server CPU ms per op.
- B5  ``POST /api/v1/sessions/bench/copy`` of a 100 MiB file between two real shims
      (1 MiB base64 chunks through the platform), MiB/s, and the server's RSS growth
      (peak during the copy minus before it, sampled every 20 ms).
- B6  1,000 idle shims (raw websocket clients doing the HELLO handshake with a user token,
      each with its own ``machine_id``, answering PINGs) and 1,000 idle ``/ws`` sessions on
      one fresh process: all connected, memory per connection, the process heartbeat
      (``ServerProcess.heartbeat_at``) and the shim PINGs on time, ``/healthz`` answering,
      and every connection still alive at the end (each ``/ws`` session answers a ``ping``).
- (B6') information: N shims of one user attached to every session (``"*"``) connect one
        after another; how many ``MACHINE_LIST_REQUEST`` the platform sends.

The baseline, measured in the same run and interleaved with Dispatch, is a bare
``websockets`` server in one process (machines_relay.py) that the **same real shims** connect
to: it answers HELLO, then relays the same JSON envelopes between a caller and the shim,
parsing and re-serialising each frame; for B5 it glues the copy itself (the same
FILE_STAT / FILE_READ 1 MiB base64 / FILE_WRITE append / FILE_STAT hash / FILE_MOVE
sequence as machines/services/copy.py). No auth, no database, no channel layer, no HTTP:
its caller speaks websockets, while Dispatch's operations are REST calls, so B4's ratio
includes HTTP (the ``(B4')`` row shows Dispatch's bare HTTP round trip on the same client).

This file starts the servers, runs the phases and writes the report, and is the entry point
of the child processes they start (``relay``, ``tool-driver``, ``b6-clients``); the phases
are machines_b4.py, machines_b5.py and machines_b6.py, the rows and details
machines_table.py, what they share machines_common.py (bench/README.md#machines-machinespy-b4-b5-b6).

Prints a table and writes bench/results/machines.json. Bounded (aborts itself after
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
sys.path.insert(0, str(BENCH))

from common import finish_report, print_table, process_rss_mib  # noqa: E402
from machines_b4 import b4, b4_tool, run_tool_driver  # noqa: E402
from machines_b5 import b5  # noqa: E402
from machines_b6 import b6, b6_clients, b6_tokens  # noqa: E402
from machines_common import (  # noqa: E402
    B6_CONNECTIONS,
    B6_PONG_TIMEOUT,
    B6_STAMPS_PER_SECOND,
    SERVER_ENV,
    Rig,
    Sizes,
    make_source,
    start_shim,
)
from machines_relay import relay_server, run_relay  # noqa: E402
from machines_table import print_details, rows  # noqa: E402

from core.open_files import raise_open_file_limit  # noqa: E402

RESULTS = BENCH / "results" / "machines.json"
HARD_LIMIT = 600  # seconds: the whole run is aborted (and cleaned up) past this


# --- the run --------------------------------------------------------------------------------


def run(sizes: Sizes) -> dict[str, Any]:
    from remote_calls import logs_on_failure

    from tests.infra import instance

    report: dict[str, Any] = {"notes": []}
    with tempfile.TemporaryDirectory(prefix="bench-machines-") as scratch, relay_server() as (relay_url, relay_pid):
        work = Path(scratch)
        for directory in ("src", "dst-dispatch", "dst-relay"):
            (work / directory).mkdir()
        print("· starting Dispatch (SQLite, in-memory channel layer) and four real shims…", flush=True)
        with instance(**SERVER_ENV) as inst, logs_on_failure(inst):
            server = inst.serve()
            token = inst.admin_token
            shims = {
                "dispatch-src": start_shim(server.url, token, "src", work / "src", work / "state-d-src"),
                "dispatch-dst": start_shim(server.url, token, "dst", work / "dst-dispatch", work / "state-d-dst"),
                "relay-src": start_shim(relay_url, "relay", "src", work / "src", work / "state-r-src"),
                "relay-dst": start_shim(relay_url, "relay", "dst", work / "dst-relay", work / "state-r-dst"),
            }
            try:
                rig = Rig(dispatch_url=server.url, token=token, relay_url=relay_url, work=work, pids={})
                rig.pids = {"dispatch": server.proc.pid, "relay": relay_pid}
                rig.pids.update({f"shim.{name}": shim.pid for name, shim in shims.items()})
                rig.stat_path.write_text("stat me\n")
                rig.source_sha256 = make_source(rig.source_file, sizes.copy_mib)

                print(
                    f"· B4: {sizes.warmup} warm-up + {sizes.calls} sequential FILE_STAT on each, "
                    f"{sizes.rounds} interleaved rounds…",
                    flush=True,
                )
                report["b4"] = asyncio.run(b4(rig, sizes))
                print("· B4 (tool path): PostgreSQL + Redis, serve + a Django tool driver, interleaved…", flush=True)
                report["b4_tool"] = asyncio.run(b4_tool(rig, sizes, work))
                print(f"· B5: {sizes.copy_rounds} x {sizes.copy_mib} MiB copy on each, interleaved…", flush=True)
                report["b5"] = asyncio.run(b5(rig, sizes, server.proc.pid))
                report["b5"]["relay_rss_mib_after"] = round(process_rss_mib(relay_pid), 1)
            finally:
                for shim in shims.values():
                    shim.stop()

            print(
                f"· B6: a fresh process; {sizes.storm_shims} shims on '*' first (B6'), then {sizes.shims} idle shims + "
                f"{sizes.sessions} idle /ws sessions of {sizes.b6_users} users from {sizes.b6_clients} client "
                f"processes, {sizes.idle_seconds:g} s idle; then {sizes.one_user_shims} shims of one user (B6'')…",
                flush=True,
            )
            server.stop()
            inst.create_user("storm")
            storm_token = inst.token("storm")
            b6_server = inst.serve(
                DISPATCH_SHIM_PING_INTERVAL=sizes.ping_interval, DISPATCH_SHIM_PONG_TIMEOUT=B6_PONG_TIMEOUT
            )
            database = Path(inst.env["DISPATCH_DATA_DIR"]) / "dispatch.sqlite3"
            tokens = b6_tokens(inst, sizes.b6_users)
            try:
                report["b6"] = asyncio.run(b6(b6_server, tokens, storm_token, token, database, sizes))
            except (RuntimeError, OSError) as exc:  # B4 and B5 are still reported; the row says why not B6
                report["b6"] = {"failed": f"{type(exc).__name__}: {exc}", "shims": sizes.shims,
                                "sessions": sizes.sessions}  # fmt: skip
                report["notes"].append(f"B6 not measured: {report['b6']['failed']}")
    return report


def machine() -> dict[str, Any]:
    from remote_calls import machine as describe

    return describe()


def main(argv: list[str]) -> int:
    if argv[:1] == ["tool-driver"]:
        parser = argparse.ArgumentParser(description="the B4 tool-path driver (a Django process)")
        parser.add_argument("kind", choices=["tool-driver"])
        parser.add_argument("--path", required=True)
        run_tool_driver(parser.parse_args(argv).path)
        return 0
    if argv[:1] == ["relay"]:
        parser = argparse.ArgumentParser(description="the bare websockets shim relay (baseline)")
        parser.add_argument("kind", choices=["relay"])
        parser.add_argument("--port", type=int, required=True)
        asyncio.run(run_relay(parser.parse_args(argv).port))
        return 0
    if argv[:1] == ["b6-clients"]:
        parser = argparse.ArgumentParser(description="one B6 client process (driven by the B6 phase)")
        parser.add_argument("kind", choices=["b6-clients"])
        for name in ("--ws-base", "--token", "--tag"):
            parser.add_argument(name, required=True)
        for name in ("--shims", "--sessions", "--concurrency"):
            parser.add_argument(name, type=int, required=True)
        parser.add_argument("--limit", type=float, required=True)
        options = parser.parse_args(argv)
        raise_open_file_limit()
        asyncio.run(b6_clients(options.ws_base, options.token, options.tag, options.shims, options.sessions,
                               options.concurrency, options.limit))  # fmt: skip
        return 0
    parser = argparse.ArgumentParser(description="Machine benchmarks B4-B6 beside a bare relay.")
    parser.add_argument("--quick", action="store_true", help="a short run (about a minute)")
    parser.add_argument("--calls", type=int, help="sequential FILE_STATs per target for B4 (default 1000)")
    parser.add_argument(
        "--connections", type=int, help=f"B6 shims, and as many /ws sessions (default {B6_CONNECTIONS})"
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument(
        "--output", type=Path, default=RESULTS, help=f"JSON results (default {RESULTS.relative_to(REPO)})"
    )
    options = parser.parse_args(argv)
    sizes = (
        Sizes(warmup=30, calls=300, rounds=3, copy_rounds=1, copy_mib=100, shims=B6_CONNECTIONS,
              sessions=B6_CONNECTIONS, idle_seconds=10, storm_shims=30, one_user_shims=300)
        if options.quick
        else Sizes(warmup=100, calls=1000, rounds=5, copy_rounds=2, copy_mib=100, shims=B6_CONNECTIONS,
                   sessions=B6_CONNECTIONS, idle_seconds=20, storm_shims=50)
    )  # fmt: skip
    if options.calls:
        sizes.calls = options.calls
    if options.connections:
        sizes.shims = sizes.sessions = options.connections
    sizes.ping_interval = max(4.0, sizes.shims / B6_STAMPS_PER_SECOND)
    fd_limit = raise_open_file_limit()[1]

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
        f"Machine benchmarks ({'quick' if options.quick else 'full'} run) on {info['cpus']} CPU(s), "
        f"{info['cpu_model']}; open-file limit {fd_limit}.\n"
        f"NOTE: servers, the relay, the shims and this client share these {info['cpus']} cores; "
        "compare ratios, not absolutes.",
        flush=True,
    )
    try:
        report = run(sizes)
    except (KeyboardInterrupt, TimeoutError) as exc:
        print(f"aborted ({exc}); every process it started has been stopped", file=sys.stderr)
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        signal.alarm(0)
    table = rows(report)
    print()
    print_table(table)
    print()
    print_details(report, sizes)
    storm = report["b6"].get("storm")
    if storm and storm["machine_list_requests"] > 2 * storm["shims"]:
        report["notes"].append(
            f"(B6') {storm['shims']} shims of one user on '*' made the platform send "
            f"{storm['machine_list_requests']} MACHINE_LIST_REQUESTs: every new attachment asks every attached "
            "shim again (machines/services/connections.py announce_attachment), so it grows as N^2/2; "
            "docs/shim-protocol.md#machine-sessions asks when a second machine attaches"
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
        footer="",
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
