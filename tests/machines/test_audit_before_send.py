"""The audit record is the record that an operation ran (docs/operating.md "Logs"): it is
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
from machines.services import operations
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


async def test_the_audit_record_is_in_the_database_before_the_shim_gets_the_operation(
    shims: Any, owner: Any
) -> None:
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
    assert seen_by_the_shim == [[{"op": "FILE_STAT", "machine_id": "m1", "result": operations.PENDING}]]
    await settle()
    (record,) = await database_sync_to_async(lambda: list(AuditRecord.objects.filter(op="FILE_STAT")))()
    assert record.result["ok"] is True and "pending" not in record.result
    assert record.outcome == "ok"
