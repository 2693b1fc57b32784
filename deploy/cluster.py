"""Dispatch behind nginx: several ``serve --no-background`` processes, one ``dispatch_worker``,
PostgreSQL + Redis, and a private nginx in front (docs/deploy.md).

Importable (``tests/cluster.py`` builds the cluster tests on it) and runnable: ``make
cluster`` / ``python -m deploy.cluster`` / ``python deploy/cluster.py`` starts the topology,
prints its URL and stops everything on Ctrl-C or SIGTERM.

Pieces:

- ``topology_env(public_url)``: the settings every process of the topology gets;
- ``self_signed_certificate(directory)``: a certificate for 127.0.0.1 and localhost
  (``cryptography``), for ``tls=True``;
- ``nginx_conf(...)``: ``deploy/nginx.conf`` filled in;
- ``Nginx.start(...)``: nginx run as ``nginx -p PREFIX -e PREFIX/error.log -c
  PREFIX/nginx.conf -g 'daemon off;'`` with everything it writes under ``PREFIX``;
- ``Cluster``: the whole topology as child processes (what ``make cluster`` runs).

Nothing here imports Django or Dispatch: app code never imports this package.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit, urlunsplit

import httpx

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = Path(__file__).resolve().with_name("nginx.conf")

# dispatch/settings.py: MAX_REQUEST_BYTES, DISPATCH_MAX_REQUEST_BYTES's default (16 MiB).
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024

# Presence in this topology, seconds: three servers, a worker and the load share a small
# machine, and a shorter TTL would reap live connections (docs/deploy.md).
PROCESS_TTL = 6
HEARTBEAT_INTERVAL = 1

# nginx's passive health check per server: left out for FAIL_TIMEOUT seconds after MAX_FAILS
# failed attempts (a refused connection, a timed-out read) within that time: a frozen process
# is found by a read timing out and then kept out for about a DISPATCH_PROCESS_TTL (10 s by
# default), long enough for its clients to notice and reconnect elsewhere (docs/deploy.md).
MAX_FAILS = 1
FAIL_TIMEOUT = 10
# The same processes listed again as `backup` peers, which nginx uses only once every
# primary peer is left out: a rolling restart refuses connections on each process in turn,
# and with restarts closer together than FAIL_TIMEOUT every primary is left out at once
# (nginx would answer 502 "no live upstreams" although two processes are up). The backups
# forget a failure after BACKUP_FAIL_TIMEOUT, so they still skip a refusing process.
BACKUP_FAIL_TIMEOUT = 1

# What nginx is sized for (docs/deploy.md "Sizing nginx"): the sockets one process is
# documented to hold (docs/operating.md "Limits": 5,000 shims and 5,000 /ws sessions), two
# nginx connections per proxied socket (the client's and the upstream one), and room for
# idle or half-open clients on top. Each worker can carry the whole load alone.
SOCKETS_PER_PROCESS = 10_000
IDLE_HEADROOM = 10_000
DESCRIPTOR_HEADROOM = 1_024  # listening sockets, logs, files: beyond the connections
# Open requests per client address (websockets and event streams included): one user's
# machine holds a shim, a few remotes, its agents' MCP streams and pages; a NAT holds many.
PER_ADDRESS_CONNECTIONS = 1_000


def worker_connections(processes: int) -> int:
    """``worker_connections`` for ``processes`` upstream ``serve`` processes:
    ``2 × SOCKETS_PER_PROCESS × processes + IDLE_HEADROOM`` (70,000 for three).
    Raises ``ValueError`` for fewer than one process."""
    if processes < 1:
        raise ValueError("nginx is sized for at least one serve process")
    return 2 * SOCKETS_PER_PROCESS * processes + IDLE_HEADROOM


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at ``host`` right now (the kernel's pick)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def body_cap(env: Mapping[str, str]) -> int:
    """Dispatch's request body cap in bytes, as ``serve`` reads it from ``env``
    (``DISPATCH_MAX_REQUEST_BYTES``, default 16 MiB); nginx's ``client_max_body_size``.

    Raises ``ValueError`` for a value that is not a whole number.
    """
    given = env.get("DISPATCH_MAX_REQUEST_BYTES", "").strip()
    return int(given) if given else DEFAULT_MAX_REQUEST_BYTES


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


# --- TLS ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Certificate:
    """A PEM certificate and its private key on disk; ``cert`` is also the CA file clients
    trust (``SSL_CERT_FILE``, ``NODE_EXTRA_CA_CERTS``): it is self-signed."""

    cert: Path
    key: Path


def self_signed_certificate(directory: Path, hosts: Iterable[str] = ("127.0.0.1", "localhost")) -> Certificate:
    """Write ``cert.pem`` and ``key.pem`` (EC P-256, valid 30 days) into ``directory``.

    The certificate is its own CA (``basicConstraints CA:true``) and names every entry of
    ``hosts`` in its subject alternative names (IP addresses as IP entries), so Python's
    ``ssl`` and Node accept it for those hosts once told to trust it.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Dispatch test cluster")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_path.chmod(0o600)
    return Certificate(cert=cert_path, key=key_path)


