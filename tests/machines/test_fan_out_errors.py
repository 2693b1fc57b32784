"""A fan-out whose one machine fails other than with a machine error (docs/live-operations.md):
the outage's 503 on one machine's writes is that machine's entry, and a bug in one entry is
raised only once its siblings ended, so their in-flight row outlives them."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from channels.db import database_sync_to_async

from core.errors import TemporarilyUnavailable
from machines.models import OperationInFlight
from machines.services import operations
from tests.machines.live_shim import lines
from tests.machines.test_live_operations import fan_out, live_shim

pytestmark = [pytest.mark.django_db(transaction=True)]


def _failing_on(machine_id: str, error: BaseException, monkeypatch: pytest.MonkeyPatch) -> None:
    run = operations._RoutedOp.run

    async def failing(self: Any, *, candidate: Any, on_output: Any) -> Any:
        if candidate.machine_id == machine_id:
            raise error
        return await run(self, candidate=candidate, on_output=on_output)

    monkeypatch.setattr(operations._RoutedOp, "run", failing)


async def test_the_outages_503_on_one_machine_is_that_machines_entry(shims, owner, monkeypatch):
    await shims.connect(owner, machine_id="m1", hostname="a")
    await shims.connect(owner, machine_id="m2", hostname="b")
    _failing_on("m2", TemporarilyUnavailable("the database cannot be written", {"service": "database"}), monkeypatch)
    answer = await fan_out(owner, ["a", "b"])
    entries = {entry["name"]: entry for entry in answer["results"]}
    assert entries["a"]["ok"] is True
    assert entries["b"]["ok"] is False and entries["b"]["error"]["code"] == "TEMPORARILY_UNAVAILABLE"


async def test_a_bug_in_one_entry_is_raised_after_its_siblings_ended_and_their_row_outlives_them(
    shims, owner, monkeypatch
):
    slow = await live_shim(shims, owner, lambda payload: lines(50, pause=0.02), machine_id="m1", hostname="a")
    await shims.connect(owner, machine_id="m2", hostname="b", protocol_version="2.1")
    _failing_on("m2", RuntimeError("a bug"), monkeypatch)
    request_id = str(uuid.uuid4())
    task = asyncio.ensure_future(fan_out(owner, "*", request_id=request_id, on_output=lambda output: None))
    count = database_sync_to_async(lambda: OperationInFlight.objects.filter(request_id=request_id).count())
    await asyncio.sleep(0.2)  # m2 has failed by now; m1 is still sending its lines
    assert request_id in slow.running and not task.done()
    assert await count() == 1  # the row that cancels m1 by request id is still there
    with pytest.raises(RuntimeError, match="a bug"):
        await asyncio.wait_for(task, 10)
    assert request_id not in slow.running
    assert await count() == 0
