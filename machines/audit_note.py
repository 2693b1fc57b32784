"""What the edge running a tool call adds to the machine audit records the call writes
(docs/shim-protocol.md#audit; docs/agents.md#approvals).

The agents' tool set sets ``AUDIT_NOTE`` around a machine tool call an agent makes right
after one of its approvals allowed that very call (``{"approval_id": "apr_…"}``);
``audit_record_begin`` / ``audit_record_create`` merge it into the record's ``details``.
A ``ContextVar``: it follows the call into ``database_sync_to_async`` and is never seen by
another call. Work started from an empty context (a background audit write) sees none.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

AUDIT_NOTE: ContextVar[dict[str, Any] | None] = ContextVar("dispatch_audit_note", default=None)


def audit_note() -> dict[str, Any]:
    """The note of the tool call running in this context (a JSON-safe dict), ``{}`` outside one."""
    return dict(AUDIT_NOTE.get() or {})
