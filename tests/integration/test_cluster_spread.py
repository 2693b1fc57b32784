"""Connections through nginx spread over three ``serve`` processes, and calls between any
two of them succeed whichever processes hold caller and callee.

The topology is ``tests.cluster``'s (nginx with TLS, least connections, no sticky
sessions; three ``serve --no-background``, one ``dispatch_worker``, PostgreSQL + Redis).
Where each connection landed is read from the database: the ``server_process`` of its
``WsSession``, ``Remote`` or ``MachineConnection`` row.

Shims: ``REAL_SHIMS`` are real ``python -m machines.shim run`` processes; the others are
raw websocket shim clients in this process (``RawShim``: HELLO, then PING and FILE_STAT
answered), because 20 shim processes on a 2-core machine take most of this test's budget
to start (each is a Python interpreter importing httpx and websockets).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import uuid
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect

from tests.cluster import Cluster, shared_cluster, trusting
from tests.infra import eventually
from tests.live_clients import LiveSession

pytestmark = [
    pytest.mark.integration,
    pytest.mark.multiprocess,
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.timeout(240),
]

CALLERS = 60
REMOTES = 10
SHIMS = 20
REAL_SHIMS = 3
# Calls in flight at once: each call is a few queries on its processes' one database
# thread, which the presence heartbeat shares; 600 at once on a busy 2-core machine starved
# the heartbeats past the 6 s TTL and every process was reaped (its sockets closed).
IN_FLIGHT = 30
SESSION = "spread"
ALL_PAIRS = {(a, b) for a in range(3) for b in range(3)}

ECHO = {
    "name": "echo",
    "description": "Answer with the remote's name and the arguments.",
    "parameters": {"type": "object", "properties": {"caller": {"type": "integer"}}, "required": ["caller"]},
}


@pytest.fixture
def topo(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    topo = shared_cluster(request.config, tls=True)
    trusting(topo, monkeypatch)
    return topo


# --- clients -------------------------------------------------------------------------------


class RemoteHost:
    """A /ws session serving remote ``name`` (function ``echo``): every call is answered
    with ``{"remote": name, "args": args}``."""

    def __init__(self, session: LiveSession, name: str) -> None:
        self.session = session
        self.name = name
        self.calls = 0
        self.task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            event = await self.session.next_event(timeout=3600)
            if isinstance(event, dict) and event.get("action") == "remote-call":
                self.calls += 1
                await self.session.send(
                    {
                        "action": "remote-call-result",
                        "requestId": event["requestId"],
                        "result": {"remote": self.name, "args": event["args"]},
                    }
                )


class RawShim:
    """A raw shim client (docs/shim-protocol.md#the-handshake): HELLO attached to
    ``SESSION``, then answers PING with PONG and FILE_STAT with a FILE_STAT_RESPONSE whose
    ``size_bytes`` is its index."""

    def __init__(self, ws: ClientConnection, machine_id: str, index: int) -> None:
        self.ws = ws
        self.machine_id = machine_id
        self.index = index
        self.task = asyncio.create_task(self._serve())

    @classmethod
    async def open(cls, ws_base: str, token: str, index: int) -> RawShim:
        ws = await connect(
            f"{ws_base}/ws/shim/", additional_headers={"Authorization": f"Bearer {token}"}, open_timeout=30
        )
        machine_id = str(uuid.uuid4())
        hello = envelope(
            "HELLO",
            {
                "shim_version": "test-raw",
                "protocol_version": "2.0",
                "machine_id": machine_id,
                "hostname": f"raw-{index}",
                "display_name": f"raw-{index}",
                "platform": "linux",
                "arch": "x86_64",
                "capabilities": ["files"],
                "allowed_roots": ["/nonexistent/raw"],
                "sessions": [SESSION],
                "hardware_devices": [],
            },
        )
        await ws.send(json.dumps(hello))
        ack = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert ack["type"] == "HELLO_ACK" and ack["id"] == hello["id"], ack
        return cls(ws, machine_id, index)

    async def _serve(self) -> None:
        with contextlib.suppress(Exception):
            async for text in self.ws:
                frame = json.loads(text)
                if frame["type"] == "PING":
                    await self.ws.send(json.dumps(envelope("PONG", {}, id=frame["id"])))
                elif frame["type"] == "FILE_STAT":
                    stat = {
                        "exists": True,
                        "is_file": True,
                        "is_dir": False,
                        "is_symlink": False,
                        "size_bytes": self.index,
                        "mtime": time.time(),
                        "mode": 0o644,
                    }
                    await self.ws.send(json.dumps(envelope("FILE_STAT_RESPONSE", stat, id=frame["id"])))

    async def close(self) -> None:
        await self.ws.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.task, 5)


def envelope(message_type: str, payload: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A frame in the shim envelope (docs/shim-protocol.md#the-envelope)."""
    return {
        "type": message_type,
        "id": fields.pop("id", None) or str(uuid.uuid4()),
        "ts": time.time(),
        "version": "2.0",
        "session_id": None,
        "target_machine": None,
        "payload": payload,
    }


# --- where connections landed ------------------------------------------------------------------


def ws_session_processes(topo: Cluster) -> dict[str, str]:
    return {str(i): str(p) for i, p in topo.rows("SELECT id, server_process_id FROM remotes_wssession")}


def remote_processes(topo: Cluster) -> dict[str, str]:
    return {str(n): str(p) for n, p in topo.rows("SELECT name, server_process_id FROM remotes_remote")}


def shim_processes(topo: Cluster) -> dict[str, str]:
    rows = topo.rows(
        "SELECT m.machine_id, c.server_process_id FROM machines_machineconnection c "
        "JOIN machines_machine m ON m.id = c.machine_id"
    )
    return {str(m): str(p) for m, p in rows}


def spread(processes: list[int]) -> dict[int, int]:
    return dict(sorted(Counter(processes).items()))


# --- the test ------------------------------------------------------------------------------------


async def test_connections_through_nginx_spread_over_three_processes_and_reach_each_other(
    topo: Cluster, tmp_path: Path
) -> None:
    index = topo.process_index()
    assert sorted(index.values()) == [0, 1, 2], index
    started = time.monotonic()
    timings: dict[str, float] = {}
    reaped_before = topo.reaped_count()

    async with AsyncExitStack() as stack:
        heartbeats = stack.enter_context(topo.heartbeat_watch())
        # 10 remotes, each served by its own /ws session.
        remotes: dict[str, RemoteHost] = {}
        for n in range(REMOTES):
            session = await stack.enter_async_context(LiveSession.open(topo.ws_url, topo.token))
            name = f"spread-{n}"
            reply = await session.request("remote-connect", {"remotename": name, "tools": [ECHO]})
            assert reply["message"] == "remote connected", reply
            remotes[name] = RemoteHost(session, name)
        remote_at = {name: index[process] for name, process in remote_processes(topo).items() if name in remotes}
        assert set(remote_at) == set(remotes)

        # 60 caller sessions, opened one at a time: each new WsSession row is that session's.
        callers: list[tuple[LiveSession, int]] = []
        known = set(ws_session_processes(topo))
        for _ in range(CALLERS):
            session = await stack.enter_async_context(LiveSession.open(topo.ws_url, topo.token))

            def new_rows(seen: set[str] = known) -> dict[str, str]:
                return {k: v for k, v in ws_session_processes(topo).items() if k not in seen}

            fresh = await eventually(new_rows, timeout=10, what="the new session's row", details=topo.details)
            assert len(fresh) == 1, fresh
            ((session_id, process),) = fresh.items()
            known.add(session_id)
            callers.append((session, index[process]))
        timings["sessions"] = time.monotonic() - started

        # 20 shims attached to SESSION: a few real shim processes, the rest raw clients.
        shim_started = time.monotonic()
        for n in range(REAL_SHIMS):
            (tmp_path / f"root-{n}").mkdir()
        real = [
            topo.shim(f"spread-real-{n}", tmp_path / f"root-{n}", "--session", SESSION, wait=False)
            for n in range(REAL_SHIMS)
        ]
        raw: list[RawShim] = []
        for n in range(REAL_SHIMS, SHIMS):
            raw.append(await RawShim.open(topo.url.replace("https", "wss", 1).replace("http", "ws", 1), topo.token, n))
        for shim in real:
            await asyncio.to_thread(shim.wait_connected, 1, 60)
        timings["shims"] = time.monotonic() - shim_started
        shim_ids = {shim.machine_id: n for n, shim in enumerate(real)} | {s.machine_id: s.index for s in raw}
        shim_at = {m: index[p] for m, p in (await eventually(lambda: _all_shims(topo, shim_ids), timeout=15)).items()}

        caller_spread = spread([p for _, p in callers])
        remote_spread = spread(list(remote_at.values()))
        shim_spread = spread(list(shim_at.values()))
        print(f"\nspread over processes 0/1/2: callers {caller_spread}, remotes {remote_spread}, shims {shim_spread}")
        assert set(caller_spread) == {0, 1, 2}, caller_spread
        assert set(remote_spread) == {0, 1, 2}, remote_spread
        assert set(shim_spread) == {0, 1, 2}, shim_spread

        # Remote calls, IN_FLIGHT at a time.
        calls_started = time.monotonic()

        in_flight = asyncio.Semaphore(IN_FLIGHT)

        async def call(caller: int, session: LiveSession, remote: str) -> tuple[int, str, Any]:
            async with in_flight:
                reply = await session.request(
                    "remote-call",
                    {"remotename": remote, "function": "echo", "args": {"caller": caller}, "timeout": 60},
                    timeout=90,
                )
            return caller, remote, reply

        # Each caller calls one remote on each process (turn by turn, so every remote is
        # called): every (caller process, remote process) pair, CALLERS × 3 calls.
        by_process = {p: sorted(name for name, at in remote_at.items() if at == p) for p in range(3)}
        plan = [
            (c, session, by_process[p][c % len(by_process[p])])
            for c, (session, _) in enumerate(callers)
            for p in range(3)
        ]
        results = await asyncio.gather(*(call(c, session, remote) for c, session, remote in plan))
        timings[f"{len(plan)} calls"] = time.monotonic() - calls_started
        pairs: Counter[tuple[int, int]] = Counter()
        failed = []
        for caller, remote, reply in results:
            if reply.get("result") == {"remote": remote, "args": {"caller": caller}}:
                pairs[(callers[caller][1], remote_at[remote])] += 1
            else:
                failed.append((caller, remote, reply))
        print(f"remote calls by (caller process, remote process): {dict(sorted(pairs.items()))}")
        assert failed == [], f"{len(failed)} failed: {failed[:5]}\n{topo.details()}"
        assert set(pairs) == ALL_PAIRS, pairs
        assert sum(host.calls for host in remotes.values()) == len(plan)
        assert all(host.calls for host in remotes.values()), {n: h.calls for n, h in remotes.items()}

        # Machine operations: from each process directly (the caller's process is known)
        # to every shim, and through nginx to every shim.
        ops_started = time.monotonic()
        op_pairs: Counter[tuple[int, int]] = Counter()
        through_nginx = 0
        headers = {"Authorization": f"Bearer {topo.token}"}
        verify = topo.ssl_context() or True
        async with httpx.AsyncClient(headers=headers, timeout=60, verify=verify) as http:

            async def stat(base: str, machine_id: str) -> tuple[str, httpx.Response]:
                body = {"op": "FILE_STAT", "payload": {"path": "."}, "target_machine": machine_id}
                return machine_id, await http.post(f"{base}/api/v1/sessions/{SESSION}/ops", json=body)

            bases = [(server_index, server.url) for server_index, server in enumerate(topo.servers)]
            bases.append((None, topo.url))
            answers = await asyncio.gather(
                *(
                    _tagged(caller, stat(base, machine_id))
                    for (caller, base), machine_id in itertools.product(bases, shim_ids)
                )
            )
        op_failures = []
        for caller, (machine_id, response) in answers:
            answer = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
            if (
                response.status_code == 200
                and answer.get("machine_id") == machine_id
                and (answer["type"] == "FILE_STAT_RESPONSE")
            ):
                if caller is None:
                    through_nginx += 1
                else:
                    op_pairs[(caller, shim_at[machine_id])] += 1
            else:
                op_failures.append((caller, machine_id, response.status_code, response.text[:300]))
        timings["80 ops"] = time.monotonic() - ops_started
        print(f"machine ops by (caller process, shim process): {dict(sorted(op_pairs.items()))}")
        print(f"machine ops through nginx: {through_nginx}")
        assert op_failures == [], op_failures[:5]
        assert set(op_pairs) == ALL_PAIRS, op_pairs
        assert through_nginx == SHIMS

        # The same lists from every process, each reached on its own port.
        machine_lists = []
        remote_lists = []
        for server in topo.servers:
            response = await asyncio.to_thread(server.get, "/api/v1/machines", topo.token)
            assert response.status_code == 200, response.text
            machine_lists.append(sorted(_stable(entry) for entry in response.json()["machines"]))
            async with LiveSession.open(server.ws_url, topo.token) as direct:
                listed = await direct.request("remote-list")
                remote_lists.append(sorted(json.dumps(entry, sort_keys=True) for entry in listed["remotes"]))
        assert {json.loads(e)["machine_id"] for e in machine_lists[0]} >= set(shim_ids)
        assert machine_lists[1] == machine_lists[0] and machine_lists[2] == machine_lists[0]
        assert {json.loads(e)["remotename"] for e in remote_lists[0]} >= set(remotes)
        assert remote_lists[1] == remote_lists[0] and remote_lists[2] == remote_lists[0]

        for shim in raw:
            await shim.close()
        for shim in real:
            shim.stop()
        for host in remotes.values():
            host.task.cancel()
    print("timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    print("largest heartbeat age (s): " + ", ".join(f"{age:.1f}" for age in sorted(heartbeats.values())))
    # A reaped process closes every socket it holds: the calls above would have failed.
    assert topo.reaped_count() == reaped_before, topo.details()

    # Leave the shared cluster as found: no remote, no shim connection, no session.
    async def clean() -> bool:
        return not remote_processes(topo) and not shim_processes(topo) and not ws_session_processes(topo)

    await eventually(clean, timeout=15, what="every connection row to go", details=topo.details)


async def _tagged(tag: Any, awaitable: Any) -> tuple[Any, Any]:
    return tag, await awaitable


def _all_shims(topo: Cluster, shim_ids: dict[str, int]) -> dict[str, str] | None:
    found = {m: p for m, p in shim_processes(topo).items() if m in shim_ids}
    return found if len(found) == len(shim_ids) else None


def _stable(entry: dict[str, Any]) -> str:
    """A machine entry without the fields that move while it is listed (last seen times)."""
    return json.dumps({k: v for k, v in entry.items() if not k.startswith("last_")}, sort_keys=True)