# --- nginx -------------------------------------------------------------------------------


def nginx_binary() -> str | None:
    """The nginx executable (``PATH``, else Debian's ``/usr/sbin/nginx``), or ``None``."""
    found = shutil.which("nginx")
    if found:
        return found
    return "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None


def nginx_conf(
    *,
    prefix: Path,
    port: int,
    upstreams: Iterable[int],
    max_body_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    tls: Certificate | None = None,
    host: str = "127.0.0.1",
    upstream_host: str = "127.0.0.1",
    as_root: bool | None = None,
    per_address: int = PER_ADDRESS_CONNECTIONS,
) -> str:
    """``deploy/nginx.conf`` for a private nginx listening on ``host:port`` (TLS with
    ``tls``) in front of ``serve`` processes on ``upstream_host`` at the ``upstreams`` ports.

    Everything nginx writes (pid, logs, the five temp paths) goes under ``prefix``.
    ``as_root`` (default: whether this process is root) adds ``user root;``: a master run
    as root would otherwise run its worker as ``nobody``, which cannot write under a
    private ``prefix``. ``worker_connections`` follows the number of upstreams
    (:func:`worker_connections`), ``worker_rlimit_nofile`` exceeds it by
    ``DESCRIPTOR_HEADROOM``; ``per_address`` is ``limit_conn`` per client address.
    Raises ``ValueError`` without any upstream or for ``per_address`` under 1.
    """
    ports = list(upstreams)
    if not ports:
        raise ValueError("nginx_conf needs at least one upstream port")
    if per_address < 1:
        raise ValueError(f"per_address must be at least 1, got {per_address}")
    connections = worker_connections(len(ports))
    if as_root is None:
        as_root = os.geteuid() == 0
    servers = "\n".join(
        [f"        server {upstream_host}:{p} max_fails={MAX_FAILS} fail_timeout={FAIL_TIMEOUT}s;" for p in ports]
        + [
            f"        server {upstream_host}:{p} max_fails={MAX_FAILS} fail_timeout={BACKUP_FAIL_TIMEOUT}s backup;"
            for p in ports
        ]
    )
    if tls is None:
        listen = f"        listen {host}:{port};"
    else:
        listen = "\n".join(
            [
                f"        listen {host}:{port} ssl;",
                f"        ssl_certificate {tls.cert};",
                f"        ssl_certificate_key {tls.key};",
                "        ssl_protocols TLSv1.2 TLSv1.3;",
            ]
        )
    return (
        TEMPLATE.read_text()
        .replace("@USER@", "user root;" if as_root else "# (not root: nginx's worker runs as this user)")
        .replace("@PREFIX@", str(prefix))
        .replace("@UPSTREAM_SERVERS@", servers)
        .replace("@LISTEN@", listen)
        .replace("@MAX_BODY@", str(max_body_bytes))
        .replace("@WORKER_CONNECTIONS@", str(connections))
        .replace("@RLIMIT_NOFILE@", str(connections + DESCRIPTOR_HEADROOM))
        .replace("@PER_ADDRESS@", str(per_address))
    )


