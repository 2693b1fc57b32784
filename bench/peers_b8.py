"""B8 of bench/peers.py: the outbox from A to B with C stopped or unresponsive, beside a
bare signed POST loop; the drain alone (B8') and a backlog (B8''), every phase checked
from both databases.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from common import CpuMeter, CpuPerOp
from peers_common import C_MAIL_EVERY, DRAIN_HOLDER, POSTERS, Peers, Rest, Sizes, create_experts, run_child, shadows_of

# --- B8 ------------------------------------------------------------------------------------------


@dataclass
class Phase:
    name: str
    prefix: str
    messages: int
    c_mail: bool
    last_ids: list[int] = field(default_factory=list)
    c_sent: int = 0
    started_wall: float = 0.0
    ended_wall: float = 0.0
    complete: bool = True
    enqueue_seconds: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)
    cpu_seconds: float = 0.0  # A's and B's, over the phase
    post_seconds: float | None = None  # posting stops then (``messages`` becomes what was posted)
    planned: int = 0  # the messages meant, when posting was stopped early


async def post_phase(peers: Peers, phase: Phase, shadows_b: list[str], shadow_c: str | None, *, wait: float) -> None:
    """Post ``phase.messages`` messages to B's shadows (``POSTERS`` concurrent posters, each
    sequential on its own shadow), plus C's mail when ``phase.c_mail``; wait until each
    poster's last message is ``delivered`` on A, at most ``wait`` seconds after the last
    POST (then ``phase.complete`` is False and the phase is measured as it stands). With
    ``phase.post_seconds`` the posters stop then, and ``phase.messages`` becomes what they
    posted (the whole run must fit its time budget on a slow day)."""
    rest = Rest(peers.server_a.url, peers.a.admin_token)
    try:
        share = [phase.messages // len(shadows_b) + (1 if i < phase.messages % len(shadows_b) else 0)
                 for i in range(len(shadows_b))]  # fmt: skip
        last: list[int] = [0] * len(shadows_b)
        posted: list[int] = [0] * len(shadows_b)
        stop_at = time.monotonic() + phase.post_seconds if phase.post_seconds else float("inf")

        async def mail_for_c() -> None:
            assert shadow_c is not None
            phase.c_sent += 1
            body = {"content": f"{phase.prefix}c-{phase.c_sent:05d}"}
            await rest.call("POST", f"/api/v1/agents/{shadow_c}/messages", body, ok=201)

        async def poster(index: int) -> None:
            for seq in range(share[index]):
                if time.monotonic() >= stop_at:
                    break
                if phase.c_mail and index == 0 and seq % max(1, C_MAIL_EVERY // len(shadows_b)) == 0:
                    await mail_for_c()
                body = {"content": f"{phase.prefix}{index}-{seq:05d}"}
                answer = await rest.call("POST", f"/api/v1/agents/{shadows_b[index]}/messages", body, ok=201)
                last[index] = answer["id"]
                posted[index] += 1

        with CpuMeter({"A": peers.server_a.pid, "B": peers.server_b.pid}) as meter:
            phase.started_wall = time.time()
            began = time.perf_counter()
            await asyncio.gather(*(poster(index) for index in range(len(shadows_b))))
            phase.enqueue_seconds = time.perf_counter() - began
            if sum(posted) < phase.messages:
                phase.planned, phase.messages = phase.messages, sum(posted)
            phase.last_ids = last
            deadline = time.monotonic() + wait
            pending = [message_id for message_id in last if message_id]
            while pending:
                answer = await rest.call("GET", f"/api/v1/messages/{pending[0]}")
                if answer["status"] == "delivered":
                    pending.pop(0)
                    continue
                if answer["status"] != "queued":
                    raise RuntimeError(f"message {pending[0]} is {answer['status']}: {answer.get('error')}")
                if time.monotonic() > deadline:
                    break  # measured as is: what arrived by now (check_phase counts it)
                await asyncio.sleep(0.05)
            phase.complete = not pending
            phase.ended_wall = time.time()
        phase.cpu = meter.percent
        phase.cpu_seconds = meter.cpu_seconds(["A", "B"])
    finally:
        await rest.close()


def check_phase(peers: Peers, phase: Phase) -> dict[str, Any]:
    """Exactly once, in order, all delivered; throughput from B's arrival times."""
    # A first, then B: a row A marked delivered has reached B already (the drain may still be
    # running when a phase was cut short, so B can hold a row A has not marked yet).
    outbox = run_child(peers.a.env, "dump-outbox", "--prefix", phase.prefix)
    received = run_child(peers.b.env, "dump-received", "--prefix", phase.prefix)
    to_b = [row for row in outbox if row[0] == "Bee"]
    to_c = [row for row in outbox if row[0] == "Cee"]
    keys = [row[1] for row in received]
    contents = [row[2] for row in received]
    order = {row[1]: position for position, row in enumerate(to_b)}
    positions = [order.get(key, -1) for key in keys]
    # In order: B received exactly the first len(received) of A's rows for it, in A's order.
    in_outbox_order = positions == list(range(len(positions)))
    per_poster: dict[str, list[int]] = {}
    for content in contents:
        poster, seq = content[len(phase.prefix) :].split("-")
        per_poster.setdefault(poster, []).append(int(seq))
    posters_ascending = all(seqs == sorted(seqs) for seqs in per_poster.values())
    arrivals = [row[3] for row in received]
    complete = len(received) == phase.messages
    end = max(arrivals) if complete else phase.ended_wall
    seconds = end - phase.started_wall
    gaps = sorted(y - x for x, y in itertools.pairwise(arrivals))
    checks: dict[str, Any] = {
        "received": len(received),
        "distinct_keys": len(set(keys)),
        "distinct_contents": len(set(contents)),
        "duplicates": len(received) - len(set(keys)),
        "complete": complete,
        "exactly_once": len(received) == len(set(keys)) == len(set(contents))
        and {row[1] for row in to_b if row[3] == "delivered"} <= set(keys)
        and (not complete or len(received) == phase.messages),
        "keys_match_outbox": set(keys) <= {row[1] for row in to_b},
        "in_outbox_order": in_outbox_order,
        "posters_ascending": posters_ascending,
        "outbox_rows_for_b": len(to_b),
        "b_rows_delivered": sum(1 for row in to_b if row[3] == "delivered"),
        "b_rows_retried": sum(1 for row in to_b if row[4] > 0),
        "c_rows": len(to_c),
        "c_rows_queued": sum(1 for row in to_c if row[3] == "queued"),
        "c_rows_queued_and_tried": sum(1 for row in to_c if row[3] == "queued" and row[4] >= 1),
        "c_first_attempts": max((row[4] for row in to_c), default=0),
        "c_last_error": to_c[0][5] if to_c else "",
    }
    checks["ok"] = (
        checks["exactly_once"]
        and checks["keys_match_outbox"]
        and in_outbox_order
        and posters_ascending
        and checks["b_rows_delivered"] <= len(received)
        and (not complete or checks["b_rows_delivered"] == phase.messages)
        and checks["c_rows"] == phase.c_sent == checks["c_rows_queued"]
    )
    return {
        "name": phase.name,
        "messages": phase.messages,
        "planned": phase.planned or phase.messages,
        "c_mail_sent": phase.c_sent,
        "seconds": round(seconds, 3),
        "rate": len(received) / seconds if seconds > 0 else 0.0,
        "delivered": len(received),
        "enqueue_seconds": round(phase.enqueue_seconds, 3),
        "enqueue_rate": phase.messages / phase.enqueue_seconds if phase.enqueue_seconds else float("nan"),
        "arrival_span_seconds": round(max(arrivals) - min(arrivals), 3) if arrivals else None,
        "max_gap_ms": round(gaps[-1] * 1000, 1) if gaps else 0.0,
        "p99_gap_ms": round(gaps[int(len(gaps) * 0.99)] * 1000, 1) if gaps else None,
        "checks": checks,
        "cpu": phase.cpu,
        "cpu_ms_per_message": round(1000 * phase.cpu_seconds / len(received), 3) if received else None,
    }


