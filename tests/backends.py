"""The PostgreSQL and Redis a test needs, found or started.

PostgreSQL at ``DISPATCH_TEST_POSTGRES_URL`` (default
``postgres://postgres@127.0.0.1:5432/postgres``), Redis at ``DISPATCH_TEST_REDIS_URL``
(default ``redis://127.0.0.1:6379``) or a throwaway ``redis-server``. Without them a test is
skipped with the reason, except under ``CI=true``, where it fails (``unavailable``).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn
from urllib.parse import urlsplit

import pytest

ON_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable(reason: str) -> NoReturn:
    """Skip (locally) or fail (on CI) a test whose service is missing."""
    if ON_CI:
        pytest.fail(f"{reason} (CI=true: a missing service is a failure)")
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def postgres_admin_url() -> str:
    return os.environ.get("DISPATCH_TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/postgres")


@contextmanager
def postgres_admin(admin_url: str) -> Iterator[Any]:
    """An autocommit connection to ``admin_url``; a server that cannot be reached makes
    the test ``unavailable`` (skipped, or failed under CI), but any other refusal — too
    many clients, a failed statement — is an error of the test."""
    import psycopg

    try:
        conn = psycopg.connect(admin_url, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        if exc.sqlstate is not None:  # the server answered and refused
            raise
        unavailable(f"PostgreSQL not reachable at {admin_url}: {exc}")
    with conn:
        yield conn


@contextmanager
def postgres_database(prefix: str = "dispatch_it_", *, template: str = "") -> Iterator[str]:
    """A fresh PostgreSQL database for one test, empty or a copy of the database
    ``template``; yields its URL and drops it after.

    Its name is ``database_name(prefix)`` (``prefix`` tells whose leftovers a database is;
    lowercase letters, digits and ``_`` only).
    """
    import psycopg

    admin_url = postgres_admin_url()
    name = database_name(prefix)
    from_template = f' TEMPLATE "{template}"' if template else ""
    with postgres_admin(admin_url) as conn:
        for attempt in range(50):
            try:
                conn.execute(f'CREATE DATABASE "{name}"{from_template}')
                break
            except psycopg.errors.ObjectInUse:
                # The template's last user (the migrating process) may take a moment to go.
                if attempt == 49:
                    raise
                time.sleep(0.1)
    url = admin_url.rsplit("/", 1)[0] + "/" + name
    try:
        yield url
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


_MAKER = re.compile(r"_p(\d+)_[0-9a-f]{12}$")


def database_name(prefix: str) -> str:
    """``prefix`` + ``p<this process's pid>_`` + 12 random hex digits: the pid lets a later
    run tell that the database's maker is gone (``orphan_databases_drop``)."""
    return f"{prefix}p{os.getpid()}_{uuid.uuid4().hex[:12]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def orphan_databases_drop(admin_url: str) -> list[str]:
    """Drop the test databases (``dispatch…`` named by ``database_name``) whose making
    process is gone: an xdist worker killed before its ``finally`` or ``atexit`` ran leaves
    its instance and template databases behind. Only for a server on this host, whose pids
    these are, and never one with a connection open (another PID namespace, a container
    sharing this server, may hold it); returns the names dropped."""
    if urlsplit(admin_url).hostname not in ("127.0.0.1", "localhost", "::1"):
        return []
    import psycopg

    dropped: list[str] = []
    with postgres_admin(admin_url) as conn:
        names = [row[0] for row in conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'dispatch%'")]
        for name in names:
            maker = _MAKER.search(name)
            if maker is not None and not _alive(int(maker.group(1))):
                try:
                    conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
                except psycopg.errors.ObjectInUse:
                    continue
                dropped.append(name)
    return dropped


def redis_answers(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except Exception:
        return False


def start_redis_server(port: int) -> subprocess.Popen[bytes]:
    """Start a private ``redis-server`` on 127.0.0.1:``port`` (no persistence) and wait until
    it answers; the caller stops it (``kill()`` for a crash). Skips (fails on CI) without
    the binary or when it does not come up within 5 s."""
    binary = shutil.which("redis-server")
    if binary is None:
        unavailable("no redis-server to start")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(50):
        if redis_answers(f"redis://127.0.0.1:{port}"):
            return proc
        time.sleep(0.1)
    proc.kill()
    proc.wait(5)
    unavailable("redis-server did not start")


@contextmanager
def redis_url() -> Iterator[str]:
    """A Redis URL with a private key prefix's worth of isolation (a random db-less prefix).

    Uses the running Redis when it answers, else starts ``redis-server`` on a free port.
    """
    base = os.environ.get("DISPATCH_TEST_REDIS_URL", "redis://127.0.0.1:6379")
    if redis_answers(base):
        yield base
        return
    if shutil.which("redis-server") is None:
        unavailable(f"Redis not reachable at {base} and no redis-server to start")
    port = free_port()
    proc = start_redis_server(port)
    try:
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(5)
