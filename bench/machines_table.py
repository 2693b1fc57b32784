"""The rows (common.bench_row) and the printed details of bench/machines.py's report."""

from __future__ import annotations

from typing import Any

from common import CpuPerOp, bench_row
from machines_common import (
    B4_REST_MAX_RATIO,
    B4_TOOL_MAX_RATIO,
    B5_MAX_GROWTH_MIB,
    B5_MIN_SHARE,
    B6_CONNECTIONS,
    B6_MAX_CPU_MS_PER_HELLO,
    B6_MAX_CPU_MS_PER_SESSION,
    B6_MAX_IDLE_CPU_PERCENT,
    B6_MAX_KIB,
    B6_PONG_TIMEOUT,
    Sizes,
)

# --- the table ------------------------------------------------------------------------------


def _lat(summary: dict[str, float]) -> str:
    return f"{summary['p50_ms']:.2f} / {summary['p95_ms']:.2f} / {summary['p99_ms']:.2f}"


def _sequential_cpu(phase: dict[str, Any], cpu: dict[str, float], server: str) -> float | None:
    """Server CPU ms per sequential op: its mean CPU share over the phase × the mean latency."""
    return CpuPerOp.from_percent(cpu.get(server), phase["mean_ms"]).ms


def b4_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The B4 rows (common.bench_row): REST and its /healthz floor (_rest_rows), then the
    goals beyond REST: MCP <= the /healthz floor + 3x bare (same run, SQLite
    server); the built-in agent's tool path <= 4x bare, and REST <= floor + 3x bare on the
    PostgreSQL + Redis server that path uses (server CPU ms per op of the serve process)."""
    b4, tool = report["b4"], report.get("b4_tool")
    relay_p50, floor_p50 = b4["relay"]["p50_ms"], b4["http_floor"]["p50_ms"]
    relay_cpu = b4["cpu"].get("relay", {}).get("relay_ms_per_op")
    mcp_p50 = b4["mcp"]["p50_ms"]
    rows = [
        *_rest_rows(b4),
        bench_row(
            "B4 mcp",
            "MCP tools/call local_pc_file_stat, SQLite server (ms p50/p95/p99)",
            dispatch=f"{_lat(b4['mcp'])} (HTTP)",
            baseline=f"{_lat(b4['relay'])} (bare relay, ws)",
            ratio=f"floor + {(mcp_p50 - floor_p50) / relay_p50:.1f}x bare",
            cpu=(b4["cpu"].get("mcp", {}).get("dispatch_ms_per_op"), relay_cpu),
            goal=f"p50 <= /healthz floor + {B4_REST_MAX_RATIO:g}x bare",
            passed=mcp_p50 <= floor_p50 + B4_REST_MAX_RATIO * relay_p50,
            numbers={"dispatch_p50_ms": mcp_p50, "baseline_p50_ms": relay_p50, "floor_p50_ms": floor_p50},
        ),
    ]
    if tool is None:
        return rows
    t_relay, t_floor = tool["relay"]["p50_ms"], tool["http_floor"]["p50_ms"]
    t_tool, t_rest = tool["tool"]["p50_ms"], tool["dispatch"]["p50_ms"]
    t_relay_cpu = tool["cpu"].get("relay", {}).get("relay_ms_per_op")
    rows += [
        bench_row(
            "B4 tool",
            "the built-in agent's local_pc_file_stat handler in a 2nd Django process, PostgreSQL + Redis",
            dispatch=_lat(tool["tool"]),
            baseline=f"{_lat(tool['relay'])} (bare relay, ws)",
            ratio=f"{t_tool / t_relay:.1f}x",
            cpu=(tool["cpu"].get("tool", {}).get("dispatch_ms_per_op"), t_relay_cpu),
            goal=f"p50 <= {B4_TOOL_MAX_RATIO:g}x bare",
            passed=t_tool <= B4_TOOL_MAX_RATIO * t_relay,
            numbers={"dispatch_p50_ms": t_tool, "baseline_p50_ms": t_relay},
        ),
        bench_row(
            "B4 rest/pg",
            f"REST …/ops on that PostgreSQL + Redis server (/healthz p50 {t_floor:.2f} ms)",
            dispatch=f"{_lat(tool['dispatch'])} (HTTP)",
            baseline=f"{_lat(tool['relay'])} (bare relay, ws)",
            ratio=f"floor + {(t_rest - t_floor) / t_relay:.1f}x bare",
            cpu=(tool["cpu"].get("dispatch", {}).get("dispatch_ms_per_op"), t_relay_cpu),
            goal=f"p50 <= /healthz floor + {B4_REST_MAX_RATIO:g}x bare",
            passed=t_rest <= t_floor + B4_REST_MAX_RATIO * t_relay,
            numbers={"dispatch_p50_ms": t_rest, "baseline_p50_ms": t_relay, "floor_p50_ms": t_floor},
        ),
    ]
    return rows


B6_GOAL = (
    f"{B6_CONNECTIONS:,} + {B6_CONNECTIONS:,}; heartbeats on time; <= {B6_MAX_KIB:g} KiB each; CPU <= "
    f"{B6_MAX_CPU_MS_PER_SESSION:g} ms per /ws session, <= {B6_MAX_CPU_MS_PER_HELLO:g} ms per HELLO; idle CPU <= "
    f"{B6_MAX_IDLE_CPU_PERCENT:g}%"
)


def rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The B4–B6 rows (common.bench_row), goals from bench/README.md#goals."""
    b5, b6 = report["b5"], report["b6"]
    if "failed" in b6:
        return [
            *b4_rows(report),
            *_rows_b5(b5),
            bench_row(
                "B6",
                f"{b6['shims']:,} idle shims + {b6['sessions']:,} idle /ws sessions, one process",
                dispatch=f"not measured: {b6['failed'][:200]}",
                goal=B6_GOAL,
                passed=False,
            ),
        ]
    return b4_rows(report) + _rows_b5(b5) + _rows_b6(b6)


