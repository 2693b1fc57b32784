"""What bench/peers.py's phases (B7, B8) share: the sizes, the goals (bench/README.md#goals),
the three paired instances (A links to B and C), a REST client, expert agents and their
shadows on A, and ``run_child``, which runs peers.py in one of its child modes
(peers_children.py) with an instance's environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
SCRIPT = BENCH / "peers.py"  # the entry point of the child modes
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


def run_child(env: dict[str, str], mode: str, *args: str, timeout: float = 600) -> Any:
    """Run bench/peers.py in ``mode`` with ``env``; returns the JSON it wrote."""
    out = Path(env["DISPATCH_DATA_DIR"]) / f"bench-{mode}-{uuid.uuid4().hex[:6]}.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), mode, "--out", str(out), *args],
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
