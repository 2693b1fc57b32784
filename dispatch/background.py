"""Background services of a process, run as asyncio tasks (spec/overview.md "How it runs").

``serve`` runs them in its own event loop unless ``--no-background``; ``dispatch_worker``
runs only them. The presence heartbeat is not one of them: every process that holds
connections heartbeats (``heartbeat_loop``).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Awaitable, Callable

from asgiref.sync import sync_to_async
from django.conf import settings

from dispatch import services
from dispatch.consumers import shutdown_local_connections

logger = logging.getLogger(__name__)

CLI_SUPERVISE_INTERVAL = 2.0  # seconds between two CLI agent reconciliations


def _db(function: Callable[..., object]) -> Callable[..., Awaitable[object]]:
    # Short queries only; thread_sensitive keeps them on the process's one DB thread.
    return sync_to_async(function, thread_sensitive=True)


async def heartbeat_loop(*, kind: str) -> None:
    """Stamp this process's heartbeat every ``DISPATCH_HEARTBEAT_INTERVAL`` seconds.

    If the row was reaped (this process looked dead to others), every socket of the
    process is closed so its clients reconnect and register again.
    """
    while True:
        await asyncio.sleep(settings.PROCESS_HEARTBEAT_INTERVAL)
        try:
            intact = await _db(services.server_process_heartbeat)(kind=kind)
        except Exception:
            logger.exception("heartbeat failed")
            continue
        if not intact:
            await shutdown_local_connections()


def reap_once() -> None:
    """Reap dead server processes, then fail the runs they were executing ("worker lost";
    never replayed, spec/agents.md §1)."""
    from dispatch.agents.services import runs_fail_orphaned
    from dispatch.selectors import alive_processes

    services.server_process_reap()
    runs_fail_orphaned(alive_process_ids=alive_processes().values_list("pk", flat=True))


async def reaper_loop() -> None:
    """Reap every ``DISPATCH_REAP_INTERVAL`` seconds (``reap_once``)."""
    while True:
        try:
            await _db(reap_once)()
        except Exception:
            logger.exception("reaping failed")
        await asyncio.sleep(settings.REAP_INTERVAL)


async def cli_supervisor_loop() -> None:
    """Reconcile this host's CLI agents with their tmux sessions every 2 s (spec/agents.md §2).

    ``supervise_once`` blocks on tmux subprocesses, so it runs off the DB thread.
    """
    from dispatch.agents.cli import supervise_once

    if shutil.which("tmux") is None:
        # Nothing to supervise without tmux (and no CLI agent can be launched here).
        logger.info("tmux is not installed: CLI agents are unavailable on this host")
        return
    while True:
        try:
            await sync_to_async(supervise_once, thread_sensitive=False)()
        except Exception:
            logger.exception("CLI agent supervision failed")
        await asyncio.sleep(CLI_SUPERVISE_INTERVAL)


def background_services() -> list[Callable[[], Awaitable[None]]]:
    """The background services of this version, each an endless coroutine function."""
    from dispatch.agents.executor import executor_loop

    return [reaper_loop, executor_loop, cli_supervisor_loop]


async def run_background_services() -> None:
    """Run every background service until cancelled; a crashed service is restarted, one
    that returns (nothing to do on this host) is left ended."""

    async def supervise(service: Callable[[], Awaitable[None]]) -> None:
        while True:
            try:
                await service()
                return  # a service that returns has nothing (more) to do here
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("background service %s crashed; restarting in 1 s", service.__name__)
                await asyncio.sleep(1)

    await asyncio.gather(*(supervise(service) for service in background_services()))
