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

Prints a table and writes bench/results/peers.json. Bounded (aborts itself after
HARD_LIMIT seconds) and stops every process it started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

from common import CpuMeter, CpuPerOp, bench_row, finish_report, latency_summary, print_table  # noqa: E402

RESULTS = BENCH / "results" / "peers.json"
HARD_LIMIT = 2400  # seconds
B7_MAX_P95_MS = 500.0
B7_MAX_RATIO = 2.0  # mirror lag p95 <= 2x B's own stream
B8_MIN_RATE = 150.0  # messages per second (the floor: 100)
B8_MIN_BARE_RATIO = 2.0  # >= 2x the bare one-POST-per-message loop
B8_MIN_ENQUEUE_RATIO = 0.5  # REST enqueue >= 0.5x the /healthz rate, same posters
B8_NO_DELAY_RATIO = 0.9  # rate with C down / rate without C
POSTERS = 4  # concurrent posters on A, one per expert agent on B
C_MAIL_EVERY = 1000  # one message for the down peer C every this many messages for B
DRAIN_HOLDER = "bench-drain-alone"  # the drain lease holder of the (B8') drain-alone phase

SERVER_ENV: dict[str, Any] = {
    "DISPATCH_HEARTBEAT_INTERVAL": "2",
    "DISPATCH_PROCESS_TTL": "10",
    "DISPATCH_REAP_INTERVAL": "2",
    "DISPATCH_REMOTE_LIVENESS_INTERVAL": "2",
    "DISPATCH_LOG_LEVEL": "WARNING",
}


# --- child modes: run with an instance's environment ------------------------------------------


def _django() -> None:
    # bench/machines.py would shadow the `machines` package of the project.
    sys.path[:] = [entry for entry in sys.path if entry and Path(entry).resolve() != BENCH]
    import django

    django.setup()


def signed_loop(output: Path, *, label: str, agent_id: str, count: int, prefix: str) -> None:
    """The B8 baseline, in a child with A's settings: ``count`` sequential signed
    ``POST /api/v1/peers/messages`` to agent ``agent_id`` on peer ``label`` over one
    keep-alive ``httpx.Client`` (a fresh ``Idempotency-Key`` each, signed with A's key by
    ``peers.auth.sign_request_with_key``). Writes ``{count, seconds, statuses}`` to ``output``.
    """
    _django()
    import httpx

    from core import secrets_at_rest
    from peers.auth import sign_request_with_key
    from peers.models import Peer
    from peers.services.identity import identity_get

    peer = Peer.objects.get(label=label, revoked_at__isnull=True)
    identity = identity_get()
    token = secrets_at_rest.decrypt(peer.outbound_token_encrypted).decode()
    url = peer.url.rstrip("/") + "/api/v1/peers/messages"
    sender = {"instance_id": identity.instance_id, "agent_id": None, "name": "bench"}
    statuses: Counter[int] = Counter()
    with httpx.Client(timeout=30) as client:
        started = time.perf_counter()
        for index in range(count):
            body = {"to_agent_id": agent_id, "content": f"{prefix}{index:05d}", "from": sender}
            request = client.build_request(
                "POST",
                url,
                content=json.dumps(body, separators=(",", ":")).encode(),
                headers={
                    "Content-Type": "application/json",
                    "Authorization": f"Bearer {token}",
                    "Idempotency-Key": str(uuid.uuid4()),
                },
            )
            sign_request_with_key(request, private_key=identity.private_key, keyid=identity.fingerprint)
            statuses[client.send(request).status_code] += 1
        seconds = time.perf_counter() - started
    output.write_text(json.dumps({"count": count, "seconds": seconds, "statuses": dict(statuses)}))


def dump_received(output: Path, *, prefix: str) -> None:
    """In a child with B's settings: every ``AgentMessage`` whose content starts with
    ``prefix``, by id: ``[[id, idempotency_key, content, created_at epoch seconds], ...]``."""
    _django()
    from agents.models import AgentMessage

    rows = AgentMessage.objects.filter(content__startswith=prefix).order_by("id")
    output.write_text(
        json.dumps([[m.pk, m.idempotency_key, m.content, m.created_at.timestamp()] for m in rows.iterator()])
    )


