"""Background loops back off after an error and log once per change of state
(docs/operating.md#health; without it the peer-mirror loop made 200–700 passes a second, two
tracebacks each, while Redis was down).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from channels.layers import get_channel_layer
from django.db import OperationalError

from core.realtime import LoopHealth
from dispatch import background
from tests.outage import LayerOutage


def _warnings(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno >= logging.WARNING]


async def _run_for(seconds: float, coroutine: Any) -> None:
    task = asyncio.ensure_future(coroutine)
    await asyncio.sleep(seconds)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _run_until(done: Any, coroutine: Any, timeout: float = 15.0) -> None:
    """Run ``coroutine`` until ``done()`` holds (polled every 10 ms) or ``timeout`` seconds
    pass, then cancel it: a loaded machine only makes it take longer."""
    task = asyncio.ensure_future(coroutine)
    try:
        async with asyncio.timeout(timeout):
            while not done():
                await asyncio.sleep(0.01)
    except TimeoutError:
        pass
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_the_delay_doubles_from_base_up_to_the_cap_with_jitter_within_20_percent() -> None:
    low = LoopHealth("x", base=0.5, cap=4.0, rand=lambda: 0.0)
    high = LoopHealth("x", base=0.5, cap=4.0, rand=lambda: 0.999999)
    error = RuntimeError("down")
    assert [round(low.failed(error), 3) for _ in range(6)] == [0.4, 0.8, 1.6, 3.2, 3.2, 3.2]
    assert [round(high.failed(error), 2) for _ in range(6)] == [0.6, 1.2, 2.4, 4.8, 4.8, 4.8]
    low.ok()
    assert round(low.failed(error), 3) == 0.4  # a success starts over


def test_it_logs_the_first_failure_and_the_recovery_and_nothing_in_between(caplog: pytest.LogCaptureFixture) -> None:
    health = LoopHealth("the loop", log=logging.getLogger("tests.loop"))
    with caplog.at_level(logging.DEBUG, logger="tests.loop"):
        for _ in range(50):
            health.failed(OperationalError("connection refused"))
        health.ok()
        health.ok()
    assert _warnings(caplog, "tests.loop") == [
        "the loop failing: OperationalError: connection refused; retrying with backoff (up to 30s), "
        "logged again when it recovers",
        "the loop recovered after 50 failed passes",
    ]


@pytest.mark.django_db(transaction=True)
async def test_the_peer_mirror_loop_backs_off_while_the_channel_layer_is_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from peers import mirror

    outage = LayerOutage(get_channel_layer())
    outage.start()
    with caplog.at_level(logging.INFO):
        await _run_for(1.5, mirror.mirror_loop())
    # Old code: hundreds of passes, two tracebacks each. Now: a pass, ~1 s, another.
    assert 1 <= outage.failures <= 4, outage.failures
    assert len(_warnings(caplog, "peers.mirror")) == 1, _warnings(caplog, "peers.mirror")


@pytest.mark.django_db(transaction=True)
async def test_the_outbox_drain_loop_logs_a_failing_doorbell_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from peers import outbox_drain as outbox

    monkeypatch.setattr(outbox, "DRAIN_INTERVAL", 0.05)
    outage = LayerOutage(get_channel_layer())
    outage.start()
    with caplog.at_level(logging.INFO):
        await _run_until(lambda: outage.failures >= 5, outbox.outbox_drain_loop())
    assert outage.failures >= 5  # it still polls the database at its own pace
    assert len(_warnings(caplog, "peers.outbox")) == 1, _warnings(caplog, "peers.outbox")


async def test_the_heartbeat_logs_a_database_outage_once_and_its_recovery_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    settings.PROCESS_HEARTBEAT_INTERVAL = 0.01
    calls = {"count": 0}

    def heartbeat(**kwargs: Any) -> bool:
        calls["count"] += 1
        if calls["count"] <= 20:
            raise OperationalError("connection refused")
        return True

    monkeypatch.setattr(background.services, "server_process_heartbeat", heartbeat)
    with caplog.at_level(logging.INFO):
        await _run_until(lambda: calls["count"] > 21, background.heartbeat_loop(kind="serve"))
    assert calls["count"] > 21
    assert [m.split(":")[0] for m in _warnings(caplog, "dispatch.background")] == [
        "presence heartbeat failing",
        "presence heartbeat recovered after 20 failed passes",
    ]