def _rest_rows(b4: dict[str, Any]) -> list[dict[str, Any]]:
    relay_p50 = b4["relay"]["p50_ms"]
    floor_p50 = b4["http_floor"]["p50_ms"]
    ratio = b4["dispatch"]["p50_ms"] / relay_p50
    rest_goal = floor_p50 + B4_REST_MAX_RATIO * relay_p50
    relay_cpu = _sequential_cpu(b4["relay"], b4["cpu"]["relay"], "relay")
    return [
        bench_row(
            "B4",
            "FILE_STAT round trip through the router, real shim, REST (ms p50/p95/p99)",
            dispatch=f"{_lat(b4['dispatch'])} (HTTP)",
            baseline=f"{_lat(b4['relay'])} (bare relay, ws)",
            ratio=f"{ratio:.1f}x; floor + {(b4['dispatch']['p50_ms'] - floor_p50) / relay_p50:.1f}x bare",
            cpu=(_sequential_cpu(b4["dispatch"], b4["cpu"]["dispatch"], "dispatch"), relay_cpu),
            goal=f"p50 <= /healthz floor + {B4_REST_MAX_RATIO:g}x bare (= {rest_goal:.2f} ms)",
            passed=b4["dispatch"]["p50_ms"] <= rest_goal,
            numbers={"dispatch_p50_ms": b4["dispatch"]["p50_ms"], "baseline_p50_ms": relay_p50,
                     "floor_p50_ms": floor_p50, "ratio": ratio, "goal_p50_ms": rest_goal},
        ),
        bench_row(
            "(B4')",
            "info: GET /healthz on the same keep-alive client: HTTP + Django + 1 query, no shim (ms)",
            dispatch=_lat(b4["http_floor"]),
            baseline=f"{_lat(b4['relay'])} (bare relay, ws)",
            ratio=f"{floor_p50 / relay_p50:.1f}x",
            cpu=(_sequential_cpu(b4["http_floor"], b4["cpu"]["http_floor"], "dispatch"), relay_cpu),
        ),
    ]  # fmt: skip


def _rows_b5(b5: dict[str, Any]) -> list[dict[str, Any]]:
    share = b5["dispatch_mib_per_second"] / b5["relay_mib_per_second"]
    growth = b5["rss_growth_peak_mib"]
    b5_cpu = b5.get("cpu_ms_per_mib", {})
    return [
        bench_row(
            "B5",
            f"copy of a {b5['file_mib']} MiB file between two shims (MiB/s, median); server RSS growth; CPU per MiB",
            dispatch=f"{b5['dispatch_mib_per_second']:.1f} MiB/s, RSS +{growth:.1f} MiB (peak)",
            baseline=f"{b5['relay_mib_per_second']:.1f} MiB/s (bare relay)",
            ratio=f"{share:.0%}",
            cpu=(b5_cpu.get("dispatch"), b5_cpu.get("relay")),
            goal=f">= {B5_MIN_SHARE:.0%} of bare; growth <= {B5_MAX_GROWTH_MIB:g} MiB",
            passed=share >= B5_MIN_SHARE and growth <= B5_MAX_GROWTH_MIB,
            numbers={"dispatch_mib_per_s": b5["dispatch_mib_per_second"],
                     "baseline_mib_per_s": b5["relay_mib_per_second"], "ratio": share, "rss_growth_mib": growth},
        ),
    ]  # fmt: skip


