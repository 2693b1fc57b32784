"""The error of a failed machine operation, and how a fan-out entry shows one (docs/shim-protocol.md#errors)."""

from __future__ import annotations

from typing import Any

from core.errors import DispatchError


class MachineError(DispatchError):
    """A failed machine operation: a shim ``ERROR`` or a platform code (docs/shim-protocol.md#errors)."""


def fan_out_error(error: DispatchError) -> dict[str, Any]:
    """A fan-out entry's ``error``: ``{code, message, details}``."""
    return {"code": error.code, "message": error.message, "details": error.details or {}}
