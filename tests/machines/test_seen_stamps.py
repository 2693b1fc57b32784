"""PONGs stamp ``last_seen_at`` in batches (machines/services/connections.py
``shim_seen_soon``): one UPDATE a second for every connection of the process that
answered meanwhile, instead of one write per PONG on the process's one sync thread
(docs/shim-protocol.md#machine-status; bench B6: 250 writes a second at 5,000 shims)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from channels.db import database_sync_to_async
from django.utils import timezone

from machines.models import MachineConnection
from machines.services import connections
from tests.machines.conftest import eventually

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def fresh_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test its own buffer: a stamp left by another test's event loop stays out."""
    monkeypatch.setattr(connections, "_seen_stamps", connections._SeenStamps())


def _stamps(connection_ids: list[str]) -> dict[str, Any]:
    rows = MachineConnection.objects.filter(connection_id__in=connection_ids)
    return dict(rows.values_list("connection_id", "last_seen_at"))


async def _connection_ids(machine_ids: list[str]) -> list[str]:
    rows = await database_sync_to_async(
        lambda: dict(
            MachineConnection.objects.filter(machine__machine_id__in=machine_ids).values_list(
                "machine__machine_id", "connection_id"
            )
        )
    )()
    return [rows[machine_id] for machine_id in machine_ids]


async def _age_all(connection_ids: list[str], by: timedelta) -> Any:
    old = timezone.now() - by
    await database_sync_to_async(
        lambda: MachineConnection.objects.filter(connection_id__in=connection_ids).update(last_seen_at=old)
    )()
    return old


async def test_the_pongs_of_many_shims_are_one_write(
    shims: Any, owner: Any, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.SHIM_PING_INTERVAL = 0.2
    settings.SHIM_PONG_TIMEOUT = 0.2
    names = [f"m{n}" for n in range(12)]
    for name in names:
        await shims.connect(owner, machine_id=name)
    ids = await _connection_ids(names)
    writes: list[int] = []
    original = connections.shim_seen

    def counting(*, connection_ids: list[str], seen_at: Any) -> int:
        writes.append(len(connection_ids))
        return original(connection_ids=connection_ids, seen_at=seen_at)

    monkeypatch.setattr(connections, "shim_seen", counting)
    monkeypatch.setattr(connections, "SEEN_FLUSH_INTERVAL", 0.6)
    old = await _age_all(ids, timedelta(hours=1))
    stamps = await eventually(
        lambda: database_sync_to_async(_stamps)(ids), lambda got: all(at > old for at in got.values()), timeout=5
    )
    assert all(at > old for at in stamps.values()), stamps
    # 12 shims PINGed every 0.2 s for at least 0.6 s: 36+ PONGs, stamped a batch at a time.
    assert writes and max(writes) > 1, writes
    assert len(writes) < sum(writes), writes


async def test_a_shim_that_stops_answering_keeps_its_old_stamp(shims: Any, owner: Any, settings: Any) -> None:
    settings.SHIM_PING_INTERVAL = 0.2
    settings.SHIM_PONG_TIMEOUT = 5
    await shims.connect(owner, machine_id="live")
    mute = await shims.connect(owner, machine_id="mute")
    mute.answer_pings = False
    ids = await _connection_ids(["live", "mute"])
    old = await _age_all(ids, timedelta(hours=1))
    stamps = await eventually(lambda: database_sync_to_async(_stamps)(ids), lambda got: got[ids[0]] > old, timeout=5)
    assert stamps[ids[0]] > old
    assert stamps[ids[1]] == old


def test_shim_seen_writes_in_chunks_and_only_the_given_rows(monkeypatch: pytest.MonkeyPatch, owner: Any) -> None:
    from core.services import server_process_ensure
    from machines.models import Machine

    process_id = server_process_ensure()
    rows = []
    for n in range(5):
        machine = Machine.objects.create(user=owner, machine_id=f"c{n}", hostname=f"h{n}")
        rows.append(
            MachineConnection.objects.create(
                machine=machine,
                user=owner,
                connection_id=f"conn_{n:016x}",
                channel_name=f"x.{n}",
                server_process_id=process_id,
                protocol_version="2.1",
            )
        )
    old = timezone.now() - timedelta(hours=1)
    MachineConnection.objects.update(last_seen_at=old)
    monkeypatch.setattr(connections, "SEEN_BATCH", 2)
    seen_at = timezone.now()
    chosen = [row.connection_id for row in rows[:4]] + ["conn_gone"]
    assert connections.shim_seen(connection_ids=chosen, seen_at=seen_at) == 4
    stamps = _stamps([row.connection_id for row in rows])
    assert [stamps[row.connection_id] for row in rows] == [seen_at] * 4 + [old]


async def test_a_failed_write_is_logged_and_the_next_pong_stamps_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[list[str]] = []

    def failing_once(*, connection_ids: list[str], seen_at: Any) -> int:
        calls.append(connection_ids)
        if len(calls) == 1:
            raise RuntimeError("database is locked")
        return len(connection_ids)

    monkeypatch.setattr(connections, "shim_seen", failing_once)
    monkeypatch.setattr(connections, "SEEN_FLUSH_INTERVAL", 0.05)
    connections.shim_seen_soon("conn_a")
    await asyncio.sleep(0.2)
    assert "could not stamp 1 shim connections as seen: database is locked" in caplog.text
    connections.shim_seen_soon("conn_a")
    await asyncio.sleep(0.2)
    assert calls == [["conn_a"], ["conn_a"]]
