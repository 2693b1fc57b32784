"""A frozen or stopped dependency under a real ``serve`` process (docs/operating.md#health).

Redis frozen with SIGSTOP (not killed: it still accepts connections and never answers)
used to stall ``/healthz`` and every request that touched Redis for the connections' 30 s
socket timeout, with nothing in the log. Now, while it is frozen: ``/healthz`` answers
within its documented 3 s naming the channel layer; a read that needs no Redis answers
200, one that does 503 ``TEMPORARILY_UNAVAILABLE`` with ``Retry-After`` naming the channel
layer; so is the MCP ``list_machines`` tool (an ``isError`` result, no traceback), while a
machine operation to a shim of the same process needs no Redis and answers; the log holds one
WARNING for the outage however many requests fail. After SIGCONT everything works again
and one INFO says so.

PostgreSQL stopped (``pg_ctl stop``) under a ``serve`` process: ``/healthz`` answers within
3 s naming the database, and 200 again once it is back.

Each test runs its own ``redis-server`` / PostgreSQL cluster on free ports, never the
machine's shared ones.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.backends import free_port, start_redis_server, unavailable
from tests.infra import instance, wait_until

HEALTHZ_BOUND = 3.5  # seconds: /healthz's documented 3 s, plus the test client's own overhead
DEADLINE = 2.0  # DISPATCH_DEPENDENCY_TIMEOUT's default, the bound of a request that needs Redis
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def timed(method: str, url: str, **kwargs: Any) -> tuple[float, httpx.Response]:
    started = time.monotonic()
    response = httpx.request(method, url, timeout=60, **kwargs)
    return time.monotonic() - started, response


def mcp_tool(url: str, token: str, name: str, arguments: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """``tools/call`` over ``/mcp``; returns (seconds, the JSON-RPC answer)."""
    envelope = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": name, "arguments": arguments}}
    took, response = timed(
        "POST", f"{url}/mcp", headers={**MCP_HEADERS, "Authorization": f"Bearer {token}"}, json=envelope
    )
    assert response.status_code == 200, response.text
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        lines = [line[5:] for line in response.text.splitlines() if line.startswith("data:") and line[5:].strip()]
        return took, json.loads(lines[-1])
    return took, response.json()


def outage_lines(log: str, level: str) -> list[str]:
    return [line for line in log.splitlines() if f" {level} core.outage:" in line]


@pytest.mark.integration
@pytest.mark.redis
@pytest.mark.timeout(180)
def test_a_frozen_redis_costs_a_request_its_deadline_and_the_log_one_warning(tmp_path: Path) -> None:
    port = free_port()
    redis = start_redis_server(port)
    try:
        with instance(
            REDIS_URL=f"redis://127.0.0.1:{port}",
            DISPATCH_REDIS_PREFIX=f"dispatch-it-{uuid.uuid4().hex[:8]}",
            DISPATCH_LOG_LEVEL="INFO",
        ) as inst:
            server = inst.serve()
            token = inst.admin_token
            auth = {"Authorization": f"Bearer {token}"}
            root = tmp_path / "root"
            root.mkdir()
            (root / "a.txt").write_text("hello")
            inst.shim("laptop", root, "--session", "s1")
            op = {"op": "FILE_STAT", "payload": {"path": str(root / "a.txt")}}
            assert timed("POST", f"{server.url}/api/v1/sessions/s1/ops", headers=auth, json=op)[1].status_code == 200
            assert timed("GET", f"{server.url}/api/v1/machines", headers=auth)[1].status_code == 200

            os.kill(redis.pid, signal.SIGSTOP)
            try:
                took, health = timed("GET", f"{server.url}/healthz")
                print(f"\n/healthz with Redis frozen: {took:.2f}s {health.json()}")
                assert took < HEALTHZ_BOUND
                assert health.status_code == 503 and health.headers["Retry-After"]
                body = health.json()
                assert (body["database"], body["channel_layer"], body["failing"]) == ("ok", "error", ["channel_layer"])
                assert body["errors"]["channel_layer"]

                # A read that needs no Redis is not held up.
                took, agents = timed("GET", f"{server.url}/api/v1/agents", headers=auth)
                print(f"GET /api/v1/agents: {took:.2f}s {agents.status_code}")
                assert agents.status_code == 200 and took < DEADLINE

                # One that needs it (the default-machine cache) is a 503 naming the layer.
                took, machines = timed("GET", f"{server.url}/api/v1/machines", headers=auth)
                print(f"GET /api/v1/machines: {took:.2f}s {machines.status_code} {machines.text}")
                assert took < DEADLINE + 1.5
                assert machines.status_code == 503 and machines.headers["Retry-After"]
                error = machines.json()["error"]
                assert error["code"] == "TEMPORARILY_UNAVAILABLE"
                assert error["message"].startswith("the channel layer (Redis)")
                assert error["details"] == {"service": "channel_layer"}

                # A machine operation to a shim connected to this very process needs no Redis:
                # the request and its reply skip the channel layer
                # (docs/operating.md#channel-layer), so it is answered, not held up or refused 503.
                took, answered = timed("POST", f"{server.url}/api/v1/sessions/s1/ops", headers=auth, json=op)
                print(f"POST ops: {took:.2f}s {answered.status_code} {answered.text}")
                assert took < DEADLINE
                assert answered.status_code == 200, answered.text
                assert answered.json()["type"] == "FILE_STAT_RESPONSE"

                # MCP list_machines: an isError result naming the layer, no traceback.
                took, answer = mcp_tool(server.url, token, "list_machines", {"session_id": "s1"})
                print(f"MCP list_machines: {took:.2f}s {answer}")
                assert took < DEADLINE + 1.5
                result = answer["result"]
                assert result["isError"] is True
                text = result["content"][0]["text"]
                assert text.startswith("TEMPORARILY_UNAVAILABLE: the channel layer (Redis)"), text

                # More requests during the outage add no log line (the background loops log
                # their own first failure once each, whenever it comes).
                seen = len(server.log())
                for _ in range(5):
                    assert timed("GET", f"{server.url}/api/v1/machines", headers=auth)[1].status_code == 503
                added = server.log()[seen:].splitlines()
                assert not [
                    line
                    for line in added
                    if (" WARNING " in line or " ERROR " in line) and " dispatch.background:" not in line
                ], added
            finally:
                os.kill(redis.pid, signal.SIGCONT)

            def healthy() -> bool:
                return httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200

            wait_until(healthy, timeout=30, what="/healthz 200 after SIGCONT", details=server.log)
            wait_until(
                lambda: (
                    timed("POST", f"{server.url}/api/v1/sessions/s1/ops", headers=auth, json=op)[1].status_code == 200
                ),
                timeout=30,
                what="a machine operation after SIGCONT",
                details=server.log,
            )
            log = server.log()
            print(log[-3000:])
            assert len(outage_lines(log, "WARNING")) == 1, log
            assert "the channel layer (Redis) is unavailable" in outage_lines(log, "WARNING")[0]
            assert [line for line in outage_lines(log, "INFO") if "the channel layer (Redis) is back" in line], log
            assert "Traceback" not in log
            assert " ERROR django.request" not in log
    finally:
        os.kill(redis.pid, signal.SIGCONT)
        redis.kill()
        redis.wait(5)


# --- a PostgreSQL cluster of the test's own ------------------------------------------------


def _pg_binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        for candidate in sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True):
            return str(candidate)
        unavailable(f"no {name} to start a PostgreSQL cluster")
    return found


def _as_postgres(args: list[str]) -> list[str]:
    """``args`` run as the ``postgres`` user when this is root (initdb and postgres refuse root)."""
    if os.geteuid() != 0:
        return args
    runuser = shutil.which("runuser")
    if runuser is None:
        unavailable("running as root without runuser: cannot start a private PostgreSQL")
    return [runuser, "-u", "postgres", "--", *args]


@contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    """A throwaway PostgreSQL cluster on a free port, with an empty ``dispatch`` database."""
    port = free_port()
    base = Path(tempfile.mkdtemp(prefix="dispatch-pg-"))
    data, sockets = base / "data", base / "sockets"
    sockets.mkdir()
    if os.geteuid() == 0:
        shutil.chown(base, "postgres")
        shutil.chown(sockets, "postgres")
    pg_ctl = _pg_binary("pg_ctl")
    subprocess.run(
        _as_postgres([_pg_binary("initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync"]),
        check=True,
        capture_output=True,
    )
    options = f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1 -c fsync=off"

    def start() -> None:
        subprocess.run(
            _as_postgres([pg_ctl, "-D", str(data), "-o", options, "-l", str(base / "log"), "-w", "start"]),
            check=True,
            capture_output=True,
        )

    def stop() -> None:
        subprocess.run(_as_postgres([pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"]), capture_output=True)

    def postmaster() -> int:
        return int((data / "postmaster.pid").read_text().split()[0])

    def children(parent: int) -> set[int]:
        """The postmaster's children (the backends, the checkpointer …)."""
        found = set()
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:
                found.add(int(stat.parent.name))
        return found

    def send(pid: int, signum: int) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    def signal_all(signum: int) -> None:
        """The postmaster first, so that it forks no backend the loop below has not seen (the
        server's pool opens connections while the test freezes it: a backend forked between
        listing the children and stopping the postmaster kept answering ``/healthz``); then
        its children until a listing finds none new."""
        parent = postmaster()
        send(parent, signum)
        signalled: set[int] = set()
        while fresh := children(parent) - signalled:
            for pid in fresh:
                send(pid, signum)
            signalled |= fresh

    start()
    try:
        with psycopg.connect(f"postgres://postgres@127.0.0.1:{port}/postgres", autocommit=True) as conn:
            conn.execute("CREATE DATABASE dispatch")
        yield PrivatePostgres(f"postgres://postgres@127.0.0.1:{port}/dispatch", stop, start, signal_all)
    finally:
        try:
            signal_all(signal.SIGCONT)
        except (OSError, ValueError):
            pass
        stop()
        shutil.rmtree(base, ignore_errors=True)


