"""What bench/live.py's phases (B10-B12) share: the sizes, the goals (bench/README.md#goals),
the shim protocol's version and limits, the command B10 streams, ``Skip`` for a row whose
feature the server lacks, and the wording of a refusal.

Imported by bench/live.py, which imports the Django app ``machines`` (``machines.shim``)
before it puts bench/ on ``sys.path``: bench/machines.py has the same name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from machines_common import SERVER_ENV as MACHINES_SERVER_ENV
from machines_common import SESSION as MACHINES_SESSION

from machines.shim import protocol as shim_protocol

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
SCRIPT = BENCH / "live.py"  # the entry point of the child processes (its ``relay`` and ``shims`` modes)
MiB = 1024 * 1024
SESSION = MACHINES_SESSION  # "bench": the real shims of B10 and B11
FANOUT_SESSION = "fanout"
MAX_MESSAGE = shim_protocol.MAX_MESSAGE_BYTES
LIVE_VERSION = shim_protocol.PROTOCOL_VERSION  # "2.1"
DEFAULT_LIMITS = shim_protocol.Limits()

# Goals: bench/README.md#goals.
B10_MAX_P95_MS = 200.0
B11_MIN_SHARE = 0.50
B11_MAX_GROWTH_MIB = 32.0
B12_MAX_RATIO = 2.0

FIRST_BYTE_COMMAND = ["sh", "-c", "echo ready; exec sleep 30"]
PROBE_SECONDS = 10.0  # a feature that has not answered within this is reported as missing

SERVER_ENV: dict[str, Any] = {**MACHINES_SERVER_ENV}


class Skip(Exception):
    """A row cannot be measured: the feature it needs is not there (the message says which)."""


@dataclass
class Sizes:
    samples: int
    warmup: int
    pipe_mib: int
    transfer_rounds: int
    fanout: int
    fanout_rounds: int


@dataclass
class Rig:
    dispatch_url: str
    token: str
    relay_url: str
    work: Path
    server_pid: int
    notes: list[str] = field(default_factory=list)
    relay_pid: int = 0


def _refused(response: Any, what: str) -> str:
    body = response.text if hasattr(response, "text") else ""
    return f"{what} answered {response.status_code} {response.headers.get('content-type', '')}: {body[:200]}"
