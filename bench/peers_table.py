"""The rows (common.bench_row) and the printed details of bench/peers.py's report."""

from __future__ import annotations

from typing import Any

from common import bench_row
from peers_common import (
    B7_MAX_P95_MS,
    B7_MAX_RATIO,
    B8_MIN_BARE_RATIO,
    B8_MIN_ENQUEUE_RATIO,
    B8_MIN_RATE,
    B8_NO_DELAY_RATIO,
    POSTERS,
)


def _lat(summary: dict[str, float]) -> str:
    return f"{summary['p50_ms']:.1f} / {summary['p95_ms']:.1f} / {summary['p99_ms']:.1f}"


def rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The B7 and B8 rows (common.bench_row), goals from bench/README.md#goals. CPU: A's and B's ms per
    change (B7) or per message delivered (B8); the bare loop's is B's alone (it has no A)."""
    b7 = report["b7"]
    mirror, local = b7["mirror"], b7["local"]
    ratio7 = mirror["p95_ms"] / local["p95_ms"]
    table = [
        bench_row(
            "B7",
            f"mirroring lag: status change on B (REST) → shadow's agent.upsert on A's /api/v1/events, "
            f"{b7['changes']} changes (ms p50/p95/p99)",
            dispatch=_lat(mirror),
            baseline=_lat(local) + " (B's own stream)",
            ratio=f"{ratio7:.1f}x (p95)",
            cpu=(b7.get("cpu_ms_per_change"), None),
            goal=f"p95 <= {B7_MAX_RATIO:g}x B's own stream (and <= {B7_MAX_P95_MS:g} ms)",
            passed=ratio7 <= B7_MAX_RATIO and mirror["p95_ms"] <= B7_MAX_P95_MS,
            numbers={"dispatch_p95_ms": mirror["p95_ms"], "baseline_p95_ms": local["p95_ms"], "ratio": ratio7},
        )
    ]
    b8 = report["b8"]
    bare = b8["baseline"]["rate"]
    bare_cpu = b8["baseline"].get("cpu_ms_per_message")
    bare_text = f"{bare:,.1f} msgs/s (bare signed POST loop)"
    alone = b8["phases"][0]
    for phase in b8["phases"]:
        checks = phase["checks"]
        ok = checks["ok"]
        name = phase["name"]
        situation = {
            "alone": "C linked, stopped, no mail for it",
            "C down": f"C stopped (connection refused), {phase['c_mail_sent']} queued for it",
            "C unresponsive": f"C unresponsive (accepts TCP, never answers), {phase['c_mail_sent']} queued for it",
        }[name]
        no_delay = phase["rate"] >= B8_NO_DELAY_RATIO * alone["rate"]
        if name == "alone":
            goal, passed = "— (once, in order)", None if ok else False
        elif name == "C down":
            floor = max(B8_MIN_RATE, B8_MIN_BARE_RATIO * bare)
            goal = (
                f">= {B8_MIN_BARE_RATIO:g}x bare and >= {B8_MIN_RATE:g}/s (= {floor:,.0f}/s); once, in order; "
                "C adds no delay"
            )
            passed = ok and checks["complete"] and phase["rate"] >= floor and no_delay
        else:
            goal = f"once, in order; C adds no delay (>= {B8_NO_DELAY_RATIO:.0%} of the rate without C)"
            passed = ok and checks["complete"] and no_delay
        table.append(
            bench_row(
                "(B8')" if name == "alone" else "B8",
                f"outbox: {phase['messages']:,} messages A → B's agents (REST enqueue, {POSTERS} posters), "
                + situation,
                dispatch=(
                    "" if phase.get("planned", phase["messages"]) == phase["messages"]
                    else f"posting stopped at {phase['messages']:,} of {phase['planned']:,}; "
                )
                + (
                    "" if checks["complete"] else f"only {phase['delivered']:,} arrived in {phase['seconds']:.0f} s: "
                )
                + f"{phase['rate']:,.1f} msgs/s (max gap {phase['max_gap_ms'] / 1000:.1f} s); once "
                f"{checks['exactly_once']}, in order {checks['in_outbox_order'] and checks['posters_ascending']}",
                baseline=bare_text,
                ratio=f"{phase['rate'] / bare:.2f}x",
                cpu=(phase.get("cpu_ms_per_message"), bare_cpu),
                goal=goal,
                passed=passed,
                numbers={"dispatch_msgs_per_s": phase["rate"], "baseline_msgs_per_s": bare,
                         "ratio": phase["rate"] / bare, "delivered": phase["delivered"], "ok": ok},
            )
        )  # fmt: skip
    healthz = b8.get("healthz")
    down = next((phase for phase in b8["phases"] if phase["name"] == "C down"), None)
    if healthz and down:
        share = down["enqueue_rate"] / healthz["rate"]
        table.append(
            bench_row(
                "B8",
                f"REST enqueue alone: POST /api/v1/agents/{{shadow}}/messages on A during the C-down phase, "
                f"{POSTERS} posters (msgs/s)",
                dispatch=f"{down['enqueue_rate']:,.1f}/s",
                baseline=f"{healthz['rate']:,.1f}/s (GET /healthz, same posters)",
                ratio=f"{share:.2f}x",
                goal=f">= {B8_MIN_ENQUEUE_RATIO:g}x the /healthz rate",
                passed=share >= B8_MIN_ENQUEUE_RATIO,
                numbers={"dispatch_per_s": down["enqueue_rate"], "baseline_per_s": healthz["rate"], "ratio": share},
            )
        )
    drained = b8["drain"]
    table.append(
        bench_row(
            "(B8')",
            f"info: outbox drain alone: {drained['delivered']:,} rows queued by the service, "
            "outbox_drain_peer passes back to back in one process (no REST load)",
            dispatch=f"{drained['rate']:,.1f} msgs/s; once {drained['checks']['exactly_once']}, in order "
            f"{drained['checks']['in_outbox_order']}",
            baseline=bare_text,
            ratio=f"{drained['rate'] / bare:.2f}x",
            passed=None if drained["checks"]["ok"] else False,
        )
    )
    backlog = b8["backlog"]
    table.append(
        bench_row(
            "(B8'')",
            f"info: a backlog of {backlog['queued']:,} rows in A's own drain loop after one doorbell ring, "
            f"{backlog['window_seconds']:g} s window",
            dispatch=f"{backlog['delivered']:,} delivered ({backlog['rate']:.1f} msgs/s) in "
            f"{len(backlog['bursts'])} burst(s): "
            + ", ".join(f"{b['messages']} at {b['from_s']:.1f}-{b['to_s']:.1f} s" for b in backlog["bursts"]),
            goal="— (all within the window)",
            passed=None if backlog["duplicates"] == 0 else False,
        )
    )
    return table


def print_details(report: dict[str, Any]) -> None:
    b7 = report["b7"]
    print(
        f"B7: REST stop/start on B {_lat(b7['rest_on_b'])} ms; upserts seen A {b7['upserts_seen']['A']}, "
        f"B {b7['upserts_seen']['B']}; CPU % of one core: " + ", ".join(f"{k} {v:.0f}%" for k, v in b7["cpu"].items())
    )
    b8 = report["b8"]
    print(
        f"B8 baseline: {b8['baseline']['count']} signed POSTs in {b8['baseline']['seconds']:.2f} s, "
        f"statuses {b8['baseline']['statuses']}"
    )
    for phase in b8["phases"]:
        print(
            f"B8 {phase['name']}: {phase['messages']:,} in {phase['seconds']} s (first POST on A → last arrival on B); "
            f"enqueue alone {phase['enqueue_rate']:.1f}/s; arrival gaps p99 {phase['p99_gap_ms']} ms, "
            f"max {phase['max_gap_ms']} ms; CPU % of one core: "
            + ", ".join(f"{k} {v:.0f}%" for k, v in phase["cpu"].items())
        )
        print(f"    checks: {phase['checks']}")
    drained = b8["drain"]
    print(
        f"B8 drain alone: {drained['delivered']:,} delivered in {drained['seconds']:.2f} s over {drained['passes']} "
        f"passes (skipped {drained['skipped']}); enqueue by the service "
        f"{drained['enqueue']['count'] / drained['enqueue']['seconds']:.0f}/s; "
        "time per delivered row by step (ms):"
    )
    for name, step in sorted(drained["steps"].items(), key=lambda item: -item[1]["seconds"]):
        per_row = 1000 * step["seconds"] / max(1, drained["delivered"])
        print(f"      {name}: {step['calls']} calls, {per_row:.2f} ms per row")
    print(f"    checks: {drained['checks']}")
    print(f"B8 backlog: {b8['backlog']}")
    healthz = b8["healthz"]
    for phase in b8["phases"]:
        print(
            f"B8 REST enqueue ({phase['name']}) {phase['enqueue_rate']:.1f}/s vs GET /healthz {healthz['rate']:.1f}/s "
            f"with the same {POSTERS} posters: {phase['enqueue_rate'] / healthz['rate']:.2f}x (goal: >= 0.5x)"
        )
