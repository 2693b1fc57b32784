"""The shim's state file and configuration file (docs/shim-protocol.md#the-shim-program).

State (``state.json``, mode 0600 in a 0700 directory): ``{"machine_id", "server",
"token"}``. The ``machine_id`` is a UUID generated once and kept; ``logout`` removes only
the token. Configuration (``config.toml``, read with ``tomllib``)::

    allowed_roots = ["~/src", "/srv/data"]
    capabilities = ["shell", "files"]

    [limits]
    max_file_size_bytes = 10485760
    command_timeout_seconds = 30
    max_command_timeout_seconds = 600
    max_concurrent = 4

Both live in the state directory: ``--state-dir``, else ``$DISPATCH_SHIM_STATE_DIR``,
else ``~/.config/dispatch-shim``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tomllib
import uuid
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .protocol import Capability, Limits

logger = logging.getLogger("machines.shim")

STATE_DIR_ENV = "DISPATCH_SHIM_STATE_DIR"
"""Environment variable naming the state directory."""

STATE_FILE_NAME = "state.json"
CONFIG_FILE_NAME = "config.toml"
AUDIT_FILE_NAME = "audit.jsonl"


class StateError(Exception):
    """The state file exists but cannot be read or parsed."""


class ConfigError(Exception):
    """The configuration file is malformed (the message names the key)."""


def default_state_dir() -> Path:
    """``$DISPATCH_SHIM_STATE_DIR`` if set, else ``~/.config/dispatch-shim``."""
    configured = os.environ.get(STATE_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".config" / "dispatch-shim"


@dataclass
class ShimState:
    """What the shim remembers between runs: its identity, where it logged in, its token."""

    machine_id: str | None = None
    server: str | None = None
    token: str | None = None


class StateStore:
    """Reads and writes ``<state_dir>/state.json`` (mode 0600; the directory 0700 when
    the store creates it). Writes are atomic: a 0600 temporary file renamed into place."""

    def __init__(self, state_dir: str | os.PathLike[str] | None = None) -> None:
        self.state_dir = Path(state_dir).expanduser() if state_dir is not None else default_state_dir()
        self.path = self.state_dir / STATE_FILE_NAME

    @property
    def config_path(self) -> Path:
        """``<state_dir>/config.toml``."""
        return self.state_dir / CONFIG_FILE_NAME

    @property
    def audit_path(self) -> Path:
        """``<state_dir>/audit.jsonl``."""
        return self.state_dir / AUDIT_FILE_NAME

    def load(self) -> ShimState:
        """The stored state; an empty ``ShimState`` when there is no file yet.

        Tightens a state file readable by others back to 0600 (it holds a token).
        Raises ``StateError`` for an unreadable or malformed file.
        """
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return ShimState()
        except OSError as error:
            raise StateError(f"cannot read {self.path}: {error.strerror}") from None
        with contextlib.suppress(OSError):
            if self.path.stat().st_mode & 0o077:
                logger.warning("%s was readable by others; setting its mode to 0600", self.path)
                self.path.chmod(0o600)
        try:
            raw = json.loads(text)
        except ValueError as error:
            raise StateError(f"{self.path} is not valid JSON: {error}") from None
        if not isinstance(raw, dict):
            raise StateError(f"{self.path} must hold a JSON object")
        values = {}
        for item in fields(ShimState):
            value = raw.get(item.name)
            if value is not None and not isinstance(value, str):
                raise StateError(f"{self.path}: {item.name!r} must be a string")
            values[item.name] = value
        return ShimState(**values)

    def save(self, state: ShimState) -> None:
        """Write ``state`` atomically with mode 0600. Raises ``OSError`` on failure."""
        if not self.state_dir.exists():
            self.state_dir.mkdir(mode=0o700, parents=True)
        temporary = self.path.with_name(f".{STATE_FILE_NAME}.{uuid.uuid4().hex}.tmp")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(descriptor, "w", encoding="utf-8") as file:
                json.dump(asdict(state), file, indent=2)
                file.write("\n")
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise

    def ensure_machine_id(self) -> ShimState:
        """The state, with a ``machine_id`` (a new UUID4, saved at once) if it had none."""
        state = self.load()
        if not state.machine_id:
            state.machine_id = str(uuid.uuid4())
            self.save(state)
        return state


@dataclass(frozen=True)
class ShimConfig:
    """The configuration file's settings; ``None`` means "not configured"."""

    allowed_roots: tuple[str, ...] | None = None
    capabilities: tuple[str, ...] | None = None
    limits: Limits = field(default_factory=Limits)


def load_config(path: str | os.PathLike[str]) -> ShimConfig:
    """Read a ``config.toml`` (shape in the module docstring); a missing file gives the
    defaults. Roots are ``~``-expanded, not yet checked. Raises ``ConfigError`` for bad
    TOML, unknown keys or wrong types."""
    path = Path(path)
    try:
        with path.open("rb") as file:
            raw = tomllib.load(file)
    except FileNotFoundError:
        return ShimConfig()
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: {error}") from None
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror}") from None
    unknown = set(raw) - {"allowed_roots", "capabilities", "limits"}
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted(unknown)}")
    roots = _string_list(raw, "allowed_roots", path)
    capabilities = _string_list(raw, "capabilities", path)
    if capabilities is not None:
        known = {str(capability) for capability in Capability}
        if not set(capabilities) <= known:
            raise ConfigError(f"{path}: capabilities must be among {sorted(known)}")
    limits_table = raw.get("limits", {})
    if not isinstance(limits_table, dict):
        raise ConfigError(f"{path}: [limits] must be a table")
    limit_names = {item.name for item in fields(Limits)}
    if set(limits_table) - limit_names:
        raise ConfigError(f"{path}: unknown [limits] keys {sorted(set(limits_table) - limit_names)}")
    try:
        limits = Limits(**limits_table)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{path}: [limits]: {error}") from None
    return ShimConfig(
        allowed_roots=tuple(os.path.expanduser(root) for root in roots) if roots is not None else None,
        capabilities=tuple(capabilities) if capabilities is not None else None,
        limits=limits,
    )


def _string_list(raw: dict[str, Any], key: str, path: Path) -> list[str] | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise ConfigError(f"{path}: {key} must be a list of non-empty strings")
    return value
