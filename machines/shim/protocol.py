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
import types
import uuid
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields, replace
from dataclasses import field as _field
from enum import IntEnum, StrEnum
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

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


# --- operation payloads: the one definition of each request payload (docs/shim-protocol.md#operations)
#
# Standard-library dataclasses, so the shim (which installs without pydantic) checks what it
# receives with them (``payload_of``), while the platform derives its pydantic models from
# the same classes (``machines.schemas.payload_model``: the REST route's validation and the
# tools' input schemas). Each field's constraints sit in its ``metadata`` under pydantic's
# ``Field`` argument names (``ge``, ``gt``, ``le``, ``min_length``, ``description``), which
# both readers understand. A field given as ``null`` reads as absent (its default), as the
# shim has always read it.

PATH_DESCRIPTION = "Absolute path, or relative to the machine's first allowed root."

MAX_LIST_ENTRIES = 100_000
"""The largest ``max_entries`` FILE_LIST accepts."""

Encoding = Literal["utf-8", "base64"]
"""``encoding`` of FILE_READ and FILE_WRITE."""


_PATH = {"min_length": 1, "description": PATH_DESCRIPTION}  # a path field's metadata


@dataclass(frozen=True, slots=True)
class FileRead:
    """``FILE_READ`` ``{path, encoding?, offset?, length?}``: ``offset`` and ``length`` in bytes."""

    path: str = _field(metadata=_PATH)
    encoding: Encoding = "utf-8"
    offset: int | None = _field(default=None, metadata={"ge": 0, "description": "First byte to read."})
    length: int | None = _field(default=None, metadata={"ge": 0, "description": "Bytes to read at most."})


@dataclass(frozen=True, slots=True)
class FileWrite:
    """``FILE_WRITE`` ``{path, content, encoding?, create_parents?, append?}``."""

    path: str = _field(metadata=_PATH)
    content: str = _field(metadata={"description": "The text, or the bytes in base64 with encoding base64."})
    encoding: Encoding = "utf-8"
    create_parents: bool = False
    append: bool = False


@dataclass(frozen=True, slots=True)
class FileStat:
    """``FILE_STAT`` ``{path, hash?}``: ``hash: true`` adds the file's SHA-256."""

    path: str = _field(metadata=_PATH)
    hash: bool = False


@dataclass(frozen=True, slots=True)
class FileList:
    """``FILE_LIST`` ``{path, glob?, recursive?, include_hidden?, max_entries?}``
    (``max_entries``: 1,000 when absent, at most ``MAX_LIST_ENTRIES``)."""

    path: str = _field(metadata=_PATH)
    glob: str | None = _field(
        default=None, metadata={"min_length": 1, "description": "Matches the name, or the relative path with '/'."}
    )
    recursive: bool = False
    include_hidden: bool = False
    max_entries: int | None = _field(default=None, metadata={"ge": 1, "le": MAX_LIST_ENTRIES})


@dataclass(frozen=True, slots=True)
class FileDelete:
    """``FILE_DELETE`` ``{path, recursive?, missing_ok?}``."""

    path: str = _field(metadata=_PATH)
    recursive: bool = False
    missing_ok: bool = False


@dataclass(frozen=True, slots=True)
class FileMove:
    """``FILE_MOVE`` ``{src, dst, overwrite?}``: ``dst`` is the new path."""

    src: str = _field(metadata=_PATH)
    dst: str = _field(metadata={**_PATH, "description": "The new path (not a directory to move into)."})
    overwrite: bool = False


@dataclass(frozen=True, slots=True)
class LiveFields:
    """The 2.1 fields of ``EXECUTE_COMMAND`` (docs/shim-protocol.md#live-operations-21), which
    the platform sets for a stream or a pipe, never a caller."""

    stream: bool = False
    binary: bool = False
    stdin: Literal["null", "stream"] = "null"
    pipe: bool = False


@dataclass(frozen=True, slots=True)
class ExecuteCommand(LiveFields):
    """``EXECUTE_COMMAND`` ``{argv | command, cwd?, timeout_seconds?, env?}`` plus the
    ``LiveFields``; exactly one of ``argv`` and ``command`` (``Operations`` checks that, and
    NUL bytes: a JSON schema of the payload says it only as ``oneOf``, which tool callers
    refuse at the top level). ``timeout_seconds`` is at most the platform's
    ``max_command_timeout_seconds`` (a shim may have lowered its own)."""

    argv: list[str] | None = _field(
        default=None, metadata={"min_length": 1, "description": "Program and arguments, run without a shell."}
    )
    command: str | None = _field(
        default=None, metadata={"min_length": 1, "description": "Run through the user's shell."}
    )
    cwd: str | None = _field(default=None, metadata={"description": "Default: the machine's first allowed root."})
    timeout_seconds: float | None = _field(
        default=None,
        metadata={
            "gt": 0,
            "le": Limits.max_command_timeout_seconds,
            "description": "Seconds before the command is killed (default: the machine's command_timeout_seconds).",
        },
    )
    env: dict[str, str] | None = _field(
        default=None, metadata={"description": "Merged over a minimal environment (PATH, HOME, LANG, …)."}
    )


