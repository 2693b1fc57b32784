"""A shim answering with a value the channel layer cannot carry (docs/shim-protocol.md#errors,
``INVALID_RESPONSE``): its
operation fails at once with INVALID_RESPONSE naming why; the shim is not disconnected."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from machines.services.errors import MachineError
from machines.services.operations import machine_op

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]


async def hold(request: dict[str, Any]) -> None:
    return None


@pytest.mark.parametrize("value", ["18446744073709551616", "-9223372036854775809", "NaN", '"\\ud800"'])
async def test_an_answer_dispatch_cannot_carry_fails_the_operation_and_keeps_the_shim(shims, owner, value):
    shim = await shims.connect(owner, machine_id="m1")
    shim.handler = hold
    task = asyncio.ensure_future(
        machine_op(user=owner, session_id="s1", op="FILE_STAT", payload={"path": "/home/alice/a.txt"}, caller="t")
    )
    request = await shim.next_request("FILE_STAT")
    await shim.send(f'{{"type": "FILE_STAT_RESULT", "id": "{request["id"]}", "payload": {{"size_bytes": {value}}}}}')
    with pytest.raises(MachineError) as failure:
        await asyncio.wait_for(task, 3)
    assert failure.value.code == "INVALID_RESPONSE"
    assert "the machine answered with a value Dispatch cannot carry" in failure.value.message
    await asyncio.sleep(0.1)
    assert not shim.closed and shim.consumer_alive()
