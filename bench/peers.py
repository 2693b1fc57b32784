"""Peer benchmarks B7 and B8 (goals: bench/README.md#goals; what they measure: docs/peers.md#shadow-agents,
docs/peers.md#the-outbox).

Usage: ``.venv/bin/python bench/peers.py [--quick]`` (``make bench``).

Three real ``manage.py serve`` processes (SQLite, in-memory channel layer, each with its
own data dir and ``DISPATCH_PUBLIC_URL``), paired with the headless commands as
tests/integration/test_two_instances.py does: B and C each ``peer_offer``, A
``peer_link``s to both. A mirrors B's and C's agents as shadows; A's outbox carries A's
messages to them.

- **B7, mirroring lag**: one expert agent on B is stopped and started through B's REST API
  (``POST /api/v1/agents/{id}/stop|start``), one change at a time, ≥ 200 changes. For each
  change the driver waits for the ``agent.upsert`` of the shadow with the new status on
  **A's** ``GET /api/v1/events`` stream. The lag is measured from just before the REST call
  on B. Baseline (same run, same change): the ``agent.upsert`` of the agent itself on **B's**
  own ``/api/v1/events`` stream, i.e. what a local browser sees; the difference is the
  mirroring hop (B's peer stream → A's subscriber → shadow write → A's events). Target: p95
  ≤ 500 ms.
- **B8, outbox**: messages from A to B's expert agents through A's REST API
  (``POST /api/v1/agents/{shadow id}/messages``: message and outbox row in one transaction,
  the drain doorbell rung after commit), ``POSTERS`` concurrent posters (one per agent on B,
  each sequential, so each has its own order). Phase ``alone``: C is linked but stopped and
  has no mail. Phase ``C down``: the same, 10,000 messages, and now A also has mail for C
  (one message at the start and one every 1,000): A's drain tries C (connection refused)
  and backs it off while B's mail flows. Throughput = messages / (first POST on A → the
  last message's arrival on B, B's ``created_at``). Every phase is checked from both
  databases: B holds exactly one ``AgentMessage`` per message (distinct idempotency keys,
  distinct contents, == sent), B received them in A's outbox order (``created_at``, id),
  each poster's sequence arrived ascending, every row for B is ``delivered``; C's rows are
  still ``queued`` with ``attempts`` ≥ 1. Target: ≥ 100 msgs/s, in order, exactly once, and
  the down peer adds no delay (rate with C down ≥ 90 % of the rate without it).
  Phase ``C unresponsive`` (a B8 row too): C's port accepts TCP connections and never
  answers (a hung host), C's mail is made due now, 1,000 messages go to B as above.
  Baseline (same run): a bare signed POST loop (``httpx`` keep-alive client, the same
  Ed25519 signing, ``peers.auth.sign_request_with_key``, A's key and token) straight to
  B's ``POST /api/v1/peers/messages`` from a child process with A's settings: B's receive
  cost plus signing, with no outbox, no REST enqueue and no drain bookkeeping on A.
- **(B8')** drain alone: rows queued by the service (``peer_message_send``) in a child process
  with A's settings, then drained by ``outbox_drain_peer`` passes back to back in a child (no
  REST load); every step of a row is timed (the profile printed under the table).
- **(B8'')** backlog: rows queued by the service (A's server is not rung), then one message
  through A's REST API rings the doorbell once; what arrives on B within the window, in bursts.

This file pairs the instances, runs the phases and writes the report, and is the entry
point of the child modes they start (peers_children.py); the phases are peers_b7.py and
peers_b8.py, the rows peers_table.py, what they share peers_common.py
(bench/README.md#peers-peerspy-b7-b8).

Prints a table and writes bench/results/peers.json. Bounded (aborts itself after
HARD_LIMIT seconds) and stops every process it started.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

from common import finish_report, print_table  # noqa: E402
from peers_b7 import run_b7  # noqa: E402
from peers_b8 import run_b8  # noqa: E402
from peers_children import (  # noqa: E402
    discard_queued,
    drain,
    due_now,
    dump_outbox,
    dump_received,
    enqueue,
    signed_loop,
)
from peers_common import SERVER_ENV, Sizes, three_instances  # noqa: E402
from peers_table import print_details, rows  # noqa: E402

RESULTS = BENCH / "results" / "peers.json"
HARD_LIMIT = 2400  # seconds


# --- the run ---------------------------------------------------------------------------------------


async def run(sizes: Sizes) -> dict[str, Any]:
    report: dict[str, Any] = {"notes": []}
    with three_instances() as peers:
        print(f"· B7: {sizes.changes} status changes of an agent on B, watched on A and on B…", flush=True)
        report["b7"] = await run_b7(peers, sizes)
        report["b8"] = await run_b8(peers, sizes)
    return report


def main(argv: list[str]) -> int:
    children = {"signed-loop", "dump-received", "dump-outbox", "enqueue", "drain", "due-now", "discard-queued"}
    if argv[:1] and argv[0] in children:
        parser = argparse.ArgumentParser(description="a child step of the peers benchmark")
        parser.add_argument("kind", choices=sorted(children))
        parser.add_argument("--out", type=Path, required=True)
        parser.add_argument("--prefix", default="")
        parser.add_argument("--label", default="")
        parser.add_argument("--agent", default="")
        parser.add_argument("--count", type=int, default=0)
        parser.add_argument("--holder", default="")
        options = parser.parse_args(argv)
        if options.kind == "signed-loop":
            signed_loop(options.out, label=options.label, agent_id=options.agent, count=options.count,
                        prefix=options.prefix)  # fmt: skip
        elif options.kind == "enqueue":
            enqueue(options.out, label=options.label, agent_id=options.agent, count=options.count,
                    prefix=options.prefix, holder=options.holder)  # fmt: skip
        elif options.kind == "drain":
            drain(options.out, label=options.label, holder=options.holder)
        elif options.kind == "discard-queued":
            discard_queued(options.out, label=options.label)
        elif options.kind == "due-now":
            due_now(options.out, label=options.label)
        elif options.kind == "dump-received":
            dump_received(options.out, prefix=options.prefix)
        else:
            dump_outbox(options.out, prefix=options.prefix)
        return 0
    parser = argparse.ArgumentParser(description="Peer benchmarks B7 (mirroring lag) and B8 (outbox).")
    parser.add_argument("--quick", action="store_true", help="a short run (200 changes, 1,000 messages)")
    parser.add_argument("--changes", type=int, help="B7 status changes (default 200; at least 200 for the target)")
    parser.add_argument("--messages", type=int, help="B8 messages with C down (default 5,000; the goal's: 10,000)")
    parser.add_argument("--alone-messages", type=int, help="B8 messages without mail for C (default 1,000)")
    parser.add_argument("--baseline-messages", type=int, help="B8 bare signed POSTs (default 500)")
    parser.add_argument("--drain-messages", type=int, help="(B8') rows drained alone (default 500)")
    parser.add_argument("--hole-messages", type=int, help="B8 messages with C unresponsive (default 500)")
    parser.add_argument("--backlog-messages", type=int, help="(B8'') rows in the backlog (default 500)")
    parser.add_argument(
        "--post-seconds", type=float, help="B8 C down: stop posting after this many seconds (default 150; quick: none)"
    )
    parser.add_argument("--backlog-window", type=float, help="(B8'') seconds to watch the backlog (default 30)")
    parser.add_argument(
        "--drain-wait", type=float, help="seconds to wait for delivery after a phase's last POST (default 45)"
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument(
        "--output", type=Path, default=RESULTS, help=f"JSON results (default {RESULTS.relative_to(REPO)})"
    )
    options = parser.parse_args(argv)
    sizes = (
        Sizes(
            warmup_changes=10,
            changes=200,
            baseline_messages=300,
            alone_messages=500,
            messages=1000,
            drain_messages=300,
            hole_messages=300,
            backlog_messages=300,
            backlog_window=40,
            drain_wait=60,
        )
        if options.quick
        else Sizes(  # cut to fit a full `make bench` in 15 minutes (bench/README.md#how-long)
            warmup_changes=20,
            changes=200,
            baseline_messages=500,
            alone_messages=1000,
            messages=5_000,
            drain_messages=500,
            hole_messages=500,
            backlog_messages=500,
            backlog_window=30,
            drain_wait=45,
            post_seconds=150,
        )
    )
    if options.changes:
        sizes.changes = options.changes
    if options.messages:
        sizes.messages = options.messages
        sizes.alone_messages = min(sizes.alone_messages, options.messages)
    for name in (
        "alone_messages",
        "baseline_messages",
        "drain_messages",
        "hole_messages",
        "backlog_messages",
        "backlog_window",
        "drain_wait",
        "post_seconds",
    ):
        if getattr(options, name):
            setattr(sizes, name, getattr(options, name))

    def abort(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    def too_long(signum: int, frame: Any) -> None:
        raise TimeoutError(f"benchmark exceeded {HARD_LIMIT} s; aborted")

    from remote_calls import machine

    signal.signal(signal.SIGTERM, abort)
    signal.signal(signal.SIGALRM, too_long)
    signal.alarm(HARD_LIMIT)
    info = machine()
    started = time.monotonic()
    print(
        f"Peer benchmarks B7, B8 ({'quick' if options.quick else 'full'} run) on {info['cpus']} CPU(s), "
        f"{info['cpu_model']}.",
        flush=True,
    )
    try:
        report = asyncio.run(run(sizes))
    except (KeyboardInterrupt, TimeoutError) as exc:
        print(f"aborted ({exc}); every process it started has been stopped", file=sys.stderr)
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        signal.alarm(0)
    report["when_started"] = datetime.now().isoformat(timespec="seconds")
    table = rows(report)
    print()
    print_table(table)
    print()
    print_details(report)
    for phase in report["b8"]["phases"]:
        if not phase["checks"]["ok"]:
            report["notes"].append(f"B8 {phase['name']}: a correctness check failed: {phase['checks']}")
        if not phase["checks"]["complete"]:
            report["notes"].append(
                f"B8 {phase['name']}: {phase['delivered']:,} of {phase['messages']:,} arrived within "
                f"{sizes.drain_wait:g} s of the last POST; the rest was still queued on A"
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
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