@dataclass
class PrivatePostgres:
    """A running private cluster: ``url`` of its ``dispatch`` database; ``stop()`` /
    ``start()`` it; ``signal(signum)`` every process of it (SIGSTOP freezes it)."""

    url: str
    stop: Callable[[], None]
    start: Callable[[], None]
    signal: Callable[[int], None]


@pytest.mark.integration
@pytest.mark.postgres
@pytest.mark.timeout(180)
def test_a_stopped_or_frozen_database_is_named_by_healthz_within_3_s() -> None:
    with private_postgres() as postgres, instance(DATABASE_URL=postgres.url) as inst:
        server = inst.serve()

        def degraded(what: str) -> dict[str, Any]:
            took, health = timed("GET", f"{server.url}/healthz")
            print(f"\n/healthz with PostgreSQL {what}: {took:.2f}s {health.json()}")
            assert took < HEALTHZ_BOUND
            assert health.status_code == 503 and health.headers["Retry-After"]
            body: dict[str, Any] = health.json()
            assert body["database"] == "error" and body["database_writable"] is False
            assert "database" in body["failing"] and body["errors"]["database"]
            return body

        def back(what: str) -> None:
            wait_until(
                lambda: httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200,
                timeout=30,
                what=f"/healthz 200 once PostgreSQL is {what}",
                details=server.log,
            )

        postgres.stop()
        for _ in range(3):
            degraded("stopped")
        postgres.start()
        back("started again")

        postgres.signal(signal.SIGSTOP)  # accepts connections, answers nothing
        try:
            for _ in range(2):
                assert degraded("frozen")["errors"]["database"] == "did not answer within 2s"
        finally:
            postgres.signal(signal.SIGCONT)
        back("thawed")
