"""The nginx topology of docs/deploy.md for tests: a private nginx on a free loopback port
in front of several ``manage.py serve --no-background`` processes and one
``dispatch_worker``, on a fresh PostgreSQL database and Redis (``deploy.cluster`` writes
nginx's config and runs it; ``tests.infra`` starts Dispatch's processes).

    with cluster(servers=3, tls=True) as topo:
        topo.url                 # https://127.0.0.1:PORT, the public URL every process has
        topo.instance.shim(...)  # clients started through the instance reach nginx ...
        topo.shim("a", root)     # ... (this one does, by default)
        topo.servers[0].url      # one process directly (for per-process comparisons)
        topo.process_of(row_process_id)  # which Server holds a connection row

With ``tls`` the certificate is self-signed (SAN 127.0.0.1 and localhost) and trusted
through ``SSL_CERT_FILE`` (Python: httpx, websockets, the shim and the remote client) and
``NODE_EXTRA_CA_CERTS`` (node), set for every child process and, while the cluster runs,
for the test process itself. The topology runs with ``DISPATCH_PROCESS_TTL=6`` and a 1 s
heartbeat (``deploy.cluster.topology_env``).
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from deploy.cluster import Certificate, Nginx, body_cap, free_port, nginx_binary, self_signed_certificate, topology_env
from tests.backends import unavailable
from tests.infra import PYTHON, REPO, Instance, Process, Server, ShimProcess, instance, wait_until

MARKS = ("integration", "multiprocess", "postgres", "redis")


@dataclass
class Front:
    """nginx as a client sees it, with the same client helpers as ``tests.infra.Server``
    (``url``, ``ws_url``, ``get``, ``remote_names``), so ``Instance.shim(server=front)`` and
    ``MachineApi(front.url, …)`` go through nginx."""

    nginx: Nginx

    @property
    def url(self) -> str:
        return self.nginx.url

    @property
    def ws_url(self) -> str:
        return self.nginx.ws_url

    @property
    def port(self) -> int:
        return self.nginx.port

    def get(self, path: str, token: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.get(f"{self.url}{path}", headers=headers, timeout=10)

    def remote_names(self, token: str) -> list[str]:
        response = self.get("/api/v1/remotes", token)
        response.raise_for_status()
        return [remote["remotename"] for remote in response.json()["remotes"]]


@dataclass
class Cluster:
    """A running topology. ``servers`` are the ``serve`` processes (in start order; a
    restarted one keeps its index and port), ``front`` is nginx, ``token`` an API token
    of ``admin``."""

    instance: Instance
    front: Front
    servers: list[Server]
    worker: Process | None
    certificate: Certificate | None
    workdir: Path
    extra_serve_args: tuple[str, ...] = ("--no-background",)
    notes: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.front.url

    @property
    def ws_url(self) -> str:
        return self.front.ws_url

    @property
    def token(self) -> str:
        return self.instance.admin_token

    @property
    def nginx(self) -> Nginx:
        return self.front.nginx

    @property
    def env(self) -> dict[str, str]:
        return self.instance.env

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client context trusting the cluster's certificate (``None`` without TLS)."""
        if self.certificate is None:
            return None
        return ssl.create_default_context(cafile=str(self.certificate.cert))

    def http(self, token: str | None = None, **options: Any) -> httpx.Client:
        """An httpx client of nginx's URL (``Authorization: Bearer token`` when given)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=options.pop("timeout", 30), **options)

    def shim(self, name: str | None, root: str | os.PathLike[str] | None, *flags: str, **options: Any) -> ShimProcess:
        """``Instance.shim`` through nginx (``--server`` is nginx's URL)."""
        options.setdefault("server", self.front)
        return self.instance.shim(name, root, *flags, **options)

    # --- the processes behind nginx ------------------------------------------------------

    def start_server(self, port: int | None = None, **env: Any) -> Server:
        """Start one more ``serve`` (on ``port``, default a free one) without waiting for it
        and without telling nginx (``restart`` reuses the port nginx knows)."""
        port = port or free_port()
        started = Process.spawn(
            {**self.instance.env, **{k: str(v) for k, v in env.items()}},
            [PYTHON, str(REPO / "manage.py"), "serve", "--port", str(port), *self.extra_serve_args],
            name=f"serve-{port}",
        )
        server = Server(proc=started.proc, log_path=started.log_path, port=port)
        self.instance.servers.append(server)
        return server

    def restart(self, index: int, *, timeout: float = 30) -> Server:
        """Start ``servers[index]`` again on its port once it has exited (after ``stop``/``kill``),
        wait until it is healthy; it replaces the old entry."""
        old = self.servers[index]
        assert not old.running, f"serve on {old.port} is still running"
        server = self.start_server(old.port).wait_healthy(timeout)
        self.servers[index] = server
        return server

    def server_with_pid(self, pid: int) -> int | None:
        """The index in ``servers`` of the process ``pid``, if it is one of them."""
        return next((i for i, server in enumerate(self.servers) if server.pid == pid), None)

    # --- the database, read directly ----------------------------------------------------

    def rows(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        """``sql`` on the cluster's PostgreSQL database (its own connection, autocommit)."""
        import psycopg

        with psycopg.connect(self.instance.env["DATABASE_URL"], autocommit=True) as conn:
            return list(conn.execute(sql, params).fetchall())

    def process_pids(self) -> dict[str, int]:
        """``ServerProcess`` id → pid of every registered process (serve and worker)."""
        return {str(pid_row[0]): int(pid_row[1]) for pid_row in self.rows("SELECT id, pid FROM dispatch_serverprocess")}

    def process_index(self) -> dict[str, int]:
        """``ServerProcess`` id → index in ``servers`` (serve processes only)."""
        found = {}
        for process_id, pid in self.process_pids().items():
            index = self.server_with_pid(pid)
            if index is not None:
                found[process_id] = index
        return found

    def reaped_count(self) -> int:
        """How many times a ``serve`` process of this cluster logged that another process
        reaped it (its heartbeat was older than ``DISPATCH_PROCESS_TTL``; it then closed
        every socket it held)."""
        return sum(server.log().count("was reaped by another process") for server in self.instance.servers)

    @contextmanager
    def heartbeat_watch(self, period: float = 0.25) -> Iterator[dict[str, float]]:
        """Sample every registered process's heartbeat age (seconds) every ``period``
        seconds while the block runs; yields ``{process id: largest age seen}``."""
        import threading

        ages: dict[str, float] = {}
        done = threading.Event()

        def sample() -> None:
            while not done.wait(period):
                try:
                    rows = self.rows("SELECT id, extract(epoch from now() - heartbeat_at) FROM dispatch_serverprocess")
                except Exception:
                    continue
                for process_id, age in rows:
                    ages[str(process_id)] = max(ages.get(str(process_id), 0.0), float(age))

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield ages
        finally:
            done.set()
            thread.join(5)

    def details(self) -> str:
        """nginx's error log and the tail of every process's log, for a failure message."""
        parts = [f"--- nginx error log\n{self.nginx.error_log()[-3000:]}"]
        for process in [*self.instance.servers, *self.instance.processes]:
            parts.append(f"--- {process.log_path.name} (pid {process.pid})\n{process.log()[-2000:]}")
        return "\n".join(parts)


@contextmanager
def cluster(
    *,
    servers: int = 3,
    tls: bool = False,
    worker: bool = True,
    pool_max: int = 8,
    trust_in_this_process: bool = True,
    **env: Any,
) -> Iterator[Cluster]:
    """Start the topology (``servers`` ``serve --no-background`` processes, a
    ``dispatch_worker`` unless ``worker=False``, nginx in front; https with ``tls``) on a
    fresh PostgreSQL database and Redis prefix; ``env`` overrides settings of every process.

    With ``tls`` and ``trust_in_this_process``, ``SSL_CERT_FILE`` names the certificate in
    this process's environment too while the cluster runs (httpx clients made meanwhile
    and websockets' default context trust it). Skips (fails under ``CI=true``) without
    nginx, PostgreSQL or Redis. Each process's pool is ``pool_max`` connections
    (``DISPATCH_DB_POOL_MAX``): the machine's PostgreSQL is shared with other tests.
    """
    if nginx_binary() is None:
        unavailable("nginx is not installed (apt-get install nginx; .ci/run installs it)")
    workdir = Path(tempfile.mkdtemp(prefix="dispatch-cluster-"))
    port = free_port()
    certificate = self_signed_certificate(workdir / "tls") if tls else None
    public_url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    overrides: dict[str, Any] = {**topology_env(public_url), "DISPATCH_DB_POOL_MAX": pool_max}
    trust: dict[str, str] = {}
    if certificate is not None:
        trust = {"SSL_CERT_FILE": str(certificate.cert), "NODE_EXTRA_CA_CERTS": str(certificate.cert)}
    overrides.update(trust)
    overrides.update(env)
    if not trust_in_this_process:
        trust = {}
    saved = {name: os.environ.get(name) for name in trust}
    os.environ.update(trust)
    try:
        with instance(postgres=True, redis=True, database_prefix="dispatch_cluster_", **overrides) as inst:
            topo = Cluster(
                instance=inst,
                front=Front(nginx=None),  # type: ignore[arg-type]  # set below, once the servers listen
                servers=[],
                worker=None,
                certificate=certificate,
                workdir=workdir,
            )
            started = [topo.start_server() for _ in range(servers)]
            if worker:
                topo.worker = inst.spawn([PYTHON, str(REPO / "manage.py"), "dispatch_worker"], name="worker")
            # Generous: four Django processes start at once on a small (or busy) machine.
            topo.servers = [server.wait_healthy(90) for server in started]
            if topo.worker is not None:
                topo.worker.wait_for_log("Dispatch worker running", timeout=90)
            nginx = Nginx.start(
                workdir / "nginx",
                port=port,
                upstreams=[server.port for server in topo.servers],
                max_body_bytes=body_cap(inst.env),
                tls=certificate,
            )
            topo.front = Front(nginx=nginx)
            try:
                wait_until(
                    lambda: _healthy(topo.url, topo.ssl_context() or True),
                    timeout=15,
                    what="/healthz through nginx",
                    details=topo.details,
                )
                yield topo
            finally:
                nginx.stop()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)


_SHARED: dict[bool, Cluster] = {}


def shared_cluster(config: pytest.Config, *, tls: bool = True) -> Cluster:
    """One 3-process cluster (``tls`` or not) for the whole test run, started on first use
    and stopped when the run ends (``config.add_cleanup``): for tests that leave it as they
    found it (no process stopped, every client closed). Its certificate is NOT trusted by
    this process's environment: use ``trusting(monkeypatch)`` in the test, or
    ``ssl_context()``."""
    if tls not in _SHARED:
        stack = ExitStack()
        config.add_cleanup(stack.close)
        tmux_socket = unique("dispatch-cluster-")
        stack.callback(subprocess.run, ["tmux", "-L", tmux_socket, "kill-server"], capture_output=True, check=False)
        _SHARED[tls] = stack.enter_context(
            cluster(
                servers=3,
                tls=tls,
                trust_in_this_process=False,
                # Shell agents only (no default type: a launch names one), in a private tmux server.
                DISPATCH_AGENT_TYPES=json.dumps({"shell": {"argv": ["bash", "--norc", "-i"], "kind": "shell"}}),
                DISPATCH_TMUX_SOCKET=tmux_socket,
                DISPATCH_CLI_SUPERVISE_INTERVAL="0.3",
            )
        )

        def forget() -> None:
            _SHARED.pop(tls, None)

        config.add_cleanup(forget)
    topo = _SHARED[tls]
    dead = [server.port for server in topo.servers if not server.running]
    assert not dead and topo.nginx.running, f"the shared cluster lost serve {dead} or nginx:\n{topo.details()}"
    return topo


def trusting(topo: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trust ``topo``'s certificate in this process for one test (``SSL_CERT_FILE``,
    ``NODE_EXTRA_CA_CERTS``), as its child processes do."""
    if topo.certificate is not None:
        monkeypatch.setenv("SSL_CERT_FILE", str(topo.certificate.cert))
        monkeypatch.setenv("NODE_EXTRA_CA_CERTS", str(topo.certificate.cert))


def _healthy(url: str, verify: Any = True) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2, verify=verify).status_code == 200
    except httpx.HTTPError:
        return False


def unique(prefix: str) -> str:
    """``prefix`` + 8 random hex digits (remote names, sessions)."""
    return f"{prefix}{uuid.uuid4().hex[:8]}"


# --- idle clients, many of them, from child processes ---------------------------------------


@dataclass(frozen=True)
class IdlePlan:
    """What one ``IdleClients`` child opens to ``host:port``: ``bare`` TCP connections that
    send nothing, ``partial`` ones that send a request line and one header and stop (an
    upgrade that never completes), and ``upgrades`` complete ``/ws`` upgrade requests that
    never authenticate; round robin from the loopback ``sources`` (Linux routes all of
    127.0.0.0/8 to ``lo`` without setup)."""

    host: str
    port: int
    sources: tuple[str, ...]
    bare: int = 0
    partial: int = 0
    upgrades: int = 0
    connect_timeout: float = 15.0


class IdleClients:
    """A child process holding the connections of an ``IdlePlan`` open (one descriptor
    each: several children spread a load over several open-file limits).

    ``opened`` is what the child reported once every connect finished or failed:
    ``{"connected": n, "failed": n, "seconds": s}``; ``still_open()`` asks it how many
    are open (not closed or reset by the server); ``stop()`` ends it.
    """

    def __init__(self, plan: IdlePlan) -> None:
        self.plan = plan
        self.proc = subprocess.Popen(
            [PYTHON, "-c", "from tests.cluster import _idle_clients_main; _idle_clients_main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(plan.__dict__ | {"sources": list(plan.sources)}) + "\n")
        self.proc.stdin.flush()
        self.opened: dict[str, Any] = {}

    def wait_opened(self) -> dict[str, Any]:
        """Block until the child reports its connects (see the class docstring)."""
        if not self.opened:
            self.opened = self._read()
        return self.opened

    def still_open(self) -> int:
        """How many of the child's connections the server has not closed (``open_by_kind``
        then says which plan kinds they are)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("count\n")
        self.proc.stdin.flush()
        answer = self._read()
        self.open_by_kind: dict[str, int] = dict(answer["by_kind"])
        return int(answer["open"])

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the idle-client child exited with {self.proc.wait()}")
        return dict(json.loads(line))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def _idle_clients_main() -> None:
    """The child of ``IdleClients``: reads its plan (one JSON line) on stdin, connects
    without blocking, reports, then answers ``count`` lines until stdin closes."""
    import errno
    import resource
    import select
    import socket
    import sys
    import time

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    plan = json.loads(sys.stdin.readline())
    host, port, sources = plan["host"], int(plan["port"]), plan["sources"]
    partial = f"GET /ws HTTP/1.1\r\nHost: {host}:{port}\r\n".encode()
    upgrade = (
        f"GET /ws HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()
    kinds = [b""] * plan["bare"] + [partial] * plan["partial"] + [upgrade] * plan["upgrades"]
    started = time.monotonic()
    pending: dict[int, tuple[socket.socket, bytes]] = {}
    poller = select.poll()
    failed = 0
    for n, payload in enumerate(kinds):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.bind((sources[n % len(sources)], 0))
        code = sock.connect_ex((host, port))
        if code not in (0, errno.EINPROGRESS):
            failed += 1
            sock.close()
            continue
        pending[sock.fileno()] = (sock, payload)
        poller.register(sock, select.POLLOUT)
    connected: dict[int, socket.socket] = {}
    kind_of: dict[int, str] = {}
    names = {b"": "bare", partial: "partial", upgrade: "upgrades"}
    deadline = time.monotonic() + float(plan["connect_timeout"])
    while pending and time.monotonic() < deadline:
        for fd, _event in poller.poll(200):
            sock, payload = pending.pop(fd)
            poller.unregister(fd)
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
                failed += 1
                sock.close()
                continue
            if payload:
                sock.send(payload)
            connected[fd] = sock
            kind_of[fd] = names[payload]
    failed += len(pending)
    for sock, _payload in pending.values():
        sock.close()
    print(json.dumps({"connected": len(connected), "failed": failed, "seconds": time.monotonic() - started}))
    sys.stdout.flush()
    watcher = select.poll()
    for fd in connected:
        watcher.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    for line in sys.stdin:
        if line.strip() != "count":
            continue
        for fd, _event in watcher.poll(0):
            sock = connected[fd]
            try:
                data = sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:  # reset: nginx resets a timed-out connection
                data = b""
            if not data:
                watcher.unregister(fd)
                del connected[fd]
                sock.close()
        by_kind = {name: 0 for name in names.values()}
        for fd in connected:
            by_kind[kind_of[fd]] += 1
        print(json.dumps({"open": len(connected), "by_kind": by_kind}))
        sys.stdout.flush()
