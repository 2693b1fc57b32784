"""A cross-machine copy as an operation in flight (issue 14, design §3): progress after each
chunk, its in-flight row, cancel between chunks (the partial file removed, ``CANCELLED``)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from channels.db import database_sync_to_async

from machines.models import OperationInFlight
from machines.services import live
from machines.services.copy import CHUNK_BYTES, PARTIAL_SUFFIX, copy_between_machines
from machines.services.operations import MachineError
from tests.machines.conftest import until

pytestmark = [pytest.mark.django_db(transaction=True)]

SOURCE = "/home/alice/big.bin"
DESTINATION = "/home/alice/copy.bin"


def copy(owner: Any, **kwargs: Any) -> Any:
    return copy_between_machines(
        user=owner,
        session_id="s1",
        source_machine="laptop",
        source_path=SOURCE,
        destination_machine="buildbox",
        destination_path=DESTINATION,
        caller="test",
        **kwargs,
    )


async def two_machines(shims: Any, owner: Any, size: int) -> tuple[Any, Any]:
    source = await shims.connect(owner, machine_id="m1", hostname="laptop")
    destination = await shims.connect(owner, machine_id="m2", hostname="buildbox")
    source.files[SOURCE] = bytes(range(256)) * (size // 256)
    return source, destination


async def test_a_copy_reports_bytes_done_of_the_total_after_each_chunk(shims, owner):
    source, destination = await two_machines(shims, owner, 2 * CHUNK_BYTES + 512)
    reports: list[tuple[int, int]] = []

    async def on_progress(done: int, total: int) -> None:
        reports.append((done, total))

    answer = await copy(owner, on_progress=on_progress)
    total = 2 * CHUNK_BYTES + 512
    assert answer["size_bytes"] == total
    assert reports == [(CHUNK_BYTES, total), (2 * CHUNK_BYTES, total), (total, total)]
    assert destination.files[DESTINATION] == source.files[SOURCE]
    assert await database_sync_to_async(OperationInFlight.objects.count)() == 0


async def test_a_copy_is_listed_in_flight_and_cancelled_between_chunks(shims, owner):
    source, destination = await two_machines(shims, owner, 4 * CHUNK_BYTES)
    serve = source.handler

    async def slow(request: dict[str, Any]) -> dict[str, Any] | None:
        await asyncio.sleep(0.05)
        return await serve(request)

    source.handler = slow
    request_id = str(uuid.uuid4())
    task = asyncio.ensure_future(copy(owner, request_id=request_id))
    await until(lambda: destination.ops("FILE_WRITE"), what="the first chunk written")
    listed = await database_sync_to_async(live.operations_in_flight)(user=owner, session_id="s1")
    assert [(e["request_id"], e["kind"], e["machines"]) for e in listed] == [
        (request_id, "copy", ["laptop", "buildbox"])
    ]
    assert listed[0]["summary"] == f"laptop:{SOURCE} → buildbox:{DESTINATION}"
    await live.cancel_operation(user=owner, session_id="s1", request_id=request_id)
    with pytest.raises(MachineError) as cancelled:
        await asyncio.wait_for(task, 5)
    assert cancelled.value.code == "CANCELLED"
    assert len(destination.ops("FILE_WRITE")) < 4
    assert DESTINATION not in destination.files and DESTINATION + PARTIAL_SUFFIX not in destination.files
    assert await database_sync_to_async(OperationInFlight.objects.count)() == 0


async def test_a_copy_under_a_request_id_in_flight_is_refused(shims, owner):
    await two_machines(shims, owner, 1024)
    request_id = str(uuid.uuid4())
    await database_sync_to_async(OperationInFlight.objects.create)(
        request_id=request_id,
        user=owner,
        session_id="s1",
        kind="command",
        op="EXECUTE_COMMAND",
        caller="t",
        server_process_id=await database_sync_to_async(_process)(),
    )
    with pytest.raises(MachineError) as exists:
        await copy(owner, request_id=request_id)
    assert exists.value.code == "OPERATION_EXISTS"


def _process() -> str:
    from core.services import server_process_ensure

    return server_process_ensure()
