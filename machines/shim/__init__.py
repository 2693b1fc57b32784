"""The Dispatch shim: runs on a user's computer and serves file and shell operations
routed to it over ``/ws/shim/`` (docs/shim-protocol.md).

Imports nothing from Django (it runs on other computers); depends on ``websockets``
and ``httpx`` only. Installed as the package ``dispatch_shim`` with the command
``dispatch-shim`` (this folder's pyproject.toml; ``make dist``), hence the relative imports
inside; in a clone of the server: ``python -m machines.shim``.
"""

from __future__ import annotations

from .audit import AuditLog, redact, redact_argv
from .connection import Shim, ShimRefused, reconnect_delay, websocket_url
from .dispatcher import RequestDispatcher
from .jail import JailedPath, PathJail
from .login import LoginError, device_login
from .operations import MachineIdentity, Operations
from .protocol import (
    PROTOCOL_VERSION,
    Capability,
    CloseCode,
    ErrorCode,
    Limits,
    MessageType,
    ShimError,
)
from .state import ShimConfig, ShimState, StateStore, load_config

__all__ = [
    "PROTOCOL_VERSION",
    "AuditLog",
    "Capability",
    "CloseCode",
    "ErrorCode",
    "JailedPath",
    "Limits",
    "LoginError",
    "MachineIdentity",
    "MessageType",
    "Operations",
    "PathJail",
    "RequestDispatcher",
    "Shim",
    "ShimConfig",
    "ShimError",
    "ShimRefused",
    "ShimState",
    "StateStore",
    "device_login",
    "load_config",
    "reconnect_delay",
    "redact",
    "redact_argv",
    "websocket_url",
]
