"""What connecting a shim costs the server (bench B6): the statements of a HELLO, the hops
to the database thread, and the caches that save them — the shim's identity
(``core.credential_cache``, still refused at once when revoked here) and this process's
``ServerProcess`` row (``core.presence.process_row_trusted``, re-created when reaped).

Counts, not times: a change that adds a statement or a hop to every HELLO fails here."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from asgiref.sync import SyncToAsync
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator

from core import credential_cache, presence
from core.models import ServerProcess
from core.services import api_token_create, api_token_revoke
from core.tool_changes import tools_group
from machines.models import Machine, MachineConnection
from machines.services.connections import machine_revoke
from machines.services.device import machine_tokens_revoke
from tests.machines.conftest import SHIM_PATH, Shims, frame, hello_payload, settle
from tests.machines.test_op_path_costs import every_query

pytestmark = pytest.mark.django_db(transaction=True)

# A new machine: its token's SELECT and last_used_at UPDATE; BEGIN; the machine's SELECT,
# SAVEPOINT, INSERT, RELEASE; the connection's INSERT; whom to ask for a snapshot.
NEW_MACHINE_STATEMENTS = 9
# A reconnect (its token cached): BEGIN; the machine's SELECT and UPDATE; the old
# connection's DELETE … RETURNING; the new one's INSERT; whom to ask for a snapshot.
RECONNECT_STATEMENTS = 6


@pytest.fixture(autouse=True)
def fresh_caches() -> Iterator[None]:
    credential_cache.clear()
    presence.process_row_forget()
    yield
    credential_cache.clear()
    presence.process_row_forget()


@contextmanager
def thread_hops() -> Iterator[list[str]]:
    """The names of the sync functions run from async code (``sync_to_async`` and
    ``database_sync_to_async``), each a hop to a thread."""
    hops: list[str] = []
    original = SyncToAsync.__call__

    async def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        hops.append(getattr(self.func, "__name__", repr(self.func)))
        return await original(self, *args, **kwargs)

    SyncToAsync.__call__ = counted  # type: ignore[method-assign]
    try:
        yield hops
    finally:
        SyncToAsync.__call__ = original  # type: ignore[method-assign]


async def refused(token: str) -> bool:
    """Whether a shim with ``token`` is refused at its HELLO: ``ERROR AUTH_FAILED``, close 4401."""
    from dispatch.asgi import application

    communicator = WebsocketCommunicator(
        application, SHIM_PATH, headers=[(b"authorization", f"Bearer {token}".encode())]
    )
    connected, _ = await communicator.connect(timeout=5)
    assert connected
    await communicator.send_json_to(frame("HELLO", hello_payload()))
    texts: list[str] = []
    while True:
        message = await communicator.receive_output(5)
        if message["type"] == "websocket.close":
            await communicator.wait()
            return message.get("code") == 4401 and any("AUTH_FAILED" in text for text in texts)
        texts.append(message.get("text", ""))


async def test_a_new_machine_hello_takes_at_most_its_statements(owner: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from machines.services import connections

    # The HELLO's work ends where it asks the user's machines for snapshots; what those
    # requests and answers cost is theirs (and, left running, their timing on a loaded
    # machine decided whether they fell inside the count).
    asked: list[list[str]] = []
    done = asyncio.Event()

    async def snapshots_asked(*, user_id: int, connection_ids: list[str]) -> None:
        asked.append(connection_ids)
        done.set()

    monkeypatch.setattr(connections, "request_snapshots", snapshots_asked)
    shims = Shims()
    try:
        await shims.connect(owner)  # the process row, the first user
        await settle()
        token = await shims.token(owner, "m-2")
        with every_query() as seen:
            await shims.connect(owner, token=token, machine_id="m-2")
            await asyncio.wait_for(done.wait(), 10)
            await settle()
        assert len(asked) == 1 and len(asked[0]) == 2  # both machines are asked
        assert len(seen) <= NEW_MACHINE_STATEMENTS, "\n".join(sql[:120] for sql in seen)
    finally:
        await shims.close_all()


async def test_a_reconnect_takes_over_in_fewer_statements(owner: Any) -> None:
    shims = Shims()
    try:
        token = await shims.token(owner, "m-1")
        first = await shims.connect(owner, token=token, machine_id="m-1")
        await settle()
        with every_query() as seen:
            await shims.connect(owner, token=token, machine_id="m-1")
            assert await first.closed_with() == 4427  # taken over, told through the layer
            await settle()
        # The old socket's close deletes nothing: its row went with the new HELLO.
        assert len(seen) <= RECONNECT_STATEMENTS, "\n".join(sql[:120] for sql in seen)
        rows = await database_sync_to_async(
            lambda: list(MachineConnection.objects.values_list("machine__machine_id"))
        )()
        assert rows == [("m-1",)]
    finally:
        await shims.close_all()


async def test_a_shim_with_a_known_token_reaches_the_database_thread_once(owner: Any) -> None:
    shims = Shims()
    try:
        issued = await database_sync_to_async(api_token_create)(user=owner)
        # Each in a session of its own: no snapshot is asked for (docs/shim-protocol.md#machine-sessions).
        await shims.connect(owner, token=issued.raw, sessions=["s-a"])  # its identity and the process row are now known
        await settle()
        with thread_hops() as hops:
            await shims.connect(owner, token=issued.raw, sessions=["s-b"])
            await settle()
        # No cookie/session/user lookup, no token lookup: only recording the HELLO.
        assert hops == ["shim_attach"]
    finally:
        await shims.close_all()


async def test_a_token_revoked_here_is_refused_at_once_though_it_was_cached(owner: Any) -> None:
    shims = Shims()
    try:
        issued = await database_sync_to_async(api_token_create)(user=owner)
        await shims.connect(owner, token=issued.raw)
        await database_sync_to_async(api_token_revoke)(user=owner, token_id=issued.token.pk)
        assert await refused(issued.raw)

        machine_token = await shims.token(owner, "m-revoked")
        await shims.connect(owner, token=machine_token, machine_id="m-revoked")
        await database_sync_to_async(machine_revoke)(user=owner, machine_id="m-revoked")
        assert await refused(machine_token)

        device_token = await shims.token(owner, "m-device")
        await shims.connect(owner, token=device_token, machine_id="m-device")
        await database_sync_to_async(
            lambda: machine_tokens_revoke(
                token_ids=list(owner.machine_tokens.filter(machine_id="m-device").values_list("pk", flat=True))
            )
        )()
        assert await refused(device_token)
    finally:
        await shims.close_all()


async def test_the_process_row_is_read_once_and_re_created_when_reaped(owner: Any) -> None:
    shims = Shims()
    try:
        await shims.connect(owner)
        with every_query() as seen:
            await shims.connect(owner)
        assert not [sql for sql in seen if "dispatch_serverprocess" in sql]
        # Reaped by another process while this one still trusts its memo.
        await database_sync_to_async(lambda: ServerProcess.objects.filter(pk=presence.current_process_id()).delete())()
        assert presence.process_row_trusted()
        shim = await shims.connect(owner)
        connection_id = shim.ack["payload"]["connection_id"]
        held_by = await database_sync_to_async(
            lambda: (
                MachineConnection.objects.filter(connection_id=connection_id)
                .values_list("server_process__stopped_at", "server_process_id")
                .get()
            )
        )()
        assert held_by == (None, presence.current_process_id())
    finally:
        await shims.close_all()


async def test_a_disconnect_takes_two_statements_and_still_rings_the_tool_list(owner: Any) -> None:
    layer = get_channel_layer()
    listener = await layer.new_channel()
    await layer.group_add(tools_group(owner.pk), listener)
    shims = Shims()
    try:
        shim = await shims.connect(owner, sessions=["s-a"])
        await layer.receive(listener)  # its HELLO's ring
        with every_query() as seen:
            await shim.disconnect()
        # The connection's DELETE … RETURNING; the machine's UPDATE, if nothing else holds it.
        assert len(seen) <= 2, "\n".join(sql[:120] for sql in seen)
        assert (await asyncio.wait_for(layer.receive(listener), 3))["type"] == "tools.changed"
        status = await database_sync_to_async(
            lambda: Machine.objects.values_list("connection_status", "status_reason").get(machine_id=shim.machine_id)
        )()
        assert status == (Machine.Connection.DISCONNECTED, "the shim disconnected")
    finally:
        await shims.close_all()
        await layer.group_discard(tools_group(owner.pk), listener)


async def test_only_connections_sharing_a_session_id_exactly_are_asked_for_snapshots(owner: Any) -> None:
    shims = Shims()
    try:
        ten = await shims.connect(owner, machine_id="m-10", sessions=["agt_10", "agt_1x"])
        one = await shims.connect(owner, machine_id="m-1", sessions=["agt_1"])  # a prefix of both, shares neither
        await settle()
        assert ten.ops("MACHINE_LIST_REQUEST") == [] and one.ops("MACHINE_LIST_REQUEST") == []
        other = await shims.connect(owner, machine_id="m-2", sessions=["agt_2", "agt_1"])
        await one.next_request("MACHINE_LIST_REQUEST")
        await other.next_request("MACHINE_LIST_REQUEST")
        await settle()
        assert ten.ops("MACHINE_LIST_REQUEST") == []
    finally:
        await shims.close_all()
