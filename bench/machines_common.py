"""What bench/machines.py's phases share (B4-B6), and bench/live.py with them: the sizes,
the goals (bench/README.md#goals), the server's settings, the shim envelope, real shims,
the source file of a copy and a sampler of a process's peak RSS.

Imported by bench/machines.py and bench/live.py (which put bench/ on ``sys.path``), never
run itself.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import process_rss_mib

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
SCRIPT = BENCH / "machines.py"  # the entry point the phases start again as child processes (its modes)
MiB = 1024 * 1024
CHUNK_BYTES = MiB  # machines/services/copy.py
MAX_MESSAGE = 16 * MiB + 64 * 1024  # docs/shim-protocol.md#connecting
SESSION = "bench"

# Goals: bench/README.md#goals (where the floor each must stay above is printed too).
B4_TOOL_MAX_RATIO = 4.0  # the in-process tool path: p50 <= this x bare
B4_REST_MAX_RATIO = 3.0  # REST and MCP: p50 <= the /healthz floor + this x bare
B5_MIN_SHARE = 0.75
B5_MAX_GROWTH_MIB = 32.0
B6_CONNECTIONS = 5000  # shims, and as many /ws sessions
B6_MAX_KIB = 40.0  # server memory per connection
B6_MAX_CPU_MS_PER_SESSION = 1.5  # server CPU to open one /ws session
B6_MAX_CPU_MS_PER_HELLO = 4.0  # server CPU to open one shim connection (its HELLO)
B6_MAX_IDLE_CPU_PERCENT = 15.0  # of one core, with every connection held idle

# Production intervals (tests shorten them), like bench/remote_calls.py.
SERVER_ENV: dict[str, Any] = {
    "DISPATCH_HEARTBEAT_INTERVAL": "2",
    "DISPATCH_PROCESS_TTL": "10",
    "DISPATCH_REAP_INTERVAL": "2",
    "DISPATCH_REMOTE_LIVENESS_INTERVAL": "2",
    "DISPATCH_REMOTE_CALL_TIMEOUT": "30",
    "DISPATCH_LOG_LEVEL": "WARNING",
}
# B6 shortens the shim PING period (production: 30 s) so the run sees a few PINGs per shim,
# keeping the server's PONG stamps (one write each) near 250/s: the period is the shims
# divided by 250, at least 4 s (5,000 shims: 20 s).
B6_STAMPS_PER_SECOND = 250
B6_PONG_TIMEOUT = 5.0


def envelope(message_type: str, payload: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A frame in the shim envelope (docs/shim-protocol.md#the-envelope)."""
    return {
        "type": message_type,
        "id": fields.pop("id", None) or str(uuid.uuid4()),
        "ts": time.time(),
        "version": "2.0",
        "session_id": fields.pop("session_id", None),
        "target_machine": fields.pop("target_machine", None),
        "payload": payload,
    }


# --- real shims and what the phases drive -----------------------------------------------


def start_shim(server_url: str, token: str, name: str, root: Path, state_dir: Path) -> Any:
    """A real ``python -m machines.shim run`` attached to SESSION; waits for its HELLO_ACK."""
    from tests.infra import Process, ShimProcess

    env = {k: v for k, v in os.environ.items() if not k.startswith("DISPATCH_")}
    env.update({"PYTHONUNBUFFERED": "1", "DISPATCH_SHIM_BACKOFF_SCALE": "0.05"})
    args = [
        sys.executable,
        "-m",
        "machines.shim",
        "run",
        "--server",
        server_url,
        "--token",
        token,
        "--state-dir",
        str(state_dir),
        "--root",
        str(root),
        "--name",
        name,
        "--session",
        SESSION,
    ]
    started = Process.spawn(env, args, name=f"bench-shim-{name}")
    shim = ShimProcess(proc=started.proc, log_path=started.log_path, state_dir=state_dir, name=name)
    try:
        return shim.wait_connected(timeout=20)
    except BaseException:
        shim.kill()
        raise


@dataclass
class Sizes:
    warmup: int
    calls: int
    rounds: int
    copy_rounds: int
    copy_mib: int
    shims: int
    sessions: int
    idle_seconds: float
    storm_shims: int
    ping_interval: float = 20.0  # B6's DISPATCH_SHIM_PING_INTERVAL (s)
    b6_clients: int = 4  # client processes that open B6's connections
    b6_users: int = 50  # B6's connections are spread over this many users
    one_user_shims: int = 500  # (B6''): shims of one user, in batches of 100
    connect_limit: float = 150.0  # s: each of B6's two phases (shims, sessions) gives up then


@dataclass
class Rig:
    """Everything B4 and B5 drive: Dispatch and the relay, each with a source and a destination shim."""

    dispatch_url: str
    token: str
    relay_url: str
    work: Path
    pids: dict[str, int]
    source_file: Path = field(init=False)
    source_sha256: str = ""
    stat_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.source_file = self.work / "src" / "data.bin"
        self.stat_path = self.work / "src" / "stat-me.txt"


def make_source(path: Path, mib: int) -> str:
    """Write ``mib`` MiB of random bytes to ``path``; returns their SHA-256."""
    digest = hashlib.sha256()
    with path.open("wb") as stream:
        for _ in range(mib):
            block = os.urandom(MiB)
            digest.update(block)
            stream.write(block)
    return digest.hexdigest()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(MiB), b""):
            digest.update(block)
    return digest.hexdigest()


class RssSampler:
    """The peak RSS (MiB) of a process, sampled every ``interval`` seconds in a thread."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.pid, self.interval = pid, interval
        self.before = process_rss_mib(pid)
        self.peak = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.after = process_rss_mib(self.pid)
        self.peak = max(self.peak, self.after)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, process_rss_mib(self.pid))
