"""Dispatch behind nginx: several ``serve --no-background`` processes, one ``dispatch_worker``,
PostgreSQL + Redis, and a private nginx in front (docs/deploy.md).

Importable (``tests/cluster.py`` builds the cluster tests on it) and runnable: ``make
cluster`` / ``python -m deploy.cluster`` / ``python deploy/cluster.py`` starts the topology,
prints its URL and stops everything on Ctrl-C or SIGTERM.

Pieces:

- ``topology_env(public_url)``: the settings every process of the topology gets;
- ``self_signed_certificate(directory)`` (``deploy.tls``): a certificate for 127.0.0.1
  and localhost (``cryptography``), for ``tls=True``;
- ``nginx_conf(...)`` (``deploy.nginx``): ``deploy/nginx.conf`` filled in;
- ``Nginx.start(...)`` (``deploy.nginx``): nginx run as ``nginx -p PREFIX -e
  PREFIX/error.log -c PREFIX/nginx.conf -g 'daemon off;'`` with everything it writes
  under ``PREFIX``;
- ``Cluster``: the whole topology as child processes (what ``make cluster`` runs).

The names of ``deploy.nginx`` and ``deploy.tls`` are importable from here too.

Nothing here imports Django or Dispatch: app code never imports this package.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit, urlunsplit

import httpx

if not __package__:  # run as ``python deploy/cluster.py``: the repository root makes ``deploy`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deploy.nginx import (
    BACKUP_FAIL_TIMEOUT,
    DEFAULT_MAX_REQUEST_BYTES,
    DESCRIPTOR_HEADROOM,
    FAIL_TIMEOUT,
    IDLE_HEADROOM,
    MAX_FAILS,
    PER_ADDRESS_CONNECTIONS,
    SOCKETS_PER_PROCESS,
    TEMPLATE,
    Nginx,
    body_cap,
    nginx_binary,
    nginx_conf,
    worker_connections,
)
from deploy.tls import Certificate, self_signed_certificate

__all__ = [
    "BACKUP_FAIL_TIMEOUT",
    "DEFAULT_MAX_REQUEST_BYTES",
    "DESCRIPTOR_HEADROOM",
    "FAIL_TIMEOUT",
    "HEARTBEAT_INTERVAL",
    "IDLE_HEADROOM",
    "MAX_FAILS",
    "PER_ADDRESS_CONNECTIONS",
    "PROCESS_TTL",
    "REPO",
    "SOCKETS_PER_PROCESS",
    "TEMPLATE",
    "Certificate",
    "Child",
    "Cluster",
    "Nginx",
    "body_cap",
    "ensure_database",
    "free_port",
    "main",
    "nginx_binary",
    "nginx_conf",
    "self_signed_certificate",
    "topology_env",
    "wait_healthy",
    "worker_connections",
]

REPO = Path(__file__).resolve().parent.parent

# Presence in this topology, seconds: three servers, a worker and the load share a small
# machine, and a shorter TTL would reap live connections (docs/deploy.md).
PROCESS_TTL = 6
HEARTBEAT_INTERVAL = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at ``host`` right now (the kernel's pick)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def topology_env(public_url: str) -> dict[str, str]:
    """The settings every process of the topology gets (beside the database, Redis and
    secret key): the public URL is nginx's, presence runs on a 6 s TTL with a 1 s
    heartbeat, and the servers trust nginx's ``X-Forwarded-*`` headers."""
    return {
        "DISPATCH_PUBLIC_URL": public_url.rstrip("/"),
        "DISPATCH_PROCESS_TTL": str(PROCESS_TTL),
        "DISPATCH_HEARTBEAT_INTERVAL": str(HEARTBEAT_INTERVAL),
        "DISPATCH_REAP_INTERVAL": str(HEARTBEAT_INTERVAL),
        "DISPATCH_BEHIND_PROXY": "1",
    }


