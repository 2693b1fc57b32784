"""A shim connection's end always reaches the machine's status, whatever failed (a
machine left ``connected`` would be routed to for ever): a ``/ws/shim/`` consumer whose
channel layer fails deletes its connection row first and closes 1012; a server process
killed with SIGKILL is reaped and its machines show ``disconnected``, as after a clean
disconnect.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.utils import timezone

from core.models import ServerProcess
from dispatch.background import reap_once
from machines.models import Machine, MachineConnection
from tests.outage import LayerOutage

pytestmark = pytest.mark.django_db(transaction=True)


async def _status(machine_id: str) -> tuple[str, str]:
    machine = await Machine.objects.aget(machine_id=machine_id)
    return machine.connection_status, machine.status_reason


async def test_a_shim_whose_channel_layer_fails_closes_1012_and_its_machine_shows_disconnected(
    shims: Any, owner: Any
) -> None:
    outage = LayerOutage(get_channel_layer())
    shim = await shims.connect(owner)
    assert (await _status(shim.machine_id))[0] == Machine.Connection.CONNECTED
    outage.start()
    assert await shim.closed_with() == 1012
    assert await MachineConnection.objects.acount() == 0
    assert (await _status(shim.machine_id))[0] == Machine.Connection.DISCONNECTED


def _machine_held_by_a_dead_process(user: Any) -> Machine:
    """A machine connected through a server process whose last heartbeat is a minute old
    (it was SIGKILLed: no disconnect ran)."""
    dead = ServerProcess.objects.create(
        id="proc_deadbeefdeadbeef",
        kind="serve",
        hostname="elsewhere",
        pid=1,
        heartbeat_at=timezone.now() - timedelta(minutes=1),
    )
    machine = Machine.objects.create(
        user=user,
        machine_id="m-killed",
        hostname="laptop",
        connection_status=Machine.Connection.CONNECTED,
        status_reason="connected",
    )
    MachineConnection.objects.create(
        machine=machine, user=user, connection_id="conn_killed", channel_name="specific.x!y", server_process=dead
    )
    return machine


def test_the_reaper_shows_the_machines_of_a_killed_process_as_disconnected(owner: Any) -> None:
    machine = _machine_held_by_a_dead_process(owner)
    reap_once()
    assert not ServerProcess.objects.filter(pk="proc_deadbeefdeadbeef").exists()
    assert not MachineConnection.objects.filter(machine=machine).exists()
    machine.refresh_from_db()
    assert machine.connection_status == Machine.Connection.DISCONNECTED
    assert machine.status_reason == "the shim disconnected"


def test_the_reaper_leaves_a_machine_connected_through_a_live_process(owner: Any) -> None:
    machine = _machine_held_by_a_dead_process(owner)
    live = ServerProcess.objects.create(
        id="proc_0123456789abcdef", kind="serve", hostname="here", pid=2, heartbeat_at=timezone.now()
    )
    MachineConnection.objects.filter(machine=machine).update(server_process=live)
    reap_once()
    machine.refresh_from_db()
    assert machine.connection_status == Machine.Connection.CONNECTED


async def test_a_clean_disconnect_and_the_reaper_leave_the_same_status(shims: Any, owner: Any) -> None:
    shim = await shims.connect(owner)
    await shim.disconnect()
    clean = await _status(shim.machine_id)
    reaped_machine = await database_sync_to_async(_machine_held_by_a_dead_process)(owner)
    await database_sync_to_async(reap_once)()
    await database_sync_to_async(reaped_machine.refresh_from_db)()
    assert (reaped_machine.connection_status, reaped_machine.status_reason) == clean
