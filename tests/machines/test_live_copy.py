"""A cross-machine copy as an operation in flight (docs/live-operations.md#copy-progress): progress after each
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
from machines.services.errors import MachineError
from tests.machines.conftest import ShimFailure, until

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


# --- the pipeline (bench B5): chunk n+1 is read while chunk n is written ----------------------


def record_timeline(source: Any, destination: Any, timeline: list[tuple[str, int]], write_delay: float) -> None:
    """Make both fake shims log ``("read", offset)`` when a FILE_READ arrives and
    ``("written", chunk index)`` when a FILE_WRITE is answered (each write taking
    ``write_delay`` seconds)."""
    read, write = source.handler, destination.handler
    writes = 0

    async def reading(request: dict[str, Any]) -> dict[str, Any] | None:
        if request["type"] == "FILE_READ":
            timeline.append(("read", request["payload"]["offset"]))
        return await read(request)

    async def writing(request: dict[str, Any]) -> dict[str, Any] | None:
        nonlocal writes
        if request["type"] != "FILE_WRITE":
            return await write(request)
        await asyncio.sleep(write_delay)
        answer = await write(request)
        timeline.append(("written", writes))
        writes += 1
        return answer

    source.handler, destination.handler = reading, writing


async def test_the_next_chunk_is_read_while_this_one_is_written_and_no_further(shims: Any, owner: Any) -> None:
    source, destination = await two_machines(shims, owner, 4 * CHUNK_BYTES)
    timeline: list[tuple[str, int]] = []
    record_timeline(source, destination, timeline, write_delay=0.1)
    answer = await copy(owner)
    assert answer["size_bytes"] == 4 * CHUNK_BYTES
    assert destination.files[DESTINATION] == source.files[SOURCE]
    # Chunk n+1's read arrives before chunk n's write is answered (overlap), and chunk
    # n+2's only after it (at most two chunks held).
    assert timeline == [
        ("read", 0),
        ("read", CHUNK_BYTES),
        ("written", 0),
        ("read", 2 * CHUNK_BYTES),
        ("written", 1),
        ("read", 3 * CHUNK_BYTES),
        ("written", 2),
        ("written", 3),
    ]


async def test_a_write_failing_mid_pipeline_leaves_no_partial_file_and_no_read_behind(shims: Any, owner: Any) -> None:
    source, destination = await two_machines(shims, owner, 4 * CHUNK_BYTES)
    write = destination.handler

    async def full_disk(request: dict[str, Any]) -> dict[str, Any] | None:
        if request["type"] == "FILE_WRITE" and len(destination.ops("FILE_WRITE")) == 2:
            await asyncio.sleep(0.05)  # the third chunk's read is in flight meanwhile
            raise ShimFailure("DISK_FULL", "no space left on device")
        return await write(request)

    destination.handler = full_disk
    with pytest.raises(MachineError) as failed:
        await copy(owner)
    assert failed.value.code == "DISK_FULL"
    assert len(destination.ops("FILE_WRITE")) == 2 and len(source.ops("FILE_READ")) == 3
    assert destination.ops("FILE_DELETE")[-1]["payload"]["path"] == DESTINATION + PARTIAL_SUFFIX
    assert DESTINATION not in destination.files and DESTINATION + PARTIAL_SUFFIX not in destination.files
    assert await database_sync_to_async(OperationInFlight.objects.count)() == 0


async def test_a_read_failing_mid_pipeline_stops_after_the_chunks_read_before_it(shims: Any, owner: Any) -> None:
    source, destination = await two_machines(shims, owner, 4 * CHUNK_BYTES)
    read = source.handler

    async def bad_sector(request: dict[str, Any]) -> dict[str, Any] | None:
        if request["type"] == "FILE_READ" and request["payload"]["offset"] == 2 * CHUNK_BYTES:
            raise ShimFailure("IO_ERROR", "input/output error")
        return await read(request)

    source.handler = bad_sector
    with pytest.raises(MachineError) as failed:
        await copy(owner)
    assert failed.value.code == "IO_ERROR"
    assert len(destination.ops("FILE_WRITE")) == 2 and len(source.ops("FILE_READ")) == 3
    assert DESTINATION not in destination.files and DESTINATION + PARTIAL_SUFFIX not in destination.files
    assert await database_sync_to_async(OperationInFlight.objects.count)() == 0
