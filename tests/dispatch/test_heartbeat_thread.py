"""The presence heartbeat has its own thread and database connection.

Every ``database_sync_to_async`` call of a process runs on one thread. Under load that
thread has a queue of queries; a heartbeat waiting behind it for ``DISPATCH_PROCESS_TTL``
could get a busy, live process reaped with all its connections.
``dispatch.background.heartbeat_stamp`` runs the stamp elsewhere, so a busy database
thread no longer silences it. Runs on the tests' SQLite file (pass 1) and on PostgreSQL
(pass 2).
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta

import pytest
from asgiref.sync import sync_to_async
from django.db import connection
from django.utils import timezone

from core.models import ServerProcess
from core.services import server_process_ensure
from dispatch import background
from dispatch.background import heartbeat_loop

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _heartbeat_of(process_id: str) -> datetime:
    try:
        return ServerProcess.objects.values_list("heartbeat_at", flat=True).get(pk=process_id)
    finally:
        connection.close()  # this short-lived thread's connection


async def test_the_heartbeat_goes_on_while_the_process_s_database_thread_is_busy(settings: object) -> None:
    settings.PROCESS_HEARTBEAT_INTERVAL = 0.1  # type: ignore[attr-defined]
    process_id = await sync_to_async(server_process_ensure)()
    stale = timezone.now() - timedelta(hours=1)
    await sync_to_async(ServerProcess.objects.filter(pk=process_id).update)(heartbeat_at=stale)
    beating = asyncio.ensure_future(heartbeat_loop(kind="serve"))
    # The process's one database thread is busy for 3 s (a long queue of queries).
    busy = asyncio.ensure_future(sync_to_async(time.sleep, thread_sensitive=True)(3.0))
    try:
        await asyncio.sleep(1.0)
        assert not busy.done()
        first = await sync_to_async(_heartbeat_of, thread_sensitive=False)(process_id)
        assert first > timezone.now() - timedelta(seconds=1)
        await asyncio.sleep(0.5)
        assert await sync_to_async(_heartbeat_of, thread_sensitive=False)(process_id) > first  # it goes on
    finally:
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)
        await busy
        await asyncio.wrap_future(background._HEARTBEAT_THREAD.submit(lambda: connection.close()))  # stamp over
