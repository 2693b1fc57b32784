"""The suite drops the PostgreSQL databases a crashed test process left behind
(tests/backends.py ``orphan_databases_drop``), and only those."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.backends import database_name, orphan_databases_drop, postgres_admin, postgres_admin_url

pytestmark = pytest.mark.postgres


def _exists(admin_url: str, name: str) -> bool:
    with postgres_admin(admin_url) as conn:
        return conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone() is not None


def test_a_database_whose_maker_is_gone_is_dropped_and_a_live_makers_is_kept() -> None:
    admin_url = postgres_admin_url()
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    orphan = f"dispatch_it_p{gone.stdout.strip()}_{database_name('')[-12:]}"  # made by a process now gone
    mine = database_name("dispatch_it_")
    with postgres_admin(admin_url) as conn:
        conn.execute(f'CREATE DATABASE "{orphan}"')
        conn.execute(f'CREATE DATABASE "{mine}"')
    try:
        dropped = orphan_databases_drop(admin_url)
        assert orphan in dropped and mine not in dropped
        assert not _exists(admin_url, orphan) and _exists(admin_url, mine)
    finally:
        with postgres_admin(admin_url) as conn:
            for name in (orphan, mine):
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
