"""The ``/ws/shim/`` handshake, attachment and presence (docs/shim-protocol.md#the-handshake,
docs/shim-protocol.md#presence-and-takeover)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import pytest
from channels.db import database_sync_to_async

from core.presence import current_process_id
from machines.models import Machine, MachineConnection
from machines.services import connections
from machines.services.errors import MachineError
from machines.services.operations import machine_op
from tests.machines.conftest import SHIM_PATH, eventually, frame, hello_payload

pytestmark = pytest.mark.django_db(transaction=True)


async def machine_token(user: Any, machine_id: str) -> str:
    from machines.services.device import machine_token_create

    return (await database_sync_to_async(machine_token_create)(user=user, machine_id=machine_id)).raw


async def refused(ws: Any, hello: Any | None = None) -> tuple[dict[str, Any], int | None]:
    """Send ``hello`` (if any) and return the ERROR frame and the close code that follow."""
    if hello is not None:
        await ws.send(hello)
    error = await ws.recv()
    return error, await ws.closed_with()


# --- authentication ---------------------------------------------------------------------


async def test_it_refuses_a_shim_without_a_token_with_auth_failed_and_4401(ws_connect):
    async with ws_connect(path=SHIM_PATH) as ws:
        error, code = await refused(ws)
    assert error["type"] == "ERROR"
    assert error["payload"]["code"] == "AUTH_FAILED"
    assert error["payload"]["fatal"] is True
    assert code == 4401


async def test_it_refuses_an_invalid_token_with_4401(ws_connect, owner):
    async with ws_connect(token="not-a-token", path=SHIM_PATH) as ws:
        error, code = await refused(ws)
    assert (error["payload"]["code"], code) == ("AUTH_FAILED", 4401)


async def test_it_refuses_a_machine_token_used_for_another_machine_id(ws_connect, owner, count_rows):
    token = await machine_token(owner, "machine-a")
    async with ws_connect(token=token, path=SHIM_PATH) as ws:
        error, code = await refused(ws, frame("HELLO", hello_payload(machine_id="machine-b")))
    assert (error["payload"]["code"], code) == ("AUTH_FAILED", 4401)
    assert await count_rows(MachineConnection) == 0


async def test_it_accepts_a_user_api_token_for_development(shims, owner, owner_token, count_rows):
    shim = await shims.connect(token=owner_token, machine_id="dev-box")
    assert shim.ack["payload"]["connection_id"].startswith("conn_")
    assert await count_rows(MachineConnection, machine__user=owner, machine__machine_id="dev-box") == 1


async def test_a_revoked_machine_token_is_refused(ws_connect, owner):
    token = await machine_token(owner, "m1")
    await database_sync_to_async(Machine.objects.create)(user=owner, machine_id="m1")
    await database_sync_to_async(connections.machine_revoke)(user=owner, machine_id="m1")
    async with ws_connect(token=token, path=SHIM_PATH) as ws:
        error, code = await refused(ws)
    assert (error["payload"]["code"], code) == ("AUTH_FAILED", 4401)


# --- HELLO ----------------------------------------------------------------------------


async def test_it_closes_4408_when_no_hello_arrives_in_time(ws_connect, owner, settings):
    settings.SHIM_HELLO_TIMEOUT = 0.2
    token = await machine_token(owner, "m1")
    async with ws_connect(token=token, path=SHIM_PATH) as ws:
        started = time.monotonic()
        error, code = await refused(ws)
        elapsed = time.monotonic() - started
    assert error["payload"]["code"] == "HELLO_TIMEOUT"
    assert code == 4408
    assert 0.15 < elapsed < 2


async def test_a_hello_in_time_cancels_the_deadline(shims, owner, settings):
    settings.SHIM_HELLO_TIMEOUT = 0.2
    shim = await shims.connect(owner)
    await asyncio.sleep(0.4)
    assert not shim.closed
    assert shim.frames == []


@pytest.mark.parametrize(
    "first_frame",
    [
        pytest.param("not json", id="non-json"),
        pytest.param("[1, 2]", id="json-array"),
        pytest.param(json.dumps(frame("PING", {})), id="not-hello"),
        pytest.param(json.dumps(frame("HELLO", "payload")), id="payload-not-object"),
        pytest.param(json.dumps(frame("HELLO", hello_payload(platform="windows"))), id="bad-platform"),
        pytest.param(
            json.dumps(frame("HELLO", {k: v for k, v in hello_payload().items() if k != "machine_id"})),
            id="missing-machine-id",
        ),
        pytest.param(
            json.dumps(frame("HELLO", {k: v for k, v in hello_payload().items() if k != "capabilities"})),
            id="missing-capabilities",
        ),
        pytest.param(json.dumps(frame("HELLO", hello_payload(capabilities=["gpu"]))), id="unknown-capability"),
        pytest.param(json.dumps(frame("HELLO", hello_payload(allowed_roots=["relative"]))), id="relative-root"),
        pytest.param(json.dumps(frame("HELLO", hello_payload(protocol_version="two"))), id="bad-version"),
        pytest.param(json.dumps(frame("HELLO", hello_payload(sessions=["/bad"]))), id="bad-session"),
    ],
)
async def test_it_closes_4400_after_an_error_for_a_malformed_hello(ws_connect, owner, count_rows, first_frame):
    token = await machine_token(owner, "m1")
    async with ws_connect(token=token, path=SHIM_PATH) as ws:
        error, code = await refused(ws, first_frame)
    assert error["type"] == "ERROR"
    assert error["payload"]["code"] == "INVALID_HELLO"
    assert code == 4400
    assert await count_rows(MachineConnection) == 0


async def test_a_major_version_mismatch_is_refused_with_4426_and_both_versions(ws_connect, owner, count_rows):
    token = await machine_token(owner, "m1")
    async with ws_connect(token=token, path=SHIM_PATH) as ws:
        error, code = await refused(ws, frame("HELLO", hello_payload(machine_id="m1", protocol_version="3.0")))
    assert error["payload"]["code"] == "PROTOCOL_VERSION_MISMATCH"
    assert error["payload"]["details"] == {"shim_max": "3.0", "platform_max": "2.1"}
    assert code == 4426
    assert await count_rows(MachineConnection) == 0


async def test_a_newer_minor_version_negotiates_the_lower_minor(shims, owner):
    shim = await shims.connect(owner, protocol_version="2.5")
    assert shim.ack["payload"]["protocol_version"] == "2.1"


async def test_hello_ack_reuses_the_hello_id_and_states_capabilities_and_limits(shims, owner):
    shim = await shims.connect(owner, capabilities=["files"])
    ack = shim.ack
    assert ack["type"] == "HELLO_ACK"  # and handshake() checked ack["id"] == the HELLO's id
    assert ack["version"] == "2.1"
    assert ack["payload"]["protocol_version"] == "2.0"
    assert ack["payload"]["connection_id"].startswith("conn_")
    assert set(ack["payload"]["granted_capabilities"]) <= {"files"}
    assert ack["payload"]["granted_capabilities"] == ["files"]
    assert ack["payload"]["limits"] == {
        "max_file_size_bytes": 10485760,
        "command_timeout_seconds": 30,
        "max_command_timeout_seconds": 600,
        "max_concurrent": 4,
        "max_stream_bytes": 1024**3,
        "stream_window_bytes": 1024**2,
    }


async def test_the_connection_row_records_channel_process_and_sessions(shims, owner):
    shim = await shims.connect(owner, hostname="Build-Server", sessions=["agt_1", "agt_2"])
    row = await database_sync_to_async(
        lambda: MachineConnection.objects.select_related("machine").get(
            connection_id=shim.ack["payload"]["connection_id"]
        )
    )()
    assert row.channel_name.strip()
    assert row.server_process_id == current_process_id()
    assert row.sessions == ["agt_1", "agt_2"]
    assert row.machine.user_id == owner.pk
    assert row.machine.hostname == "Build-Server"
    assert row.machine.connection_status == Machine.Connection.CONNECTED


async def test_a_disconnect_deletes_the_row_and_shows_the_machine_disconnected(shims, owner, count_rows):
    shim = await shims.connect(owner, machine_id="m1")
    assert await count_rows(MachineConnection) == 1
    await shim.disconnect()
    assert await count_rows(MachineConnection) == 0
    machine = await database_sync_to_async(Machine.objects.get)(user=owner, machine_id="m1")
    assert machine.connection_status == Machine.Connection.DISCONNECTED


# --- takeover ------------------------------------------------------------------------------


async def test_the_same_machine_reconnecting_revokes_the_old_socket_with_4427(shims, owner, count_rows, settings):
    settings.REMOTE_LIVENESS_INTERVAL = 30  # the pending operation must fail from the takeover itself
    token = await shims.token(owner, "m1")
    old = await shims.connect(token=token, machine_id="m1")
    old.handler = lambda request: asyncio.sleep(0)  # never answers (returns None)
    pending = asyncio.ensure_future(
        machine_op(user=owner, session_id="s1", op="FILE_STAT", payload={"path": "/home/alice/a"}, caller="test")
    )
    await old.next_request("FILE_STAT")
    new = await shims.connect(token=token, machine_id="m1")
    revoked = await old.next_frame("SESSION_REVOKED")
    assert revoked["payload"] == {"reason": "reconnected"}
    assert await old.closed_with() == 4427
    with pytest.raises(MachineError) as failure:
        await asyncio.wait_for(pending, 2)
    assert failure.value.code == "MACHINE_UNREACHABLE"
    rows = await database_sync_to_async(
        lambda: list(MachineConnection.objects.values_list("connection_id", flat=True))
    )()
    assert rows == [new.ack["payload"]["connection_id"]]
    # The new socket keeps the machine's slot: operations go to it.
    response = await machine_op(
        user=owner, session_id="s1", op="EXECUTE_COMMAND", payload={"argv": ["echo", "hi"]}, caller="test"
    )
    assert response["machine_id"] == "m1"
    assert new.ops("EXECUTE_COMMAND") and not old.ops("EXECUTE_COMMAND")
    # The old socket closing does not disturb the new attachment.
    await old.disconnect()
    assert await count_rows(MachineConnection) == 1


# --- N = 2 -----------------------------------------------------------------------------


async def test_a_second_shim_in_a_shared_session_triggers_snapshots_from_both(shims, owner):
    first = await shims.connect(owner, machine_id="m1", hostname="laptop", sessions=["agt_1"])
    await asyncio.sleep(0.1)
    assert first.ops("MACHINE_LIST_REQUEST") == []  # N = 1: nothing to ask
    second = await shims.connect(owner, machine_id="m2", hostname="server", sessions=["*"])
    await first.next_request("MACHINE_LIST_REQUEST")
    await second.next_request("MACHINE_LIST_REQUEST")

    def snapshots() -> dict[str, Any]:
        return dict(Machine.objects.filter(user=owner).values_list("machine_id", "snapshot"))

    cached = await eventually(database_sync_to_async(snapshots), lambda found: all(found.values()))
    assert cached["m1"]["hostname"] == "laptop"
    assert cached["m2"]["hostname"] == "server"
    assert cached["m1"]["machine_id"] == "m1"


async def test_an_operation_in_flight_on_the_first_shim_survives_the_second_attaching(shims, owner):
    first = await shims.connect(owner, machine_id="m1")
    first.files["/home/alice/a"] = b"kept"
    release = asyncio.Event()

    async def slow(request: dict[str, Any]) -> dict[str, Any] | None:
        if request["type"] == "FILE_READ":
            await release.wait()
        return await first.memory_handler(request)

    first.handler = slow
    pending = asyncio.ensure_future(
        machine_op(user=owner, session_id="s1", op="FILE_READ", payload={"path": "/home/alice/a"}, caller="test")
    )
    await first.next_request("FILE_READ")
    await shims.connect(owner, machine_id="m2")
    await first.next_request("MACHINE_LIST_REQUEST")
    release.set()
    response = await asyncio.wait_for(pending, 2)
    assert (response["machine_id"], response["payload"]["content"]) == ("m1", "kept")
    assert first.frames == []  # no ERROR, no SESSION_REVOKED


async def test_shims_in_disjoint_sessions_are_not_asked_for_snapshots(shims, owner):
    first = await shims.connect(owner, machine_id="m1", sessions=["agt_1"])
    second = await shims.connect(owner, machine_id="m2", sessions=["agt_2"])
    await asyncio.sleep(0.2)
    assert first.ops("MACHINE_LIST_REQUEST") == []
    assert second.ops("MACHINE_LIST_REQUEST") == []


# --- presence ------------------------------------------------------------------------------


async def test_the_platform_pings_and_keeps_a_shim_that_answers(shims, owner, settings):
    settings.SHIM_PING_INTERVAL = 0.1
    settings.SHIM_PONG_TIMEOUT = 0.1
    shim = await shims.connect(owner)
    ping = await shim.next_request("PING", count=3, timeout=3)
    assert ping["payload"] == {}
    assert not shim.closed


async def test_a_shim_that_misses_a_pong_is_dropped(shims, owner, settings):
    settings.SHIM_PING_INTERVAL = 0.1
    settings.SHIM_PONG_TIMEOUT = 0.2
    shim = await shims.connect(owner)
    shim.answer_pings = False
    await shim.next_request("PING")
    code = await shim.closed_with(timeout=2)
    assert code is not None


async def test_the_platform_answers_a_ping_from_the_shim(shims, owner):
    shim = await shims.connect(owner)
    ping = frame("PING", {})
    await shim.send(ping)
    pong = await shim.next_frame("PONG")
    assert pong["id"] == ping["id"]


# --- revocation ------------------------------------------------------------------------------


async def test_revoking_the_machine_closes_its_live_socket_with_4401(shims, owner, count_rows):
    shim = await shims.connect(owner, machine_id="m1")
    await database_sync_to_async(connections.machine_revoke)(user=owner, machine_id="m1")
    error = await shim.next_frame("ERROR")
    assert error["payload"]["code"] == "AUTH_FAILED"
    assert await shim.closed_with() == 4401
    assert await count_rows(MachineConnection) == 0


async def test_revoking_through_the_api_closes_the_socket_with_4401(shims, owner, owner_token):
    from django.test import AsyncClient

    shim = await shims.connect(owner, machine_id="m1")
    response = await AsyncClient().delete("/api/v1/machines/m1", headers={"authorization": f"Bearer {owner_token}"})
    assert response.status_code == 200
    assert await shim.closed_with() == 4401
    with pytest.raises(MachineError) as failure:
        await machine_op(user=owner, session_id="s1", op="FILE_STAT", payload={"path": "/home/alice"}, caller="t")
    assert failure.value.code == "MACHINE_NOT_ATTACHED"


async def test_a_machine_id_is_scoped_to_its_user(shims, owner, member, count_rows):
    machine_id = str(uuid.uuid4())
    await shims.connect(owner, machine_id=machine_id)
    await shims.connect(member, machine_id=machine_id)
    assert await count_rows(MachineConnection) == 2  # no takeover across users
    assert await count_rows(Machine, machine_id=machine_id) == 2


async def test_the_grant_is_what_the_shim_offers_and_its_owner_allows(shims, owner):
    from machines.services.connections import machine_capabilities_set

    first = await shims.connect(owner, machine_id="m-allow", capabilities=["files", "shell"])
    assert first.ack["payload"]["granted_capabilities"] == ["files", "shell"]
    await database_sync_to_async(machine_capabilities_set)(user=owner, machine_id="m-allow", allowed=["files"])
    again = await shims.connect(owner, machine_id="m-allow", capabilities=["files", "shell"])
    assert again.ack["payload"]["granted_capabilities"] == ["files"]
