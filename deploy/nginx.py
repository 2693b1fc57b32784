"""The private nginx in front of the ``serve`` processes: ``deploy/nginx.conf`` filled in
(``nginx_conf``), its sizing (docs/deploy.md#sizing-nginx) and passive health checks, and
``Nginx``, nginx run in the foreground with everything it writes under one prefix
(docs/deploy.md#nginx).

Used by ``deploy.cluster`` (``make cluster``) and the cluster tests. Nothing here imports
Django or Dispatch.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from deploy.tls import Certificate

TEMPLATE = Path(__file__).resolve().with_name("nginx.conf")

# dispatch/settings.py: MAX_REQUEST_BYTES, DISPATCH_MAX_REQUEST_BYTES's default (16 MiB).
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024

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

# What nginx is sized for (docs/deploy.md#sizing-nginx): the sockets one process is
# documented to hold (docs/operating.md#limits: 5,000 shims and 5,000 /ws sessions), two
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


def body_cap(env: Mapping[str, str]) -> int:
    """Dispatch's request body cap in bytes, as ``serve`` reads it from ``env``
    (``DISPATCH_MAX_REQUEST_BYTES``, default 16 MiB); nginx's ``client_max_body_size``.

    Raises ``ValueError`` for a value that is not a whole number.
    """
    given = env.get("DISPATCH_MAX_REQUEST_BYTES", "").strip()
    return int(given) if given else DEFAULT_MAX_REQUEST_BYTES


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
