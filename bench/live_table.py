"""The rows (common.bench_row) of bench/live.py's report."""

from __future__ import annotations

from typing import Any

from common import bench_row, percentile
from live_common import B10_MAX_P95_MS, B11_MAX_GROWTH_MIB, B11_MIN_SHARE, B12_MAX_RATIO

# --- the table ------------------------------------------------------------------------------


def _lat(summary: dict[str, float]) -> str:
    return f"{summary['p50_ms']:.1f} / {summary['p95_ms']:.1f} / {summary['p99_ms']:.1f}"


def _skip(row_id: str, what: str, why: str, goal: str, baseline: str = "—") -> dict[str, Any]:
    return bench_row(
        row_id,
        what,
        dispatch=f"SKIP: {why if len(why) <= 120 else why[:117] + '...'}",
        baseline=baseline,
        goal=goal,
        why=why,
        skipped=True,
    )


def rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The B10–B12 rows (common.bench_row); CPU is the server's (the relay's) ms per sample."""
    table: list[dict[str, Any]] = []
    b10, b11, b12 = report["b10"], report["b11"], report["b12"]
    target10 = f"p95 <= {B10_MAX_P95_MS:g} ms"
    relay = b10.get("relay")
    relay_text = f"{_lat(relay['first_output'])} (bare relay)" if relay else "SKIP (see notes)"
    for name, label in (("rest", "REST (SSE output event)"), ("mcp", "MCP (notifications/progress)")):
        what = f"first output byte of a streamed command via {label}, then cancel (ms p50/p95/p99)"
        if name in b10["skipped"]:
            table.append(_skip("B10", what, b10["skipped"][name], target10, relay_text if relay else "—"))
            continue
        first = b10[name]["first_output"]
        table.append(
            bench_row(
                "B10",
                what,
                dispatch=_lat(first),
                baseline=relay_text,
                ratio=f"{first['p95_ms'] / relay['first_output']['p95_ms']:.1f}x (p95)" if relay else "—",
                cpu=(b10[name].get("cpu_ms_per_sample"), relay.get("cpu_ms_per_sample") if relay else None),
                goal=target10,
                passed=first["p95_ms"] <= B10_MAX_P95_MS,
                numbers={"dispatch_p95_ms": first["p95_ms"],
                         "baseline_p95_ms": relay["first_output"]["p95_ms"] if relay else None},
            )
        )  # fmt: skip
    measured = [name for name in ("relay", "rest", "mcp") if name in b10]
    if measured:
        table.append(
            bench_row(
                "(B10')",
                "info: cancel sent -> the operation's end received (ms p50/p95), " + ", ".join(measured),
                dispatch="; ".join(
                    f"{name} {b10[name]['cancel_to_end']['p50_ms']:.1f} / {b10[name]['cancel_to_end']['p95_ms']:.1f}"
                    for name in measured
                ),
            )
        )
    what11 = f"pipe of {b11['mib']} MiB: head -c on src -> sha256sum on dst (MiB/s median); server RSS growth"
    target11 = f">= {B11_MIN_SHARE:.0%} of the copy; growth <= {B11_MAX_GROWTH_MIB:g} MiB; hash correct"
    cpu11 = b11.get("cpu_ms_per_mib", {})
    if "skipped" in b11:
        table.append(_skip("B11", what11, b11["skipped"], target11, f"copy {b11['copy_mib_per_second']:.1f} MiB/s"))
    else:
        share = b11["pipe_mib_per_second"] / b11["copy_mib_per_second"]
        growth = b11["rss_growth_peak_mib"]
        table.append(
            bench_row(
                "B11",
                what11 + "; CPU per MiB",
                dispatch=f"{b11['pipe_mib_per_second']:.1f} MiB/s, RSS +{growth:.1f} MiB (peak), "
                f"hash {'correct' if b11['hash_ok'] else 'WRONG'}",
                baseline=f"{b11['copy_mib_per_second']:.1f} MiB/s (Dispatch's copy)",
                ratio=f"{share:.0%}",
                cpu=(cpu11.get("pipe"), cpu11.get("copy")),
                goal=target11,
                passed=share >= B11_MIN_SHARE and growth <= B11_MAX_GROWTH_MIB and b11["hash_ok"] and b11["bytes_ok"],
                numbers={"dispatch_mib_per_s": b11["pipe_mib_per_second"],
                         "baseline_mib_per_s": b11["copy_mib_per_second"], "ratio": share, "rss_growth_mib": growth},
            )
        )  # fmt: skip
    what12 = f"fan-out of `sleep 1` to {report['sizes_fanout']} in-process shims (s, median)"
    target12 = f"<= {B12_MAX_RATIO:g}x one machine's"
    if "skipped" in b12:
        one = percentile(sorted(b12["one"]), 0.5)
        table.append(_skip("B12", what12, b12["skipped"], target12, f"{one:.3f} s (one machine)"))
    else:
        ratio = b12["many_s"] / b12["one_s"]
        cpu12 = b12.get("cpu_ms_per_op", {})
        table.append(
            bench_row(
                "B12",
                what12 + "; CPU per fan-out",
                dispatch=f"{b12['many_s']:.3f} s; overhead time({b12['machines']}) - time(1) = "
                f"{b12['overhead_s'] * 1000:.0f} ms",
                baseline=f"{b12['one_s']:.3f} s (one machine)",
                ratio=f"{ratio:.2f}x",
                cpu=(cpu12.get("many"), cpu12.get("one")),
                goal=target12,
                passed=ratio <= B12_MAX_RATIO,
                numbers={"dispatch_s": b12["many_s"], "baseline_s": b12["one_s"], "ratio": ratio},
            )
        )
    return table