def _rows_b6(b6: dict[str, Any]) -> list[dict[str, Any]]:
    alive = b6["shims_alive"] + b6["sessions_answered_ping"]
    wanted = b6["shims"] + b6["sessions"]
    ping_max = b6["ping_gap_s"]["max"]
    pings_on_time = b6["shims_pinged"] == b6["shims"] and ping_max is not None and ping_max <= b6["ping_period_s"] + 1.0
    heartbeat_on_time = b6["heartbeat_max_age_s"] <= 2 * b6["heartbeat_interval_s"]
    per_connection = b6["kib_per_connection"]
    per_session, per_hello = b6["cpu_ms_per_session_opened"], b6["cpu_ms_per_shim_opened"]
    storm = b6["storm"]
    one = b6["one_user"]
    return [
        bench_row(
            "B6",
            f"{b6['shims']:,} idle shims + {b6['sessions']:,} idle /ws sessions of {b6['users']} users, one process, "
            f"{b6['client_processes']} client processes; CPU per connection opened",
            dispatch=f"{alive:,}/{wanted:,} alive; {per_connection:.0f} KiB/conn; heartbeat max age "
            f"{b6['heartbeat_max_age_s']:.1f} s; PING gap max {ping_max} s (period {b6['ping_period_s']:g} s); "
            f"idle CPU {b6['idle_cpu_percent']:.0f}%; CPU per /ws session {per_session:g} ms, "
            f"per HELLO {per_hello:g} ms",
            cpu=(b6["cpu_ms_per_connection_opened"], None),
            goal=B6_GOAL,
            passed=alive == wanted and wanted >= 2 * B6_CONNECTIONS and pings_on_time and heartbeat_on_time
            and per_connection <= B6_MAX_KIB and per_session <= B6_MAX_CPU_MS_PER_SESSION
            and per_hello <= B6_MAX_CPU_MS_PER_HELLO and b6["idle_cpu_percent"] <= B6_MAX_IDLE_CPU_PERCENT,
            numbers={"connections_wanted": wanted, "connections_alive": alive, "kib_per_connection": per_connection,
                     "heartbeat_max_age_s": b6["heartbeat_max_age_s"], "ping_gap_max_s": ping_max,
                     "idle_cpu_percent": b6["idle_cpu_percent"], "cpu_ms_per_session_opened": per_session,
                     "cpu_ms_per_shim_opened": per_hello},
        ),
        bench_row(
            "(B6'')",
            f"info: {one['shims']:,} shims of ONE user, {one['batch']} at a time: server CPU ms per HELLO, "
            "first batch -> last",
            dispatch=f"{one['cpu_ms_per_hello'][0]} -> {one['cpu_ms_per_hello'][-1]} ms",
            cpu=(one["cpu_ms_per_hello"][-1], None),
            goal="— (flat if a HELLO's cost did not grow with the user's machines)",
        ),
        bench_row(
            "(B6')",
            f"info: {storm['shims']} shims of one user on '*', one by one: MACHINE_LIST_REQUESTs sent",
            dispatch=f"{storm['machine_list_requests']} ({storm['to_the_first_shim']} to the first shim)",
            goal=f"— (~{storm['shims']} if only newcomers were asked)",
        ),
    ]  # fmt: skip


def _cpu_text(key: str, value: float) -> str:
    return (
        f"{key.removesuffix('_ms_per_op')} {value:.2f} ms/op" if key.endswith("_ms_per_op") else f"{key} {value:.0f}%"
    )


