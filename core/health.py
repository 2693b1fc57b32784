"""What ``/healthz`` checks, each within a deadline (docs/operating.md#health).

``/healthz`` is what load balancers poll, so it must answer in time whatever is frozen:
the database check and the channel-layer round trip run at once, each given
``check_seconds()`` (``DISPATCH_DEPENDENCY_TIMEOUT``, at most ``CHECK_SECONDS_MAX``), and
a check that has not answered by then counts as failed — the answer comes within 3 s.

The database check proves the database *writable*, not just reachable: after ``SELECT 1``
it stamps this process's heartbeat row (the write the heartbeat loop makes every couple of
seconds anyway) and commits, so a full disk or a read-only database shows as
``database_writable: false``.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from core import realtime
from core.models import ServerProcess
from core.outage import tracker
from core.presence import current_process_id

CHECK_SECONDS_MAX = 2.5
"""Longest a check may take: both run at once, so ``/healthz`` answers within 3 s."""
_DATABASE_CHECKS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="healthz")
"""Threads of the database check: one stuck on a frozen database (a query has no client-side
deadline) keeps its thread until the server answers, so they are kept apart from the loop's
default executor, which other work needs meanwhile."""


def check_seconds() -> float:
    """Seconds each ``/healthz`` check gets: ``DISPATCH_DEPENDENCY_TIMEOUT``, at most ``CHECK_SECONDS_MAX``."""
    return float(min(settings.DEPENDENCY_TIMEOUT, CHECK_SECONDS_MAX))


@dataclass
class Health:
    """One ``/healthz`` answer: ``database`` reachable, ``database_writable`` (a committed
    write worked), ``channel_layer`` (a probe came back); ``errors`` says why, per failing
    part (``"database"``, ``"channel_layer"``)."""

    database: bool = False
    database_writable: bool = False
    channel_layer: bool = False
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        """Every part works (a check that answered late counts as failed)."""
        return not self.errors and self.database and self.database_writable and self.channel_layer

    def as_dict(self) -> dict[str, Any]:
        """The JSON body: ``{"status": "ok" | "degraded", "process_id", "database": "ok" |
        "error", "database_writable": bool, "channel_layer": "ok" | "error", "failing":
        [part, …], "errors": {part: reason}}``."""
        return {
            "status": "ok" if self.healthy else "degraded",
            "process_id": current_process_id(),
            "database": "error" if "database" in self.errors else "ok",
            "database_writable": self.database_writable and "database" not in self.errors,
            "channel_layer": "error" if "channel_layer" in self.errors else "ok",
            "failing": [part for part in ("database", "channel_layer") if part in self.errors],
            "errors": self.errors,
        }


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip()[:300]}"


def _database_check() -> tuple[bool, bool, str]:
    """``(reachable, writable, why not)``: ``SELECT 1``, then a committed stamp of this
    process's heartbeat row. Sync; runs on a thread of its own."""
    try:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
        except Exception as exc:
            return False, False, f"not reachable: {_reason(exc)}"
        try:
            with transaction.atomic():
                ServerProcess.objects.filter(pk=current_process_id(), stopped_at__isnull=True).update(
                    heartbeat_at=timezone.now()
                )
        except Exception as exc:
            return True, False, f"not writable: {_reason(exc)}"
        return True, True, ""
    finally:
        connection.close()


_database_checking: tuple[asyncio.AbstractEventLoop, asyncio.Future[tuple[bool, bool, str]]] | None = None


def _database_check_shared() -> asyncio.Future[tuple[bool, bool, str]]:
    """The database check in flight on this loop, or a new one: concurrent ``/healthz``
    requests (a load balancer's burst, a client retrying) share one check instead of
    queueing one each behind the others, each still waiting only its own deadline."""
    global _database_checking
    loop = asyncio.get_running_loop()
    if _database_checking is not None:
        checking_loop, running = _database_checking
        if checking_loop is loop and not running.done():
            return running
    check = sync_to_async(_database_check, thread_sensitive=False, executor=_DATABASE_CHECKS)
    running = asyncio.ensure_future(check())
    _database_checking = (loop, running)
    return running


async def _bounded(part: str, check: Any, seconds: float, health: Health) -> None:
    try:
        async with asyncio.timeout(seconds):
            await check
    except TimeoutError:
        health.errors.setdefault(part, f"did not answer within {seconds:g}s")


async def health_check() -> Health:
    """Check the database (reachable and writable) and the channel layer (a probe to this
    process comes back) at once, each within ``check_seconds()``; report each outcome to
    ``core.outage.tracker``. Never raises."""
    seconds = check_seconds()
    health = Health()

    async def database() -> None:
        reachable, writable, why = await asyncio.shield(_database_check_shared())
        health.database, health.database_writable = reachable, writable
        if why:
            health.errors["database"] = why

    async def layer() -> None:
        if await realtime.layer_round_trip(timeout=seconds):
            health.channel_layer = True
        else:
            health.errors["channel_layer"] = f"no probe came back within {seconds:g}s"

    await asyncio.gather(
        _bounded("database", database(), seconds, health),
        _bounded("channel_layer", layer(), seconds, health),
    )
    if health.database and health.database_writable:
        tracker.ok("database")
    elif "database" in health.errors:
        tracker.failed("database", health.errors["database"])
    if health.channel_layer:
        tracker.ok("channel_layer")
    else:
        tracker.failed("channel_layer", health.errors.get("channel_layer", "no answer"))
    return health
