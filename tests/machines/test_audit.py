"""The platform's audit of routed operations (docs/shim-protocol.md#audit)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from channels.db import database_sync_to_async

from machines.models import AuditRecord
from machines.services.errors import MachineError
from machines.services.operations import machine_op
from machines.shim.redaction import redact_argv
from tests.machines.conftest import ShimFailure, settle, snapshots_stored

pytestmark = pytest.mark.django_db(transaction=True)


async def records(**filters: Any) -> list[AuditRecord]:
    await settle()
    return await database_sync_to_async(lambda: list(AuditRecord.objects.filter(**filters).order_by("ts")))()


async def test_each_routed_operation_writes_a_record_after_the_reply(shims, owner):
    shim = await shims.connect(owner, machine_id="m1")
    shim.files["/home/alice/a.txt"] = b"hello"
    await machine_op(
        user=owner, session_id="agt_1", op="FILE_READ", payload={"path": "/home/alice/a.txt"}, caller="agt_1"
    )
    await machine_op(
        user=owner,
        session_id="agt_1",
        op="EXECUTE_COMMAND",
        payload={"argv": ["ls", "-l"], "cwd": "/home/alice"},
        caller="mcp:claude",
    )
    read, command = await records()
    request = shim.ops("FILE_READ")[0]
    assert (read.user_id, read.session_id, read.machine_id, read.op) == (owner.pk, "agt_1", "m1", "FILE_READ")
    assert read.request_id == request["id"]  # matches the shim's own audit log
    assert read.details == {"path": "/home/alice/a.txt"}
    assert read.result["ok"] is True
    assert isinstance(read.result["duration_ms"], int)
    assert read.caller == "agt_1"
    assert command.details == {"argv": ["ls", "-l"], "cwd": "/home/alice"}
    assert command.result["exit_code"] == 0
    assert command.caller == "mcp:claude"


async def test_a_failed_operation_is_recorded_with_its_error_code(shims, owner):
    shim = await shims.connect(owner, machine_id="m1")

    async def refuse(request: dict[str, Any]) -> None:
        raise ShimFailure("PATH_OUTSIDE_ALLOWED_ROOT", "no")

    shim.handler = refuse
    with pytest.raises(MachineError):
        await machine_op(user=owner, session_id="s1", op="FILE_STAT", payload={"path": "/etc"}, caller="api")
    with pytest.raises(MachineError):
        await machine_op(
            user=owner, session_id="s1", op="FILE_STAT", payload={"path": "/etc"}, target_machine="nas", caller="api"
        )
    refused, unrouted = await records()
    assert (refused.machine_id, refused.result["ok"], refused.result["error_code"]) == (
        "m1",
        False,
        "PATH_OUTSIDE_ALLOWED_ROOT",
    )
    assert (unrouted.machine_id, unrouted.result["error_code"]) == ("", "MACHINE_NOT_ATTACHED")


async def test_records_never_hold_file_contents_or_env_values(shims, owner):
    await shims.connect(owner, machine_id="m1")
    await machine_op(
        user=owner,
        session_id="s1",
        op="FILE_WRITE",
        payload={"path": "/home/alice/diary.txt", "content": "DEAR-DIARY-CONTENT", "encoding": "utf-8"},
        caller="api",
    )
    await machine_op(
        user=owner,
        session_id="s1",
        op="EXECUTE_COMMAND",
        payload={"argv": ["deploy"], "env": {"DEPLOY_MODE": "ENV-VALUE-1", "HOME": "ENV-VALUE-2"}},
        caller="api",
    )
    write, command = await records()
    stored = json.dumps([write.details, write.result, command.details, command.result])
    for secret in ("DEAR-DIARY-CONTENT", "ENV-VALUE-1", "ENV-VALUE-2"):
        assert secret not in stored
    assert write.details["path"] == "/home/alice/diary.txt"
    assert write.details["content_chars"] == len("DEAR-DIARY-CONTENT")
    assert command.details["env_keys"] == ["DEPLOY_MODE", "HOME"]


async def test_secret_looking_arguments_are_redacted(shims, owner):
    shim = await shims.connect(owner, machine_id="m1")
    argv = [
        "deploy",
        "--password=pw-0001",
        "token=tk-0002",
        "AWS_SECRET_KEY=ak-0003",
        "Authorization: Bearer br-0004",
        "GITHUB_TOKEN=gh-0005",
        "--api-key",
        "sep-0006",
        "--verbose",
    ]
    await machine_op(user=owner, session_id="s1", op="EXECUTE_COMMAND", payload={"argv": argv}, caller="api")
    await machine_op(
        user=owner,
        session_id="s1",
        op="EXECUTE_COMMAND",
        payload={
            "command": "curl -H 'Authorization: Bearer br-0007' https://x.example?token=tk-0008 DB_PASSWORD=db-0009"
        },
        caller="api",
    )
    with_argv, with_command = await records()
    stored = json.dumps([with_argv.details, with_command.details])
    for secret in ("pw-0001", "tk-0002", "ak-0003", "br-0004", "gh-0005", "sep-0006", "br-0007", "tk-0008", "db-0009"):
        assert secret not in stored, secret
    assert with_argv.details["argv"] == [
        "deploy",
        "--password=[REDACTED]",
        "token=[REDACTED]",
        "AWS_SECRET_KEY=[REDACTED]",
        "Authorization: [REDACTED]",
        "GITHUB_TOKEN=[REDACTED]",
        "--api-key",
        "[REDACTED]",
        "--verbose",
    ]
    assert with_command.details["command"].startswith("curl -H 'Authorization: [REDACTED]'")
    # The shim itself still gets the real arguments.
    assert shim.ops("EXECUTE_COMMAND")[0]["payload"]["argv"] == argv


def test_ordinary_arguments_are_kept():
    argv = ["git", "commit", "-m", "token bucket fix", "--author=alice", "MONKEY=1", "keyboard"]
    assert redact_argv(argv) == argv


async def test_an_operation_through_the_rest_api_is_audited(shims, owner, owner_token):
    from django.test import AsyncClient

    await shims.connect(owner, machine_id="m1")
    response = await AsyncClient().post(
        "/api/v1/sessions/s1/ops",
        {"op": "FILE_STAT", "payload": {"path": "/home/alice/a"}},
        content_type="application/json",
        headers={"authorization": f"Bearer {owner_token}"},
    )
    assert response.status_code == 200
    (record,) = await records()
    assert (record.op, record.machine_id, record.caller, record.result["ok"]) == ("FILE_STAT", "m1", "api", True)


async def test_every_operation_of_a_rest_copy_is_audited(shims, owner, owner_token):
    from django.test import AsyncClient

    laptop = await shims.connect(owner, machine_id="m1", hostname="laptop", allowed_roots=["/a"])
    server = await shims.connect(owner, machine_id="m2", hostname="server", allowed_roots=["/b"])
    laptop.files["/a/f"] = b"x" * 10
    await snapshots_stored(owner, 2)
    response = await AsyncClient().post(
        "/api/v1/sessions/s1/copy",
        {"source_machine": "m1", "source_path": "/a/f", "destination_machine": "m2", "destination_path": "/b/f"},
        content_type="application/json",
        headers={"authorization": f"Bearer {owner_token}"},
    )
    assert response.status_code == 200, response.content
    sent = [r for shim in (laptop, server) for r in shim.requests if r["type"] != "MACHINE_LIST_REQUEST"]
    audited = await records()
    assert sorted(r.request_id for r in audited) == sorted(r["id"] for r in sent)
    assert {r.op for r in audited} == {"FILE_STAT", "FILE_READ", "FILE_WRITE", "FILE_MOVE"}


async def test_an_abandoned_rest_operation_is_still_audited(shims, owner, owner_token):
    import asyncio

    from django.test import AsyncClient

    shim = await shims.connect(owner, machine_id="m1")

    async def hold(request: dict[str, Any]) -> None:
        return None

    shim.handler = hold
    call = asyncio.ensure_future(
        AsyncClient().post(
            "/api/v1/sessions/s1/ops",
            {"op": "FILE_STAT", "payload": {"path": "/home/alice/a"}},
            content_type="application/json",
            headers={"authorization": f"Bearer {owner_token}"},
        )
    )
    await shim.next_request("FILE_STAT")
    call.cancel()  # the HTTP client went away
    with pytest.raises(asyncio.CancelledError):
        await call
    (record,) = await records()
    assert (record.op, record.machine_id, record.result["ok"]) == ("FILE_STAT", "m1", False)


async def test_an_overloaded_shim_shows_on_the_health_axis_until_it_works_again(shims, owner):
    from machines.models import Machine

    shim = await shims.connect(owner, machine_id="m1")
    shim.files["/home/alice/a.txt"] = b"hello"

    async def overloaded(request: dict[str, Any]) -> None:
        raise ShimFailure("SHIM_OVERLOADED", "too many operations in flight")

    shim.handler = overloaded
    with pytest.raises(MachineError) as refused:
        await machine_op(user=owner, session_id="s1", op="FILE_STAT", payload={"path": "/home/alice"}, caller="api")
    assert refused.value.code == "SHIM_OVERLOADED"
    await settle()
    machine = await database_sync_to_async(Machine.objects.get)(user=owner, machine_id="m1")
    assert (machine.connection_status, machine.health) == ("connected", "overloaded")
    assert "too many" in machine.status_reason

    shim.handler = shim.memory_handler
    await machine_op(user=owner, session_id="s1", op="FILE_READ", payload={"path": "/home/alice/a.txt"}, caller="api")
    await settle()
    machine = await database_sync_to_async(Machine.objects.get)(user=owner, machine_id="m1")
    assert (machine.health, machine.status_reason) == ("ok", "connected")