def print_details(report: dict[str, Any], sizes: Sizes) -> None:
    b4, b5, b6 = report["b4"], report["b5"], report["b6"]
    print(
        "B4: Dispatch is driven over HTTP (POST /api/v1/sessions/bench/ops, keep-alive), the bare relay over a "
        "websocket: HTTP is not in the baseline. (B4') is Dispatch's cheapest real HTTP round trip (/healthz: "
        "HTTP, Django, one query, no shim), a floor for any REST operation."
    )
    used = b4["machines_used"]
    print(f"    machines that served: REST {used['dispatch']}, MCP {used['mcp']}, relay {used['relay']}")
    print("    CPU, % of one core, while each was measured (shims listed apart; 'others' is the rest of the machine):")
    for name, cpu in b4["cpu"].items():
        print(f"      {name}: " + ", ".join(_cpu_text(k, v) for k, v in cpu.items()))
    tool = report["b4_tool"]
    print(
        "B4 tool: the local_pc_file_stat handler timed inside the driver process (ms p50/p95/p99 "
        f"{_lat(tool['tool'])}; {_lat(tool['tool_pipe'])} with the bench's pipe to it); on that server "
        f"/healthz {_lat(tool['http_floor'])}, REST {_lat(tool['dispatch'])}, relay {_lat(tool['relay'])}"
    )
    for name, cpu in tool["cpu"].items():
        print(f"      {name}: " + ", ".join(_cpu_text(k, v) for k, v in cpu.items()))
    for name in ("dispatch", "relay"):
        speeds = ", ".join(f"{run['mib_per_second']:.1f}" for run in b5["runs"][name])
        print(f"B5: {name} MiB/s per copy: {speeds}")
    for index, run in enumerate(b5["runs"]["dispatch"]):
        print(
            f"    Dispatch copy {index}: RSS {run['rss_before_mib']:.1f} MiB before, "
            f"{run['rss_peak_mib']:.1f} peak, {run['rss_after_mib']:.1f} after"
        )
    if "failed" in b6:
        print(f"B6: not measured: {b6['failed']}")
        return
    rss = b6["rss_mib"]
    one = b6["one_user"]
    print(
        f"(B6''): {one['shims']:,} shims of one user, {one['batch']} at a time: server CPU ms per HELLO by batch: "
        + ", ".join(f"{value:g}" for value in one["cpu_ms_per_hello"])
    )

    def failed(kind: str) -> str:
        samples = b6[f"{kind}_error_samples"]
        return f"{b6[f'{kind}_errors']} failed" + (": " + "; ".join(samples) if samples else "")

    print(
        f"B6: {b6['client_processes']} client processes; {b6['shims_opened']:,}/{b6['shims']:,} shims opened "
        f"({failed('shim')}) "
        f"in {b6['shims_connect_seconds']} s, {b6['sessions_opened']:,}/{b6['sessions']:,} /ws sessions "
        f"({failed('session')}) "
        f"in {b6['sessions_connect_seconds']} s; server CPU ms per shim opened {b6['cpu_ms_per_shim_opened']}, per "
        f"session {b6['cpu_ms_per_session_opened']}; idle CPU {b6['idle_cpu_percent']}% of a core"
    )
    print(
        f"    RSS {rss['before']:.0f} -> {rss['after_shims']:.0f} (shims) -> {rss['after_sessions']:.0f} (sessions) -> "
        f"{rss['after_idle']:.0f} MiB after {sizes.idle_seconds:g} s idle: "
        f"{b6['kib_per_shim']:.0f} KiB per shim, {b6['kib_per_session']:.0f} KiB per /ws session"
    )
    print(
        f"    process heartbeat every {b6['heartbeat_interval_s']:g} s: max age {b6['heartbeat_max_age_s']} s over "
        f"{b6['heartbeat_samples']} samples; /healthz ms p50/p95/p99 {_lat(b6['healthz_ms'])}"
    )
    print(
        f"    shim PINGs (DISPATCH_SHIM_PING_INTERVAL={b6['ping_period_s']:g}, PONG_TIMEOUT={B6_PONG_TIMEOUT:g}: "
        f"one every {b6['ping_period_s']:g} s): "
        f"{b6['pings']} to {b6['shims_pinged']}/{b6['shims']} shims; "
        f"gap s p50 {b6['ping_gap_s']['p50']}, p99 {b6['ping_gap_s']['p99']}, max {b6['ping_gap_s']['max']}; "
        f"first PING after HELLO_ACK max {b6['first_ping_after_ack_s']['max']} s"
    )
    print(
        f"    /ws sessions answering a ping at the end: {b6['sessions_answered_ping']}/{b6['sessions']} "
        f"(ms p50/p95/p99 {_lat(b6['ws_ping_ms'])}, all sent at once); shims still connected: "
        f"{b6['shims_alive']}/{b6['shims']}"
    )