def wait_healthy(
    url: str, *, timeout: float = 60.0, proc: subprocess.Popen[Any] | None = None, verify: Any = True
) -> None:
    """Wait until ``GET url/healthz`` answers 200. Raises ``RuntimeError`` when ``proc``
    exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the process for {url} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2, verify=verify).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url}/healthz did not answer 200 within {timeout:g}s")


@dataclass
class Child:
    """A process of the topology and the file its output goes to."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    port: int | None = None


@dataclass
class Cluster:
    """``servers`` × ``serve --no-background`` + one ``dispatch_worker`` + nginx on ``port``.

    ``env`` holds the database, Redis, secret key and data dir; ``start`` adds
    ``topology_env`` and runs everything from ``workdir`` (logs, nginx's prefix, the
    certificate). ``stop`` sends SIGTERM to every process and waits (SIGKILL after 20 s).
    """

    env: dict[str, str]
    workdir: Path
    servers: int = 3
    tls: bool = False
    host: str = "127.0.0.1"
    port: int = 0
    python: str = sys.executable
    children: list[Child] = field(default_factory=list)
    nginx: Nginx | None = None
    certificate: Certificate | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def _spawn(self, name: str, args: list[str], port: int | None = None) -> Child:
        log_path = self.workdir / f"{name}.log"
        with log_path.open("wb") as log:
            # Own process group: a Ctrl-C reaches only the launcher, whose single SIGTERM is a
            # clean stop (a serve that got SIGINT and then SIGTERM would stop at once).
            proc = subprocess.Popen(args, env=self.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, process_group=0)
        child = Child(name=name, proc=proc, log_path=log_path, port=port)
        self.children.append(child)
        return child

    def manage(self, *args: str) -> str:
        """Run ``manage.py ARGS`` in the topology's environment; its output. Raises
        ``RuntimeError`` with the output when it fails."""
        done = subprocess.run(
            [self.python, str(REPO / "manage.py"), *args], env=self.env, cwd=REPO, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
        return done.stdout

    def start(self) -> str:
        """Migrate, make sure an admin exists, start everything; returns what
        ``ensure_admin`` printed (the first admin's password, once)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port(self.host)
        if self.tls:
            self.certificate = self_signed_certificate(self.workdir / "tls")
            self.env["SSL_CERT_FILE"] = str(self.certificate.cert)
        self.env.update(topology_env(self.url))
        self.manage("migrate", "--noinput", "-v0")
        admin = self.manage("ensure_admin")
        for _ in range(self.servers):
            port = free_port()
            args = [self.python, str(REPO / "manage.py"), "serve", "--port", str(port), "--no-background"]
            self._spawn(f"serve-{port}", args, port)
        self._spawn("worker", [self.python, str(REPO / "manage.py"), "dispatch_worker"])
        for child in self.children:
            if child.port is not None:
                wait_healthy(f"http://127.0.0.1:{child.port}", proc=child.proc)
        self.nginx = Nginx.start(
            self.workdir / "nginx",
            port=self.port,
            upstreams=[c.port for c in self.children if c.port is not None],
            max_body_bytes=body_cap(self.env),
            tls=self.certificate,
            host=self.host,
        )
        wait_healthy(self.url, verify=str(self.certificate.cert) if self.certificate else True)
        return admin

    def exited(self) -> Child | None:
        """A child that is no longer running, if any."""
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def stop(self) -> None:
        if self.nginx is not None:
            self.nginx.stop()
        for child in self.children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        for child in self.children:
            try:
                child.proc.wait(20)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait(5)


def ensure_database(admin_url: str, name: str) -> str:
    """``CREATE DATABASE name`` on the server of ``admin_url`` unless it exists; its URL."""
    import psycopg

    with psycopg.connect(admin_url, autocommit=True, connect_timeout=5) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{name}"')
    parts = urlsplit(admin_url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, ""))


def main(argv: list[str] | None = None, out: IO[str] = sys.stdout) -> int:
    """``python -m deploy.cluster [--servers N] [--tls] [--port P]``: the topology until
    Ctrl-C / SIGTERM. Exit status 0 after a requested stop, 1 when a process died."""
    parser = argparse.ArgumentParser(prog="python -m deploy.cluster", description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=3, help="serve processes behind nginx (default 3)")
    parser.add_argument("--tls", action="store_true", help="nginx speaks HTTPS with a self-signed certificate")
    parser.add_argument("--host", default="127.0.0.1", help="nginx's address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="nginx's port (default 8080; 0: a free one)")
    parser.add_argument(
        "--data-dir", default=str(REPO / "var" / "cluster"), help="DISPATCH_DATA_DIR and logs (default var/cluster)"
    )
    options = parser.parse_args(argv)
    if options.servers < 1:
        parser.error("--servers must be at least 1")

    database_url = os.environ.get("DATABASE_URL", "")
    if not database_url:
        admin_url = os.environ.get("DISPATCH_CLUSTER_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/postgres")
        try:
            database_url = ensure_database(admin_url, "dispatch_cluster")
        except Exception as exc:
            print(f"Could not create database dispatch_cluster at {admin_url}: {exc}", file=sys.stderr)
            print("Set DATABASE_URL=postgres://… to an existing database.", file=sys.stderr)
            return 2
    if not database_url.startswith(("postgres://", "postgresql://")):
        print(f"DATABASE_URL must be a PostgreSQL URL for several processes, got {database_url!r}", file=sys.stderr)
        return 2
    data_dir = Path(options.data_dir).resolve()
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "REDIS_URL": os.environ.get("REDIS_URL", "") or "redis://127.0.0.1:6379/0",
        "DISPATCH_REDIS_PREFIX": os.environ.get("DISPATCH_REDIS_PREFIX", "") or "dispatch-cluster",
        "DISPATCH_DATA_DIR": str(data_dir),
        "PYTHONUNBUFFERED": "1",
    }
    cluster = Cluster(
        env=env,
        workdir=data_dir / "run",
        servers=options.servers,
        tls=options.tls,
        host=options.host,
        port=options.port,
    )

    stop_requested = False

    def request_stop(signum: int, frame: Any) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        admin = cluster.start()
    except Exception as exc:
        print(f"The cluster did not start: {exc}", file=sys.stderr)
        for child in cluster.children:
            print(f"--- {child.log_path}\n{child.log_path.read_text(errors='replace')[-2000:]}", file=sys.stderr)
        cluster.stop()
        return 1
    if admin.strip():
        out.write(admin if admin.endswith("\n") else admin + "\n")
    out.write(f"Dispatch cluster at {cluster.url}/\n")
    for child in cluster.children:
        where = f"http://127.0.0.1:{child.port}" if child.port else "background services"
        out.write(f"  {child.name:<12} pid {child.proc.pid:<7} {where}  log {child.log_path}\n")
    assert cluster.nginx is not None
    out.write(f"  nginx        pid {cluster.nginx.proc.pid:<7} {cluster.nginx.conf_path}\n")
    out.write(f"  database {database_url}, Redis {env['REDIS_URL']} (prefix {env['DISPATCH_REDIS_PREFIX']})\n")
    if cluster.certificate is not None:
        out.write(
            f"  self-signed certificate {cluster.certificate.cert}: clients trust it with\n"
            f"    SSL_CERT_FILE={cluster.certificate.cert} (shim, remote client, httpx) or\n"
            f"    NODE_EXTRA_CA_CERTS={cluster.certificate.cert} (node); browsers will warn\n"
        )
    out.write("Ctrl-C stops everything.\n")
    out.flush()
    status = 0
    while not stop_requested:
        dead = cluster.exited()
        if dead is not None or (cluster.nginx is not None and not cluster.nginx.running):
            name = dead.name if dead else "nginx"
            print(f"{name} exited; stopping the cluster (see its log)", file=sys.stderr)
            status = 1
            break
        time.sleep(0.5)
    out.write("Stopping…\n")
    out.flush()
    cluster.stop()
    return status


if __name__ == "__main__":
    sys.exit(main())
