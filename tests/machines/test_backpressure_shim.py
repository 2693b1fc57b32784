"""Back-pressure on /ws/shim/ (docs/shim-protocol.md#back-pressure,
docs/operating.md#bounds): a shim that has not read what it was sent gets no new operation
(MACHINE_BUSY at once, nothing queued), a pipe into it waits at its source whatever stdin
credit it claims, a copy into it pauses; operations in flight are capped per session and
per user.

Under Channels' test communicator a socket's unsent backlog is unknown (0), so each test
sets it per machine through ``backlog`` (the consumer's ``unsent_bytes``); the same code
reads daphne's transport buffer under ``serve`` (tests/integration/test_memory_shim.py).
"""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from machines.consumers import ShimConsumer
from machines.services import live
from machines.services.admission import OPERATIONS_IN_FLIGHT, OperationRefused
from machines.services.copy import CHUNK_BYTES, copy_between_machines
from machines.services.errors import MachineError
from machines.services.inflight import pipe_command_ids
from machines.services.operations import machine_op
from tests.machines.conftest import until
from tests.machines.live_shim import LiveMachine

pytestmark = [pytest.mark.django_db(transaction=True)]

OVER = 1 << 40  # an unsent backlog far over any high-water mark


@pytest.fixture
def backlog(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """``backlog[machine_id] = bytes``: what the machine's socket has not read (default 0)."""
    unread: dict[str, int] = {}

    def unsent_bytes(consumer: ShimConsumer) -> int:
        return unread.get(consumer.machine_id or "", 0)

    monkeypatch.setattr(ShimConsumer, "unsent_bytes", unsent_bytes)
    yield unread


def write(owner: Any, content: str, **kwargs: Any) -> Any:
    return machine_op(
        user=owner,
        session_id=kwargs.pop("session_id", "s1"),
        op="FILE_WRITE",
        payload={"path": "/home/alice/f.txt", "content": content},
        caller="test",
        **kwargs,
    )


async def test_an_operation_for_a_shim_over_the_high_water_mark_fails_busy_at_once_and_is_never_sent(
    shims, owner, backlog
):
    shim = await shims.connect(owner, machine_id="m1", hostname="laptop")
    backlog["m1"] = OVER
    with pytest.raises(MachineError) as refused:
        await asyncio.wait_for(write(owner, "x" * 1000), 5)  # at once: no timeout
    assert refused.value.code == "MACHINE_BUSY"
    assert "laptop" in refused.value.message and "busy" in refused.value.message
    assert refused.value.details == {"unsent_bytes": OVER, "high_water_bytes": 4 * 1024 * 1024}
    assert shim.ops("FILE_WRITE") == []
    assert OPERATIONS_IN_FLIGHT.counts(user_id=owner.pk) == (0, 0)

    backlog["m1"] = 0  # it read everything: the next one goes
    answer = await write(owner, "hello")
    assert answer["type"] == "FILE_WRITTEN" or answer["payload"]
    assert shim.files["/home/alice/f.txt"] == b"hello"


async def test_a_frame_that_would_take_the_backlog_past_the_mark_is_refused_a_small_one_is_not(
    shims, owner, backlog, settings
):
    settings.WS_HIGH_WATER = 256 * 1024
    shim = await shims.connect(owner, machine_id="m1", hostname="laptop")
    backlog["m1"] = 200 * 1024
    with pytest.raises(MachineError) as refused:
        await write(owner, "x" * 100 * 1024)
    assert refused.value.code == "MACHINE_BUSY"
    await write(owner, "small")
    assert shim.files["/home/alice/f.txt"] == b"small"


async def test_the_rest_api_answers_a_busy_machine_503_with_retry_after(shims, owner, owner_token, backlog):
    from django.test import AsyncClient

    await shims.connect(owner, machine_id="m1", hostname="laptop")
    backlog["m1"] = OVER
    body = {"op": "FILE_WRITE", "payload": {"path": "/home/alice/f.txt", "content": "x"}}
    response = await AsyncClient().post(
        "/api/v1/sessions/s1/ops",
        json.dumps(body),
        content_type="application/json",
        headers={"authorization": f"Bearer {owner_token}"},
    )
    assert response.status_code == 503
    assert response["Retry-After"] == "1"
    assert response.json()["error"]["code"] == "MACHINE_BUSY"


async def test_operations_in_flight_over_the_session_cap_are_refused_at_once_and_nothing_is_sent(
    shims, owner, settings
):
    settings.MACHINE_OPS_PER_SESSION = 2
    shim = await shims.connect(owner, machine_id="m1", hostname="laptop")
    shim.handler = _never_answer
    hanging = [asyncio.ensure_future(write(owner, f"{n}")) for n in range(2)]
    await shim.next_request("FILE_WRITE", count=2)
    with pytest.raises(OperationRefused) as refused:
        await write(owner, "third")
    assert refused.value.code == "RATE_LIMITED"
    assert "DISPATCH_MACHINE_OPS_PER_SESSION" in refused.value.message
    assert len(shim.ops("FILE_WRITE")) == 2
    # another session of the same user is counted apart (its own cap)
    other = asyncio.ensure_future(write(owner, "elsewhere", session_id="s2"))
    await until(lambda: len(shim.ops("FILE_WRITE")) == 3, what="the other session's write sent")
    for task in [*hanging, other]:
        task.cancel()
    await asyncio.gather(*hanging, other, return_exceptions=True)
    assert OPERATIONS_IN_FLIGHT.counts(user_id=owner.pk) == (0, 0)
    assert OPERATIONS_IN_FLIGHT.counts() == (0, 0)


async def test_payload_bytes_in_flight_over_the_user_cap_are_refused_naming_the_setting(shims, owner, settings):
    settings.MACHINE_OP_BYTES_PER_USER = 64 * 1024
    shim = await shims.connect(owner, machine_id="m1", hostname="laptop")
    shim.handler = _never_answer
    first = asyncio.ensure_future(write(owner, "x" * 40 * 1024))
    await shim.next_request("FILE_WRITE")
    with pytest.raises(OperationRefused) as refused:
        await write(owner, "y" * 40 * 1024, session_id="s2")
    assert "DISPATCH_MACHINE_OP_BYTES_PER_USER" in refused.value.message
    assert refused.value.details["setting"] == "DISPATCH_MACHINE_OP_BYTES_PER_USER"
    assert len(shim.ops("FILE_WRITE")) == 1
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    assert OPERATIONS_IN_FLIGHT.counts(user_id=owner.pk) == (0, 0)


async def test_a_pipe_into_a_shim_that_claims_huge_stdin_credit_and_reads_nothing_waits_at_its_source(
    shims, owner, backlog
):
    source = LiveMachine(await shims.connect(owner, protocol_version="2.1", machine_id="m1", hostname="laptop"))
    sink = await shims.connect(owner, protocol_version="2.1", machine_id="m2", hostname="buildbox")
    destination = LiveMachine(sink, lambda payload: _nothing())
    window = source.window
    frames = 3 * window // (64 * 1024)
    source.script = lambda payload: _frames(frames, 64 * 1024)
    destination.stdin_paused = True  # it takes nothing …
    request_id = str(uuid.uuid4())
    source_id, destination_id = pipe_command_ids(request_id)
    pipe = asyncio.ensure_future(
        live.pipe(
            user=owner,
            session_id="s1",
            source={"machine": "laptop", "argv": ["cat", "big"]},
            destination={"machine": "buildbox", "command": "sha256sum"},
            caller="test",
            request_id=request_id,
        )
    )
    await sink.next_request("EXECUTE_COMMAND")
    backlog["m2"] = OVER  # … its socket is full …
    flow = {"request_id": destination_id, "stream": "stdin", "credit_total": 2**50}
    await sink.send({"type": "FLOW", "id": str(uuid.uuid4()), "payload": flow})  # … and it claims 2^50

    def source_waits_or_all_moved() -> bool:
        sent = source.sent.get(source_id, {}).get("stdout", 0)
        return sent >= frames * 64 * 1024 or (sent > 0 and sent >= source.credit(source_id, "stdout"))

    await until(source_waits_or_all_moved, timeout=10, what="the source to block or finish")
    await asyncio.sleep(0.3)  # what the platform would still forward arrives
    forwarded = sum(len(base64.b64decode(f["payload"]["data"])) for f in sink.frames if f["type"] == "COMMAND_INPUT")
    assert forwarded <= window, f"{forwarded} bytes handed to a socket that reads nothing (window {window})"
    assert source.credit(source_id, "stdout") <= window, "the source was granted credit the destination never read"
    assert not pipe.done()

    backlog["m2"] = 0  # it drains: the pipe goes on to the end
    destination.stdin_paused = False
    answer = await asyncio.wait_for(pipe, 20)
    assert answer["bytes"] == frames * 64 * 1024
    assert len(destination.stdin[destination_id]) == frames * 64 * 1024


async def test_a_copy_into_a_busy_machine_pauses_and_goes_on_once_it_drains(shims, owner, backlog):
    source = await shims.connect(owner, machine_id="m1", hostname="laptop")
    destination = await shims.connect(owner, machine_id="m2", hostname="buildbox")
    source.files["/home/alice/big.bin"] = bytes(range(256)) * (2 * CHUNK_BYTES // 256)
    backlog["m2"] = OVER
    copy = asyncio.ensure_future(
        copy_between_machines(
            user=owner,
            session_id="s1",
            source_machine="laptop",
            source_path="/home/alice/big.bin",
            destination_machine="buildbox",
            destination_path="/home/alice/copy.bin",
            caller="test",
        )
    )
    await source.next_request("FILE_STAT")
    await asyncio.sleep(0.6)  # a few tries refused busy
    assert not copy.done(), copy.exception() if copy.done() else None
    assert destination.ops("FILE_WRITE") == [] and destination.ops("FILE_STAT") == []
    backlog["m2"] = 0
    answer = await asyncio.wait_for(copy, 10)
    assert answer["size_bytes"] == 2 * CHUNK_BYTES
    assert destination.files["/home/alice/copy.bin"] == source.files["/home/alice/big.bin"]


async def _never_answer(request: dict[str, Any]) -> dict[str, Any] | None:
    return None


async def _nothing() -> Any:
    return
    yield


async def _frames(count: int, size: int) -> Any:
    for index in range(count):
        yield "stdout", bytes([index % 256]) * size
