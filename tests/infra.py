"""Real infrastructure for tests: Dispatch instances (a data dir, a migrated database) and
the ``manage.py serve``, worker and shim subprocesses started on them.

The PostgreSQL and Redis they use come from ``tests.backends`` (skipped without them,
failed under ``CI=true``); the clients that talk to them are in ``tests.live_clients``.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.backends import (
    database_name,
    free_port,
    orphan_databases_drop,
    postgres_admin,
    postgres_admin_url,
    postgres_database,
    redis_url,
)

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


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
    if "DISPATCH_CHANNEL_LAYER" in os.environ:
        # A run on channels-redis' lists (DISPATCH_CHANNEL_LAYER=list) puts the servers it
        # starts on them too, not only the test process.
        env["DISPATCH_CHANNEL_LAYER"] = os.environ["DISPATCH_CHANNEL_LAYER"]
    if "PYTEST_CURRENT_TEST" in os.environ:
        # In a test, not a benchmark: xdist workers' servers share one PostgreSQL (100
        # connections by default), so each gets a smaller pool than production's 20 (a
        # test that measures the pool sets its own).
        env["DISPATCH_DB_POOL_MAX"] = "8"
    env.update(overrides)
    return env


def manage(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``manage.py`` with ``args`` in ``env``; returns the completed process.

    With ``check``, a failure raises ``AssertionError`` carrying the command's stderr (a
    bare ``CalledProcessError`` would hide why it failed).
    """
    done = subprocess.run(
        [PYTHON, str(REPO / "manage.py"), *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    if check and done.returncode != 0:
        raise AssertionError(
            f"manage.py {' '.join(args[:2])} exited {done.returncode}:\n{done.stderr[-3000:]}{done.stdout[-1000:]}"
        )
    return done


def wait_until(
    condition: Callable[[], Any],
    *,
    timeout: float,
    interval: float = 0.05,
    what: str = "condition",
    details: Callable[[], str] | None = None,
) -> Any:
    """Poll ``condition`` until it returns a truthy value (returned) or ``timeout`` seconds pass.

    Raises ``AssertionError`` naming ``what`` (plus ``details()``, e.g. a server log) when
    the deadline passes.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(_timed_out(timeout, what, details))
        time.sleep(interval)


async def eventually(
    condition: Callable[[], Any],
    *,
    timeout: float,
    interval: float = 0.05,
    what: str = "condition",
    details: Callable[[], str] | None = None,
) -> Any:
    """``wait_until`` for async tests: ``condition`` may be a coroutine function."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if loop.time() >= deadline:
            raise AssertionError(_timed_out(timeout, what, details))
        await asyncio.sleep(interval)


def _timed_out(timeout: float, what: str, details: Callable[[], str] | None) -> str:
    message = f"timed out after {timeout:g}s waiting for {what}"
    return f"{message}\n{details()}" if details is not None else message


@dataclass
class Process:
    """A background subprocess (a client, a worker, a server) writing its output to a log file."""

    proc: subprocess.Popen[str]
    log_path: Path
    terminated: bool = field(default=False, init=False)

    @classmethod
    def spawn(cls, env: dict[str, str], args: list[str], *, name: str) -> Process:
        log_path = Path(tempfile.mkstemp(prefix=f"dispatch-{name}-", suffix=".log")[1])
        with log_path.open("w") as log:
            proc = subprocess.Popen(args, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
        return cls(proc=proc, log_path=log_path)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float = 30) -> None:
        """Wait until ``text`` appears in the output; fail if the process exits first."""

        def seen() -> bool:
            if text in self.log():
                return True
            if not self.running:
                raise RuntimeError(f"process exited with {self.proc.returncode} before {text!r}:\n{self.log()}")
            return False

        wait_until(seen, timeout=timeout, what=f"{text!r} in the log")

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to clean up."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self) -> None:
        """Send SIGTERM once (a second SIGTERM would make ``serve`` skip its clean shutdown)."""
        if self.proc.poll() is None and not self.terminated:
            self.terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 15) -> int:
        """SIGTERM and wait (SIGKILL after ``timeout`` seconds); returns the exit code."""
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                # A hung process: `serve` prints every thread's stack on SIGUSR1 (into its
                # log, for the failure report), then it is killed.
                try:
                    self.proc.send_signal(signal.SIGUSR1)
                    time.sleep(0.5)
                except ProcessLookupError:
                    pass
                self.proc.kill()
                self.proc.wait(5)
        return int(self.proc.returncode)


@dataclass
class Server(Process):
    """A running ``manage.py serve`` subprocess, healthy on ``port``."""

    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    @classmethod
    def start(cls, env: dict[str, str], *extra: str) -> Server:
        """Start ``manage.py serve`` on a free port and wait until ``/healthz`` answers 200."""
        return cls.spawn_serve(env, *extra).wait_healthy()

    @classmethod
    def spawn_serve(cls, env: dict[str, str], *extra: str, public: bool = False) -> Server:
        """Start ``manage.py serve`` on a free port without waiting (see ``wait_healthy``);
        ``public``: with ``DISPATCH_PUBLIC_URL`` set to that port's URL."""
        port = free_port()
        if public:
            env = {**env, "DISPATCH_PUBLIC_URL": f"http://127.0.0.1:{port}"}
        started = Process.spawn(
            env, [PYTHON, str(REPO / "manage.py"), "serve", "--port", str(port), *extra], name=f"serve-{port}"
        )
        return cls(proc=started.proc, log_path=started.log_path, port=port)

    def wait_healthy(self, timeout: float = 30) -> Server:
        """Wait until ``/healthz`` answers 200; stops the process and raises if it never does."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"serve did not become healthy:\n{self.log()}")

    def get(self, path: str, token: str | None = None) -> httpx.Response:
        """``GET path`` on this server, with ``Authorization: Bearer token`` when given."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.get(f"{self.url}{path}", headers=headers, timeout=10)

    def remote_names(self, token: str) -> list[str]:
        """Names of the token owner's connected remotes, from ``GET /api/v1/remotes``."""
        response = self.get("/api/v1/remotes", token)
        response.raise_for_status()
        return [remote["remotename"] for remote in response.json()["remotes"]]


@dataclass
class ShimProcess(Process):
    """A ``python -m machines.shim run`` subprocess (docs/shim-protocol.md) and its state
    directory.

    ``machine_id`` is read from ``<state_dir>/state.json``; ``audit()`` parses the shim's
    own JSONL audit log (one record per operation it served).
    """

    state_dir: Path = field(default_factory=Path)
    name: str | None = None

    @property
    def machine_id(self) -> str:
        return str(json.loads((self.state_dir / "state.json").read_text())["machine_id"])

    def connections(self) -> int:
        """How many handshakes this shim has completed (``connected to …`` log lines)."""
        return self.log().count("INFO machines.shim: connected to ")

    def wait_connected(self, count: int = 1, timeout: float = 30) -> ShimProcess:
        """Wait until the shim has completed ``count`` handshakes; fail if it exits first."""

        def connected() -> bool:
            if self.connections() >= count:
                return True
            if not self.running:
                raise RuntimeError(f"shim exited with {self.proc.returncode} before connecting:\n{self.log()}")
            return False

        wait_until(connected, timeout=timeout, what=f"shim {self.name!r} to connect", details=self.log)
        return self

    def audit(self) -> list[dict[str, Any]]:
        """The records of the shim's audit log (``audit.jsonl``), oldest first."""
        path = self.state_dir / "audit.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def audited_ops(self) -> list[str]:
        """The ``op`` of every audit record."""
        return [str(record["op"]) for record in self.audit()]


@dataclass
class ShimLogin(Process):
    """A ``python -m machines.shim login`` subprocess waiting for its code to be approved."""

    def user_code(self, timeout: float = 30) -> str:
        """The ``XXXX-XXXX`` code the login printed (docs/shim-protocol.md#getting-a-token)."""

        def printed() -> str | None:
            found = re.search(r"enter the code ([A-Z]{4}-[A-Z]{4})", self.log())
            if found is None and not self.running:
                raise RuntimeError(f"login exited with {self.proc.returncode} before printing a code:\n{self.log()}")
            return found.group(1) if found else None

        return str(wait_until(printed, timeout=timeout, what="the login's user code", details=self.log))


@dataclass
class Instance:
    """One Dispatch deployment's configuration (data dir, database, channel layer).

    ``admin_password`` is the one-time password ``ensure_admin`` printed for ``admin``, and
    ``admin_token`` an API token of ``admin`` issued at setup (``token()`` issues more).
    Everything started through it (servers, workers, clients) is stopped by ``stop()``.
    """

    env: dict[str, str]
    servers: list[Server] = field(default_factory=list)
    processes: list[Process] = field(default_factory=list)
    admin_password: str = ""
    admin_token: str = ""

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

    def serve(self, *extra: str, wait: bool = True, public: bool = False, **env: Any) -> Server:
        """Start ``manage.py serve`` (``extra`` arguments, ``env`` overrides).

        Waits until it is healthy unless ``wait=False`` (then call ``Server.wait_healthy``:
        servers started together come up in parallel). ``public``: its ``DISPATCH_PUBLIC_URL``
        is its own URL (what OAuth's issuer and resource are made of).
        """
        server = Server.spawn_serve({**self.env, **{k: str(v) for k, v in env.items()}}, *extra, public=public)
        self.servers.append(server)
        return server.wait_healthy() if wait else server

    def worker(self, **env: Any) -> Process:
        """Start ``manage.py dispatch_worker`` and wait until it has registered its process."""
        worker = self.spawn([PYTHON, str(REPO / "manage.py"), "dispatch_worker"], name="worker", **env)
        worker.wait_for_log("Dispatch worker running")
        return worker

    def client(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run ``python -m remotes.client ARGS`` to completion (output captured as text)."""
        return subprocess.run(
            [PYTHON, "-m", "remotes.client", *args],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def spawn(self, args: list[str], *, name: str, **env: Any) -> Process:
        """Start a background process in this instance's environment; ``stop()`` ends it."""
        process = Process.spawn({**self.env, **{k: str(v) for k, v in env.items()}}, args, name=name)
        self.processes.append(process)
        return process

    def shim(
        self,
        name: str | None,
        root: str | os.PathLike[str] | None,
        *flags: str,
        server: Server | None = None,
        token: str | None = None,
        stored_login: bool = False,
        state_dir: str | os.PathLike[str] | None = None,
        wait: bool = True,
        **env: Any,
    ) -> ShimProcess:
        """Start ``python -m machines.shim run`` against ``server`` (default: the first one started).

        ``name`` is its ``--name`` (display name), ``root`` its ``--root``, ``flags`` more
        arguments (``--no-shell``, ``--session ID``…). It authenticates with ``token``
        (default: ``admin``'s API token) unless ``stored_login`` (then the state dir's login
        is used). ``state_dir`` defaults to a fresh directory in the instance's data dir, so
        each shim has its own ``machine_id``; pass the same one twice for a takeover.
        Reconnect delays are scaled by ``DISPATCH_SHIM_BACKOFF_SCALE=0.05`` unless ``env``
        says otherwise. Waits for the ``HELLO_ACK`` unless ``wait=False``.
        """
        target = server or self.servers[0]
        if state_dir is None:
            state_dir = Path(self.env["DISPATCH_DATA_DIR"]) / "shims" / f"{name or 'shim'}-{uuid.uuid4().hex[:8]}"
        args = [PYTHON, "-m", "machines.shim", "run", "--server", target.url, "--state-dir", str(state_dir)]
        if not stored_login:
            args += ["--token", token or self.admin_token]
        if root is not None:
            args += ["--root", str(root)]
        if name is not None:
            args += ["--name", name]
        shim_env = {"DISPATCH_SHIM_BACKOFF_SCALE": "0.05", **{k: str(v) for k, v in env.items()}}
        started = Process.spawn({**self.env, **shim_env}, [*args, *flags], name=f"shim-{name or 'anon'}")
        shim = ShimProcess(proc=started.proc, log_path=started.log_path, state_dir=Path(state_dir), name=name)
        self.processes.append(shim)
        return shim.wait_connected() if wait else shim

    def shim_login(self, server: Server | None = None, *, state_dir: str | os.PathLike[str]) -> ShimLogin:
        """Start ``python -m machines.shim login --server URL --state-dir DIR`` (the device flow).

        Read the code with ``ShimLogin.user_code()``; the process exits 0 once it is approved.
        """
        target = server or self.servers[0]
        args = [PYTHON, "-m", "machines.shim", "login", "--server", target.url, "--state-dir", str(state_dir)]
        started = Process.spawn(self.env, args, name="shim-login")
        login = ShimLogin(proc=started.proc, log_path=started.log_path)
        self.processes.append(login)
        return login

    def stop(self) -> None:
        """SIGTERM every process started through this instance at once, then wait for each."""
        everything = [*self.processes, *self.servers]
        for process in everything:
            process.terminate()
        for process in everything:
            process.stop()


_SETUP = (
    "from django.core.management import call_command; "
    "call_command('migrate', verbosity=0); "
    "from core.services import instance_identity_get; instance_identity_get(); "
    "call_command('ensure_admin'); "
    "call_command('issue_token', 'admin', name='tests')"
)

# A migrated database to copy, made once per test process (SQLite: a file; PostgreSQL: a
# template database): migrating from nothing costs each instance seconds of CPU, over
# hundreds of instances a suite. The template holds no instance identity (migration 0001
# makes one; _SETUP makes each copy its own), and _SETUP still migrates, so a copy made
# before a new migration only costs that migration.
_TEMPLATE_SETUP = (
    "from django.core.management import call_command; "
    "call_command('migrate', verbosity=0); "
    "from core.models import InstanceIdentity; InstanceIdentity.objects.all().delete()"
)
_templates: dict[str, str] = {}
_templates_lock = threading.Lock()


def _migrated_template(*, postgres: bool) -> str:
    """The SQLite file or PostgreSQL database (on ``postgres_admin_url()``'s server) to
    copy a new instance's database from; made on first use."""
    kind = "postgres" if postgres else "sqlite"
    with _templates_lock:
        if kind in _templates:
            return _templates[kind]
        folder = tempfile.mkdtemp(prefix="dispatch-it-template-")
        atexit.register(shutil.rmtree, folder, True)
        env = base_env(DISPATCH_DATA_DIR=folder, SECRET_KEY=uuid.uuid4().hex * 2)
        if postgres:
            admin_url = postgres_admin_url()
            orphan_databases_drop(admin_url)  # what crashed runs left, once per process
            name = database_name("dispatch_it_template_")
            with postgres_admin(admin_url) as conn:
                conn.execute(f'CREATE DATABASE "{name}"')
            atexit.register(_drop_database, admin_url, name)
            env["DATABASE_URL"] = admin_url.rsplit("/", 1)[0] + "/" + name
            manage(env, "shell", "-c", _TEMPLATE_SETUP)
            _templates[kind] = name
        else:
            manage(env, "shell", "-c", _TEMPLATE_SETUP)
            _templates[kind] = str(Path(folder) / "dispatch.sqlite3")
        return _templates[kind]


def _drop_database(admin_url: str, name: str) -> None:
    import psycopg

    with contextlib.suppress(psycopg.Error), psycopg.connect(admin_url, autocommit=True, connect_timeout=3) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def instance(
    *, postgres: bool = False, redis: bool = False, database_prefix: str = "dispatch_it_", **env: Any
) -> Iterator[Instance]:
    """A migrated Dispatch instance with an ``admin`` user, on SQLite or PostgreSQL (+ Redis).

    With ``postgres`` its database is a fresh one named ``database_prefix`` + random hex.
    """
    data_dir = tempfile.mkdtemp(prefix="dispatch-it-")
    overrides = {
        "DISPATCH_DATA_DIR": data_dir,
        "SECRET_KEY": uuid.uuid4().hex * 2,
        **{k: str(v) for k, v in env.items()},
    }
    with (
        _maybe(
            postgres_database(database_prefix, template=_migrated_template(postgres=True)) if postgres else None
        ) as database_url,
        _maybe(redis_url() if redis else None) as redis_base,
    ):
        if database_url:
            overrides["DATABASE_URL"] = database_url
        elif "DATABASE_URL" not in env:
            database = Path(overrides["DISPATCH_DATA_DIR"]) / "dispatch.sqlite3"
            if not database.exists():
                shutil.copyfile(_migrated_template(postgres=False), database)
        if redis_base:
            overrides["REDIS_URL"] = redis_base
            overrides["DISPATCH_REDIS_PREFIX"] = f"dispatch-it-{uuid.uuid4().hex[:8]}"
        inst = Instance(env=base_env(**overrides))
        # migrate, ensure_admin and issue_token in one process: each Django start costs a second or two.
        created = inst.manage("shell", "-c", _SETUP).stdout
        inst.admin_password = next(
            (line.split(":", 1)[1].strip() for line in created.splitlines() if line.strip().startswith("password:")), ""
        )
        inst.admin_token = created.strip().splitlines()[-1]
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
