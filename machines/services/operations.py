"""Routed operations on machines: ``machine_op``, snapshots, ``list_machines`` (machines.md §4–§7).

``machine_op`` is ``async def`` and waits on the channel layer (never on the shared sync
thread); the shim may be held by another server process. While waiting it re-checks that
the connection row exists and its process is alive, so a dead holder is noticed within
seconds (``MACHINE_UNREACHABLE``).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import re
import sys
import time
import uuid
from datetime import timedelta
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings
from django.contrib.auth.models import User
from django.utils import timezone

from core import metrics, wire
from core.errors import DispatchError, InvalidRequest
from core.presence import current_process_id
from core.realtime import Gone, request_reply
from machines.models import AuditRecord, Machine, MachineConnection, PathRecency
from machines.protocol import (
    CALLER_OPERATIONS,
    DEFAULT_LIMITS,
    SESSION_ID_PATTERN,
    MachineOpMessage,
    MachineReplyMessage,
)
from machines.services import router
from machines.services.router import Candidate
from machines.shim.redaction import redact, redact_argv

logger = logging.getLogger(__name__)

# An operation travels as a MachineOpMessage to machines.consumers.ShimConsumer, which
# answers on its reply_channel with a MachineReplyMessage (machines.protocol).
TIMEOUT_MARGIN = 10.0  # seconds the platform waits past an operation's own timeout (§5)
SNAPSHOT_TIMEOUT = 10.0  # seconds to wait for MACHINE_LIST_RESPONSEs
_background: set[asyncio.Future[Any]] = set()


class MachineError(DispatchError):
    """A failed machine operation: a shim ``ERROR`` or a platform code (§5, §6)."""


def check_session_id(session_id: str) -> str:
    """Validate a machine ``session_id`` (§4) or raise ``InvalidRequest``."""
    if not isinstance(session_id, str) or not re.fullmatch(SESSION_ID_PATTERN, session_id):
        raise InvalidRequest(
            "session_id must be 1-256 characters from letters, digits and '._:-', not starting with a symbol"
        )
    return session_id


def operation_timeout(op: str, payload: dict[str, Any], limits: dict[str, int]) -> float:
    """Seconds to wait for a response: the command's own timeout (or the default) + 10 s."""
    timeout = float(limits.get("command_timeout_seconds", DEFAULT_LIMITS["command_timeout_seconds"]))
    requested = payload.get("timeout_seconds")
    if op == "EXECUTE_COMMAND" and isinstance(requested, (int, float)) and not isinstance(requested, bool):
        timeout = max(0.0, min(float(payload["timeout_seconds"]), limits.get("max_command_timeout_seconds", 600)))
    return float(timeout) + TIMEOUT_MARGIN


@database_sync_to_async
def _connection_alive(connection_id: str, server_process_id: str) -> bool:
    rows = MachineConnection.objects.filter(connection_id=connection_id)
    if server_process_id != current_process_id():
        cutoff = timezone.now() - timedelta(seconds=settings.PROCESS_TTL)
        rows = rows.filter(server_process__heartbeat_at__gte=cutoff)
    return rows.exists()


async def send_to_machine(
    candidate: Candidate,
    *,
    op: str,
    payload: dict[str, Any],
    session_id: str,
    timeout: float,
    request_id: str | None = None,
) -> MachineReplyMessage:
    """Send one operation to the chosen machine's connection and wait for its reply
    (``core.realtime.request_reply``), re-checking every ``DISPATCH_REMOTE_LIVENESS_INTERVAL``
    seconds that the connection row exists and its process is alive.

    ``request_id`` is the envelope ``id`` the shim sees (a fresh uuid4 unless given);
    ``timeout`` in seconds from the send. Returns the ``MachineReplyMessage``
    (``response_type``, ``payload``; ``ERROR`` included); raises ``MachineError``
    ``MACHINE_UNREACHABLE`` (connection gone, its process dead, or its channel full) or
    ``TIMEOUT``.
    """

    async def connected() -> Gone | None:
        if await _connection_alive(candidate.connection_id, candidate.server_process_id):
            return None
        return Gone(MachineError("MACHINE_UNREACHABLE", f"machine '{candidate.name}' disconnected"))

    return await request_reply(
        candidate.channel_name,
        MachineOpMessage(
            op=op, payload=payload, request_id=request_id or str(uuid.uuid4()), session_id=session_id, timeout=timeout
        ),
        reply=MachineReplyMessage,
        timeout=timeout,
        timed_out=MachineError(
            "TIMEOUT", f"no answer from machine '{candidate.name}' within {timeout:g}s; the operation may have run"
        ),
        busy=MachineError("MACHINE_UNREACHABLE", f"machine '{candidate.name}' is not taking requests"),
        liveness=connected,
    )


