"""The payload of each shim operation, defined once (docs/shim-protocol.md#operations):
standard-library dataclasses, so the shim (which installs without pydantic) checks what it
receives with them (``payload_of``), while the platform derives its pydantic models from the
same classes (``machines.schemas.payload_model``: the REST route's validation and the tools'
input schemas). Each field's constraints sit in its ``metadata`` under pydantic's ``Field``
argument names (``ge``, ``gt``, ``le``, ``min_length``, ``description``), which both readers
understand. A field given as ``null`` reads as absent (its default), as the shim has always
read it. Standard library only, like ``protocol``.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from dataclasses import field as _field
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

from .protocol import ErrorCode, Limits, MessageType, ShimError

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
