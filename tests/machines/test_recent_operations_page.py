"""The Machines page's "Recent operations" (docs/live-operations.md#the-machines-page):
a copy is one row, not one per chunk; a pipe is one row naming both machines; a cancelled
command says so. Real copies, pipes and cancels run through the services against the fake
shims of ``tests/machines/conftest.py``; the page is rendered by its view."""

from __future__ import annotations

import asyncio
import uuid
from html.parser import HTMLParser
from typing import Any

import pytest
from django.test import AsyncClient

from machines.services import live
from machines.services.copy import CHUNK_BYTES, copy_between_machines
from machines.services.errors import MachineError
from machines.services.operations import machine_op
from tests.machines.conftest import ShimFailure, settle, until
from tests.machines.live_shim import LiveMachine, endless, lines

pytestmark = [pytest.mark.django_db(transaction=True)]

SOURCE = "/home/alice/big.bin"
DESTINATION = "/home/alice/copy.bin"


class _Rows(HTMLParser):
    """The cells' text of each row of the table under the "Recent operations" heading."""

    def __init__(self) -> None:
        super().__init__()
        self.in_section = False
        self.heading = ""
        self.in_h2 = False
        self.in_body = False
        self.rows: list[list[str]] = []
        self.cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "h2":
            self.in_h2, self.heading = True, ""
        elif tag == "tbody" and self.in_section:
            self.in_body = True
        elif tag == "tr" and self.in_body:
            self.rows.append([])
        elif tag == "td" and self.in_body:
            self.cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "h2":
            self.in_h2 = False
            self.in_section = self.heading.strip() == "Recent operations"
        elif tag == "tbody":
            self.in_body = False
        elif tag == "td" and self.cell is not None:
            self.rows[-1].append(" ".join("".join(self.cell).split()))
            self.cell = None

    def handle_data(self, data: str) -> None:
        if self.in_h2:
            self.heading += data
        if self.cell is not None:
            self.cell.append(data)


async def recent_operations(user: Any) -> list[dict[str, str]]:
    """The page's rows as ``{when, operation, machine, session, details, result, caller}``."""
    await settle()  # the audit records are written after the replies
    client = AsyncClient()
    await client.aforce_login(user)
    response = await client.get("/machines/")
    assert response.status_code == 200
    parser = _Rows()
    parser.feed(response.content.decode())
    names = ("when", "operation", "machine", "session", "details", "result", "caller")
    return [dict(zip(names, row, strict=True)) for row in parser.rows]


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


async def test_a_copy_is_one_row_naming_both_machines_and_paths(shims: Any, owner: Any) -> None:
    _, destination = await two_machines(shims, owner, 3 * CHUNK_BYTES + 512)
    await copy(owner)
    assert len(destination.ops("FILE_WRITE")) == 4  # four chunks: a dozen audited steps in all

    rows = await recent_operations(owner)

    assert len(rows) == 1, rows
    (row,) = rows
    assert row["operation"].startswith("COPY")
    assert row["machine"] == "laptop → buildbox"
    assert f"from={SOURCE}" in row["details"] and f"to={DESTINATION}" in row["details"]
    assert "chunks=4" in row["details"]
    assert row["result"].split()[0] == "ok"
    assert row["caller"] == "test"


async def test_a_copy_stays_one_row_among_operations_of_their_own(shims: Any, owner: Any, member: Any) -> None:
    await two_machines(shims, owner, CHUNK_BYTES)
    await machine_op(user=owner, session_id="s1", op="FILE_LIST", payload={"path": "/home/alice"}, caller="api")
    await copy(owner)
    await machine_op(user=owner, session_id="s1", op="FILE_STAT", payload={"path": DESTINATION}, caller="api")

    rows = await recent_operations(owner)

    assert [row["operation"].split()[0] for row in rows] == ["FILE_STAT", "COPY", "FILE_LIST"]
    assert await recent_operations(member) == []  # another user's page shows none of it


async def test_a_cancelled_copy_is_one_row_marked_cancelled(shims: Any, owner: Any) -> None:
    source, destination = await two_machines(shims, owner, 4 * CHUNK_BYTES)
    serve = source.handler

    async def slow(request: dict[str, Any]) -> dict[str, Any] | None:
        await asyncio.sleep(0.05)
        return await serve(request)

    source.handler = slow
    request_id = str(uuid.uuid4())
    task = asyncio.ensure_future(copy(owner, request_id=request_id))
    await until(lambda: destination.ops("FILE_WRITE"), what="the first chunk written")
    await live.cancel_operation(user=owner, session_id="s1", request_id=request_id)
    with pytest.raises(MachineError):
        await asyncio.wait_for(task, 5)

    rows = await recent_operations(owner)

    assert len(rows) == 1, rows
    assert rows[0]["operation"].startswith("COPY") and rows[0]["machine"] == "laptop → buildbox"
    assert rows[0]["result"].split()[0] == "cancelled"


