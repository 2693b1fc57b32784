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
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings

from dispatch import services
from dispatch.consumers import shutdown_local_connections

logger = logging.getLogger(__name__)

BUSY_PAUSE = 0.3  # seconds between CLI supervisor passes while messages wait for a quiet pane
PASS_FINISH_TIMEOUT = 10.0  # seconds a shutdown waits for an in-flight supervisor pass


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
    """Supervise this host's CLI agents (spec/agents.md §2) while holding the host's lease.

    Runs ``cli.supervise_once`` every ``DISPATCH_CLI_SUPERVISE_INTERVAL`` seconds, sooner
    when the host's doorbell group (``messages.doorbell_group``) rings for a new message,
    and again after a short pause while messages still wait. Polling never stops: the
    doorbell is at-most-once. ``supervise_once`` blocks on tmux subprocesses and short
    sleeps, so it runs in a worker thread, never on the process's DB thread. On
    cancellation (clean shutdown) the lease is released so another process takes over.
    """
    from channels.layers import get_channel_layer

    from dispatch.agents.cli import supervise_once, supervisor_lease_release
    from dispatch.agents.messages import doorbell_group
    from dispatch.presence import HOSTNAME, current_process_id

    if shutil.which("tmux") is None:
        # Nothing to supervise without tmux (and no CLI agent can be launched here).
        logger.info("tmux is not installed: CLI agents are unavailable on this host")
        return
    layer = get_channel_layer()
    group = doorbell_group(HOSTNAME)
    channel = await layer.new_channel() if layer is not None else None
    try:
        while True:
            busy = False
            supervising = asyncio.ensure_future(sync_to_async(supervise_once, thread_sensitive=False)())
            try:
                outcome = await asyncio.shield(supervising)
                busy = outcome.busy
            except asyncio.CancelledError:
                # The pass runs in a thread nothing can stop, and its after-commit
                # broadcasts need this event loop: let it finish before the loop goes away
                # (else the process hangs at exit, joining that thread).
                await asyncio.wait({supervising}, timeout=PASS_FINISH_TIMEOUT)
                raise
            except Exception:
                logger.exception("CLI agent supervision failed")
            await _doorbell_wait(layer, channel, group, BUSY_PAUSE if busy else settings.CLI_SUPERVISE_INTERVAL)
    finally:
        try:
            await asyncio.wait_for(_db(supervisor_lease_release)(holder=current_process_id()), 5)
            if layer is not None and channel is not None:
                await asyncio.wait_for(layer.group_discard(group, channel), 5)
        except (Exception, asyncio.CancelledError):
            logger.info("could not release the CLI supervisor lease; it expires by itself")


async def _doorbell_wait(layer: Any, channel: str | None, group: str, timeout: float) -> None:
    """Wait ``timeout`` seconds or until a doorbell arrives on ``channel`` (re-joining ``group``)."""
    if layer is None or channel is None:
        await asyncio.sleep(timeout)
        return
    try:
        await layer.group_add(group, channel)  # renewed each time: groups expire
        async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it can swallow a cancel
            await layer.receive(channel)
    except TimeoutError:
        pass
    except Exception:
        logger.exception("CLI doorbell wait failed")
        await asyncio.sleep(timeout)


def background_services() -> list[Callable[[], Awaitable[None]]]:
    """The background services of this version, each an endless coroutine function."""
    from dispatch.agents.executor import executor_loop
    from peers.mirror import mirror_loop
    from peers.outbox import outbox_drain_loop

    return [reaper_loop, executor_loop, cli_supervisor_loop, mirror_loop, outbox_drain_loop]


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
