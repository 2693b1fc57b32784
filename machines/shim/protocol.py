"""The shim wire protocol (docs/shim-protocol.md): the one definition, for both ends.

The envelope every frame carries, the message types, the operations and the capability
each needs, the error codes and the ``ERROR`` payload, the close codes, the version
rule, the id patterns and the limits negotiated in the handshake. Plain dicts on the
wire; this module only builds, parses and checks them.

The shim imports it, and so does the platform (``machines.protocol`` adds only what the
server needs on top: the ``HELLO`` model it validates with, version negotiation, the
channel-layer messages). Standard library only — it imports nothing from Django,
``core`` or any server module, because the shim package installs without them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from enum import IntEnum, StrEnum
from typing import Any

PROTOCOL_VERSION = "2.1"
"""The protocol version this shim speaks, ``"major.minor"``. 2.1 adds streamed
command output (``COMMAND_OUTPUT``), ``CANCEL``, streamed stdin (``COMMAND_INPUT``) with
``FLOW`` credits; a connection negotiated at 2.0 uses none of them."""

LIVE_OPERATIONS_VERSION = (2, 1)
"""The first ``(major, minor)`` with streamed output, ``CANCEL``, ``COMMAND_INPUT`` and ``FLOW``."""

STREAM_FLUSH_BYTES = 64 * 1024
"""Bytes: a stream's buffer is sent as a ``COMMAND_OUTPUT`` frame once it holds this much."""

STREAM_FLUSH_SECONDS = 0.1
"""Seconds: otherwise buffered output goes out this long after the previous frame (the
first output of an operation goes at once)."""

CANCEL_GRACE_SECONDS = 5.0
"""Seconds between the SIGTERM a ``CANCEL`` sends a command's process group and the SIGKILL."""

SHIM_VERSION = "0.1.0"
"""This program's version, sent in ``HELLO.shim_version``."""

MAX_FRAME_BYTES = 16 * 1024 * 1024
"""Largest payload-carrying frame either side sends: 16 MiB."""

MAX_MESSAGE_BYTES = MAX_FRAME_BYTES + 64 * 1024
"""Websocket ``max_size`` the shim connects with: 16 MiB + 64 KiB of envelope slack."""

MAX_FILE_SIZE_CEILING = 12 * 1024 * 1024
"""Bytes: the largest ``max_file_size_bytes`` the shim accepts, so that a whole-limit read
in base64 (4/3 of it: 16 MiB) still fits in one frame."""

SESSION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,255}$"
"""A machine session id (docs/shim-protocol.md#machine-sessions); ``HELLO.sessions`` holds these or ``"*"``."""

MACHINE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$"
"""A ``machine_id`` as ``HELLO`` and the device login carry it."""


class MessageType(StrEnum):
    """Every frame ``type`` of the protocol."""

    HELLO = "HELLO"
    HELLO_ACK = "HELLO_ACK"
    ERROR = "ERROR"
    PING = "PING"
    PONG = "PONG"
    SESSION_REVOKED = "SESSION_REVOKED"
    ACK = "ACK"
    MACHINE_LIST_REQUEST = "MACHINE_LIST_REQUEST"
    MACHINE_LIST_RESPONSE = "MACHINE_LIST_RESPONSE"
    FILE_READ = "FILE_READ"
    FILE_CONTENTS = "FILE_CONTENTS"
    FILE_WRITE = "FILE_WRITE"
    FILE_STAT = "FILE_STAT"
    FILE_STAT_RESPONSE = "FILE_STAT_RESPONSE"
    FILE_LIST = "FILE_LIST"
    FILE_LIST_RESPONSE = "FILE_LIST_RESPONSE"
    FILE_DELETE = "FILE_DELETE"
    FILE_MOVE = "FILE_MOVE"
    EXECUTE_COMMAND = "EXECUTE_COMMAND"
    COMMAND_RESULT = "COMMAND_RESULT"
    # 2.1: live operations
    COMMAND_OUTPUT = "COMMAND_OUTPUT"
    CANCEL = "CANCEL"
    COMMAND_INPUT = "COMMAND_INPUT"
    FLOW = "FLOW"


class ErrorCode(StrEnum):
    """``ERROR.payload.code`` values the shim sends (docs/shim-protocol.md#errors).

    ``CANCELLED`` (2.1): a ``CANCEL`` stopped an operation that is not a command (a command
    still ends with its ``COMMAND_RESULT {cancelled: true}``).
    ``INTERNAL_ERROR`` is the shim's own addition for a bug in the shim (an exception no
    rule maps); the platform should treat it like any failed operation.
    """

    PATH_OUTSIDE_ALLOWED_ROOT = "PATH_OUTSIDE_ALLOWED_ROOT"
    PATH_NOT_FOUND = "PATH_NOT_FOUND"
    PATH_EXISTS = "PATH_EXISTS"
    PATH_NOT_EMPTY = "PATH_NOT_EMPTY"
    IS_A_DIRECTORY = "IS_A_DIRECTORY"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    ENCODING_ERROR = "ENCODING_ERROR"
    FILE_TOO_LARGE = "FILE_TOO_LARGE"
    INVALID_REQUEST = "INVALID_REQUEST"
    UNSUPPORTED_OPERATION = "UNSUPPORTED_OPERATION"
    CAPABILITY_NOT_GRANTED = "CAPABILITY_NOT_GRANTED"
    SHIM_OVERLOADED = "SHIM_OVERLOADED"
    CANCELLED = "CANCELLED"
    INTERNAL_ERROR = "INTERNAL_ERROR"