async def machine_op(
    *,
    user: User,
    session_id: str,
    op: str,
    payload: dict[str, Any],
    target_machine: str | None = None,
    caller: str,
) -> dict[str, Any]:
    """Route ``op`` with ``payload`` to a machine of ``session_id`` and return its response.

    Returns ``{"machine_id", "type", "payload"}`` (the shim's response). Raises
    ``InvalidRequest`` (unknown op, bad payload or session id) and ``MachineError`` with a
    §5/§6 code (``MACHINE_NOT_ATTACHED``, ``MACHINE_AMBIGUOUS``, ``CAPABILITY_NOT_GRANTED``,
    ``MACHINE_UNREACHABLE``, ``TIMEOUT``, or the shim's own code such as
    ``PATH_OUTSIDE_ALLOWED_ROOT``). Never retried automatically. An ``AuditRecord`` is
    written after the reply, off the hot path (§7). ``caller`` names who asked (agent id,
    ``mcp:…``, ``api``).
    """
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
    started = time.monotonic()
    request_id = str(uuid.uuid4())
    candidate: Candidate | None = None
    result: dict[str, Any] = {"ok": False}
    try:
        try:
            candidate = await database_sync_to_async(router.choose)(
                user=user, session_id=session_id, op=op, payload=payload, target_machine=target_machine
            )
        except DispatchError as exc:
            raise MachineError(exc.code, exc.message, exc.details) from None
        reply = await send_to_machine(
            candidate,
            op=op,
            payload=payload,
            session_id=session_id,
            timeout=operation_timeout(op, payload, candidate.limits),
            request_id=request_id,
        )
        if reply.response_type == "ERROR":
            error = reply.payload
            code = str(error.get("code") or "MACHINE_ERROR")
            result = {"ok": False, "error_code": code}
            raise MachineError(code, str(error.get("message") or code), error.get("details") or {})
        response = {"machine_id": candidate.machine_id, "type": reply.response_type, "payload": reply.payload}
        result = {"ok": True}
        if op == "EXECUTE_COMMAND":
            result["exit_code"] = reply.payload.get("exit_code")
        if router.operation_path(op, payload) is not None:
            # Recency is a routing input: it must be visible to the very next operation
            # (a write and the following read of one file go to one machine, §6 step 2),
            # so unlike the audit record it is written before the reply is returned.
            await database_sync_to_async(path_recency_record)(
                user=user, session_id=session_id, machine_id=candidate.machine_id, op=op, payload=payload
            )
        return response
    except MachineError as exc:
        result = {"ok": False, "error_code": exc.code}
        raise
    finally:
        result["duration_ms"] = round((time.monotonic() - started) * 1000)
        metrics.machine_operation_observed(
            operation=op, ok=result["ok"], failure=sys.exc_info()[1], seconds=time.monotonic() - started
        )
        _after_reply(
            user=user,
            session_id=session_id,
            machine_id=candidate.machine_id if candidate else "",
            request_id=request_id,
            op=op,
            payload=payload,
            result=result,
            caller=caller,
        )


def _after_reply(**record: Any) -> None:
    """Write the audit record in the background, after the reply."""
    _in_background(database_sync_to_async(audit_record_create)(**record))


def _in_background(work: Any) -> None:
    """Run ``work`` (a coroutine) as a task that outlives the caller.

    The task starts from an empty context: one copied from an async view would send its
    ``database_sync_to_async`` calls to that request's thread executor, which is gone
    once the response is sent ("CurrentThreadExecutor already quit"), losing the work.
    """
    task = asyncio.get_running_loop().create_task(work, context=contextvars.Context())
    _background.add(task)
    task.add_done_callback(_background.discard)


def audit_details(op: str, payload: dict[str, Any]) -> dict[str, Any]:
    """What an audit record keeps of a payload: paths, argv (redacted), sizes, env keys —
    never contents or env values (§7)."""
    details: dict[str, Any] = {}
    for key in ("path", "src", "dst", "cwd", "glob", "encoding", "offset", "length", "recursive", "timeout_seconds"):
        if key in payload and isinstance(payload[key], (str, int, float, bool)):
            details[key] = payload[key]
    if isinstance(payload.get("argv"), list):
        details["argv"] = redact_argv(payload["argv"])
    if isinstance(payload.get("command"), str):
        details["command"] = redact(payload["command"])
    if isinstance(payload.get("env"), dict):
        details["env_keys"] = sorted(str(k) for k in payload["env"])
    if isinstance(payload.get("content"), str):
        details["content_chars"] = len(payload["content"])
    return details


