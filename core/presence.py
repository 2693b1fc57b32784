"""This process's identity as a ``ServerProcess`` (docs/deployment.md#what-runs-where).

The id is made once per process at import and names the process in connection rows.
The process also knows its own live sockets (``local_connections``), only to close them
when it stops or finds itself reaped: routing never uses this set, it uses the rows.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
import weakref
from typing import Any

PROCESS_ID = f"proc_{secrets.token_hex(8)}"
HOSTNAME = socket.gethostname()
PID = os.getpid()

_local_connections: weakref.WeakSet[Any] = weakref.WeakSet()

PROCESS_ROW_TRUST_SECONDS = 1.0
"""How long a connection may take this process's ``ServerProcess`` row as live without
reading it again (``process_row_trusted``). A row reaped meanwhile makes the connection
row's foreign key fail at commit; the caller then forgets the memo and writes again, so
the memo saves a query per connection and never attaches one to a missing row."""

_row_confirmed_at: float | None = None  # time.monotonic() of the last confirmation


def current_process_id() -> str:
    """The id of this process's ``ServerProcess`` row (``proc_`` + 16 hex)."""
    return PROCESS_ID


def process_row_confirmed() -> None:
    """Note that this process's row was just read or written live (not stopped)."""
    global _row_confirmed_at
    _row_confirmed_at = time.monotonic()


def process_row_trusted() -> bool:
    """Whether this process's row was confirmed live less than
    ``PROCESS_ROW_TRUST_SECONDS`` ago (no database access)."""
    confirmed = _row_confirmed_at
    return confirmed is not None and time.monotonic() - confirmed < PROCESS_ROW_TRUST_SECONDS


def process_row_forget() -> None:
    """Drop the memo: the next connection reads (and if need be re-creates) the row."""
    global _row_confirmed_at
    _row_confirmed_at = None


def connection_opened(consumer: Any) -> None:
    """Remember a consumer of this process (weakly) so shutdown can reach it."""
    _local_connections.add(consumer)


def connection_closed(consumer: Any) -> None:
    _local_connections.discard(consumer)


def presence_group(process_id: str) -> str:
    """The channel-layer group a process answers ``presence.ping`` on: ``presence.`` + its
    id (``dispatch.background.presence_loop`` joins it; a takeover's check,
    docs/operating.md#a-client-of-a-dead-process-registering-again)."""
    return f"presence.{process_id}"


def pid_absent(*, hostname: str, pid: int) -> bool:
    """Whether process ``pid`` of host ``hostname`` certainly no longer exists: True only on
    this host (same hostname) when ``kill(pid, 0)`` says there is no such process. A pid
    found proves nothing (pids are reused), nor does another host's pid: both give False.
    """
    if hostname != HOSTNAME or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: a process of another user has that pid
        return False
    return False


def local_channel_names() -> list[str]:
    """The channel names of this process's open consumers."""
    return [consumer.channel_name for consumer in list(_local_connections) if getattr(consumer, "channel_name", None)]
