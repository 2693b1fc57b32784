"""Machine operations and shim connections in ``/metrics`` (docs/metrics.md): operations
counted by type and result and timed, shim connections counted from this process's rows."""

from __future__ import annotations

from typing import Any

import pytest

from machines.services.errors import MachineError
from machines.services.operations import machine_op
from tests.machines.conftest import ShimFailure
from tests.scrape import scrape, value

pytestmark = pytest.mark.django_db(transaction=True)


async def test_the_shim_gauge_counts_this_processs_shim_connections(shims: Any, owner: Any) -> None:
    assert value(await scrape(), "dispatch_shims_connected") == 0
    shim = await shims.connect(owner, machine_id="m1")
    await shims.connect(owner, machine_id="m2")
    assert value(await scrape(), "dispatch_shims_connected") == 2
    await shim.disconnect()
    assert value(await scrape(), "dispatch_shims_connected") == 1


# --- machine operations ---------------------------------------------------------------------


async def test_machine_operations_are_counted_by_type_and_result_and_timed(shims: Any, owner: Any) -> None:
    shim = await shims.connect(owner, machine_id="m1")
    shim.files["/home/alice/a.txt"] = b"hello"
    before = await scrape()
    read = {"path": "/home/alice/a.txt", "encoding": "utf-8"}
    await machine_op(user=owner, session_id="s1", op="FILE_READ", payload=read, caller="test")
    await machine_op(user=owner, session_id="s1", op="FILE_STAT", payload={"path": "/home/alice/a.txt"}, caller="test")
    with pytest.raises(MachineError):
        missing = {"path": "/home/alice/missing.txt", "encoding": "utf-8"}
        await machine_op(user=owner, session_id="s1", op="FILE_READ", payload=missing, caller="test")

    async def refuse(request: dict[str, Any]) -> dict[str, Any]:
        raise ShimFailure("NOT_A_DISPATCH_CODE", "a code the shim made up")

    shim.handler = refuse
    with pytest.raises(MachineError):
        await machine_op(user=owner, session_id="s1", op="FILE_STAT", payload={"path": "/x"}, caller="test")
    with pytest.raises(MachineError):  # routed nowhere: no machine serves this user's session
        await machine_op(
            user=owner, session_id="s1", op="FILE_STAT", payload={"path": "/x"}, target_machine="nope", caller="test"
        )
    after = await scrape()

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    operations = "dispatch_machine_operations_total"
    assert delta(operations, operation="FILE_READ", result="ok") == 1
    assert delta(operations, operation="FILE_STAT", result="ok") == 1
    assert delta(operations, operation="FILE_READ", result="PATH_NOT_FOUND") == 1
    assert delta(operations, operation="FILE_STAT", result="OTHER") == 1  # an unknown code is not a new series
    assert value(after, operations, operation="FILE_STAT", result="NOT_A_DISPATCH_CODE") == 0
    assert delta(operations, operation="FILE_STAT", result="MACHINE_NOT_ATTACHED") == 1
    seconds = "dispatch_machine_operation_duration_seconds_count"
    assert delta(seconds, operation="FILE_READ", outcome="ok") == 1
    assert delta(seconds, operation="FILE_READ", outcome="error") == 1
    assert delta(seconds, operation="FILE_STAT", outcome="error") == 2
