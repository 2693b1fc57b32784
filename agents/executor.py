"""The background run executor (docs/agents.md#the-expert-agent).

Every process with background services claims queued runs from the database
(``run_claim_next``: one run per agent at a time, two processes never claim the same
run) and executes each claimed run as its own asyncio task, so several agents' runs
proceed in parallel. A run whose process dies is failed by the reaper ("worker lost"),
never replayed.
"""

from __future__ import annotations

import asyncio
import logging

from channels.db import database_sync_to_async

from agents import services
from agents.expert import ExpertAgent
from agents.models import Run
from core.presence import current_process_id
from core.realtime import LoopHealth

logger = logging.getLogger(__name__)

POLL_INTERVAL = 0.5  # seconds between claims when nothing is queued


async def claim_next() -> Run | None:
    """Claim the next queued run for this process, or ``None``."""
    run: Run | None = await database_sync_to_async(services.run_claim_next)(process_id=current_process_id())
    return run


async def execute_run(run: Run) -> None:
    """Execute one claimed run with the ``ExpertAgent`` to its end.

    An unexpected failure still ends the run (``failed``, "internal error"), so no run
    is left ``running`` by a live process.
    """
    try:
        agent = await ExpertAgent.for_run(run.pk)
        await agent.execute()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        logger.exception("run %s could not be executed", run.pk)
        await database_sync_to_async(services.run_finish)(
            run=run, status=Run.Status.FAILED, error=f"internal error: {type(exc).__name__}"
        )


async def run_next() -> Run | None:
    """Claim one queued run and execute it to its end; the finished run, or ``None``."""
    run = await claim_next()
    if run is None:
        return None
    await execute_run(run)
    await database_sync_to_async(run.refresh_from_db)()
    return run


async def executor_loop() -> None:
    """Claim runs every ``POLL_INTERVAL`` seconds and execute each as its own task."""
    running: set[asyncio.Task[None]] = set()
    health = LoopHealth("run executor (claiming runs)", base=POLL_INTERVAL, log=logger)
    try:
        while True:
            try:
                run = await claim_next()
            except Exception as exc:
                await health.pause(exc)  # backs off, logs once per change of state
                continue
            health.ok()
            if run is None:
                await asyncio.sleep(POLL_INTERVAL)
                continue
            task = asyncio.create_task(execute_run(run), name=f"run {run.pk}")
            running.add(task)
            task.add_done_callback(running.discard)
    finally:
        for task in running:
            task.cancel()
