"""Operations in flight (``OperationInFlight`` rows): written while a command, fan-out, pipe
or copy runs, so it can be listed and cancelled (docs/live-operations.md#cancelling), and
cancelled on the shims when the server process that ran it is gone."""

from __future__ import annotations

import uuid
from typing import Any

from django.contrib.auth.models import User
from django.db import IntegrityError, transaction

from core.realtime import send_on_commit
from core.services import server_process_ensure
from core.tools import TOOL_CALL
from machines.models import OperationInFlight
from machines.protocol import MachineCancelMessage
from machines.services.errors import MachineError
from machines.services.router import Candidate
from machines.shim.protocol import supports_live_operations
from machines.shim.redaction import redact, redact_argv

SUMMARY_MAX = 500  # characters of an in-flight row's summary


def command_summary(payload: dict[str, Any]) -> str:
    """What an in-flight list shows of a command: its argv or command line, redacted."""
    if isinstance(payload.get("argv"), list):
        text = " ".join(str(part) for part in redact_argv(payload["argv"]))
    else:
        text = redact(str(payload.get("command") or ""))
    return text[:SUMMARY_MAX]


def current_call_key() -> str | None:
    """The ``call_key`` of the tool call running in this context (``core.tools.TOOL_CALL``)."""
    call = TOOL_CALL.get()
    return call.call_key if call is not None else None


def inflight_create(
    *,
    user: User,
    session_id: str,
    request_id: str,
    kind: str,
    op: str,
    candidates: list[Candidate],
    caller: str,
    summary: str,
    call_key: str | None,
    caller_channel: str = "",
    machine_ids: list[str] | None = None,
    machine_names: list[str] | None = None,
) -> int:
    """Record an operation in flight (``OperationInFlight``), owned by this process;
    returns the row's id, which ``inflight_delete`` takes. Raises ``MachineError``
    ``OPERATION_EXISTS`` when ``user`` already has ``request_id`` in flight (request ids
    are per user: another user's is no conflict)."""
    try:
        with transaction.atomic():
            row = OperationInFlight.objects.create(
                request_id=request_id,
                user=user,
                session_id=session_id,
                kind=kind,
                op=op,
                machine_ids=machine_ids if machine_ids is not None else [c.machine_id for c in candidates],
                machine_names=machine_names if machine_names is not None else [c.name for c in candidates],
                shim_channels=[c.channel_name for c in candidates],
                protocol_versions=[c.protocol_version for c in candidates],
                caller_channel=caller_channel,
                caller=caller[:200],
                call_key=(call_key or "")[:300],
                summary=summary[:SUMMARY_MAX],
                server_process_id=server_process_ensure(),
            )
    except IntegrityError:
        refused = f"an operation with request_id {request_id} is already in flight"
        raise MachineError("OPERATION_EXISTS", refused) from None
    return int(row.pk)


def pipe_command_ids(request_id: str) -> tuple[str, str]:
    """The ids the shims see for pipe ``request_id``'s source and destination commands
    (derived from it, so a reaper can cancel them from the ``OperationInFlight`` row)."""
    base = uuid.UUID(str(request_id))
    return str(uuid.uuid5(base, "pipe-source")), str(uuid.uuid5(base, "pipe-destination"))


def operations_of_processes_cancelled(process_ids: list[str]) -> None:
    """``CANCEL`` every command still running for these (dead or stopping) server
    processes' operations in flight, once their rows are gone: the caller is gone, so
    nothing else would stop them and they would hold the shims' ``max_concurrent`` slots
    until their timeout. A command (or fan-out) → its ``request_id`` to each 2.1 shim; a
    pipe → its two commands. (A copy's FILE_* chunks are short and end on their own.)

    Registered in ``core.services.PROCESSES_GONE_HOOKS`` (it runs in the deleting
    transaction; the cancels are sent when it commits)."""
    rows = OperationInFlight.objects.filter(server_process_id__in=process_ids).exclude(kind=OperationInFlight.Kind.COPY)
    for row in rows:
        request_id = str(row.request_id)
        if row.kind == OperationInFlight.Kind.PIPE:
            ids: list[str] = list(pipe_command_ids(request_id))
        else:
            ids = [request_id] * len(row.shim_channels)
        for channel, version, shim_request_id in zip(row.shim_channels, row.protocol_versions, ids, strict=False):
            if supports_live_operations(version):
                send_on_commit(channel, MachineCancelMessage(request_id=shim_request_id))


def inflight_delete(*, row_id: int) -> None:
    """Forget an operation in flight (it was answered): the row ``inflight_create``
    returned, and only that one — the same user may already run the same request id again
    (a row of the same id made after this one stays)."""
    OperationInFlight.objects.filter(pk=row_id).delete()
