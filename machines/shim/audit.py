"""The shim's local audit log: one JSON line per operation (docs/shim-protocol.md#audit).

Each record is ``{ts, session_id, machine_id, request_id, op, details, result: {ok,
error_code, duration_ms[, exit_code][, cancelled][, bytes: {stdout, stderr, stdin}]}}``.
``details`` names paths, argv (secret-looking values redacted), sizes and the 2.1 command
options (``stream``, ``binary``, ``pipe``, ``stdin``) — never file contents, never env
values (only env keys), never streamed data. Protocol 2.1 control frames (``CANCEL``,
``FLOW``, ``COMMAND_INPUT``) and ``COMMAND_OUTPUT`` frames get no record of their own: the
operation's one record carries the bytes per stream and whether it was cancelled.
The file is created with mode 0600 and only ever appended to.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .protocol import MessageType
from .redaction import REDACTED, redact, redact_argv

__all__ = ["REDACTED", "AuditLog", "operation_details", "redact", "redact_argv"]

logger = logging.getLogger("machines.shim")


def operation_details(op: str, payload: Mapping[str, Any]) -> dict[str, Any]:
    """What the audit record says about a request: paths, flags, sizes, redacted argv.

    Never ``content`` and never env values. Unexpected field types are recorded as
    ``null`` rather than trusted.
    """
    details: dict[str, Any] = {}
    for name in ("path", "src", "dst", "cwd", "encoding", "glob", "stdin"):
        if isinstance(payload.get(name), str):
            details[name] = payload[name]
    for name in (
        "offset",
        "length",
        "max_entries",
        "timeout_seconds",
        "recursive",
        "include_hidden",
        "missing_ok",
        "overwrite",
        "create_parents",
        "append",
        "hash",
        "stream",
        "binary",
        "pipe",
    ):
        value = payload.get(name)
        if isinstance(value, bool | int | float):
            details[name] = value
    if op == MessageType.FILE_WRITE and isinstance(payload.get("content"), str):
        details["content_chars"] = len(payload["content"])
    argv = payload.get("argv")
    if isinstance(argv, list):
        details["argv"] = redact_argv(argv)
    command = payload.get("command")
    if isinstance(command, str):
        details["command"] = redact(command)
    env = payload.get("env")
    if isinstance(env, dict):
        details["env_keys"] = sorted(str(key) for key in env)
    return details


class AuditLog:
    """Appends audit records to a JSONL file (mode 0600, parent directory created 0700).

    :meth:`write` is blocking (one ``os.write`` per record, under a lock so records from
    worker threads never interleave); call it through ``asyncio.to_thread`` from async
    code. A failing write is logged, never raised: auditing must not break operations.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def write(
        self,
        *,
        session_id: str | None,
        machine_id: str,
        request_id: str | None,
        op: str,
        details: Mapping[str, Any],
        ok: bool,
        error_code: str | None,
        duration_ms: float,
        exit_code: int | None = None,
        cancelled: bool | None = None,
        byte_counts: Mapping[str, int] | None = None,
    ) -> None:
        """Append one record (see the module docstring for its shape; ``ts`` is now, in
        seconds since the epoch). ``result`` gets ``exit_code`` (commands), ``cancelled``
        (whether a ``CANCEL`` or the connection's end stopped the operation) and ``bytes``
        (``{stdout, stderr, stdin}`` raw byte counts of a command) when given."""
        result: dict[str, Any] = {"ok": ok, "error_code": error_code, "duration_ms": round(duration_ms, 3)}
        if exit_code is not None:
            result["exit_code"] = exit_code
        if cancelled is not None:
            result["cancelled"] = cancelled
        if byte_counts is not None:
            result["bytes"] = dict(byte_counts)
        record = {
            "ts": time.time(),
            "session_id": session_id,
            "machine_id": machine_id,
            "request_id": request_id,
            "op": op,
            "details": dict(details),
            "result": result,
        }
        line = (json.dumps(record, ensure_ascii=False, default=str) + "\n").encode("utf-8")
        with self._lock:
            try:
                self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    os.write(descriptor, line)
                finally:
                    os.close(descriptor)
            except OSError:
                logger.exception("could not write the audit log %s", self.path)
