"""Background services of a process, run as asyncio tasks (spec/overview.md "How it runs").

``serve`` runs them in its own event loop unless ``--no-background``; ``dispatch_worker``
runs only them. The presence heartbeat is not one of them: every process that holds
connections heartbeats (``heartbeat_loop``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import shutil
from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings

from core import services
from core.consumers import outage, shutdown_local_connections

logger = logging.getLogger(__name__)

BUSY_PAUSE = 0.3  # seconds between CLI supervisor passes while messages wait for a quiet pane
PASS_FINISH_TIMEOUT = 10.0  # seconds a shutdown waits for an in-flight supervisor pass
BACKOFF_JITTER = 0.2  # ± this fraction of a backoff delay, drawn at random
SERVICE_STABLE_AFTER = 60.0  # seconds a restarted service runs before its crashes count anew


class LoopHealth:
    """How one background loop is doing: the delay after an error, and its log.

    Every background loop reports each pass: ``ok()`` after one that worked, ``failed(exc)``
    after one that raised, which returns the seconds to wait before the next pass: ``base``
    × 2^(failures − 1), capped at ``cap``, ±20 % jitter (so a loop whose Redis or database
    is down neither spins nor retries in step with every other process). It logs one line
    per change of state — the first failure, with its error (and the traceback when it is
    not an outage), and "recovered" when a pass works again — never one per pass
    (spec/quality.md "Faults"; issue 11 item 4).
    """

    def __init__(
        self,
        name: str,
        *,
        base: float = 1.0,
        cap: float = 30.0,
        log: logging.Logger | None = None,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.name = name
        self.base = base
        self.cap = max(cap, base)
        self.log = log or logger
        self.rand = rand
        self.failures = 0  # consecutive failed passes

    def failed(self, exc: BaseException) -> float:
        """Record a failed pass; return the seconds to wait before the next one."""
        self.failures += 1
        delay = min(self.cap, self.base * 2 ** min(self.failures - 1, 30))
        delay *= 1 - BACKOFF_JITTER + 2 * BACKOFF_JITTER * self.rand()
        if self.failures == 1:
            self.log.warning(
                "%s failing: %s: %s; retrying with backoff (up to %gs), logged again when it recovers",
                self.name,
                type(exc).__name__,
                str(exc)[:300],
                self.cap,
                exc_info=None if outage(exc) else exc,
            )
        else:
            self.log.debug("%s still failing (%d passes): %s", self.name, self.failures, exc)
        return delay

    async def pause(self, exc: BaseException) -> None:
        """``failed(exc)``, then wait its delay."""
        await asyncio.sleep(self.failed(exc))

    def ok(self) -> None:
        """Record a pass that worked (logs "recovered" after failures)."""
        if self.failures:
            self.log.warning("%s recovered after %d failed passes", self.name, self.failures)
            self.failures = 0


async def doorbell_wait(layer: Any, channel: str | None, group: str, timeout: float, health: LoopHealth) -> bool:
    """Wait ``timeout`` seconds or until a ring arrives on ``channel``, re-joining ``group``
    first (groups expire). Returns whether it rang.

    The doorbell is at-most-once, so loops poll anyway: without a layer, or while the
    layer fails (reported to ``health``, which logs the change of state), this just waits
    ``timeout`` seconds — the loop goes on polling the database at its normal pace.
    """
    if layer is None or channel is None:
        await asyncio.sleep(timeout)
        return False
    try:
        await layer.group_add(group, channel)
        async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it can swallow a cancel
            await layer.receive(channel)
    except TimeoutError:
        health.ok()
        return False
    except Exception as exc:
        health.failed(exc)
        await asyncio.sleep(timeout)
        return False
    health.ok()
    return True


def _db(function: Callable[..., object]) -> Callable[..., Awaitable[object]]:
    # Short queries only; thread_sensitive keeps them on the process's one DB thread.
    return sync_to_async(function, thread_sensitive=True)


async def heartbeat_loop(*, kind: str) -> None:
    """Stamp this process's heartbeat every ``DISPATCH_HEARTBEAT_INTERVAL`` seconds.

    If the row was reaped (this process looked dead to others), every socket of the
    process is closed so its clients reconnect and register again.
    """
    # No backoff: a heartbeat that waited longer would make the process look dead.
    interval = settings.PROCESS_HEARTBEAT_INTERVAL
    health = LoopHealth("presence heartbeat", base=interval, cap=interval)
    while True:
        await asyncio.sleep(interval)
        try:
            intact = await _db(services.server_process_heartbeat)(kind=kind)
        except Exception as exc:
            health.failed(exc)
            continue
        health.ok()
        if not intact:
            await shutdown_local_connections()


async def revocation_loop() -> None:
    """Sweep for connections whose credential ended (``revocation.revocation_sweep_once``)
    every ``revocation.SWEEP_INTERVAL`` seconds, and at once when
    ``revocation.DOORBELL_GROUP`` rings. Runs in every process that holds connections
    (``serve``); after a failure it backs off up to ``revocation.MAX_BACKOFF`` and logs
    once per change of state (``LoopHealth``)."""
    from channels.layers import get_channel_layer

    from core import revocation

    layer = get_channel_layer()
    channel = await layer.new_channel()
    health = LoopHealth("revocation sweep", base=revocation.SWEEP_INTERVAL, cap=revocation.MAX_BACKOFF)
    doorbell = LoopHealth("revocation doorbell")
    while True:
        try:
            await revocation.revocation_sweep_once()
        except Exception as exc:
            await health.pause(exc)
            continue
        health.ok()
        await doorbell_wait(layer, channel, revocation.DOORBELL_GROUP, revocation.SWEEP_INTERVAL, doorbell)


def reap_once() -> None:
    """Reap dead server processes, then fail the runs they were executing ("worker lost";
    never replayed, spec/agents.md §1)."""
    from agents.services import runs_fail_orphaned
    from core.selectors import alive_processes

    services.server_process_reap()
    runs_fail_orphaned(alive_process_ids=alive_processes().values_list("pk", flat=True))


async def reaper_loop() -> None:
    """Reap every ``DISPATCH_REAP_INTERVAL`` seconds (``reap_once``)."""
    interval = settings.REAP_INTERVAL
    health = LoopHealth("reaper", base=interval, cap=max(interval, settings.PROCESS_TTL))
    while True:
        try:
            await _db(reap_once)()
        except Exception as exc:
            await health.pause(exc)
            continue
        health.ok()
        await asyncio.sleep(interval)


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

    from agents.messages import doorbell_group
    from agents.supervisor import supervise_once, supervisor_lease_release
    from core.presence import HOSTNAME, current_process_id

    if shutil.which("tmux") is None:
        # Nothing to supervise without tmux (and no CLI agent can be launched here).
        logger.info("tmux is not installed: CLI agents are unavailable on this host")
        return
    layer = get_channel_layer()
    group = doorbell_group(HOSTNAME)
    channel = await layer.new_channel() if layer is not None else None
    health = LoopHealth("CLI agent supervision")
    doorbell = LoopHealth("CLI supervisor doorbell")
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
            except Exception as exc:
                await health.pause(exc)
                continue
            health.ok()
            pause = BUSY_PAUSE if busy else settings.CLI_SUPERVISE_INTERVAL
            await doorbell_wait(layer, channel, group, pause, doorbell)
    finally:
        try:
            await asyncio.wait_for(_db(supervisor_lease_release)(holder=current_process_id()), 5)
            if layer is not None and channel is not None:
                await asyncio.wait_for(layer.group_discard(group, channel), 5)
        except (Exception, asyncio.CancelledError):
            logger.info("could not release the CLI supervisor lease; it expires by itself")


def background_services() -> list[Callable[[], Awaitable[None]]]:
    """The background services of this version, each an endless coroutine function."""
    from agents.executor import executor_loop
    from peers.mirror import mirror_loop
    from peers.outbox import outbox_drain_loop

    return [reaper_loop, executor_loop, cli_supervisor_loop, mirror_loop, outbox_drain_loop]


async def run_background_services() -> None:
    """Run every background service until cancelled; a crashed service is restarted, one
    that returns (nothing to do on this host) is left ended."""

    async def supervise(service: Callable[[], Awaitable[None]]) -> None:
        health = LoopHealth(f"background service {service.__name__}", base=1.0, cap=60.0)
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await service()
                return  # a service that returns has nothing (more) to do here
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if loop.time() - started > SERVICE_STABLE_AFTER:
                    health.ok()  # it had run well for a while: this is a new failure
                await health.pause(exc)

    await asyncio.gather(*(supervise(service) for service in background_services()))