def dump_outbox(output: Path, *, prefix: str) -> None:
    """In a child with A's settings: the outbox rows whose payload content starts with
    ``prefix``, in drain order (``created_at``, id): ``[[peer label, idempotency_key,
    content, status, attempts, last_error], ...]``."""
    _django()
    from peers.models import OutboxMessage

    rows = OutboxMessage.objects.select_related("peer").order_by("created_at", "id")
    out = []
    for row in rows.iterator():
        content = str(row.payload.get("content", ""))
        if content.startswith(prefix):
            out.append([row.peer.label, row.idempotency_key, content, row.status, row.attempts, row.last_error])
    output.write_text(json.dumps(out))


def enqueue(output: Path, *, label: str, agent_id: str, count: int, prefix: str, holder: str = "") -> None:
    """In a child with A's settings: ``count`` messages from A's admin to agent ``agent_id``
    on peer ``label`` through the service (``peers.services.outgoing.peer_message_send``: message
    and outbox row in one transaction). The doorbell rings in this process only, so A's
    server is not woken. With ``holder``, the peer's drain lease is first taken for 10
    minutes in that name (waiting up to 60 s for A's server to release it), so A's own drain
    loop, which also polls every 30 s, stays off these rows. Writes ``{count, seconds}``."""
    _django()
    from datetime import timedelta

    from peers.models import Peer
    from peers.services.leases import drain_lease_claim
    from peers.services.outgoing import peer_message_send

    peer = Peer.objects.select_related("owner").get(label=label, revoked_at__isnull=True)
    if holder:
        deadline = time.monotonic() + 60
        while not drain_lease_claim(peer_id=peer.pk, holder=holder, ttl=timedelta(minutes=10)):
            if time.monotonic() > deadline:
                raise SystemExit(f"the drain lease of {label} stayed held elsewhere for 60 s")
            time.sleep(0.1)
    started = time.perf_counter()
    for index in range(count):
        peer_message_send(user=peer.owner, sender_agent=None, peer=peer, to_agent_id=agent_id,
                          content=f"{prefix}0-{index:05d}")  # fmt: skip
    output.write_text(json.dumps({"count": count, "seconds": time.perf_counter() - started}))