@dataclass
class Nginx:
    """A private nginx (``daemon off``, in the foreground of its own process) and its prefix."""

    proc: subprocess.Popen[bytes]
    prefix: Path
    port: int
    host: str = "127.0.0.1"
    tls: Certificate | None = None
    per_address: int = PER_ADDRESS_CONNECTIONS

    @property
    def url(self) -> str:
        """``http(s)://host:port``: the topology's public URL."""
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    @property
    def ws_url(self) -> str:
        """The ``/ws`` session endpoint through nginx (``ws://`` or ``wss://``)."""
        return f"{'wss' if self.tls else 'ws'}://{self.host}:{self.port}/ws"

    @property
    def conf_path(self) -> Path:
        return self.prefix / "nginx.conf"

    @classmethod
    def start(
        cls,
        prefix: Path,
        *,
        port: int,
        upstreams: Iterable[int],
        max_body_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        tls: Certificate | None = None,
        host: str = "127.0.0.1",
        timeout: float = 10.0,
        per_address: int = PER_ADDRESS_CONNECTIONS,
    ) -> Nginx:
        """Write ``prefix/nginx.conf``, check it (``nginx -t``), start nginx and wait until
        ``host:port`` accepts connections (``timeout`` seconds). ``per_address`` is its
        ``limit_conn`` per client address.

        Raises ``RuntimeError`` without nginx, for a config it refuses, or when it exits or
        never listens (with its error log).
        """
        binary = nginx_binary()
        if binary is None:
            raise RuntimeError("nginx is not installed (Debian: apt-get install nginx-light or nginx)")
        prefix.mkdir(parents=True, exist_ok=True)
        conf = nginx_conf(
            prefix=prefix,
            port=port,
            upstreams=upstreams,
            max_body_bytes=max_body_bytes,
            tls=tls,
            host=host,
            per_address=per_address,
        )
        (prefix / "nginx.conf").write_text(conf)
        base = [binary, "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(prefix / "nginx.conf")]
        checked = subprocess.run([*base, "-t", "-q"], capture_output=True, text=True, check=False)
        if checked.returncode != 0:
            raise RuntimeError(f"nginx refused {prefix / 'nginx.conf'}:\n{checked.stderr}")
        with (prefix / "nginx.out").open("wb") as out:
            # Its own process group: a Ctrl-C at the terminal reaches the launcher, which stops it.
            proc = subprocess.Popen([*base, "-g", "daemon off;"], stdout=out, stderr=subprocess.STDOUT, process_group=0)
        nginx = cls(proc=proc, prefix=prefix, port=port, host=host, tls=tls, per_address=per_address)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"nginx exited with {proc.returncode}:\n{nginx.error_log()}")
            try:
                with socket.create_connection((host, port), timeout=1):
                    return nginx
            except OSError:
                time.sleep(0.05)
        nginx.stop()
        raise RuntimeError(f"nginx did not listen on {host}:{port} within {timeout:g}s:\n{nginx.error_log()}")

    def error_log(self) -> str:
        """nginx's error log and its own output (for a failure report)."""
        parts = []
        for name in ("nginx.out", "error.log"):
            path = self.prefix / name
            if path.exists():
                parts.append(path.read_text(errors="replace"))
        return "".join(parts)

    def access_log(self) -> str:
        path = self.prefix / "access.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def reconfigure(self, upstreams: Iterable[int], max_body_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        """Rewrite the config with other upstream ports and reload (SIGHUP): new workers take
        new connections, old ones finish theirs."""
        conf = nginx_conf(
            prefix=self.prefix,
            port=self.port,
            upstreams=upstreams,
            max_body_bytes=max_body_bytes,
            tls=self.tls,
            host=self.host,
            per_address=self.per_address,
        )
        self.conf_path.write_text(conf)
        self.proc.send_signal(signal.SIGHUP)

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """Fast shutdown (SIGTERM: open connections are closed), SIGKILL after ``timeout`` seconds."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


# --- the whole topology, for `make cluster` ------------------------------------------------


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