class CloseCode(IntEnum):
    """Websocket close codes of ``/ws/shim/`` (docs/shim-protocol.md#close-codes)."""

    NORMAL = 1000
    MESSAGE_TOO_BIG = 1009
    MALFORMED_HELLO = 4400
    AUTH_FAILED = 4401
    HELLO_TIMEOUT = 4408
    PROTOCOL_VERSION_MISMATCH = 4426
    SESSION_REVOKED = 4427


NO_RECONNECT_CLOSE_CODES: Mapping[int, str] = {
    CloseCode.AUTH_FAILED: "the platform refused the token",
    CloseCode.PROTOCOL_VERSION_MISMATCH: "the platform speaks another major protocol version",
    CloseCode.SESSION_REVOKED: "another shim with this machine_id connected and took over",
}
"""Close codes after which the shim must not reconnect, with the reason it prints."""


class Capability(StrEnum):
    """What a shim can be granted: ``files`` covers every ``FILE_*`` operation, ``shell`` ``EXECUTE_COMMAND``."""

    SHELL = "shell"
    FILES = "files"


OPERATIONS: Mapping[str, tuple[str, Capability | None]] = {
    MessageType.MACHINE_LIST_REQUEST: (MessageType.MACHINE_LIST_RESPONSE, None),
    MessageType.FILE_READ: (MessageType.FILE_CONTENTS, Capability.FILES),
    MessageType.FILE_WRITE: (MessageType.ACK, Capability.FILES),
    MessageType.FILE_STAT: (MessageType.FILE_STAT_RESPONSE, Capability.FILES),
    MessageType.FILE_LIST: (MessageType.FILE_LIST_RESPONSE, Capability.FILES),
    MessageType.FILE_DELETE: (MessageType.ACK, Capability.FILES),
    MessageType.FILE_MOVE: (MessageType.ACK, Capability.FILES),
    MessageType.EXECUTE_COMMAND: (MessageType.COMMAND_RESULT, Capability.SHELL),
    MessageType.PING: (MessageType.PONG, None),
}
"""Operation type → (response type, the capability it needs or ``None``), the table of
docs/shim-protocol.md#operations."""


