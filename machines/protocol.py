"""The shim wire protocol, platform side (machines.md §2, §3, §5).

Typed models for what the platform receives (``HELLO``) and helpers for the envelope it
sends. The shim's own copy lives in ``machines/shim/`` (it imports nothing from here).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator, model_validator

from core import wire

PROTOCOL_VERSION = "2.0"
MAX_FRAME_BYTES = 16 * 1024 * 1024  # frames over this close with 1009 (§2)

CLOSE_BAD_HELLO = 4400
CLOSE_UNAUTHENTICATED = 4401
CLOSE_HELLO_TIMEOUT = 4408
CLOSE_VERSION_MISMATCH = 4426
CLOSE_SESSION_REVOKED = 4427
CLOSE_TOO_BIG = 1009

SESSION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,255}$"

# Limits the platform grants in HELLO_ACK (§3): bytes, seconds, operations.
DEFAULT_LIMITS: dict[str, int] = {
    "max_file_size_bytes": 10 * 1024 * 1024,
    "command_timeout_seconds": 30,
    "max_command_timeout_seconds": 600,
    "max_concurrent": 4,
}

# Operation → (capability it needs, the response type a success carries) (§5).
OPERATIONS: dict[str, tuple[str | None, str]] = {
    "MACHINE_LIST_REQUEST": (None, "MACHINE_LIST_RESPONSE"),
    "FILE_READ": ("files", "FILE_CONTENTS"),
    "FILE_WRITE": ("files", "ACK"),
    "FILE_STAT": ("files", "FILE_STAT_RESPONSE"),
    "FILE_LIST": ("files", "FILE_LIST_RESPONSE"),
    "FILE_DELETE": ("files", "ACK"),
    "FILE_MOVE": ("files", "ACK"),
    "EXECUTE_COMMAND": ("shell", "COMMAND_RESULT"),
    "PING": (None, "PONG"),
}
# Operations a caller may request through machine_op (the rest are the platform's own).
CALLER_OPERATIONS = frozenset(op for op in OPERATIONS if op not in ("MACHINE_LIST_REQUEST", "PING"))
CAPABILITIES = frozenset({"shell", "files"})


def parse_version(text: str) -> tuple[int, int]:
    """``"2.0"`` → ``(2, 0)``; ``ValueError`` for anything else."""
    major, _, minor = text.partition(".")
    if not major.isdigit() or not minor.isdigit():
        raise ValueError(f"protocol_version must look like '2.0', got {text!r}")
    return int(major), int(minor)


class Hello(BaseModel):
    """The shim's ``HELLO`` payload (§3)."""

    model_config = ConfigDict(extra="ignore")

    shim_version: StrictStr = Field(max_length=64)
    protocol_version: StrictStr = Field(max_length=16)
    machine_id: StrictStr = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$")
    hostname: StrictStr = Field(min_length=1, max_length=255)
    display_name: StrictStr | None = Field(default=None, max_length=255)
    platform: Literal["linux", "darwin"]
    arch: StrictStr = Field(min_length=1, max_length=32)
    capabilities: list[Literal["shell", "files"]] = Field(max_length=8)
    allowed_roots: list[StrictStr] = Field(max_length=64)
    sessions: list[StrictStr] = Field(min_length=1, max_length=256)
    hardware_devices: list[Any] = Field(default_factory=list, max_length=64)

    @model_validator(mode="before")
    @classmethod
    def _utf8(cls, value: Any) -> Any:
        # Everything in a HELLO is stored and shown: text must be writable as UTF-8.
        if not wire.encodable(json.dumps(value, ensure_ascii=False, default=str)):
            raise ValueError("HELLO holds text that is not valid UTF-8 (a lone surrogate)")
        return value

    @field_validator("protocol_version")
    @classmethod
    def _version(cls, value: str) -> str:
        parse_version(value)
        return value

    @field_validator("allowed_roots")
    @classmethod
    def _roots(cls, value: list[str]) -> list[str]:
        for root in value:
            if not root.startswith("/") or "\x00" in root or len(root) > 4096:
                raise ValueError(f"allowed_roots entries must be absolute paths, got {root[:100]!r}")
        return value

    @field_validator("sessions")
    @classmethod
    def _sessions(cls, value: list[str]) -> list[str]:
        import re

        for session_id in value:
            if session_id != "*" and not re.fullmatch(SESSION_ID_PATTERN, session_id):
                raise ValueError(f"invalid session id {session_id[:100]!r}")
        return value


def negotiate(shim_version: str) -> str | None:
    """The negotiated version (same major, lower minor), or ``None`` on a major mismatch."""
    shim_major, shim_minor = parse_version(shim_version)
    our_major, our_minor = parse_version(PROTOCOL_VERSION)
    if shim_major != our_major:
        return None
    return f"{our_major}.{min(shim_minor, our_minor)}"


def envelope(
    message_type: str,
    payload: dict[str, Any],
    *,
    message_id: str | None = None,
    session_id: str | None = None,
    target_machine: str | None = None,
) -> dict[str, Any]:
    """One frame in the §2 envelope (a fresh uuid4 ``id`` unless given)."""
    return {
        "type": message_type,
        "id": message_id or str(uuid.uuid4()),
        "ts": time.time(),
        "version": PROTOCOL_VERSION,
        "session_id": session_id,
        "target_machine": target_machine,
        "payload": payload,
    }


def encode(frame: dict[str, Any]) -> str:
    """Serialise a frame as compact JSON (UTF-8 kept as is).

    A string may hold a lone surrogate (a ``"\\ud800"`` escape in a caller's or shim's
    JSON decodes to one), which UTF-8 cannot carry: sending the frame would fail. Such a
    frame is written with ``\\u`` escapes instead, which mean the same JSON.
    """
    text = json.dumps(frame, separators=(",", ":"), ensure_ascii=False)
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            return json.dumps(frame, separators=(",", ":"))
    return text
