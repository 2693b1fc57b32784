"""Sending an operation to a shim's connection and waiting for its reply (request/reply over
the channel layer, docs/shim-protocol.md), its timeout, ``CANCEL`` and snapshot requests.

The wait never holds the shared sync thread; the shim may be held by another server process,
so while waiting the connection row and its process are re-checked (``MACHINE_UNREACHABLE``
within seconds of a dead holder)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from channels.db import database_sync_to_async
from channels.exceptions import ChannelFull

from core.realtime import Gone, layer_send, request_reply
from machines.models import MachineConnection
from machines.protocol import DEFAULT_LIMITS, MachineCancelMessage, MachineOpMessage, MachineReplyMessage
from machines.services.audit import in_background
from machines.services.errors import MachineError
from machines.services.relay import connection_alive
from machines.services.router import Candidate

logger = logging.getLogger(__name__)


# An operation travels as a MachineOpMessage to machines.consumers.ShimConsumer, which
# answers on its reply_channel with a MachineReplyMessage (machines.protocol).
TIMEOUT_MARGIN = 10.0  # seconds the platform waits past an operation's own timeout


SNAPSHOT_TIMEOUT = 10.0  # seconds to wait for MACHINE_LIST_RESPONSEs


def operation_timeout(op: str, payload: dict[str, Any], limits: dict[str, int]) -> float:
    """Seconds to wait for a response: the command's own timeout (or the default) + 10 s."""
    timeout = float(limits.get("command_timeout_seconds", DEFAULT_LIMITS["command_timeout_seconds"]))
    requested = payload.get("timeout_seconds")
    if op == "EXECUTE_COMMAND" and isinstance(requested, (int, float)) and not isinstance(requested, bool):
        timeout = max(0.0, min(float(payload["timeout_seconds"]), limits.get("max_command_timeout_seconds", 600)))
    return float(timeout) + TIMEOUT_MARGIN


_connection_alive = connection_alive  # the liveness check (machines.services.relay), patched by tests


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
        timed_out=lambda: MachineError(
            "TIMEOUT", f"no answer from machine '{candidate.name}' within {timeout:g}s; the operation may have run"
        ),
        busy=lambda: MachineError("MACHINE_UNREACHABLE", f"machine '{candidate.name}' is not taking requests"),
        liveness=connected,
    )


async def cancel_quietly(candidate: Candidate, request_id: str) -> None:
    """Send ``CANCEL`` for ``request_id`` to ``candidate``'s shim; a failure is logged."""
    try:
        await layer_send(candidate.channel_name, MachineCancelMessage(request_id=request_id))
    except (ChannelFull, OSError) as exc:
        logger.warning("could not cancel %s on %s: %s", request_id, candidate.name, exc)


async def request_snapshots(*, user_id: int, connection_ids: list[str]) -> None:
    """Ask each connection for its ``MACHINE_LIST_RESPONSE`` and cache them (docs/shim-protocol.md#machine-sessions)."""
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

    in_background(every())
