"""The audit record is the record that an operation ran (docs/operating.md#logs): it is
written before the operation is sent, and an operation whose record cannot be written (a
full disk, a read-only database) fails with 503 and never reaches the shim."""

from __future__ import annotations

import json
from typing import Any

import pytest
from channels.db import database_sync_to_async
from django.db import OperationalError
from django.test import AsyncClient

from machines.models import AuditRecord
from machines.services import audit
from machines.services.operations import machine_op
from tests.machines.conftest import settle

pytestmark = pytest.mark.django_db(transaction=True)

PATH = "/home/alice/a.txt"


def _disk_full(*args: Any, **kwargs: Any) -> Any:
    raise OperationalError("database or disk is full")


async def test_an_operation_whose_audit_record_cannot_be_written_is_refused_503_and_never_sent(
    shims: Any, owner: Any, owner_token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    shim = await shims.connect(owner, machine_id="m1")
    shim.files[PATH] = b"x"
    monkeypatch.setattr(AuditRecord.objects, "create", _disk_full)
    response = await AsyncClient().post(
        "/api/v1/sessions/s1/ops",
        json.dumps({"op": "FILE_WRITE", "payload": {"path": PATH, "content": "overwritten"}}),
        content_type="application/json",
        headers={"authorization": f"Bearer {owner_token}"},
    )
    assert response.status_code == 503, response.content
    assert response["Retry-After"]
    error = response.json()["error"]
    assert error["code"] == "TEMPORARILY_UNAVAILABLE"
    assert "audit record could not be written" in error["message"]
    assert "disk is full" in error["message"]
    assert error["details"] == {"service": "database"}
    await settle()
    assert shim.ops("FILE_WRITE") == []
    assert shim.files[PATH] == b"x"


async def test_the_audit_record_is_in_the_database_before_the_shim_gets_the_operation(shims: Any, owner: Any) -> None:
    shim = await shims.connect(owner, machine_id="m1")
    shim.files[PATH] = b"x"
    seen_by_the_shim: list[list[dict[str, Any]]] = []
    serve = shim.handler

    async def look_first(request: dict[str, Any]) -> Any:
        rows = await database_sync_to_async(
            lambda: list(AuditRecord.objects.filter(request_id=request["id"]).values("op", "machine_id", "result"))
        )()
        seen_by_the_shim.append(rows)
        return await serve(request)

    shim.handler = look_first
    await machine_op(user=owner, session_id="s1", op="FILE_STAT", payload={"path": PATH}, caller="api")
    assert seen_by_the_shim == [[{"op": "FILE_STAT", "machine_id": "m1", "result": audit.PENDING}]]
    await settle()
    (record,) = await database_sync_to_async(lambda: list(AuditRecord.objects.filter(op="FILE_STAT")))()
    assert record.result["ok"] is True and "pending" not in record.result
    assert record.outcome == "ok"


# --- streamed commands and pipes: the same rule -----------------------------------------------


async def test_a_streamed_command_whose_audit_record_cannot_be_written_is_never_sent(
    shims: Any, owner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from machines.services.live import operation_stream
    from tests.machines.live_shim import LiveMachine

    machine = LiveMachine(await shims.connect(owner, protocol_version="2.1", machine_id="m1"))
    monkeypatch.setattr(AuditRecord.objects, "create", _disk_full)
    events = operation_stream(
        user=owner, session_id="s1", op="EXECUTE_COMMAND", payload={"argv": ["make"]}, caller="test"
    )
    with pytest.raises(Exception) as refused:
        await events.__anext__()
    assert getattr(refused.value, "code", None) == "TEMPORARILY_UNAVAILABLE", refused.value
    await settle()
    assert machine.shim.ops("EXECUTE_COMMAND") == []


async def test_a_streamed_commands_record_is_written_before_it_is_sent_and_finished_after(
    shims: Any, owner: Any
) -> None:
    from machines.services.live import operation_stream
    from tests.machines.live_shim import LiveMachine

    machine = LiveMachine(await shims.connect(owner, protocol_version="2.1", machine_id="m1"))
    seen: list[list[Any]] = []
    serve = machine.shim.handler

    async def look_first(request: dict[str, Any]) -> Any:
        if request["type"] == "EXECUTE_COMMAND":
            seen.append(
                await database_sync_to_async(
                    lambda: list(AuditRecord.objects.filter(request_id=request["id"]).values_list("result", flat=True))
                )()
            )
        return await serve(request)

    machine.shim.handler = look_first
    events = [
        event
        async for event in operation_stream(
            user=owner, session_id="s1", op="EXECUTE_COMMAND", payload={"argv": ["make"]}, caller="test"
        )
    ]
    assert events and seen == [[audit.PENDING]]  # in the database before the shim had it
    await settle()
    (record,) = await database_sync_to_async(lambda: list(AuditRecord.objects.filter(op="EXECUTE_COMMAND")))()
    assert record.result["ok"] is True and record.result["exit_code"] == 0 and record.outcome == "ok"


async def test_a_pipe_whose_audit_records_cannot_be_written_sends_neither_command(
    shims: Any, owner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from machines.services import live
    from tests.machines.live_shim import LiveMachine

    source = LiveMachine(await shims.connect(owner, protocol_version="2.1", machine_id="m1", hostname="laptop"))
    sink = LiveMachine(await shims.connect(owner, protocol_version="2.1", machine_id="m2", hostname="buildbox"))
    monkeypatch.setattr(AuditRecord.objects, "create", _disk_full)
    with pytest.raises(Exception) as refused:
        await live.pipe(
            user=owner,
            session_id="s1",
            source={"machine": "laptop", "argv": ["cat", "f"]},
            destination={"machine": "buildbox", "command": "wc -c"},
            caller="test",
        )
    assert getattr(refused.value, "code", None) == "TEMPORARILY_UNAVAILABLE", refused.value
    await settle()
    assert source.shim.ops("EXECUTE_COMMAND") == [] and sink.shim.ops("EXECUTE_COMMAND") == []
