"""Cross-machine pipes through the services, against fake 2.1 shims
(docs/live-operations.md#cross-machine-pipes): bytes moved in order, credit end to end, the destination ending first,
cancel, a 2.0 shim refused."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import uuid
from typing import Any

import pytest
from channels.db import database_sync_to_async

from machines.models import AuditRecord, OperationInFlight
from machines.services import connections, live
from machines.services.errors import MachineError
from machines.services.inflight import pipe_command_ids
from tests.machines.conftest import settle, until
from tests.machines.live_shim import LiveMachine, endless

pytestmark = [pytest.mark.django_db(transaction=True)]


async def chunks(count: int, size: int) -> Any:
    for index in range(count):
        yield "stdout", bytes([index % 256]) * size


async def machines(shims: Any, owner: Any, source_script: Any) -> tuple[LiveMachine, LiveMachine]:
    source = LiveMachine(
        await shims.connect(owner, protocol_version="2.1", machine_id="m1", hostname="laptop"), source_script
    )
    sink = await shims.connect(owner, protocol_version="2.1", machine_id="m2", hostname="buildbox")
    destination = LiveMachine(sink, lambda payload: chunks(0, 0))
    return source, destination


def run_pipe(owner: Any, **kwargs: Any) -> Any:
    return live.pipe(
        user=owner,
        session_id="s1",
        source=kwargs.pop("source", {"machine": "laptop", "argv": ["head", "-c", "1M", "/dev/urandom"]}),
        destination=kwargs.pop("destination", {"machine": "buildbox", "command": "sha256sum", "cwd": "/home/alice"}),
        caller="test",
        **kwargs,
    )


async def test_a_pipe_moves_the_source_stdout_into_the_destination_stdin(shims, owner):
    source, destination = await machines(shims, owner, lambda payload: chunks(20, 16 * 1024))
    destination.after_stdin = lambda data: f"{hashlib.sha256(data).hexdigest()} {len(data)}\n".encode()
    reports: list[tuple[int, Any]] = []
    request_id = str(uuid.uuid4())
    answer = await run_pipe(owner, request_id=request_id, on_progress=lambda done, total: reports.append((done, total)))

    expected = b"".join(bytes([index]) * 16 * 1024 for index in range(20))
    assert answer["request_id"] == request_id and answer["bytes"] == len(expected)
    # the commands' ids derive from the pipe's, so a reaper can cancel them from its row
    sent = (source.shim.ops("EXECUTE_COMMAND")[0]["id"], destination.shim.ops("EXECUTE_COMMAND")[0]["id"])
    assert sent == pipe_command_ids(request_id)
    assert answer["destination"]["stdout"] == f"{hashlib.sha256(expected).hexdigest()} {len(expected)}\n"
    assert answer["destination"]["ok"] is True and answer["destination"]["exit_code"] == 0
    assert answer["source"] == {
        "machine_id": "m1",
        "name": "laptop",
        "ok": True,
        "exit_code": 0,
        "timed_out": False,
        "cancelled": False,
        "duration_seconds": 0.01,
        "output_truncated": False,
        "stderr": "",
    }
    assert reports[-1] == (len(expected), None) and [done for done, _ in reports] == sorted(done for done, _ in reports)
    sent = source.shim.ops("EXECUTE_COMMAND")[0]["payload"]
    assert sent == {
        "argv": ["head", "-c", "1M", "/dev/urandom"],
        "timeout_seconds": 30.0,
        "binary": True,
        "pipe": True,
        "stream": True,
    }
    received = destination.shim.ops("EXECUTE_COMMAND")[0]["payload"]
    assert received == {
        "command": "sha256sum",
        "cwd": "/home/alice",
        "timeout_seconds": 30.0,
        "stdin": "stream",
        "pipe": True,
        "stream": True,
    }
    inputs = [f for f in destination.shim.frames if f["type"] == "COMMAND_INPUT"]
    assert inputs[-1]["payload"]["eof"] is True and inputs[-1]["payload"]["data"] == ""
    assert b"".join(base64.b64decode(f["payload"]["data"]) for f in inputs) == expected
    await settle()
    records = await database_sync_to_async(lambda: list(AuditRecord.objects.values_list("machine_id", "result")))()
    by_machine = {machine_id: result for machine_id, result in records}
    assert by_machine["m1"]["bytes"]["stdout"] == len(expected)
    assert by_machine["m2"]["bytes"]["stdin"] == len(expected)
    assert await database_sync_to_async(OperationInFlight.objects.count)() == 0


async def test_the_destination_ending_first_cancels_the_source(shims, owner):
    source, destination = await machines(shims, owner, lambda payload: endless(8 * 1024))
    destination.ignore_stdin = True
    answer = await asyncio.wait_for(run_pipe(owner), 5)
    assert answer["destination"]["ok"] is True and answer["destination"]["exit_code"] == 0
    assert answer["source"]["ok"] is True and answer["source"]["cancelled"] is True
    request_id = source.shim.ops("EXECUTE_COMMAND")[0]["id"]
    assert source.cancels(request_id)


@pytest.fixture
def small_window(monkeypatch: pytest.MonkeyPatch) -> int:
    window = 64 * 1024
    monkeypatch.setattr(connections, "DEFAULT_LIMITS", {**connections.DEFAULT_LIMITS, "stream_window_bytes": window})
    return window


async def test_a_destination_that_does_not_read_holds_the_source_to_its_window(shims, owner, small_window):
    source, destination = await machines(shims, owner, lambda payload: endless(16 * 1024))
    destination.stdin_paused = True
    request_id = str(uuid.uuid4())
    task = asyncio.ensure_future(run_pipe(owner, request_id=request_id))
    await until(lambda: source.sent, what="the source to run")
    source_id = next(iter(source.sent))
    await until(lambda: source.sent[source_id]["stdout"] >= small_window, what="a window")
    await asyncio.sleep(0.3)
    assert source.sent[source_id]["stdout"] == small_window  # the destination took nothing: no credit
    destination.stdin_paused = False
    await until(lambda: source.sent[source_id]["stdout"] >= 4 * small_window, what="credit relayed")
    taken = len(next(iter(destination.stdin.values())))
    assert source.sent[source_id]["stdout"] <= taken + small_window
    listed = await database_sync_to_async(live.operations_in_flight)(user=owner, session_id="s1")
    assert [(e["request_id"], e["kind"], e["machines"]) for e in listed] == [
        (request_id, "pipe", ["laptop", "buildbox"])
    ]
    assert listed[0]["summary"].startswith("laptop: head -c 1M /dev/urandom → buildbox: sha256sum")
    await live.cancel_operation(user=owner, session_id="s1", request_id=request_id)
    answer = await asyncio.wait_for(task, 5)
    assert answer["source"]["cancelled"] is True and answer["destination"]["cancelled"] is True


async def test_a_pipe_needs_two_2_1_shims_and_well_formed_ends(shims, owner):
    await shims.connect(owner, machine_id="m1", hostname="laptop")  # protocol 2.0
    sink = await shims.connect(owner, protocol_version="2.1", machine_id="m2", hostname="buildbox")
    with pytest.raises(MachineError) as refused:
        await run_pipe(owner)
    assert refused.value.code == "UNSUPPORTED_OPERATION"
    assert "machine 'laptop' runs shim 0.1.0 (protocol 2.0); a pipe needs protocol 2.1" == refused.value.message
    assert sink.ops("EXECUTE_COMMAND") == []
    from core.errors import InvalidRequest

    for source, message in (
        ({"machine": "laptop"}, "exactly one of argv"),
        ({"machine": "laptop", "argv": []}, "non-empty list"),
        ({"machine": "laptop", "argv": ["x"], "stdin": "stream"}, "unknown field 'stdin'"),
    ):
        with pytest.raises(InvalidRequest, match=message):
            await run_pipe(owner, source=source)
    with pytest.raises(InvalidRequest, match="timeout_seconds"):
        await run_pipe(owner, timeout_seconds=0)