async def healthz_rate(url: str, token: str, count: int) -> dict[str, Any]:
    """The REST floor for B8's enqueue goal (REST enqueue >= 0.5x the /healthz rate with the
    same posters, bench/README.md#goals): ``count`` ``GET /healthz`` on A from ``POSTERS`` concurrent
    sequential clients, as the phases' posters send their messages. ``{count, seconds, rate}``."""
    rest = Rest(url, token)
    try:
        share = [count // POSTERS + (1 if i < count % POSTERS else 0) for i in range(POSTERS)]

        async def poster(n: int) -> None:
            for _ in range(n):
                await rest.call("GET", "/healthz")

        began = time.perf_counter()
        await asyncio.gather(*(poster(n) for n in share))
        seconds = time.perf_counter() - began
    finally:
        await rest.close()
    return {"count": count, "seconds": seconds, "rate": count / seconds}


async def run_b8(peers: Peers, sizes: Sizes) -> dict[str, Any]:
    rest_a = Rest(peers.server_a.url, peers.a.admin_token)
    rest_b = Rest(peers.server_b.url, peers.b.admin_token)
    rest_c = Rest(peers.server_c.url, peers.c.admin_token)
    try:
        remotes_b = await create_experts(rest_b, [f"b8-{index}" for index in range(POSTERS)])
        (remote_c,) = await create_experts(rest_c, ["b8-c"])
        shadows_b = await shadows_of(rest_a, remotes_b)
        (shadow_c,) = await shadows_of(rest_a, [remote_c])
    finally:
        await rest_a.close()
        await rest_b.close()
        await rest_c.close()
    peers.server_c.stop()  # C is down from here on: linked, its shadow on A, its port closed
    print("· B8 baseline: bare signed POST loop to B's /api/v1/peers/messages…", flush=True)
    with CpuMeter({"B": peers.server_b.pid}) as meter:
        baseline = await asyncio.to_thread(
            run_child,
            peers.a.env,
            "signed-loop",
            "--label", "Bee", "--agent", remotes_b[0], "--count", str(sizes.baseline_messages), "--prefix", "b8-bare-",
        )  # fmt: skip
    baseline["cpu_ms_per_message"] = CpuPerOp().add(meter, baseline["count"], ["B"]).ms
    print(f"· B8 drain alone: {sizes.drain_messages:,} rows queued by the service, drained by "
          "outbox_drain_peer passes in a child process…", flush=True)  # fmt: skip
    queued = await asyncio.to_thread(
        run_child, peers.a.env, "enqueue",
        "--label", "Bee", "--agent", remotes_b[1], "--count", str(sizes.drain_messages), "--prefix", "b8-drain-",
        "--holder", DRAIN_HOLDER,
    )  # fmt: skip
    drained = await asyncio.to_thread(run_child, peers.a.env, "drain", "--label", "Bee", "--holder", DRAIN_HOLDER)
    drain_phase = Phase(name="drain alone", prefix="b8-drain-", messages=sizes.drain_messages, c_mail=False)
    drain_phase.started_wall = time.time() - drained["seconds"]
    drain_check = await asyncio.to_thread(check_phase, peers, drain_phase)
    print(f"· B8 REST floor: {sizes.alone_messages:,} GET /healthz on A, {POSTERS} posters…", flush=True)
    healthz = await healthz_rate(peers.server_a.url, peers.a.admin_token, sizes.alone_messages)
    phases = []
    for phase in (
        Phase(name="alone", prefix="b8-alone-", messages=sizes.alone_messages, c_mail=False),
        Phase(name="C down", prefix="b8-down-", messages=sizes.messages, c_mail=True, post_seconds=sizes.post_seconds),
    ):
        print(f"· B8 {phase.name}: {phase.messages:,} messages from A to B's agents…", flush=True)
        await post_phase(peers, phase, shadows_b, shadow_c, wait=sizes.drain_wait)
        phases.append(await asyncio.to_thread(check_phase, peers, phase))
        leftover = await asyncio.to_thread(run_child, peers.a.env, "discard-queued", "--label", "Bee")
        phases[-1]["discarded_after"] = leftover["discarded"]
        print(f"  {phases[-1]['rate']:.1f} msgs/s; checks ok: {phases[-1]['checks']['ok']}", flush=True)
    phases.append(await run_unresponsive(peers, sizes, shadows_b, shadow_c))
    leftover = await asyncio.to_thread(run_child, peers.a.env, "discard-queued", "--label", "Bee")
    phases[-1]["discarded_after"] = leftover["discarded"]
    backlog = await run_backlog(peers, sizes, remotes_b[2], shadows_b[2])
    return {
        "baseline": {**baseline, "rate": baseline["count"] / baseline["seconds"]},
        "phases": phases,
        "drain": {
            **drained,
            "enqueue": queued,
            "rate": drained["delivered"] / drained["seconds"],
            "checks": drain_check["checks"],
        },
        "backlog": backlog,
        "healthz": healthz,
    }


async def run_unresponsive(peers: Peers, sizes: Sizes, shadows_b: list[str], shadow_c: str) -> dict[str, Any]:
    """B8 with C unresponsive instead of stopped: C's port accepts TCP connections (a
    listening socket that never answers, as a host that hangs), C's queued mail is made due
    now, and ``sizes.hole_messages`` messages go to B as in the other phases (with mail for
    C at the start and every ``C_MAIL_EVERY``)."""
    hole = socket.socket()
    hole.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    hole.bind(("127.0.0.1", peers.server_c.port))
    hole.listen(4096)
    try:
        await asyncio.to_thread(run_child, peers.a.env, "due-now", "--label", "Cee")
        phase = Phase(name="C unresponsive", prefix="b8-hole-", messages=sizes.hole_messages, c_mail=True)
        print(f"· B8 {phase.name}: {phase.messages:,} messages from A to B's agents…", flush=True)
        await post_phase(peers, phase, shadows_b, shadow_c, wait=sizes.drain_wait)
        checked = await asyncio.to_thread(check_phase, peers, phase)
        print(f"  {checked['rate']:.1f} msgs/s; checks ok: {checked['checks']['ok']}", flush=True)
        return checked
    finally:
        hole.close()


async def run_backlog(peers: Peers, sizes: Sizes, remote: str, shadow: str) -> dict[str, Any]:
    """(B8'') A backlog in A's own drain loop: ``sizes.backlog_messages`` rows queued by the
    service in a child process (A's server is not rung), then one message through A's REST
    API rings the doorbell once; after ``sizes.backlog_window`` seconds, how many arrived on
    B and in which bursts (arrivals more than 5 s apart start a new burst)."""
    print(f"· B8 backlog: {sizes.backlog_messages:,} rows queued, one ring, {sizes.backlog_window:g} s "
          "window…", flush=True)  # fmt: skip
    await asyncio.to_thread(
        run_child, peers.a.env, "enqueue",
        "--label", "Bee", "--agent", remote, "--count", str(sizes.backlog_messages), "--prefix", "b8-backlog-",
    )  # fmt: skip
    rest = Rest(peers.server_a.url, peers.a.admin_token)
    try:
        rung = time.time()
        await rest.call("POST", f"/api/v1/agents/{shadow}/messages", {"content": "b8-backlog-1-00000"}, ok=201)
    finally:
        await rest.close()
    await asyncio.sleep(sizes.backlog_window)
    received = await asyncio.to_thread(run_child, peers.b.env, "dump-received", "--prefix", "b8-backlog-")
    arrivals = sorted(row[3] - rung for row in received)
    bursts: list[list[float]] = []
    for at in arrivals:
        if bursts and at - bursts[-1][1] <= 5:
            bursts[-1][1] = at
            bursts[-1][2] += 1
        else:
            bursts.append([at, at, 1])
    total = sizes.backlog_messages + 1
    return {
        "queued": total,
        "window_seconds": sizes.backlog_window,
        "delivered": len(received),
        "duplicates": len(received) - len({row[1] for row in received}),
        "rate": len(received) / sizes.backlog_window,
        "bursts": [{"from_s": round(a, 2), "to_s": round(b, 2), "messages": int(n)} for a, b, n in bursts],
    }