PAYLOADS: Mapping[str, type[Any]] = {
    MessageType.FILE_READ: FileRead,
    MessageType.FILE_WRITE: FileWrite,
    MessageType.FILE_STAT: FileStat,
    MessageType.FILE_LIST: FileList,
    MessageType.FILE_DELETE: FileDelete,
    MessageType.FILE_MOVE: FileMove,
    MessageType.EXECUTE_COMMAND: ExecuteCommand,
}
"""Operation → its payload model (``MACHINE_LIST_REQUEST`` and ``PING`` carry ``{}``)."""

Payload = TypeVar("Payload")


@dataclass(frozen=True, slots=True)
class _Check:
    """One field as ``payload_of`` checks it: its name, its default (``MISSING``: required),
    what its values may be (``kind``), the choices of a ``Literal`` and its bounds."""

    name: str
    default: Any
    kind: type | str
    choices: tuple[Any, ...]
    ge: float | None
    gt: float | None
    le: float | None
    min_length: int

    def value(self, value: Any) -> Any:
        """``value`` if it fits, else ``ShimError(INVALID_REQUEST)`` saying what the field takes."""
        name, kind = self.name, self.kind
        if kind is bool:
            if not isinstance(value, bool):
                raise ShimError(ErrorCode.INVALID_REQUEST, f"'{name}' must be true or false")
        elif kind == "choice":
            if value not in self.choices or not isinstance(value, str):
                raise ShimError(ErrorCode.INVALID_REQUEST, f"'{name}' must be one of {', '.join(self.choices)}")
        elif kind is int or kind is float:
            number = int if kind is int else int | float
            if isinstance(value, bool) or not isinstance(value, number) or not self._within(value):
                raise ShimError(ErrorCode.INVALID_REQUEST, f"'{name}' must be {self._bounds()}")
        elif kind is str:
            if not isinstance(value, str) or len(value) < self.min_length:
                raise ShimError(
                    ErrorCode.INVALID_REQUEST, f"'{name}' must be a {'non-empty ' if self.min_length else ''}string"
                )
        elif kind is list:
            strings = isinstance(value, list) and all(isinstance(v, str) for v in value)
            if not strings or len(value) < self.min_length:
                raise ShimError(ErrorCode.INVALID_REQUEST, f"'{name}' must be a non-empty list of strings")
        elif not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ShimError(ErrorCode.INVALID_REQUEST, f"'{name}' must be an object of strings")
        return value

    def _within(self, value: float) -> bool:
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
        )

    def _bounds(self) -> str:
        what = "an integer" if self.kind is int else "a number"
        bounds = [f"at least {self.ge}"] if self.ge is not None else []
        bounds += [f"above {self.gt}"] if self.gt is not None else []
        bounds += [f"at most {self.le}"] if self.le is not None else []
        return " ".join([what, " and ".join(bounds)]).strip()


def _check_of(name: str, hint: Any, default: Any, metadata: Mapping[str, Any]) -> _Check:
    if isinstance(hint, types.UnionType):  # ``X | None``: null reads as absent anyway
        hint = next(arg for arg in get_args(hint) if arg is not type(None))
    origin = get_origin(hint)
    kind: type | str = "choice" if origin is Literal else (origin or hint)
    if kind not in (bool, int, float, str, list, dict, "choice"):
        raise TypeError(f"payload_of cannot check {name}: {hint!r}")
    return _Check(
        name=name,
        default=default,
        kind=kind,
        choices=get_args(hint) if origin is Literal else (),
        ge=metadata.get("ge"),
        gt=metadata.get("gt"),
        le=metadata.get("le"),
        min_length=metadata.get("min_length", 0),
    )


_CHECKS: dict[type[Any], tuple[_Check, ...]] = {}


def _checks(model: type[Any]) -> tuple[_Check, ...]:
    checks = _CHECKS.get(model)
    if checks is None:
        hints = get_type_hints(model)
        checks = _CHECKS[model] = tuple(_check_of(f.name, hints[f.name], f.default, f.metadata) for f in fields(model))
    return checks


def payload_of(model: type[Payload], payload: Mapping[str, Any]) -> Payload:
    """``payload`` checked against ``model`` (one of ``PAYLOADS``), as an instance of it.

    Unknown fields are ignored; a field absent or ``null`` takes its default. Raises
    ``ShimError(INVALID_REQUEST)`` naming the first field that does not fit (``'hash' must be
    true or false``, ``'max_entries' must be an integer at least 1 and at most 100000``, …).
    """
    values: dict[str, Any] = {}
    for check in _checks(model):
        value = payload.get(check.name)
        if value is None:
            if check.default is MISSING:
                raise ShimError(ErrorCode.INVALID_REQUEST, f"'{check.name}' is required")
            continue
        values[check.name] = check.value(value)
    return model(**values)
