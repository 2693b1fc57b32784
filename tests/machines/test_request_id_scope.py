"""Request ids of machine operations are per user (docs/live-operations.md): a caller names
its operation with a ``request_id``; another user in flight with the same id is neither a
conflict nor something the caller can learn about. The same user twice is
``OPERATION_EXISTS`` (409). Through the REST edge, each user with their own token, against
fake 2.1 shims."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from channels.db import database_sync_to_async
from django.test import AsyncClient

from machines.models import OperationInFlight
from machines.services import live
from machines.services.errors import MachineError
from tests.machines.conftest import Shims, until
from tests.machines.live_shim import LiveMachine, lines

pytestmark = [pytest.mark.django_db(transaction=True)]

OPS = "/api/v1/sessions/s1/ops"
RID = "3f2b9c1e-8d4a-4c3b-9f00-5e6d7c8b9a01"


class Api:
    """An ``AsyncClient`` speaking JSON with one user's bearer token."""

    def __init__(self, token: str) -> None:
        self.client = AsyncClient()
        self.headers = {"authorization": f"Bearer {token}"}

    async def get(self, path: str) -> Any:
        return await self.client.get(path, headers=self.headers)

    async def post(self, path: str, body: Any = None) -> Any:
        data = json.dumps(body if body is not None else {})
        return await self.client.post(path, data, content_type="application/json", headers=self.headers)


def command(request_id: str = RID) -> dict[str, Any]:
    """A streamed command: its answer is open (``started`` sent) while the command runs."""
    return {"op": "EXECUTE_COMMAND", "payload": {"argv": ["make", "test"]}, "stream": True, "request_id": request_id}


async def last_event(response: Any) -> tuple[str, dict[str, Any]]:
    """``(event, data)`` of the last server-sent event of a streamed answer (read to its end)."""
    assert response.status_code == 200, response.content
    text = b"".join([chunk async for chunk in response.streaming_content]).decode()
    block = [block for block in text.split("\n\n") if block.startswith("event:")][-1]
    fields = dict(line.split(": ", 1) for line in block.split("\n"))
    return fields["event"], json.loads(fields["data"])


def cancelled(event: tuple[str, dict[str, Any]], machine_id: str) -> bool:
    """Whether ``event`` is ``machine_id``'s command's result, ended cancelled."""
    name, data = event
    return name == "result" and data["machine_id"] == machine_id and data["payload"]["cancelled"] is True


def in_flight() -> list[tuple[str, str]]:
    """``(username, request_id)`` of every operation in flight."""
    return sorted((row.user.username, str(row.request_id)) for row in OperationInFlight.objects.select_related("user"))


async def wait_for_rows(expected: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The in-flight rows once they are ``expected`` (a row is written just after its
    command is sent), or as they are after 3 s."""
    found: list[tuple[str, str]] = []

    async def check() -> bool:
        found[:] = await database_sync_to_async(in_flight)()
        return found == expected

    for _ in range(300):
        if await check():
            break
        await asyncio.sleep(0.01)
    return found


async def test_two_users_run_the_same_request_id_at_once_and_the_same_user_twice_is_refused(
    shims: Shims, owner: Any, member: Any, owner_token: str, member_token: str
) -> None:
    owners_machine = LiveMachine(
        await shims.connect(owner, protocol_version="2.1", machine_id="m-owner"),
        lambda payload: lines(100_000, pause=0.01),
    )
    members_machine = LiveMachine(
        await shims.connect(member, protocol_version="2.1", machine_id="m-member"),
        lambda payload: lines(100_000, pause=0.01),
    )
    owner_api, member_api = Api(owner_token), Api(member_token)

    owners_run = asyncio.ensure_future(last_event(await owner_api.post(OPS, command())))
    await until(lambda: RID in owners_machine.running, what="the owner's command to start")
    members_answer = await member_api.post(OPS, command())
    assert members_answer.status_code == 200, members_answer.content  # not OPERATION_EXISTS
    members_run = asyncio.ensure_future(last_event(members_answer))
    await until(lambda: RID in members_machine.running, what="the member's command to start")
    # Both run, each on its own user's machine, under the same id.
    both = sorted([(owner.username, RID), (member.username, RID)])
    assert await wait_for_rows(both) == both

    # The member sees only their own operation: nothing hints at the owner's.
    listed = (await member_api.get(OPS)).json()["operations"]
    assert [(op["request_id"], op["machine_ids"]) for op in listed] == [(RID, ["m-member"])]

    # The same user with the same id while it runs: 409 OPERATION_EXISTS, nothing sent.
    twice = await owner_api.post(OPS, command())
    assert twice.status_code == 409, twice.content
    assert twice.json()["error"]["code"] == "OPERATION_EXISTS"
    assert len(owners_machine.shim.ops("EXECUTE_COMMAND")) == 1

    # Cancelling is per user too: the member's cancel ends the member's command only.
    cancel = await member_api.post(f"{OPS}/{RID}/cancel")
    assert (cancel.status_code, cancel.json()) == (202, {"request_id": RID, "cancelled": True})
    assert cancelled(await asyncio.wait_for(members_run, 10), "m-member")
    assert RID in owners_machine.running and not owners_machine.cancels(RID)
    assert await wait_for_rows([(owner.username, RID)]) == [(owner.username, RID)]

    # The member may reuse the id once the cancel has landed: a command's cancel reaches the
    # shim twice (from the cancelling process, and from the caller after its own send), and
    # a CANCEL still on its way would stop the new command of the same id.
    await until(lambda: len(members_machine.cancels(RID)) == 2, what="both CANCELs of the member's first command")
    # Their run's end leaves the owner's row in place.
    again = asyncio.ensure_future(last_event(await member_api.post(OPS, command())))
    await until(lambda: len(members_machine.shim.ops("EXECUTE_COMMAND")) == 2, what="the member's second command")
    await live.cancel_operation(user=member, session_id="s1", request_id=RID)
    assert cancelled(await asyncio.wait_for(again, 10), "m-member")
    assert await wait_for_rows([(owner.username, RID)]) == [(owner.username, RID)]

    await live.cancel_operation(user=owner, session_id="s1", request_id=RID)
    assert cancelled(await asyncio.wait_for(owners_run, 10), "m-owner")
    assert await wait_for_rows([]) == []
    with pytest.raises(MachineError, match="no operation"):
        await live.cancel_operation(user=member, session_id="s1", request_id=RID)
