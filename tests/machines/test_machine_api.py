"""The machines REST API (docs/shim-protocol.md#routing), token-authenticated."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from typing import Any

import pytest
from channels.db import database_sync_to_async
from django.test import AsyncClient

from machines.models import Machine, MachineConnection, MachineToken
from machines.services.copy import CHUNK_BYTES, PARTIAL_SUFFIX
from tests.machines.conftest import ShimFailure, frame, settle, snapshots_stored

pytestmark = pytest.mark.django_db(transaction=True)


class Api:
    """An ``AsyncClient`` speaking JSON with a bearer token."""

    def __init__(self, token: str | None) -> None:
        self.client = AsyncClient()
        self.headers = {"authorization": f"Bearer {token}"} if token else {}

    async def get(self, path: str) -> Any:
        return await self.client.get(path, headers=self.headers)

    async def post(self, path: str, body: Any) -> Any:
        data = body if isinstance(body, str) else json.dumps(body)
        return await self.client.post(path, data, content_type="application/json", headers=self.headers)

    async def put(self, path: str, body: Any) -> Any:
        return await self.client.put(path, json.dumps(body), content_type="application/json", headers=self.headers)

    async def delete(self, path: str) -> Any:
        return await self.client.delete(path, headers=self.headers)


@pytest.fixture
def api(owner_token: str) -> Api:
    return Api(owner_token)


def error_of(response: Any) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message", "details"}, body
    return body["error"]


# --- machines ------------------------------------------------------------------------------


async def test_it_lists_the_callers_machines_with_status_and_default(shims, owner, member, api):
    await shims.connect(owner, machine_id="m1", hostname="laptop", display_name="Work laptop")
    await shims.connect(owner, machine_id="m2", hostname="nas", capabilities=["files"])
    await shims.connect(member, machine_id="bobs", hostname="bobs-box")
    assert (await api.put("/api/v1/machines/default", {"machine_id": "m2"})).status_code == 200
    response = await api.get("/api/v1/machines")
    assert response.status_code == 200
    machines = {m["machine_id"]: m for m in response.json()["machines"]}
    assert set(machines) == {"m1", "m2"}
    assert machines["m1"]["display_name"] == "Work laptop"
    assert machines["m2"]["display_name"] == "nas"
    assert machines["m1"]["status"] == {"connection": "connected", "health": "ok", "reason": "connected"}
    assert machines["m2"]["granted_capabilities"] == ["files"]
    assert (machines["m1"]["is_default"], machines["m2"]["is_default"]) == (False, True)


async def test_the_machine_routes_need_a_token(owner):
    anonymous = Api(None)
    for response in (
        await anonymous.get("/api/v1/machines"),
        await anonymous.get("/api/v1/sessions/s1/machines"),
        await anonymous.post("/api/v1/sessions/s1/ops", {"op": "FILE_STAT", "payload": {"path": "/"}}),
        await anonymous.post("/api/v1/sessions/s1/copy", {}),
    ):
        assert response.status_code == 401
        assert error_of(response)["code"] in ("NOT_AUTHENTICATED", "AUTHENTICATION_FAILED")
    assert (await Api("wrong").post("/api/v1/sessions/s1/ops", {"op": "FILE_STAT"})).status_code == 401


async def test_a_snapshot_without_its_machine_id_does_not_break_the_session_list(shims, owner, api):
    """The list names each machine by its row: a shim's MACHINE_LIST_RESPONSE with a null
    machine_id (stored as it came) made the answer fail validation (a 500)."""
    await shims.connect(owner, machine_id="m1", hostname="laptop", sessions=["s1"])
    await shims.connect(owner, machine_id="m2", hostname="server", sessions=["s1"])
    await snapshots_stored(owner, 2)
    await database_sync_to_async(
        lambda: Machine.objects.filter(user=owner, machine_id="m1").update(snapshot={"machine_id": None})
    )()
    response = await api.get("/api/v1/sessions/s1/machines")
    assert response.status_code == 200, response.content
    assert sorted(m["machine_id"] for m in response.json()["machines"]) == ["m1", "m2"]


async def test_session_machines_are_the_attached_snapshots(shims, owner, api):
    await shims.connect(owner, machine_id="m1", hostname="laptop", sessions=["s1"])
    await shims.connect(owner, machine_id="m2", hostname="server", display_name="Build", sessions=["*"])
    await shims.connect(owner, machine_id="m3", hostname="elsewhere", sessions=["other"])
    await snapshots_stored(owner, 3)
    assert (
        await api.post(
            "/api/v1/sessions/s1/ops",
            {"op": "FILE_STAT", "payload": {"path": "/home/alice/x"}, "target_machine": "laptop"},
        )
    ).status_code == 200
    await settle()
    assert (await api.put("/api/v1/machines/default", {"machine_id": "m2"})).status_code == 200
    response = await api.get("/api/v1/sessions/s1/machines")
    assert response.status_code == 200
    machines = {m["machine_id"]: m for m in response.json()["machines"]}
    assert set(machines) == {"m1", "m2"}
    assert machines["m1"]["display_name"] == "laptop"
    assert machines["m2"]["display_name"] == "Build"
    assert machines["m1"]["hostname"] == "laptop"
    assert machines["m1"]["platform"] == "linux" and machines["m1"]["arch"] == "x86_64"
    assert set(machines["m1"]["capabilities"]) == {"shell", "files"}
    assert machines["m2"]["last_active_at"] is None
    assert machines["m1"]["status"]["connection"] == "connected"
    assert machines["m1"]["status"]["connection"] == "connected"
    assert (machines["m1"]["is_default"], machines["m2"]["is_default"]) == (False, True)


async def test_rest_machine_routes_say_last_active_at_in_iso_8601(shims, owner, api):
    from datetime import datetime

    await shims.connect(owner, machine_id="m1", hostname="laptop")
    await shims.connect(owner, machine_id="m2", hostname="idle")
    await snapshots_stored(owner, 2)
    before = time.time()
    ran = await api.post(
        "/api/v1/sessions/s1/ops", {"op": "FILE_STAT", "payload": {"path": "/home/alice/x"}, "target_machine": "m1"}
    )
    assert ran.status_code == 200
    await settle()
    in_session = {m["machine_id"]: m for m in (await api.get("/api/v1/sessions/s1/machines")).json()["machines"]}
    mine = {m["machine_id"]: m for m in (await api.get("/api/v1/machines")).json()["machines"]}
    for listed in (in_session, mine):
        assert all("last_active_ts" not in entry for entry in listed.values())
        stamp = listed["m1"]["last_active_at"]
        assert isinstance(stamp, str)
        parsed = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
        assert parsed.tzinfo is not None and parsed.timestamp() >= before - 1
        assert listed["m2"]["last_active_at"] is None
    assert in_session["m1"]["last_active_at"] == mine["m1"]["last_active_at"]  # one format for one field


async def test_session_machines_refuse_a_bad_session_id(owner, api):
    response = await api.get("/api/v1/sessions/-x/machines")
    assert response.status_code == 400
    assert error_of(response)["code"] == "INVALID_REQUEST"


async def test_put_default_sets_and_clears_the_default(shims, owner, member, api):
    await shims.connect(owner, machine_id="m1")
    await shims.connect(member, machine_id="bobs")
    assert (await api.put("/api/v1/machines/default", {"machine_id": "m1"})).json() == {"machine_id": "m1"}
    unknown = await api.put("/api/v1/machines/default", {"machine_id": "bobs"})
    assert unknown.status_code == 404
    assert error_of(unknown)["code"] == "MACHINE_NOT_ATTACHED"
    for body, message in (
        ({"machine_id": 3}, "machine_id must be a string"),
        ({"machine_id": ""}, "machine_id must be a non-empty string"),
        ({"machine_id": "  "}, "machine_id must be a non-empty string"),
        ({}, "machine_id is required"),
        ({"machine_id": "é" * 256}, "machine_id must be at most 255 characters"),  # not echoed back
    ):
        refused = await api.put("/api/v1/machines/default", body)
        assert refused.status_code == 400
        assert error_of(refused) == {"code": "INVALID_REQUEST", "message": message, "details": {}}
    machines = (await api.get("/api/v1/machines")).json()["machines"]
    assert machines[0]["is_default"] is True
    assert (await api.put("/api/v1/machines/default", {"machine_id": None})).json() == {"machine_id": None}
    assert (await api.get("/api/v1/machines")).json()["machines"][0]["is_default"] is False


async def test_put_default_takes_what_target_machine_takes(shims, owner, api):
    laptop_id, server_id = "3f2b9c1e-aaaa-4000-8000-000000000001", "3f2b9c1e-bbbb-4000-8000-000000000002"
    await shims.connect(owner, machine_id=laptop_id, hostname="Laptop.local", display_name="Alice's Laptop")
    await shims.connect(owner, machine_id=server_id, hostname="build-server")
    for spelling, chosen in (
        ("alice's laptop", laptop_id),  # display name, any case
        ("BUILD-SERVER", server_id),  # host name
        ("laptop", laptop_id),  # unique prefix of the host name
        ("3f2b9c1e-b", server_id),  # unique prefix of the id
        (laptop_id, laptop_id),
    ):
        response = await api.put("/api/v1/machines/default", {"machine_id": spelling})
        assert response.status_code == 200, (spelling, response.content)
        assert response.json() == {"machine_id": chosen}
        listed = (await api.get("/api/v1/machines")).json()["machines"]
        assert {m["machine_id"] for m in listed if m["is_default"]} == {chosen}


async def test_put_default_answers_the_routers_errors(shims, owner, member, api):
    await shims.connect(owner, machine_id="3f2b-1", hostname="laptop")
    await shims.connect(owner, machine_id="3f2b-2", hostname="server")
    await shims.connect(member, machine_id="bobs", hostname="bobs-box")
    ambiguous = await api.put("/api/v1/machines/default", {"machine_id": "3f2b"})
    assert ambiguous.status_code == 409
    error = error_of(ambiguous)
    assert error["code"] == "MACHINE_AMBIGUOUS"
    assert {c["machine_id"] for c in error["details"]["candidates"]} == {"3f2b-1", "3f2b-2"}
    # Each candidate is named as the machine list names it (a machine without a display
    # name shows its hostname there, so here too: never an empty name).
    listed = {m["machine_id"]: m["display_name"] for m in (await api.get("/api/v1/machines")).json()["machines"]}
    assert {c["machine_id"]: c["display_name"] for c in error["details"]["candidates"]} == {
        "3f2b-1": listed["3f2b-1"],
        "3f2b-2": listed["3f2b-2"],
    }
    assert listed["3f2b-1"] == "laptop"
    for other in ("bobs-box", "bobs", "nowhere"):
        missing = await api.put("/api/v1/machines/default", {"machine_id": other})
        assert missing.status_code == 404
        error = error_of(missing)
        assert error["code"] == "MACHINE_NOT_ATTACHED"
        assert error["message"] == f"no machine '{other}' is one of yours"
        assert {m["machine_id"] for m in error["details"]["attached"]} == {"3f2b-1", "3f2b-2"}
    assert (await api.get("/api/v1/machines")).json()["machines"][0]["is_default"] is False


async def test_put_default_may_name_a_disconnected_machine_but_not_a_revoked_one(shims, owner, api):
    shim = await shims.connect(owner, machine_id="m1", hostname="nas")
    await shim.disconnect()
    await shims.connect(owner, machine_id="m2", hostname="gone")
    assert (await api.delete("/api/v1/machines/m2")).status_code == 200
    assert (await api.put("/api/v1/machines/default", {"machine_id": "nas"})).json() == {"machine_id": "m1"}
    revoked = await api.put("/api/v1/machines/default", {"machine_id": "gone"})
    assert error_of(revoked)["code"] == "MACHINE_NOT_ATTACHED"


async def test_delete_revokes_the_machine_and_its_tokens(shims, owner, api, count_rows):
    shim = await shims.connect(owner, machine_id="m1")
    response = await api.delete("/api/v1/machines/m1")
    assert response.status_code == 200
    assert response.json()["machine_id"] == "m1"
    assert await shim.closed_with() == 4401
    assert await count_rows(MachineToken, machine_id="m1", revoked_at__isnull=True) == 0
    assert await count_rows(MachineConnection) == 0
    assert (await api.get("/api/v1/machines")).json()["machines"] == []


async def test_another_users_machine_is_not_found(shims, owner, member, member_token, count_rows):
    shim = await shims.connect(owner, machine_id="m1")
    bob = Api(member_token)
    response = await bob.delete("/api/v1/machines/m1")
    assert response.status_code == 404
    assert error_of(response)["code"] == "NOT_FOUND"
    assert (await bob.put("/api/v1/machines/default", {"machine_id": "m1"})).status_code == 404
    assert (await bob.get("/api/v1/machines")).json() == {"machines": []}
    assert (await bob.get("/api/v1/sessions/s1/machines")).json() == {"machines": []}
    assert not shim.closed
    assert await count_rows(Machine, revoked_at__isnull=True) == 1


# --- operations ------------------------------------------------------------------------------


async def test_post_ops_returns_the_shims_response(shims, owner, api):
    shim = await shims.connect(owner, machine_id="m1")
    response = await api.post(
        "/api/v1/sessions/agt_1/ops", {"op": "EXECUTE_COMMAND", "payload": {"argv": ["echo", "hi"]}}
    )
    assert response.status_code == 200
    body = response.json()
    assert (body["machine_id"], body["type"]) == ("m1", "COMMAND_RESULT")
    assert body["payload"]["stdout"] == "echo hi"
    assert shim.ops("EXECUTE_COMMAND")[0]["session_id"] == "agt_1"


async def test_post_ops_to_no_machine_is_404_machine_not_attached(owner, api):
    response = await api.post("/api/v1/sessions/s1/ops", {"op": "FILE_STAT", "payload": {"path": "/x"}})
    assert response.status_code == 404
    assert error_of(response)["code"] == "MACHINE_NOT_ATTACHED"


async def test_post_ops_maps_a_shim_error_to_its_status(shims, owner, api):
    await shims.connect(owner, machine_id="m1")
    response = await api.post("/api/v1/sessions/s1/ops", {"op": "FILE_READ", "payload": {"path": "/etc/passwd"}})
    assert response.status_code == 400
    assert error_of(response)["code"] == "PATH_OUTSIDE_ALLOWED_ROOT"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/v1/sessions/s1/ops", {"op": "FILE_COPY", "payload": {}}),
        ("/api/v1/sessions/s1/ops", {"payload": {"path": "/x"}}),
        ("/api/v1/sessions/s1/ops", {"op": "FILE_STAT", "payload": "path"}),
        ("/api/v1/sessions/s1/ops", {"op": "FILE_STAT", "payload": {}, "target_machine": ["m1"]}),
        ("/api/v1/sessions/s1/ops", "not json"),
        ("/api/v1/sessions/s1/ops", "[1]"),
        ("/api/v1/sessions/.dot/ops", {"op": "FILE_STAT", "payload": {"path": "/x"}}),
    ],
)
async def test_post_ops_refuses_bad_input_with_400(shims, owner, api, path, body):
    shim = await shims.connect(owner, machine_id="m1")
    response = await api.post(path, body)
    assert response.status_code == 400
    assert error_of(response)["code"] == "INVALID_REQUEST"
    assert [r for r in shim.requests if r["type"] != "MACHINE_LIST_REQUEST"] == []


# --- copy ---------------------------------------------------------------------------------------


@pytest.fixture
async def laptop_and_server(shims, owner):
    laptop = await shims.connect(owner, machine_id="m1", hostname="laptop", allowed_roots=["/Users/alice"])
    server = await shims.connect(owner, machine_id="m2", hostname="server", allowed_roots=["/srv"])
    await snapshots_stored(owner, 2)
    return laptop, server


COPY = {
    "source_machine": "laptop",
    "source_path": "/Users/alice/data.csv",
    "destination_machine": "server",
    "destination_path": "/srv/incoming/data.csv",
}
PARTIAL = COPY["destination_path"] + PARTIAL_SUFFIX


async def test_copy_streams_a_large_file_in_chunks_and_verifies_it(laptop_and_server, api):
    laptop, server = laptop_and_server
    data = os.urandom(CHUNK_BYTES * 2 + CHUNK_BYTES // 2)  # 2.5 MiB
    laptop.files[COPY["source_path"]] = data
    response = await api.post("/api/v1/sessions/s1/copy", COPY)
    assert response.status_code == 200, response.content
    assert response.json() == {"size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert server.files == {COPY["destination_path"]: data}

    reads = laptop.ops("FILE_READ")
    assert [(r["payload"]["offset"], r["payload"]["length"]) for r in reads] == [
        (0, CHUNK_BYTES),
        (CHUNK_BYTES, CHUNK_BYTES),
        (2 * CHUNK_BYTES, CHUNK_BYTES),
    ]
    assert all(r["payload"]["encoding"] == "base64" for r in reads)
    writes = server.ops("FILE_WRITE")
    assert [w["payload"]["path"] for w in writes] == [PARTIAL] * 3
    assert [bool(w["payload"].get("append")) for w in writes] == [False, True, True]
    stats = [s["payload"] for s in server.ops("FILE_STAT")]
    assert {"path": PARTIAL, "hash": True} in stats
    assert {"path": COPY["source_path"], "hash": True} in [s["payload"] for s in laptop.ops("FILE_STAT")]
    move = server.ops("FILE_MOVE")[0]["payload"]
    assert (move["src"], move["dst"]) == (PARTIAL, COPY["destination_path"])
    assert laptop.ops("FILE_WRITE") == [] and server.ops("FILE_READ") == []


async def test_copy_of_an_empty_file_creates_an_empty_file(laptop_and_server, api):
    laptop, server = laptop_and_server
    laptop.files[COPY["source_path"]] = b""
    response = await api.post("/api/v1/sessions/s1/copy", COPY)
    assert response.status_code == 200, response.content
    assert server.files == {COPY["destination_path"]: b""}


async def test_copy_refuses_to_replace_an_existing_destination_without_overwrite(laptop_and_server, api):
    laptop, server = laptop_and_server
    laptop.files[COPY["source_path"]] = b"new"
    server.files[COPY["destination_path"]] = b"old"
    response = await api.post("/api/v1/sessions/s1/copy", COPY)
    assert response.status_code == 400
    assert error_of(response)["code"] == "PATH_EXISTS"
    assert server.files == {COPY["destination_path"]: b"old"}
    assert server.ops("FILE_WRITE") == []
    replaced = await api.post("/api/v1/sessions/s1/copy", {**COPY, "overwrite": True})
    assert replaced.status_code == 200, replaced.content
    assert server.files == {COPY["destination_path"]: b"new"}


async def test_a_failing_write_removes_the_partial_file(laptop_and_server, api):
    laptop, server = laptop_and_server
    laptop.files[COPY["source_path"]] = os.urandom(CHUNK_BYTES + 10)
    writes = 0

    async def disk_full(request: dict[str, Any]) -> dict[str, Any] | None:
        nonlocal writes
        if request["type"] == "FILE_WRITE":
            writes += 1
            if writes == 2:
                raise ShimFailure("PERMISSION_DENIED", "disk full")
        return await server.memory_handler(request)

    server.handler = disk_full
    response = await api.post("/api/v1/sessions/s1/copy", COPY)
    assert response.status_code == 403
    assert error_of(response)["code"] == "PERMISSION_DENIED"
    assert server.files == {}
    deletes = [d["payload"] for d in server.ops("FILE_DELETE")]
    assert deletes == [{"path": PARTIAL, "missing_ok": True}]


async def test_a_corrupted_copy_fails_verification_and_is_not_moved_into_place(laptop_and_server, api):
    laptop, server = laptop_and_server
    laptop.files[COPY["source_path"]] = b"a" * 1000

    async def bit_flip(request: dict[str, Any]) -> dict[str, Any] | None:
        response = await server.memory_handler(request)
        if request["type"] == "FILE_WRITE":
            server.files[PARTIAL] = b"b" + server.files[PARTIAL][1:]  # same size, other bytes
        return response

    server.handler = bit_flip
    response = await api.post("/api/v1/sessions/s1/copy", COPY)
    error = error_of(response)
    assert error["code"] == "COPY_VERIFICATION_FAILED"
    assert error["details"]["source"]["size_bytes"] == error["details"]["copy"]["size_bytes"] == 1000
    assert server.files == {}
    assert server.ops("FILE_MOVE") == []


async def test_copy_of_a_missing_source_is_path_not_found(laptop_and_server, api):
    response = await api.post("/api/v1/sessions/s1/copy", COPY)
    assert response.status_code == 404
    assert error_of(response)["code"] == "PATH_NOT_FOUND"


@pytest.mark.parametrize(
    "body",
    [
        {k: v for k, v in COPY.items() if k != "source_machine"},
        {**COPY, "destination_path": ""},
        {**COPY, "overwrite": "yes"},
        {**COPY, "source_path": 3},
    ],
)
async def test_copy_refuses_bad_input(laptop_and_server, api, body):
    response = await api.post("/api/v1/sessions/s1/copy", body)
    assert response.status_code == 400
    assert error_of(response)["code"] == "INVALID_REQUEST"


async def test_copy_to_an_unknown_machine_is_machine_not_attached(laptop_and_server, api):
    laptop, _ = laptop_and_server
    laptop.files[COPY["source_path"]] = b"x"
    response = await api.post("/api/v1/sessions/s1/copy", {**COPY, "destination_machine": "nas"})
    assert response.status_code == 404
    assert error_of(response)["code"] == "MACHINE_NOT_ATTACHED"


async def test_token_users_are_isolated_in_ops(shims, owner, member_token):
    shim = await shims.connect(owner, machine_id="m1", hostname="laptop")
    bob = Api(member_token)
    for target in (None, "m1", "laptop", "lap"):
        body: dict[str, Any] = {"op": "EXECUTE_COMMAND", "payload": {"argv": ["id"]}}
        if target:
            body["target_machine"] = target
        response = await bob.post("/api/v1/sessions/s1/ops", body)
        assert response.status_code == 404
        assert error_of(response)["code"] == "MACHINE_NOT_ATTACHED"
    assert shim.ops("EXECUTE_COMMAND") == []


async def test_a_machine_revoked_in_the_database_is_not_routed(shims, owner, api):
    await shims.connect(owner, machine_id="m1")
    await database_sync_to_async(Machine.objects.update)(revoked_at="2020-01-01T00:00:00Z")
    response = await api.post("/api/v1/sessions/s1/ops", {"op": "FILE_STAT", "payload": {"path": "/home/alice"}})
    assert response.status_code == 404


async def test_a_waiting_rest_operation_does_not_block_the_shared_sync_thread(shims, owner, api):
    from django.contrib.auth.models import User

    shim = await shims.connect(owner, machine_id="m1")

    async def hold(request: dict[str, Any]) -> None:
        return None

    shim.handler = hold
    call = asyncio.ensure_future(
        api.post("/api/v1/sessions/s1/ops", {"op": "FILE_STAT", "payload": {"path": "/home/alice/a"}})
    )
    request = await shim.next_request("FILE_STAT")
    try:
        # Any other connection's database work (a shim's HELLO, a /ws auth, a heartbeat).
        users = await asyncio.wait_for(database_sync_to_async(User.objects.count)(), 1.5)
        assert users == 1
    finally:
        await shim.send(frame("FILE_STAT_RESPONSE", {"exists": False}, message_id=request["id"]))
        assert (await asyncio.wait_for(call, 5)).status_code == 200