async def test_a_copy_in_flight_is_one_row_marked_running(shims: Any, owner: Any) -> None:
    source, destination = await two_machines(shims, owner, 4 * CHUNK_BYTES)
    serve = source.handler
    reads = asyncio.Event()

    async def held(request: dict[str, Any]) -> dict[str, Any] | None:
        if request["type"] == "FILE_READ" and request["payload"]["offset"] > 0:
            await reads.wait()  # the second chunk waits until the page was read
        return await serve(request)

    source.handler = held
    request_id = str(uuid.uuid4())
    task = asyncio.ensure_future(copy(owner, request_id=request_id))
    await until(lambda: destination.ops("FILE_WRITE"), what="the first chunk written")

    rows = await recent_operations(owner)

    reads.set()
    await asyncio.wait_for(task, 5)
    assert len(rows) == 1, rows
    assert rows[0]["operation"].startswith("COPY") and rows[0]["result"].split()[0] == "running"
    assert [row["result"].split()[0] for row in await recent_operations(owner)] == ["ok"]


async def test_a_copy_whose_write_fails_shows_the_error_once(shims: Any, owner: Any) -> None:
    _, destination = await two_machines(shims, owner, 2 * CHUNK_BYTES)
    serve = destination.handler

    async def full_disk(request: dict[str, Any]) -> dict[str, Any] | None:
        if request["type"] == "FILE_WRITE" and request["payload"].get("append"):
            raise ShimFailure("DISK_FULL", "no space left on device")
        return await serve(request)

    destination.handler = full_disk
    with pytest.raises(MachineError):
        await copy(owner)

    rows = await recent_operations(owner)

    assert len(rows) == 1, rows
    assert rows[0]["result"].split()[0] == "DISK_FULL"


async def test_a_cancelled_command_shows_as_cancelled(shims: Any, owner: Any) -> None:
    machine = LiveMachine(
        await shims.connect(owner, protocol_version="2.1", machine_id="m1", hostname="buildbox"),
        lambda payload: lines(1000, pause=0.01),
    )
    request_id = str(uuid.uuid4())

    async def run() -> list[Any]:
        return [
            event
            async for event in live.operation_stream(
                user=owner,
                session_id="s1",
                op="EXECUTE_COMMAND",
                payload={"argv": ["make", "test"]},
                caller="test",
                request_id=request_id,
            )
        ]

    task = asyncio.ensure_future(run())
    await until(lambda: request_id in machine.running, what="the command to start")
    await live.cancel_operation(user=owner, session_id="s1", request_id=request_id)
    await asyncio.wait_for(task, 5)

    rows = await recent_operations(owner)

    assert len(rows) == 1, rows
    assert rows[0]["operation"] == "EXECUTE_COMMAND" and rows[0]["machine"] == "buildbox"
    assert rows[0]["result"].split()[0] == "cancelled"


async def test_a_pipe_is_one_row_naming_its_source_and_destination(shims: Any, owner: Any) -> None:
    laptop = await shims.connect(owner, protocol_version="2.1", machine_id="m1", hostname="laptop")
    source = LiveMachine(laptop, lambda payload: lines(3))
    buildbox = await shims.connect(owner, protocol_version="2.1", machine_id="m2", hostname="buildbox")
    LiveMachine(buildbox, lambda payload: lines(0))
    answer = await live.pipe(
        user=owner,
        session_id="s1",
        source={"machine": "laptop", "argv": ["cat", "app.log"]},
        destination={"machine": "buildbox", "command": "wc -l"},
        caller="test",
    )
    assert answer["source"]["ok"] and answer["destination"]["ok"] and source.sent

    rows = await recent_operations(owner)

    assert len(rows) == 1, rows
    (row,) = rows
    assert row["operation"].startswith("PIPE")
    assert row["machine"] == "laptop → buildbox"
    assert "source=cat app.log" in row["details"] and "destination=wc -l" in row["details"]
    assert row["result"].split()[0] == "ok"


async def test_a_cancelled_pipe_is_one_row_marked_cancelled(shims: Any, owner: Any) -> None:
    laptop = await shims.connect(owner, protocol_version="2.1", machine_id="m1", hostname="laptop")
    LiveMachine(laptop, lambda payload: endless())
    buildbox = await shims.connect(owner, protocol_version="2.1", machine_id="m2", hostname="buildbox")
    destination = LiveMachine(buildbox, lambda payload: lines(0))
    request_id = str(uuid.uuid4())
    task = asyncio.ensure_future(
        live.pipe(
            user=owner,
            session_id="s1",
            source={"machine": "laptop", "argv": ["yes"]},
            destination={"machine": "buildbox", "argv": ["sha256sum"]},
            caller="test",
            request_id=request_id,
        )
    )
    await until(lambda: destination.stdin, what="bytes through the pipe")
    await live.cancel_operation(user=owner, session_id="s1", request_id=request_id)
    await asyncio.wait_for(task, 5)

    rows = await recent_operations(owner)

    assert len(rows) == 1, rows
    assert rows[0]["operation"].startswith("PIPE") and rows[0]["machine"] == "laptop → buildbox"
    assert rows[0]["result"].split()[0] == "cancelled"
