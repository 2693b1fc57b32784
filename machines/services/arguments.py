"""Checks of what a caller passes to a machine operation: session id, request id, target
machines, the operation and its payload (docs/shim-protocol.md, docs/live-operations.md)."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from core import wire
from core.errors import InvalidRequest
from machines.protocol import CALLER_OPERATIONS, SESSION_ID_PATTERN


def check_session_id(session_id: str) -> str:
    """Validate a machine ``session_id`` (docs/shim-protocol.md#machine-sessions) or raise ``InvalidRequest``."""
    if not isinstance(session_id, str) or not re.fullmatch(SESSION_ID_PATTERN, session_id):
        raise InvalidRequest(
            "session_id must be 1-256 characters from letters, digits and '._:-', not starting with a symbol"
        )
    return session_id


LIVE_PAYLOAD_FIELDS = ("stream", "binary", "stdin", "pipe")


def check_request_id(request_id: Any) -> str:
    """A caller's ``request_id`` in canonical form (a UUID string, lower case with hyphens),
    or a fresh uuid4 for ``None``. Raises ``InvalidRequest`` for anything else (a caller
    chooses it to cancel the operation by: docs/live-operations.md#cancelling)."""
    if request_id is None:
        return str(uuid.uuid4())
    if isinstance(request_id, str) and len(request_id) <= 45:
        try:
            return str(uuid.UUID(request_id))
        except ValueError:
            pass
    raise InvalidRequest(f"request_id must be a UUID, e.g. {uuid.uuid4()} (got {str(request_id)[:45]!r})")


def check_target_machines(target_machines: Any) -> list[str] | Literal["*"]:
    """``target_machines`` as a fan-out takes it: ``"*"`` or a non-empty list of names;
    ``InvalidRequest`` otherwise."""
    if target_machines == "*":
        return "*"
    if (
        not isinstance(target_machines, list)
        or not target_machines
        or not all(isinstance(name, str) and name.strip() for name in target_machines)
    ):
        raise InvalidRequest('target_machines must be a non-empty list of machine names, or "*" for every machine')
    return list(target_machines)


def check_operation(op: str, payload: Any, session_id: str, target_machine: Any) -> None:
    check_session_id(session_id)
    if op not in CALLER_OPERATIONS:
        raise InvalidRequest(
            f"unknown operation '{str(op)[:40]}'; expected one of {', '.join(sorted(CALLER_OPERATIONS))}"
        )
    if not isinstance(payload, dict):
        raise InvalidRequest("payload must be an object")
    if not wire.encodable(json.dumps(payload, ensure_ascii=False, default=str)):
        raise InvalidRequest("payload holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text")
    if target_machine is not None and not isinstance(target_machine, str):
        raise InvalidRequest("target_machine must be a string or null")


def check_plain_payload(op: str, payload: dict[str, Any]) -> None:
    """The 2.1 live fields are the platform's to set (a stream, a pipe), not a payload's."""
    if op != "EXECUTE_COMMAND":
        return
    for key in LIVE_PAYLOAD_FIELDS:
        value = payload.get(key)
        if value not in (None, False) and not (key == "stdin" and value == "null"):
            raise InvalidRequest(
                f"payload field '{key}' is set by the platform: ask for streamed output with stream "
                "(operation_stream) and for stdin from another command with a pipe"
            )
