"""This process's identity as a ``ServerProcess`` (spec/overview.md "Many machines").

The id is made once per process at import. It names the process in connection rows and
in the channel-layer group ``proc.<id>`` that every consumer of the process joins, so a
shutdown or a reap of this process reaches all of its sockets.
"""

from __future__ import annotations

import os
import secrets
import socket

PROCESS_ID = f"proc_{secrets.token_hex(8)}"
HOSTNAME = socket.gethostname()
PID = os.getpid()


def current_process_id() -> str:
    """The id of this process's ``ServerProcess`` row (``proc_`` + 16 hex)."""
    return PROCESS_ID


def process_group(process_id: str) -> str:
    """The channel-layer group joined by every consumer held by ``process_id``."""
    return f"proc.{process_id}"
