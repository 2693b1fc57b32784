"""An outage of Redis or the database is logged once per process, not once per request, and
the answers during it are 503 with ``Retry-After`` naming the dependency
(docs/operating.md#health)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from django.db import OperationalError
from django.test import AsyncClient
from redis.exceptions import ConnectionError as RedisConnectionError

from core import health
from core.channel_layer import LayerDeadlineExceeded, RedisChannelLayer
from core.errors import unavailable_error
from core.outage import OutageTracker, tracker


@pytest.fixture(autouse=True)
def fresh_tracker() -> Any:
    tracker._down.clear()
    yield
    tracker._down.clear()


def test_an_outage_is_one_warning_when_it_starts_and_one_info_when_it_ends(caplog: pytest.LogCaptureFixture) -> None:
    clock = iter([100.0, 107.5])
    outage = OutageTracker(log=logging.getLogger("test.outage"), clock=lambda: next(clock))
    with caplog.at_level(logging.DEBUG, logger="test.outage"):
        for _ in range(50):
            outage.failed("channel_layer", RedisConnectionError("Connection refused"))
        assert outage.down("channel_layer") and not outage.down("database")
        for _ in range(3):
            outage.ok("channel_layer")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "WARNING",
            "the channel layer (Redis) is unavailable (ConnectionError: Connection refused); requests that need "
            "it answer 503 until it is back, logged once when it is",
        ),
        ("INFO", "the channel layer (Redis) is back, 7.5s after its first failed call (50 failed calls)"),
    ]
    assert not outage.down("channel_layer")


def test_the_error_of_a_frozen_layer_names_it_and_its_deadline() -> None:
    mapped = unavailable_error(LayerDeadlineExceeded(2.0))
    assert mapped is not None
    assert (mapped.code, mapped.http_status) == ("TEMPORARILY_UNAVAILABLE", 503)
    assert mapped.message == "the channel layer (Redis) did not answer within 2s; retry in a moment"
    assert mapped.details == {"service": "channel_layer"}
    assert tracker.down("channel_layer")


async def test_a_layer_call_to_a_redis_that_never_answers_fails_at_its_deadline() -> None:
    frozen = asyncio.Event()

    class Frozen(RedisChannelLayer):
        async def _never(self, *args: Any) -> None:
            await frozen.wait()

    layer = Frozen(hosts=[{"address": "redis://127.0.0.1:1"}], deadline=0.2)
    for call in (
        layer._within_deadline(layer._never()),
        layer._within_deadline(layer._never()),
    ):
        with pytest.raises(LayerDeadlineExceeded) as raised:
            await call
        assert str(raised.value) == "the channel layer (Redis) did not answer within 0.2s; retry in a moment"
    assert tracker.down("channel_layer")


@pytest.mark.django_db(transaction=True)
async def test_an_api_answer_during_an_outage_is_503_with_retry_after_and_no_error_line(
    owner_token: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from agents import api as agents_api

    def frozen(*args: Any, **kwargs: Any) -> Any:
        raise LayerDeadlineExceeded(2.0)

    monkeypatch.setattr(agents_api.AgentListView, "get", frozen)
    client = AsyncClient()
    with caplog.at_level(logging.INFO):
        answers = [
            await client.get("/api/v1/agents", headers={"authorization": f"Bearer {owner_token}"}) for _ in range(3)
        ]
    for response in answers:
        assert response.status_code == 503
        assert response["Retry-After"] == "5"
        assert response.json()["error"]["message"] == (
            "the channel layer (Redis) did not answer within 2s; retry in a moment"
        )
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.name for r in warnings] == ["core.outage"], [r.getMessage() for r in warnings]


@pytest.mark.django_db(transaction=True)
async def test_healthz_says_the_database_is_not_writable_when_a_write_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from django.db.models import QuerySet

    def disk_full(self: Any, **kwargs: Any) -> int:
        raise OperationalError("database or disk is full")

    monkeypatch.setattr(QuerySet, "update", disk_full)
    response = await AsyncClient().get("/healthz")
    assert response.status_code == 503
    assert response["Retry-After"] == "5"
    body = response.json()
    assert body["status"] == "degraded"
    assert (body["database"], body["database_writable"], body["channel_layer"]) == ("error", False, "ok")
    assert body["failing"] == ["database"]
    assert body["errors"]["database"] == "not writable: OperationalError: database or disk is full"


@pytest.mark.django_db(transaction=True)
async def test_healthz_answers_within_its_deadline_when_the_layer_never_answers(
    monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    settings.DEPENDENCY_TIMEOUT = 0.3

    async def never(*, timeout: float) -> bool:
        await asyncio.Event().wait()
        return True

    monkeypatch.setattr(health.realtime, "layer_round_trip", never)
    response = await AsyncClient().get("/healthz")
    assert response.status_code == 503
    body = response.json()
    assert (body["database"], body["database_writable"], body["channel_layer"]) == ("ok", True, "error")
    assert body["errors"] == {"channel_layer": "did not answer within 0.3s"}


def test_page_requests_and_rings_during_an_outage_add_no_warning_of_their_own(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The tracker's one WARNING is the outage's line; OutageMiddleware (a page view that
    # raised) and a dropped after-commit ring used to add one WARNING each, every time.
    from django.test import RequestFactory

    from core.http import OutageMiddleware
    from core.protocol import HealthProbeMessage
    from core.realtime.rings import _ring_failed

    middleware = OutageMiddleware(lambda request: None)
    with caplog.at_level(logging.DEBUG):
        for number in range(5):
            answer = middleware.process_exception(
                RequestFactory().get(f"/agents/{number}"), RedisConnectionError("Connection refused")
            )
            assert answer is not None and answer.status_code == 503
            _ring_failed("group", HealthProbeMessage(probe="p"), RedisConnectionError("refused"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "channel layer (Redis) is unavailable" in warnings[0], warnings
