"""Redis killed under two ``serve`` processes and started again: remotes recover without a
restart of Dispatch, and no ghost rows stay (docs/operating.md#health).

The test runs its own ``redis-server`` on a free port (never the machine's shared one) and
a fresh PostgreSQL database. A remote served by the project's client (``remotes.client``,
which reconnects by itself) is on server A; the caller is on server B. While Redis is
down: A's ``/healthz`` is 503 naming the channel layer, open sockets close 1012, new ones
are accepted and closed 1013, and REST answers 503 ``TEMPORARILY_UNAVAILABLE`` rather than
500. Within 10 s of Redis coming back calls succeed again, and the ``WsSession`` and
``Remote`` rows are exactly the live ones.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import psycopg
import pytest

from examples.weather_service import get_forecast
from remotes.client import Remote
from tests.backends import free_port, start_redis_server
from tests.infra import eventually, instance
from tests.live_clients import LiveSession

pytestmark = [
    pytest.mark.integration,
    pytest.mark.multiprocess,
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.timeout(90),
]

REMOTE = "weather-service"
OUTAGE_SECONDS = 6.0
RECOVERY_BOUND = 10.0  # seconds after Redis is back by which calls must succeed again


def _rows(database_url: str) -> tuple[int, int]:
    """(ws sessions, remotes) in the instance's database."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        sessions = conn.execute("SELECT count(*) FROM remotes_wssession").fetchone()
        remotes = conn.execute("SELECT count(*) FROM remotes_remote").fetchone()
    assert sessions is not None and remotes is not None
    return int(sessions[0]), int(remotes[0])


async def test_remotes_recover_within_10_s_of_redis_coming_back_and_leave_no_ghost_rows() -> None:
    port = free_port()
    redis = start_redis_server(port)
    try:
        with instance(
            postgres=True,
            REDIS_URL=f"redis://127.0.0.1:{port}",
            DISPATCH_REDIS_PREFIX=f"dispatch-it-{uuid.uuid4().hex[:8]}",
            DISPATCH_REMOTE_CALL_TIMEOUT="5",
        ) as inst:
            a, b = inst.serve(wait=False), inst.serve(wait=False)
            a.wait_healthy()
            b.wait_healthy()
            token = inst.admin_token
            database_url = inst.env["DATABASE_URL"]
            remote = Remote(REMOTE, url=a.ws_url, token=token, functions=[get_forecast])
            serving = asyncio.create_task(remote.serve())
            try:
                async with httpx.AsyncClient(
                    base_url=b.url, headers={"Authorization": f"Bearer {token}"}, timeout=15
                ) as api:

                    async def call() -> httpx.Response:
                        return await api.post(
                            f"/api/v1/remotes/{REMOTE}/call",
                            json={
                                "function": "get_forecast",
                                "args": {"city": "Rome"},
                                "timeout": 3,
                            },
                        )

                    async def call_works() -> bool:
                        return (await call()).status_code == 200

                    await eventually(call_works, timeout=20, interval=0.2, what="the first call through B")

                    async with LiveSession.open(b.ws_url, token) as idle:
                        await idle.request("ping")
                        redis.kill()  # SIGKILL: Redis gets no chance to say goodbye
                        redis.wait(5)
                        killed_at = time.monotonic()

                        # Open sockets close 1012 (their rows deleted first).
                        assert await idle.closed(timeout=5) == 1012

                    # /healthz names the channel layer.
                    health = await api.get(f"{a.url}/healthz")
                    assert health.status_code == 503
                    assert health.json()["channel_layer"] == "error"
                    assert health.json()["database"] == "ok"

                    # A REST route that needs Redis (the password throttle) is a 503, not a 500.
                    login = await api.post(
                        "/api/v1/auth/token", json={"username": "admin", "password": inst.admin_password}
                    )
                    assert login.status_code == 503, login.text
                    assert login.json()["error"]["code"] == "TEMPORARILY_UNAVAILABLE"
                    # The remote's session is gone (404) or the layer is (503): never a 500.
                    during = await call()
                    assert during.status_code in (404, 503), during.text

                    # New sockets are accepted, then closed 1013 (try again later).
                    async with LiveSession.open(a.ws_url, token) as fresh:
                        assert await fresh.closed(timeout=5) == 1013

                    await asyncio.sleep(max(0.0, killed_at + OUTAGE_SECONDS - time.monotonic()))
                    redis = start_redis_server(port)
                    back_at = time.monotonic()

                    await eventually(
                        call_works, timeout=RECOVERY_BOUND, interval=0.2, what="a call after Redis came back"
                    )
                    recovered_after = time.monotonic() - back_at
                    print(f"calls succeed again {recovered_after:.1f}s after Redis came back")

                    # No ghost rows: the remote's one session and its remote, nothing else.
                    await eventually(lambda: _rows(database_url) == (1, 1), timeout=5, what="only the live rows")
                    # Both processes report healthy again (each probes its own layer connection;
                    # under a loaded CI run that can lag the first working call by a moment).
                    last: dict[str, str] = {}

                    async def both_healthy() -> bool:
                        healthy = True
                        for server in (a, b):
                            answer = await api.get(f"{server.url}/healthz")
                            last[server.url] = answer.text
                            healthy = healthy and answer.status_code == 200
                        return healthy

                    await eventually(
                        both_healthy, timeout=RECOVERY_BOUND, interval=0.2, what="/healthz 200 on both",
                        details=lambda: str(last),
                    )  # fmt: skip
            finally:
                serving.cancel()
                await asyncio.gather(serving, return_exceptions=True)
    finally:
        redis.kill()
        redis.wait(5)
