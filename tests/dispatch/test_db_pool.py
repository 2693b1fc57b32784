"""Database connections per process (docs/deploy.md#pool-sizes).

On PostgreSQL every ``serve`` process draws its connections from psycopg's pool, bounded by
``DISPATCH_DB_POOL_MAX``; ``DISPATCH_DB_CONN_MAX_AGE`` (persistent connections, which Django
refuses with a pool) is refused with PostgreSQL; SQLite keeps persistent connections. A
query that waits longer than ``DISPATCH_DB_POOL_TIMEOUT`` for a connection is a 503
``TEMPORARILY_UNAVAILABLE`` in the API's error shape.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from typing import Any

import httpx
import psycopg
import pytest
from django.db import OperationalError
from psycopg_pool import PoolTimeout
from rest_framework.test import APIRequestFactory

from tests.backends import postgres_admin_url
from tests.infra import PYTHON, REPO, base_env, instance

_PRINT_DB = (
    "import json, django; django.setup(); from django.conf import settings; "
    "db = settings.DATABASES['default']; "
    "print(json.dumps({k: db.get(k) for k in ('ENGINE', 'CONN_MAX_AGE', 'CONN_HEALTH_CHECKS', 'OPTIONS')}))"
)


def _settings_of(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-c", _PRINT_DB], env=base_env(**env), cwd=REPO, capture_output=True, text=True, timeout=60
    )


def test_it_refuses_a_connection_max_age_with_postgresql() -> None:
    done = _settings_of(DATABASE_URL="postgres://dispatch@127.0.0.1:5432/dispatch", DISPATCH_DB_CONN_MAX_AGE="300")
    assert done.returncode != 0
    assert "ImproperlyConfigured" in done.stderr
    assert "DISPATCH_DB_CONN_MAX_AGE" in done.stderr


def test_it_pools_postgresql_connections_and_keeps_sqlite_ones_open() -> None:
    done = _settings_of(
        DATABASE_URL="postgres://dispatch@127.0.0.1:5432/dispatch",
        DISPATCH_DB_POOL_MAX="7",
        DISPATCH_DB_POOL_TIMEOUT="1.5",
    )
    assert done.returncode == 0, done.stderr
    postgres = json.loads(done.stdout.strip().splitlines()[-1])
    assert postgres["CONN_MAX_AGE"] == 0
    assert postgres["CONN_HEALTH_CHECKS"] is False
    assert postgres["OPTIONS"]["pool"] == {"min_size": 2, "max_size": 7, "timeout": 1.5}

    done = _settings_of()
    assert done.returncode == 0, done.stderr
    sqlite = json.loads(done.stdout.strip().splitlines()[-1])
    assert sqlite["ENGINE"] == "django.db.backends.sqlite3"
    assert sqlite["CONN_MAX_AGE"] == 300
    assert "pool" not in sqlite["OPTIONS"]


def test_it_refuses_a_pool_minimum_above_its_maximum() -> None:
    done = _settings_of(
        DATABASE_URL="postgres://dispatch@127.0.0.1:5432/dispatch", DISPATCH_DB_POOL_MIN="5", DISPATCH_DB_POOL_MAX="4"
    )
    assert done.returncode != 0
    assert "DISPATCH_DB_POOL_MIN" in done.stderr


def test_it_answers_503_when_no_pooled_connection_is_free_in_time() -> None:
    """A PoolTimeout reaches the API as django.db's OperationalError (Django wraps it)."""
    from core.api import TokenListView

    class Busy(TokenListView):
        def get(self, request: Any) -> Any:
            try:
                raise PoolTimeout("couldn't get a connection after 5.00 sec")
            except PoolTimeout as exc:
                raise OperationalError(str(exc)) from exc

    request = APIRequestFactory().get("/api/v1/auth/tokens")
    response = Busy.as_view(authentication_classes=[], permission_classes=[])(request)
    assert response.status_code == 503
    assert response.data["error"]["code"] == "TEMPORARILY_UNAVAILABLE"


def _connections_to(database: str) -> int:
    with psycopg.connect(postgres_admin_url(), autocommit=True, connect_timeout=3) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (database,)).fetchone()
    return int(row[0]) if row else 0


@pytest.mark.postgres
@pytest.mark.integration
def test_it_stays_within_the_pool_under_200_concurrent_requests() -> None:
    pool_max = 5
    with instance(postgres=True, DISPATCH_DB_POOL_MAX=pool_max) as inst:
        server = inst.serve()
        token = inst.admin_token
        database = inst.env["DATABASE_URL"].rsplit("/", 1)[1]
        peak = 0
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            with psycopg.connect(postgres_admin_url(), autocommit=True, connect_timeout=3) as conn:
                while not done.is_set():
                    row = conn.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (database,)
                    ).fetchone()
                    peak = max(peak, int(row[0]) if row else 0)
                    time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        # A mix of sync DRF views, async views (database_sync_to_async) and /healthz.
        paths = ["/api/v1/agents", "/api/v1/remotes", "/api/v1/machines", "/api/v1/auth/tokens", "/healthz"]

        async def burst() -> list[int]:
            limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
            headers = {"Authorization": f"Bearer {token}"}
            async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60, headers=headers) as client:
                responses = await asyncio.gather(*(client.get(paths[i % len(paths)]) for i in range(200)))
            return [response.status_code for response in responses]

        try:
            statuses = asyncio.run(burst())
            time.sleep(0.5)
            after = _connections_to(database)
        finally:
            done.set()
            sampler.join(5)
        print(f"200 concurrent requests: peak {peak} PostgreSQL connections (pool max {pool_max}), {after} after")
        assert all(status < 500 for status in statuses), sorted(set(statuses))
        assert statuses.count(200) == 200, sorted(set(statuses))
        assert peak <= pool_max, f"{peak} connections to the database, pool max {pool_max}"
        assert after <= pool_max