class ShimError(Exception):
    """An operation failed with one of the error codes of docs/shim-protocol.md#errors; sent as an ``ERROR`` frame.

    ``details`` is a JSON-serialisable dict (or ``None``); ``message`` is for humans and
    never carries file contents, env values or tokens.
    """

    def __init__(self, code: ErrorCode, message: str, details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = dict(details) if details is not None else None

    def payload(self) -> dict[str, Any]:
        """The ``ERROR`` payload: ``{code, message, fatal: false, details?}``."""
        return error_payload(str(self.code), self.message, details=self.details)


def error_payload(
    code: str, message: str, *, fatal: bool = False, details: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """An ``ERROR`` payload ``{code, message, fatal, details?}``, from either side:
    ``details`` is included when given (not ``None``); ``fatal`` means the sender closes
    the connection next."""
    body: dict[str, Any] = {"code": code, "message": message, "fatal": fatal}
    if details is not None:
        body["details"] = dict(details)
    return body


def new_id() -> str:
    """A fresh frame id (a random UUID as a string)."""
    return str(uuid.uuid4())


def envelope(
    message_type: str,
    payload: Mapping[str, Any],
    *,
    frame_id: str | None = None,
    session_id: str | None = None,
    target_machine: str | None = None,
) -> dict[str, Any]:
    """Build one frame ``{type, id, ts, version, session_id, target_machine, payload}``
    (docs/shim-protocol.md#the-envelope).

    ``frame_id`` defaults to a new UUID; a response passes its request's id. ``ts`` is
    seconds since the epoch (float).
    """
    return {
        "type": str(message_type),
        "id": frame_id if frame_id is not None else new_id(),
        "ts": time.time(),
        "version": PROTOCOL_VERSION,
        "session_id": session_id,
        "target_machine": target_machine,
        "payload": dict(payload),
    }


def response_to(request: Mapping[str, Any], message_type: str, payload: Mapping[str, Any]) -> dict[str, Any]:
    """The response frame to ``request``: its ``id`` and ``session_id``, a new ``payload``."""
    request_id = request.get("id")
    session_id = request.get("session_id")
    return envelope(
        message_type,
        payload,
        frame_id=request_id if isinstance(request_id, str) else None,
        session_id=session_id if isinstance(session_id, str) else None,
    )


def error_to(request: Mapping[str, Any], error: ShimError) -> dict[str, Any]:
    """The ``ERROR`` frame answering ``request`` with ``error``."""
    frame = response_to(request, MessageType.ERROR, error.payload())
    if not isinstance(request.get("id"), str):
        frame["id"] = None  # the request had no usable id: answer, but correlate with nothing
    return frame


def encode(frame: Mapping[str, Any]) -> str:
    """One JSON text frame.

    Non-ASCII characters stay as they are (``\\u`` escapes would make frames of non-English
    text up to twice as large), unless the frame holds lone surrogates — file names that
    are not UTF-8 — which only the escaped form can carry.
    """
    text = json.dumps(frame, ensure_ascii=False, separators=(",", ":"))
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = json.dumps(frame, separators=(",", ":"))
    return text


def decode(text: str | bytes) -> dict[str, Any]:
    """Parse one incoming frame into a dict with a string ``type`` and a dict ``payload``.

    A missing ``payload`` becomes ``{}``. Raises ``ShimError(INVALID_REQUEST)`` for a
    binary frame, invalid JSON, a non-object, a missing/non-string ``type`` or a payload
    that is not an object.
    """
    if isinstance(text, bytes):
        raise ShimError(ErrorCode.INVALID_REQUEST, "binary frames are not part of the protocol")
    try:
        frame = json.loads(text)
    except ValueError as error:
        raise ShimError(ErrorCode.INVALID_REQUEST, f"the frame is not valid JSON: {error}") from None
    if not isinstance(frame, dict):
        raise ShimError(ErrorCode.INVALID_REQUEST, "a frame must be a JSON object")
    if not isinstance(frame.get("type"), str):
        raise ShimError(ErrorCode.INVALID_REQUEST, "the frame has no string 'type'")
    if frame.get("payload") is None:
        frame["payload"] = {}
    if not isinstance(frame["payload"], dict):
        raise ShimError(ErrorCode.INVALID_REQUEST, "the frame's 'payload' must be a JSON object")
    return frame


def parse_version(text: str) -> tuple[int, int]:
    """``"2.0"`` → ``(2, 0)`` (``"major.minor"``); ``ValueError`` for anything else."""
    major, _, minor = text.partition(".")
    if not major.isdigit() or not minor.isdigit():
        raise ValueError(f"protocol_version must look like '2.0', got {text!r}")
    return int(major), int(minor)


def major_version(version: object) -> int | None:
    """The major part of a ``"major.minor"`` version string, or ``None`` if malformed."""
    if not isinstance(version, str):
        return None
    try:
        return parse_version(version)[0]
    except ValueError:
        return None


_INTEGER_LIMITS = ("max_file_size_bytes", "max_concurrent", "max_stream_bytes", "stream_window_bytes")


def supports_live_operations(version: object) -> bool:
    """Whether a negotiated ``"major.minor"`` version has the 2.1 live operations."""
    if not isinstance(version, str):
        return False
    try:
        return parse_version(version) >= LIVE_OPERATIONS_VERSION
    except ValueError:
        return False


@dataclass(frozen=True)
class Limits:
    """Operation limits (``HELLO_ACK.limits``); the shim uses the lower of its own and
    the platform's.

    Units: bytes, seconds, seconds, operations in flight, bytes (streamed output of one
    operation, 2.1), bytes (the initial ``FLOW`` credit of each stream, 2.1). The defaults
    are the platform's documented defaults.
    """

    max_file_size_bytes: int = 10 * 1024 * 1024
    command_timeout_seconds: float = 30
    max_command_timeout_seconds: float = 600
    max_concurrent: int = 4
    max_stream_bytes: int = 1024 * 1024 * 1024
    stream_window_bytes: int = 1024 * 1024

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"limit {field.name} must be a positive number, got {value!r}")
        for name in _INTEGER_LIMITS:
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"{name} must be an integer")
        if self.max_file_size_bytes > MAX_FILE_SIZE_CEILING:
            raise ValueError(f"max_file_size_bytes may be at most {MAX_FILE_SIZE_CEILING} (12 MiB)")

    def lower(self, platform_limits: Mapping[str, Any]) -> Limits:
        """These limits lowered by the platform's ``HELLO_ACK.limits``.

        Fields the platform leaves out, or sends with a value that is not a positive
        number, keep this side's value. ``command_timeout_seconds`` never ends up above
        ``max_command_timeout_seconds``.
        """
        lowered: dict[str, Any] = {}
        for field in fields(self):
            own = getattr(self, field.name)
            theirs = platform_limits.get(field.name)
            if isinstance(theirs, bool) or not isinstance(theirs, int | float) or theirs <= 0:
                lowered[field.name] = own
            elif isinstance(own, int) and field.name in _INTEGER_LIMITS:
                lowered[field.name] = min(own, int(theirs)) or 1
            else:
                lowered[field.name] = min(own, theirs)
        limits = replace(self, **lowered)
        if limits.command_timeout_seconds > limits.max_command_timeout_seconds:
            limits = replace(limits, command_timeout_seconds=limits.max_command_timeout_seconds)
        return limits

    def as_payload(self) -> dict[str, Any]:
        """The limits as the ``HELLO_ACK.limits`` dict shape."""
        return {field.name: getattr(self, field.name) for field in fields(self)}
