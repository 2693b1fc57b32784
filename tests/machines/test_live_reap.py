"""Operations in flight of a caller process that died: when the reaper
deletes the dead process (and its ``OperationInFlight`` rows by cascade), the commands
they still run on the shims are cancelled — they would otherwise hold the shims'
``max_concurrent`` slots until their timeout, with no caller and no row to cancel."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

import pytest
from channels.db import database_sync_to_async
from django.utils import timezone

from core.models import ServerProcess
from core.services import server_process_reap
from machines.models import MachineConnection, OperationInFlight
from machines.services.inflight import pipe_command_ids

pytestmark = [pytest.mark.django_db(transaction=True)]

GHOST = "proc_ghost0000000000"


def _ghost_rows(owner: Any, channel: str, *, versions: list[str]) -> dict[str, str]:
    ServerProcess.objects.create(
        id=GHOST, kind="serve", hostname="elsewhere", pid=4242, heartbeat_at=timezone.now() - timedelta(hours=1)
    )
    ids = {kind: str(uuid.uuid4()) for kind in ("command", "pipe", "copy")}
    for kind, request_id in ids.items():
        channels = [channel] if kind == "command" else [channel, channel]
        OperationInFlight.objects.create(
            request_id=request_id,
            user=owner,
            session_id="s1",
            kind=kind,
            op={"command": "EXECUTE_COMMAND", "pipe": "PIPE", "copy": "COPY"}[kind],
            machine_ids=["m"] * len(channels),
            machine_names=["laptop"] * len(channels),
            shim_channels=channels,
            protocol_versions=versions * len(channels),
            caller_channel="",
            caller="test",
            summary="x",
            server_process_id=GHOST,
        )
    return ids


async def _cancels(shim: Any) -> list[str]:
    await asyncio.sleep(0.3)
    return sorted(f["payload"]["request_id"] for f in shim.frames if f["type"] == "CANCEL")


async def test_reaping_a_dead_caller_cancels_its_commands_and_pipes_on_the_shims(shims, owner):
    shim = await shims.connect(owner, protocol_version="2.1")
    channel = await database_sync_to_async(lambda: MachineConnection.objects.get().channel_name)()
    ids = await database_sync_to_async(_ghost_rows)(owner, channel, versions=["2.1"])
    reaped = await database_sync_to_async(server_process_reap)()
    assert reaped == [GHOST]
    assert not await database_sync_to_async(OperationInFlight.objects.exists)()
    expected = sorted([ids["command"], *pipe_command_ids(ids["pipe"])])
    assert await _cancels(shim) == expected
    assert shim.consumer_alive()


async def test_a_2_0_shim_gets_no_cancel(shims, owner):
    shim = await shims.connect(owner)
    channel = await database_sync_to_async(lambda: MachineConnection.objects.get().channel_name)()
    await database_sync_to_async(_ghost_rows)(owner, channel, versions=["2.0"])
    await database_sync_to_async(server_process_reap)()
    assert await _cancels(shim) == []
