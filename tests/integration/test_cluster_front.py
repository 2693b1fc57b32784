"""The front: what the shipped nginx config (deploy/nginx.conf, docs/deploy.md) holds.

One topology (``tests.cluster``: nginx from the shipped template, three ``serve
--no-background``, one ``dispatch_worker``, PostgreSQL + Redis, ``DISPATCH_PROCESS_TTL=6``,
1 s heartbeat) for the module, in order:

- 10,000 idle connections (bare, half-sent headers, upgrades that never authenticate)
  from 49 loopback addresses, held by two child processes, while a real remote connects
  and is called over REST and MCP; the idle ones are then dropped by nginx's header
  timeout (or Dispatch's authentication timeout);
- the per-address connection limit, on a second nginx with a low limit;
- a frozen (SIGSTOPped) ``serve`` holding a shim and a remote: calls to them end within
  the TTL (failing, or answered once the client reconnected elsewhere), the clients move
  to live processes within the TTL plus their detection time, and reads through nginx
  keep working. It runs last: the frozen process is woken at its end.

Each test prints what it measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from deploy.cluster import Nginx, body_cap, free_port
from remotes.client import Remote
from tests.cluster import MARKS, Cluster, IdleClients, IdlePlan, cluster
from tests.infra import eventually
from tests.live_clients import LiveSession

pytestmark = [*(getattr(pytest.mark, mark) for mark in MARKS), pytest.mark.timeout(300)]

TTL = 6.0  # deploy.cluster.PROCESS_TTL
HEADER_TIMEOUT = 10.0  # deploy/nginx.conf client_header_timeout
AUTH_TIMEOUT = 10.0  # DISPATCH_WS_AUTH_TIMEOUT, DISPATCH_SHIM_HELLO_TIMEOUT
DETECTION = 12.0  # the clients' KEEPALIVE_INTERVAL + KEEPALIVE_TIMEOUT + CLOSE_TIMEOUT
SESSION = "front"


@pytest.fixture(scope="module")
def topo() -> Iterator[Cluster]:
    with cluster(servers=3, tls=False) as topo:
        yield topo


def now() -> float:
    return time.monotonic()


async def echo(n: int) -> dict[str, int]:
    """Answer ``{"n": n}``."""
    return {"n": n}


@contextlib.asynccontextmanager
async def serving(name: str, url: str, token: str) -> AsyncIterator[list[float]]:
    """A real ``remotes.client.Remote`` named ``name`` serving ``echo`` at ``url``; yields
    the times it (re)registered."""
    registrations: list[float] = []

    def announce(line: str) -> None:
        if line.startswith(("serving", "reconnected")):
            registrations.append(now())

    remote = Remote(name, url=url, token=token, functions=[echo])
    task = asyncio.create_task(remote.serve(announce=announce))
    try:
        yield registrations
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def holders(topo: Cluster) -> dict[str, dict[str, str]]:
    """Which process (id) holds each remote (by name) and each machine (by machine_id)."""
    remotes = {str(n): str(p) for n, p in topo.rows("SELECT name, server_process_id FROM remotes_remote")}
    machines = {
        str(m): str(p)
        for m, p in topo.rows(
            "SELECT m.machine_id, c.server_process_id FROM machines_machineconnection c "
            "JOIN machines_machine m ON m.id = c.machine_id"
        )
    }
    return {"remotes": remotes, "machines": machines}


def report(name: str, summary: dict[str, Any]) -> str:
    text = json.dumps(summary, sort_keys=True)
    print(f"\n{name}: {text}")
    return text


def mcp_call(url: str, token: str, tool: str, arguments: dict[str, Any], timeout: float = 30) -> dict[str, Any]:
    """One stateless MCP ``tools/call`` (POST /mcp, docs/mcp.md); its ``result``."""
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": tool, "arguments": arguments}}
    response = httpx.post(
        f"{url}/mcp",
        json=call,
        headers={"Authorization": f"Bearer {token}", "Accept": "application/json, text/event-stream"},
        timeout=timeout,
    )
    assert response.status_code == 200, response.text[:500]
    body = response.text
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        body = next(
            line[len("data:") :] for line in body.splitlines() if line.startswith("data:") and '"result"' in line
        )
    return dict(json.loads(body)["result"])


# --- 10,000 idle connections ------------------------------------------------------------------

IDLE = 10_000
SOURCES = tuple(f"127.0.0.{n}" for n in range(2, 51))


async def test_10_000_idle_connections_leave_room_for_a_client_and_are_dropped_after_the_header_timeout(
    topo: Cluster,
) -> None:
    """Two children open 10,000 connections through nginx that never send a complete
    request (bare, half-sent headers) or never authenticate (complete ``/ws`` upgrades),
    from 49 loopback addresses. While they are all open, a real remote connects through
    nginx and is called over REST and MCP, and a read answers; afterwards nginx (or
    Dispatch, for the upgrades) drops every one of them."""
    half = IDLE // 2
    plans = [
        IdlePlan(topo.nginx.host, topo.nginx.port, SOURCES[i::2], bare=half - 220, partial=200, upgrades=20)
        for i in range(2)
    ]
    children = [IdleClients(plan) for plan in plans]
    try:
        opened = [await asyncio.to_thread(child.wait_opened) for child in children]
        flooded = now()
        open_before = sum([await asyncio.to_thread(child.still_open) for child in children])
        summary: dict[str, Any] = {"opened": opened, "open_before_client": open_before}
        assert sum(o["connected"] for o in opened) == IDLE, report("idle_front", summary)
        assert open_before == IDLE, report("idle_front", summary)

        # The client, while they are open: a new remote registers, REST and MCP call it.
        name = f"front-{uuid.uuid4().hex[:6]}"
        client_started = now()
        async with serving(name, topo.ws_url, topo.token) as registrations:
            await eventually(lambda: registrations, timeout=15, what="the remote to register", details=topo.details)
            async with httpx.AsyncClient(
                base_url=topo.url, headers={"Authorization": f"Bearer {topo.token}"}, timeout=15
            ) as http:
                listed = await http.get("/api/v1/remotes")
                called = await http.post(f"/api/v1/remotes/{name}/call", json={"function": "echo", "args": {"n": 7}})
            over_mcp = await asyncio.to_thread(mcp_call, topo.url, topo.token, f"remote__{name}__echo", {"n": 8})
        summary["client_seconds"] = round(now() - client_started, 2)
        open_after = sum([await asyncio.to_thread(child.still_open) for child in children])
        summary["open_after_client"] = open_after
        summary["seconds_since_flood"] = round(now() - flooded, 2)
        text = report("idle_front", summary)
        assert listed.status_code == 200 and name in [r["remotename"] for r in listed.json()["remotes"]], text
        assert called.status_code == 200 and called.json() == {"result": {"n": 7}}, (called.text, text)
        assert not over_mcp.get("isError") and '"n": 8' in json.dumps(over_mcp), (over_mcp, text)

        # Then every idle connection goes: nginx's client_header_timeout for the bare and
        # half-sent ones, Dispatch's authentication timeout for the upgrades.
        async def remaining() -> int:
            return sum([await asyncio.to_thread(child.still_open) for child in children])

        # The bound is generous on purpose: under a full test run on a small machine the
        # three processes and nginx share two cores with the flood; what is checked is that
        # every idle connection is dropped, not how promptly.
        deadline = flooded + max(HEADER_TIMEOUT, AUTH_TIMEOUT) + 45
        left = await remaining()
        while left and now() < deadline:
            await asyncio.sleep(1)
            left = await remaining()
        summary["dropped_after_s"] = round(now() - flooded, 2)
        summary["left_open"] = left
        summary["left_open_by_kind"] = {
            kind: sum(child.open_by_kind.get(kind, 0) for child in children) for kind in ("bare", "partial", "upgrades")
        }
        assert left == 0, report("idle_front", summary)
        report("idle_front", summary)
    finally:
        for child in children:
            child.stop()


# --- the per-address limit ----------------------------------------------------------------------

PER_ADDRESS = 20


@pytest.fixture
def strict_nginx(topo: Cluster, tmp_path: Path) -> Iterator[Nginx]:
    """A second nginx from the same template before the same processes, with a per-address
    limit of ``PER_ADDRESS`` open requests."""
    nginx = Nginx.start(
        tmp_path / "prefix",
        port=free_port(),
        upstreams=[server.port for server in topo.servers],
        max_body_bytes=body_cap(topo.env),
        per_address=PER_ADDRESS,
    )
    try:
        yield nginx
    finally:
        nginx.stop()


async def test_an_address_over_its_connection_limit_is_refused_in_dispatch_s_error_shape(
    topo: Cluster, strict_nginx: Nginx
) -> None:
    """``PER_ADDRESS`` websockets from one address are let through; the next one from that
    address is refused with 429 ``RATE_LIMITED``, while another address is still served."""
    url = strict_nginx.ws_url
    headers = {"Authorization": f"Bearer {topo.token}"}
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(PER_ADDRESS):
            await stack.enter_async_context(connect(url, additional_headers=headers, local_addr=("127.0.0.60", 0)))
        with pytest.raises(InvalidStatus) as refused:
            async with connect(url, additional_headers=headers, local_addr=("127.0.0.60", 0)):
                pass
        response = refused.value.response
        assert response.status_code == 429, response
        error = json.loads(response.body or b"{}")["error"]
        assert error["code"] == "RATE_LIMITED" and error["details"] == {"max_connections": PER_ADDRESS}, error
        async with connect(url, additional_headers=headers, local_addr=("127.0.0.61", 0)) as other:
            await other.send(json.dumps({"action": "ping", "nonce": 1}))
            assert json.loads(await asyncio.wait_for(other.recv(), 10)) == {"pong": True, "nonce": 1}


# --- a frozen process ------------------------------------------------------------------------------

RECOVERY_BOUND = TTL + DETECTION  # the TTL plus the clients' detection time


@dataclass
class Outcome:
    """One call (``kind`` "call" or "op") or read: when it started and ended, how it ended."""

    kind: str
    started: float
    ended: float
    outcome: str


async def test_a_frozen_process_costs_calls_on_its_clients_only_until_the_ttl_and_reads_go_elsewhere(
    topo: Cluster, tmp_path: Path
) -> None:
    """SIGSTOP the ``serve`` holding a shim (``python -m machines.shim``) and a remote,
    both connected through nginx. From a live process, calls to them and operations on the
    shim keep going, and reads go through nginx. Every call ends (fails or is answered)
    within the TTL (plus the call's own few seconds); the shim and the remote are back on
    live processes and answer within the TTL plus their detection time; every read through
    nginx is answered. Then the process is woken (SIGCONT) and is healthy again."""
    token = topo.token
    names = [f"frozen-{n}-{uuid.uuid4().hex[:4]}" for n in range(3)]
    async with contextlib.AsyncExitStack() as stack:
        # One remote, then one shim, per process: least connections puts one of each on each.
        for name in names:
            registrations = await stack.enter_async_context(serving(name, topo.ws_url, token))
            await eventually(registrations.copy, timeout=30, what=f"remote {name}", details=topo.details)
        shims = []
        for n in range(3):
            (tmp_path / f"root-{n}").mkdir()
            shim = topo.shim(f"front-{n}", tmp_path / f"root-{n}", "--session", SESSION, wait=False)
            await asyncio.to_thread(shim.wait_connected, 1, 60)
            shims.append(shim)
        held = await asyncio.to_thread(holders, topo)
        index = topo.process_index()
        by_process: dict[int, dict[str, list[str]]] = {}
        for name in names:
            by_process.setdefault(index[held["remotes"][name]], {"remotes": [], "machines": []})["remotes"].append(name)
        for shim in shims:
            place = by_process.setdefault(index[held["machines"][shim.machine_id]], {"remotes": [], "machines": []})
            place["machines"].append(shim.machine_id)
        frozen_index = next((i for i, p in sorted(by_process.items()) if p["remotes"] and p["machines"]), None)
        assert frozen_index is not None, f"no process holds both a remote and a shim: {by_process}"
        remote_name = by_process[frozen_index]["remotes"][0]
        machine_id = by_process[frozen_index]["machines"][0]
        frozen = topo.servers[frozen_index]
        live = topo.servers[(frozen_index + 1) % 3]
        frozen_process_id = next(p for p, i in index.items() if i == frozen_index)

        outcomes: list[Outcome] = []
        answered: dict[str, list[float]] = {"call": [], "op": []}
        stopping = asyncio.Event()
        headers = {"Authorization": f"Bearer {token}"}

        async def calls(session: LiveSession) -> None:
            turn = 0
            while not stopping.is_set():
                turn += 1
                started = now()
                body = {"remotename": remote_name, "function": "echo", "args": {"n": turn}, "timeout": 20}
                try:
                    reply = await session.request("remote-call", body, timeout=40)
                    outcome = "ok" if reply.get("result") == {"n": turn} else str(reply.get("error"))
                except Exception as exc:  # the assertion below reports it
                    outcome = f"{type(exc).__name__}: {exc}"
                outcomes.append(Outcome("call", started, now(), outcome))
                if outcome == "ok":
                    answered["call"].append(now())
                await asyncio.sleep(0.2)

        async def operations(http: httpx.AsyncClient) -> None:
            while not stopping.is_set():
                started = now()
                body = {"op": "EXECUTE_COMMAND", "payload": {"argv": ["true"]}, "target_machine": machine_id}
                try:
                    response = await http.post(f"/api/v1/sessions/{SESSION}/ops", json=body)
                    if response.status_code == 200:
                        outcome = "ok"
                    else:
                        outcome = f"{response.status_code} {response.json()['error']['code']}"
                except Exception as exc:
                    outcome = f"{type(exc).__name__}: {exc}"
                outcomes.append(Outcome("op", started, now(), outcome))
                if outcome == "ok":
                    answered["op"].append(now())
                await asyncio.sleep(0.2)

        async def reads(http: httpx.AsyncClient) -> None:
            while not stopping.is_set():
                started = now()
                try:
                    response = await http.get("/api/v1/remotes")
                    outcome = "ok" if response.status_code == 200 else f"{response.status_code}"
                except Exception as exc:
                    outcome = f"{type(exc).__name__}: {exc}"
                outcomes.append(Outcome("read", started, now(), outcome))
                await asyncio.sleep(0.2)

        session = await stack.enter_async_context(LiveSession.open(live.ws_url, token))
        direct = await stack.enter_async_context(httpx.AsyncClient(base_url=live.url, headers=headers, timeout=60))
        front = await stack.enter_async_context(httpx.AsyncClient(base_url=topo.url, headers=headers, timeout=60))
        # Both answer before the freeze.
        assert (
            await session.request("remote-call", {"remotename": remote_name, "function": "echo", "args": {"n": 0}})
        )["result"] == {"n": 0}
        warm = await direct.post(
            f"/api/v1/sessions/{SESSION}/ops",
            json={"op": "EXECUTE_COMMAND", "payload": {"argv": ["true"]}, "target_machine": machine_id},
        )
        assert warm.status_code == 200, warm.text

        frozen.proc.send_signal(signal.SIGSTOP)
        t0 = now()
        tasks = [asyncio.create_task(job) for job in (calls(session), operations(direct), reads(front))]
        try:

            def moved() -> bool:
                after = [t for t in answered["call"] if t > t0] and [t for t in answered["op"] if t > t0]
                return bool(after)

            with contextlib.suppress(AssertionError):
                await eventually(moved, timeout=RECOVERY_BOUND + 30, interval=0.2)
            recovered = now() - t0
            await asyncio.sleep(2)  # a few more calls on the new connections
            stopping.set()
            await asyncio.wait(tasks, timeout=70)
        finally:
            stopping.set()
            for task in tasks:
                task.cancel()
            frozen.proc.send_signal(signal.SIGCONT)
        held_after = await asyncio.to_thread(holders, topo)

        def first_ok(kind: str) -> float | None:
            return next((round(t - t0, 2) for t in answered[kind] if t > t0), None)

        late = [
            o for o in outcomes if o.kind != "read" and o.started >= t0 and o.ended > max(t0 + TTL + 6, o.started + 6)
        ]
        failed_reads = [o for o in outcomes if o.kind == "read" and o.outcome != "ok"]
        reads_done = [o for o in outcomes if o.kind == "read"]
        first_call, first_op = first_ok("call"), first_ok("op")
        summary: dict[str, Any] = {
            "recovered_after_s": round(recovered, 2),
            "first_call_answered_s": first_call,
            "first_op_answered_s": first_op,
            "outcomes": {
                kind: dict(
                    sorted(
                        {
                            outcome: sum(1 for o in outcomes if o.kind == kind and o.outcome == outcome)
                            for outcome in {o.outcome[:80] for o in outcomes if o.kind == kind}
                        }.items()
                    )
                )
                for kind in ("call", "op", "read")
            },
            "slowest_read_s": round(max((o.ended - o.started for o in reads_done), default=0.0), 2),
            "late_calls": [(o.kind, round(o.started - t0, 2), round(o.ended - t0, 2), o.outcome[:80]) for o in late],
            "remote_on_frozen_after": held_after["remotes"].get(remote_name) == frozen_process_id,
            "shim_on_frozen_after": held_after["machines"].get(machine_id) == frozen_process_id,
        }
        text = report("frozen_front", summary)
        assert first_call is not None and first_call <= RECOVERY_BOUND, text
        assert first_op is not None and first_op <= RECOVERY_BOUND, text
        assert not late, text
        assert reads_done and not failed_reads, text
        # The woken process finds itself reaped, closes what it held and serves again.
        await eventually(
            lambda: frozen.get("/healthz").status_code == 200, timeout=30, what="the woken process to be healthy"
        )
        for shim in shims:
            shim.stop()