def audit_record_create(
    *,
    user: User,
    session_id: str,
    machine_id: str,
    request_id: str,
    op: str,
    payload: dict[str, Any],
    result: dict[str, Any],
    caller: str,
) -> AuditRecord:
    """Record one routed operation (``request_id``: the envelope id the shim saw, so the
    record matches the shim's own audit log) and stamp the machine's last activity."""
    record = AuditRecord.objects.create(
        user=user,
        session_id=session_id,
        machine_id=machine_id,
        request_id=request_id,
        op=op,
        details=audit_details(op, payload),
        result=result,
        caller=caller[:200],
    )
    if machine_id and result.get("ok"):
        machines = Machine.objects.filter(user=user, machine_id=machine_id)
        machines.update(last_active_at=timezone.now())
        machines.filter(health=Machine.Health.OVERLOADED).update(health=Machine.Health.OK, status_reason="connected")
    elif machine_id and result.get("error_code") == "SHIM_OVERLOADED":
        # The second status axis (§4): shown until the machine completes an operation again.
        Machine.objects.filter(user=user, machine_id=machine_id).update(
            health=Machine.Health.OVERLOADED, status_reason="the shim refused work: too many operations in flight"
        )
    return record


def path_recency_record(*, user: User, session_id: str, machine_id: str, op: str, payload: dict[str, Any]) -> None:
    """Remember that ``machine_id`` last operated on the operation's path in ``session_id``
    (routing step 2, recency)."""
    path = router.operation_path(op, payload)
    if path and len(path) <= 1024:
        PathRecency.objects.update_or_create(
            user=user,
            session_id=session_id,
            path=path,
            defaults={"machine_id": machine_id, "updated_at": timezone.now()},
        )


async def request_snapshots(*, user_id: int, connection_ids: list[str]) -> None:
    """Ask each connection for its ``MACHINE_LIST_RESPONSE`` and cache them (§4 "N = 2")."""
    rows = await database_sync_to_async(
        lambda: list(MachineConnection.objects.filter(connection_id__in=connection_ids).select_related("machine"))
    )()

    async def one(row: MachineConnection) -> None:
        candidate = Candidate.of(row)
        try:
            await send_to_machine(
                candidate, op="MACHINE_LIST_REQUEST", payload={}, session_id="*", timeout=SNAPSHOT_TIMEOUT
            )
        except MachineError as exc:
            logger.info("no snapshot from %s: %s", candidate.name, exc.message)

    async def every() -> None:
        await asyncio.gather(*(one(row) for row in rows))

    _in_background(every())


def attached_machines(*, user: User, session_id: str) -> list[dict[str, Any]]:
    """Per machine of ``user`` attached to ``session_id``, by name: its snapshot (the cached
    ``MACHINE_LIST_RESPONSE`` payload, else what its ``HELLO`` said, §4) plus
    ``display_name`` (its name), ``last_active_at`` (an aware ``datetime`` of its last
    routed operation, or ``None``), ``status`` and ``is_default``. Each edge renders
    ``last_active_at`` in its own words (REST: ISO 8601; the tool: ``last_active_ts``).
    Raises ``InvalidRequest`` for a malformed ``session_id``."""
    check_session_id(session_id)
    default_id = router.default_machine_id(user=user)
    attached = {c.machine_id for c in router.attached_candidates(user=user, session_id=session_id)}
    snapshots = []
    for machine in Machine.objects.filter(user=user, machine_id__in=attached).order_by("display_name", "hostname"):
        snapshot = machine.snapshot or {
            "machine_id": machine.machine_id,
            "hostname": machine.hostname,
            "display_name": machine.display_name,
            "platform": machine.platform,
            "arch": machine.arch,
            "capabilities": machine.granted_capabilities,
            "hardware_devices": machine.hardware_devices,
        }
        snapshots.append(
            {
                **snapshot,
                "display_name": machine.name,
                "last_active_at": machine.last_active_at,
                "status": machine_status(machine),
                "is_default": machine.machine_id == default_id,
            }
        )
    return snapshots


def list_machines(*, user: User, session_id: str) -> list[dict[str, Any]]:
    """The ``list_machines`` tool's answer (§6 "Tools"): ``attached_machines`` with, in place
    of ``last_active_at``, the spec's ``last_active_ts`` (epoch seconds, or ``None``)."""
    listed = []
    for entry in attached_machines(user=user, session_id=session_id):
        listed.append(
            {
                ("last_active_ts" if key == "last_active_at" else key): (
                    value.timestamp() if key == "last_active_at" and value is not None else value
                )
                for key, value in entry.items()
            }
        )
    return listed


def machine_status(machine: Machine) -> dict[str, str]:
    """The two-axis status shown to users (§4): connection, health and a reason."""
    return {"connection": machine.connection_status, "health": machine.health, "reason": machine.status_reason}