def drain(output: Path, *, label: str, holder: str) -> None:
    """In a child with A's settings: ``peers.outbox_drain.outbox_drain_peer`` passes for peer
    ``label``, back to back, until a pass delivers nothing; no REST load, no doorbell. The
    passes hold the drain lease ``enqueue`` took as ``holder`` until the end (a pass would
    release it, and A's own drain loop could take it between two passes).
    Each step of a row is timed by wrapping the outbox module's functions (the database
    steps run through ``database_sync_to_async``, so their time includes the thread hop).
    Writes ``{delivered, seconds, passes, skipped, steps: {name: {calls, seconds}}}``."""
    _django()
    import peers.outbox_drain as outbox
    from peers.client import PeerClient
    from peers.models import Peer

    steps: dict[str, dict[str, float]] = {}

    def timed(name: str, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                entry = steps.setdefault(name, {"calls": 0, "seconds": 0.0})
                entry["calls"] += 1
                entry["seconds"] += time.perf_counter() - began

        return wrapper

    release_lease = outbox.drain_lease_release
    outbox.drain_lease_release = lambda **kwargs: None  # kept until every pass is done
    for name in (
        "drain_lease_claim",
        "drain_lease_release",
        "_due_rows",
        "_live_peer",
        "outbox_mark_delivered",
        "outbox_mark_delivered_many",  # a batch's delivered rows, one transaction (messages.batch)
    ):
        if hasattr(outbox, name):
            setattr(outbox, name, timed(name, getattr(outbox, name)))
    original_db = outbox._db

    def db_hop(function: Any) -> Any:  # the whole database_sync_to_async call, thread hop included
        wrapped = original_db(function)

        async def call(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return await wrapped(*args, **kwargs)
            finally:
                entry = steps.setdefault("database_sync_to_async (all, incl. hop)", {"calls": 0, "seconds": 0.0})
                entry["calls"] += 1
                entry["seconds"] += time.perf_counter() - began

        return call

    outbox._db = db_hop
    original_post = PeerClient.post

    async def post(self: Any, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return await original_post(self, *args, **kwargs)
        finally:
            entry = steps.setdefault("PeerClient.post (signed POST: one row, or a batch)", {"calls": 0, "seconds": 0.0})
            entry["calls"] += 1
            entry["seconds"] += time.perf_counter() - began

    PeerClient.post = post  # type: ignore[method-assign]
    peer = Peer.objects.get(label=label, revoked_at__isnull=True)

    async def passes() -> dict[str, Any]:
        delivered, count, skipped = 0, 0, Counter[str]()
        began = time.perf_counter()
        while True:
            report = await outbox.outbox_drain_peer(peer.pk, holder=holder)
            count += 1
            if report.skipped:
                skipped[report.skipped] += 1
            delivered += len(report.delivered)
            if not report.delivered and not report.skipped:
                break
            if report.skipped:
                if count > 10_000:
                    break
                await asyncio.sleep(0.01)
        return {"delivered": delivered, "seconds": time.perf_counter() - began, "passes": count,
                "skipped": dict(skipped)}  # fmt: skip

    result = asyncio.run(passes())
    release_lease(peer_id=peer.pk, holder=holder)
    output.write_text(json.dumps({**result, "steps": steps}))


def due_now(output: Path, *, label: str) -> None:
    """In a child with A's settings: make peer ``label``'s queued outbox rows due now with
    their backoff forgotten (as a reconnect does, ``peers.services.outbox.outbox_backoff_reset``).
    Writes ``{"reset": n}``."""
    _django()
    from django.utils import timezone

    from peers.models import OutboxMessage

    reset = OutboxMessage.objects.filter(peer__label=label, status=OutboxMessage.Status.QUEUED).update(
        attempts=0, next_attempt_at=timezone.now()
    )
    output.write_text(json.dumps({"reset": reset}))


def discard_queued(output: Path, *, label: str) -> None:
    """In a child with A's settings: peer ``label``'s still-queued outbox rows become
    ``discarded`` (the leftovers of an incomplete phase, so the next phase starts with an
    empty queue). Writes ``{"discarded": n}``."""
    _django()
    from peers.models import OutboxMessage

    discarded = OutboxMessage.objects.filter(peer__label=label, status=OutboxMessage.Status.QUEUED).update(
        status=OutboxMessage.Status.DISCARDED
    )
    output.write_text(json.dumps({"discarded": discarded}))


def run_child(env: dict[str, str], mode: str, *args: str, timeout: float = 600) -> Any:
    """Run this script in ``mode`` with ``env``; returns the JSON it wrote."""
    out = Path(env["DISPATCH_DATA_DIR"]) / f"bench-{mode}-{uuid.uuid4().hex[:6]}.json"
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), mode, "--out", str(out), *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{mode} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


# --- the three instances -----------------------------------------------------------------------


@dataclass
class Peers:
    """The running instances: A (links to B and C), B (healthy peer), C (stopped after linking)."""

    a: Any
    b: Any
    c: Any
    server_a: Any
    server_b: Any
    server_c: Any


@contextlib.contextmanager
def three_instances() -> Iterator[Peers]:
    """A, B and C served on fixed ports (their public URLs); B and C offer, A links to both
    (labels ``Bee`` and ``Cee``); then A is served. C is left running (B8 stops it)."""
    from tests.infra import PYTHON, Process, Server, free_port, instance

    def serve_at(inst: Any, port: int) -> Any:
        started = Process.spawn(
            inst.env, [PYTHON, str(REPO / "manage.py"), "serve", "--port", str(port)], name="bench-peer"
        )
        server = Server(proc=started.proc, log_path=started.log_path, port=port)
        inst.servers.append(server)
        return server.wait_healthy()

    ports = [free_port() for _ in range(3)]
    with contextlib.ExitStack() as stack:
        a, b, c = (
            stack.enter_context(instance(DISPATCH_PUBLIC_URL=f"http://127.0.0.1:{port}", **SERVER_ENV))
            for port in ports
        )
        from remote_calls import logs_on_failure

        for inst in (a, b, c):
            stack.enter_context(logs_on_failure(inst))
        server_b, server_c = serve_at(b, ports[1]), serve_at(c, ports[2])
        for inst, server, label in ((b, server_b, "Bee"), (c, server_c, "Cee")):
            offer = inst.manage("peer_offer").stdout
            code = re.search(r"code: (\S+)", offer)
            if code is None:
                raise RuntimeError(f"peer_offer printed no code: {offer}")
            linked = a.manage("peer_link", server.url, code.group(1), "--label", label).stdout
            if f"linked: {label}" not in linked:
                raise RuntimeError(f"peer_link failed: {linked}")
        server_a = serve_at(a, ports[0])
        yield Peers(a=a, b=b, c=c, server_a=server_a, server_b=server_b, server_c=server_c)


class Rest:
    """An async keep-alive REST client of one instance as its admin."""

    def __init__(self, url: str, token: str) -> None:
        import httpx

        self.client = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)

    async def call(self, method: str, path: str, body: dict[str, Any] | None = None, ok: int = 200) -> Any:
        response = await self.client.request(method, path, json=body)
        if response.status_code != ok:
            raise RuntimeError(f"{method} {path} answered {response.status_code}: {response.text[:500]}")
        return response.json()

    async def close(self) -> None:
        await self.client.aclose()


async def create_experts(rest: Rest, names: list[str]) -> list[str]:
    """Expert agents (no LLM configured: a message queues a run that fails fast)."""
    return [
        (await rest.call("POST", "/api/v1/agents", {"type": "expert", "name": name, "cwd": "/tmp"}, ok=201))["id"]
        for name in names
    ]


async def shadows_of(rest_a: Rest, remote_ids: list[str], timeout: float = 60) -> list[str]:
    """The ids on A of the shadows of ``remote_ids``, once the mirror has them all."""
    deadline = time.monotonic() + timeout
    while True:
        agents = (await rest_a.call("GET", "/api/v1/agents?limit=500"))["agents"]
        found = {agent["peer_agent_id"]: agent["id"] for agent in agents if agent.get("peer_agent_id")}
        if all(remote in found for remote in remote_ids):
            return [found[remote] for remote in remote_ids]
        if time.monotonic() > deadline:
            raise RuntimeError(f"no shadows on A for {remote_ids} within {timeout:g} s (found {found})")
        await asyncio.sleep(0.1)


# --- B7 ------------------------------------------------------------------------------------------


class UpsertWatch:
    """Reads one instance's ``GET /api/v1/events`` and stamps each ``agent.upsert`` of one
    agent: ``wait(status)`` returns the ``perf_counter`` time of the first upsert with
    ``status`` after ``arm()``."""

    def __init__(self, url: str, token: str, agent_id: str) -> None:
        self.url, self.token, self.agent_id = url, token, agent_id
        self.expected: str | None = None
        self.future: asyncio.Future[float] | None = None
        self.upserts = 0
        self.opened = asyncio.Event()
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        import httpx
        from httpx_sse import aconnect_sse

        timeout = httpx.Timeout(10, read=None)
        async with (
            httpx.AsyncClient(timeout=timeout) as client,
            aconnect_sse(
                client, "GET", f"{self.url}/api/v1/events", headers={"Authorization": f"Bearer {self.token}"}
            ) as events,
        ):
            events.response.raise_for_status()
            self.opened.set()
            async for sse in events.aiter_sse():
                if sse.event != "agent.upsert":
                    continue
                now = time.perf_counter()
                data = json.loads(sse.data)
                if data.get("id") != self.agent_id:
                    continue
                self.upserts += 1
                future = self.future
                if future is not None and not future.done() and data.get("status") == self.expected:
                    future.set_result(now)

    def arm(self, status: str) -> None:
        self.expected = status
        self.future = asyncio.get_running_loop().create_future()

    async def wait(self, timeout: float = 15) -> float:
        assert self.future is not None
        return await asyncio.wait_for(self.future, timeout)

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task


async def run_b7(peers: Peers, sizes: Sizes) -> dict[str, Any]:
    """B7: ``sizes.changes`` stop/start changes of one agent on B; lag to A's shadow upsert
    and (baseline) to B's own upsert, in ms."""
    rest_a = Rest(peers.server_a.url, peers.a.admin_token)
    rest_b = Rest(peers.server_b.url, peers.b.admin_token)
    watches: list[UpsertWatch] = []
    try:
        (remote,) = await create_experts(rest_b, ["b7-mirrored"])
        (shadow,) = await shadows_of(rest_a, [remote])
        on_a = UpsertWatch(peers.server_a.url, peers.a.admin_token, shadow)
        on_b = UpsertWatch(peers.server_b.url, peers.b.admin_token, remote)
        watches = [on_a, on_b]
        await asyncio.wait_for(asyncio.gather(on_a.opened.wait(), on_b.opened.wait()), 15)
        status = (await rest_b.call("GET", f"/api/v1/agents/{remote}"))["status"]
        mirror_ms: list[float] = []
        local_ms: list[float] = []
        rest_ms: list[float] = []
        with CpuMeter({"A": peers.server_a.pid, "B": peers.server_b.pid}) as meter:
            for index in range(sizes.warmup_changes + sizes.changes):
                action, status = ("stop", "stopped") if status == "running" else ("start", "running")
                on_a.arm(status)
                on_b.arm(status)
                started = time.perf_counter()
                answer = await rest_b.call("POST", f"/api/v1/agents/{remote}/{action}")
                answered = time.perf_counter()
                if answer["status"] != status:
                    raise RuntimeError(f"{action} answered status {answer['status']}")
                seen_a, seen_b = await asyncio.gather(on_a.wait(), on_b.wait())
                if index >= sizes.warmup_changes:
                    mirror_ms.append((seen_a - started) * 1000)
                    local_ms.append((seen_b - started) * 1000)
                    rest_ms.append((answered - started) * 1000)
        final = (await rest_a.call("GET", f"/api/v1/agents/{shadow}"))["status"]
        if final != status:
            raise RuntimeError(f"the shadow ended {final}, B's agent {status}")
        return {
            "changes": sizes.changes,
            "mirror": latency_summary(mirror_ms),
            "local": latency_summary(local_ms),
            "rest_on_b": latency_summary(rest_ms),
            "upserts_seen": {"A": on_a.upserts, "B": on_b.upserts},
            "cpu": meter.percent,
            "cpu_ms_per_change": CpuPerOp().add(meter, sizes.warmup_changes + sizes.changes, ["A", "B"]).ms,
        }
    finally:
        for watch in watches:
            await watch.close()
        await rest_a.close()
        await rest_b.close()


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


# --- the run ---------------------------------------------------------------------------------------


@dataclass
class Sizes:
    warmup_changes: int
    changes: int
    baseline_messages: int
    alone_messages: int
    messages: int
    drain_messages: int
    hole_messages: int
    backlog_messages: int
    backlog_window: float
    drain_wait: float
    post_seconds: float | None = None  # B8 C down: posting stops after this (None: all ``messages``)


async def run(sizes: Sizes) -> dict[str, Any]:
    report: dict[str, Any] = {"notes": []}
    with three_instances() as peers:
        print(f"· B7: {sizes.changes} status changes of an agent on B, watched on A and on B…", flush=True)
        report["b7"] = await run_b7(peers, sizes)
        report["b8"] = await run_b8(peers, sizes)
    return report


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
        else Sizes(  # cut to fit a full `make bench` in 15 minutes (bench/README.md "How long")
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
