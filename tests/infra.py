"""Real infrastructure for tests: PostgreSQL, Redis and `manage.py serve` subprocesses.

Tests that need PostgreSQL or Redis find them (``DISPATCH_TEST_POSTGRES_URL``, default
``postgres://postgres@127.0.0.1:5432/postgres``; ``DISPATCH_TEST_REDIS_URL``, default
``redis://127.0.0.1:6379``) or start a throwaway ``redis-server``. Without them a test is
skipped with the reason, except under ``CI=true``, where it fails.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
ON_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable(reason: str) -> None:
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
def postgres_database() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test; yields its URL and drops it after."""
    import psycopg

    admin_url = postgres_admin_url()
    name = f"dispatch_it_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(admin_url, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as exc:
        unavailable(f"PostgreSQL not reachable at {admin_url}: {exc}")
    url = admin_url.rsplit("/", 1)[0] + "/" + name
    try:
        yield url
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def redis_answers(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except Exception:
        return False


@contextmanager
def redis_url() -> Iterator[str]:
    """A Redis URL with a private key prefix's worth of isolation (a random db-less prefix).

    Uses the running Redis when it answers, else starts ``redis-server`` on a free port.
    """
    base = os.environ.get("DISPATCH_TEST_REDIS_URL", "redis://127.0.0.1:6379")
    if redis_answers(base):
        yield base
        return
    binary = shutil.which("redis-server")
    if binary is None:
        unavailable(f"Redis not reachable at {base} and no redis-server to start")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}"
    try:
        for _ in range(50):
            if redis_answers(url):
                break
            time.sleep(0.1)
        else:
            unavailable("redis-server did not start")
        yield url
    finally:
        proc.terminate()
        proc.wait(5)


def base_env(**overrides: str) -> dict[str, str]:
    """The environment of a child Dispatch process: this one's, minus test-only state."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "REDIS_URL", "DISPATCH_"))}
    env.update(
        {
            "DJANGO_SETTINGS_MODULE": "dispatch.settings",
            "PYTHONUNBUFFERED": "1",
            "DISPATCH_PROCESS_TTL": "3",
            "DISPATCH_HEARTBEAT_INTERVAL": "0.5",
            "DISPATCH_REAP_INTERVAL": "0.5",
            "DISPATCH_REMOTE_LIVENESS_INTERVAL": "0.5",
            "DISPATCH_REMOTE_CALL_TIMEOUT": "10",
            "DISPATCH_LOG_LEVEL": "WARNING",
        }
    )
    env.update(overrides)
    return env


def manage(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``manage.py`` with ``args`` in ``env``; returns the completed process."""
    return subprocess.run(
        [PYTHON, str(REPO / "manage.py"), *args], env=env, cwd=REPO, capture_output=True, text=True, check=check, timeout=120
    )


@dataclass
class Instance:
    """One Dispatch deployment's configuration (data dir, database, channel layer)."""

    env: dict[str, str]
    servers: list[Server] = field(default_factory=list)

    def manage(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return manage(self.env, *args, check=check)

    def token(self, username: str = "admin") -> str:
        return self.manage("issue_token", username).stdout.strip().splitlines()[-1]

    def create_user(self, username: str, password: str = "pw-secret-123") -> None:
        self.manage(
            "shell",
            "-c",
            "from django.contrib.auth import get_user_model; "
            f"get_user_model().objects.create_user({username!r}, password={password!r})",
        )

    def serve(self, *extra: str) -> Server:
        server = Server.start(self.env, *extra)
        self.servers.append(server)
        return server

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


@dataclass
class Server:
    """A running ``manage.py serve`` subprocess."""

    proc: subprocess.Popen[str]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    @classmethod
    def start(cls, env: dict[str, str], *extra: str) -> Server:
        port = free_port()
        log_path = Path(tempfile.mkstemp(prefix=f"dispatch-serve-{port}-", suffix=".log")[1])
        log = log_path.open("w")
        proc = subprocess.Popen(
            [PYTHON, str(REPO / "manage.py"), "serve", "--port", str(port), *extra],
            env=env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        server = cls(proc=proc, port=port, log_path=log_path)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode}:\n{server.log()}")
            try:
                if httpx.get(f"{server.url}/healthz", timeout=1).status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        server.stop()
        raise RuntimeError(f"serve did not become healthy:\n{server.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to clean up."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 15) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return int(self.proc.returncode)


@contextmanager
def instance(*, postgres: bool = False, redis: bool = False, **env: Any) -> Iterator[Instance]:
    """A migrated Dispatch instance with an ``admin`` user, on SQLite or PostgreSQL (+ Redis)."""
    data_dir = tempfile.mkdtemp(prefix="dispatch-it-")
    overrides = {"DISPATCH_DATA_DIR": data_dir, "SECRET_KEY": uuid.uuid4().hex * 2, **{k: str(v) for k, v in env.items()}}
    with _maybe(postgres_database() if postgres else None) as database_url, _maybe(
        redis_url() if redis else None
    ) as redis_base:
        if database_url:
            overrides["DATABASE_URL"] = database_url
        if redis_base:
            overrides["REDIS_URL"] = redis_base
            overrides["DISPATCH_REDIS_PREFIX"] = f"dispatch-it-{uuid.uuid4().hex[:8]}"
        inst = Instance(env=base_env(**overrides))
        inst.manage("migrate", "-v0")
        inst.manage("ensure_admin")
        try:
            yield inst
        finally:
            inst.stop()
            shutil.rmtree(data_dir, ignore_errors=True)


@contextmanager
def _maybe(manager: Any) -> Iterator[Any]:
    if manager is None:
        yield None
    else:
        with manager as value:
            yield value
