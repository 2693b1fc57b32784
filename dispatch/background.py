"""Background services of a process, run as asyncio tasks (docs/deployment.md#what-runs-where).

``serve`` runs them in its own event loop unless ``--no-background``; ``dispatch_worker``
runs only them. The presence heartbeat is not one of them: every process that holds
connections heartbeats (``heartbeat_loop``).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections, connection

from core import services
from core.consumers import shutdown_local_connections
from core.protocol import CredentialsRingMessage, PresencePingMessage, PresencePingReply
from core.realtime import LoopHealth, Subscription, layer_send

logger = logging.getLogger(__name__)

BUSY_PAUSE = 0.3  # seconds between CLI supervisor passes while messages wait for a quiet pane
PASS_FINISH_TIMEOUT = 10.0  # seconds a shutdown waits for an in-flight supervisor pass
SERVICE_STABLE_AFTER = 60.0  # seconds a restarted service runs before its crashes count anew


def _db(function: Callable[..., object]) -> Callable[..., Awaitable[object]]:
    # Short queries only; thread_sensitive keeps them on the process's one DB thread.
    return sync_to_async(function, thread_sensitive=True)


# The heartbeat's own thread and database connection (heartbeat_stamp).
_HEARTBEAT_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dispatch-heartbeat")


def _stamp_on_own_connection(*, kind: str) -> bool:
    close_old_connections()  # a broken or expired connection of this thread goes first
    try:
        return services.server_process_heartbeat(kind=kind)
    finally:
        close_old_connections()  # without persistent connections: back to the pool now


def heartbeat_stamp() -> Callable[..., Awaitable[bool]]:
    """``await heartbeat_stamp()(kind=...)`` runs ``services.server_process_heartbeat``.

    On its own thread and database connection (``dispatch-heartbeat``), not on the
    process's one thread for ``database_sync_to_async``: under load that thread has a
    queue of queries, and a heartbeat waiting behind it for ``DISPATCH_PROCESS_TTL``
    would get a busy, live process reaped with all its connections. An
    in-memory SQLite database exists only on the thread that made it: there
    the stamp stays on that thread.
    """
    if connection.vendor == "sqlite" and connection.is_in_memory_db():  # type: ignore[attr-defined]
        return _db(services.server_process_heartbeat)  # type: ignore[return-value]
    return sync_to_async(_stamp_on_own_connection, thread_sensitive=False, executor=_HEARTBEAT_THREAD)


async def heartbeat_loop(*, kind: str) -> None:
    """Stamp this process's heartbeat every ``DISPATCH_HEARTBEAT_INTERVAL`` seconds
    (``heartbeat_stamp``: on its own thread), and answer presence pings meanwhile
    (``presence_loop``).

    If the row was reaped (this process looked dead to others), every socket of the
    process is closed so its clients reconnect and register again.
    """
    # No backoff: a heartbeat that waited longer would make the process look dead.
    interval = settings.PROCESS_HEARTBEAT_INTERVAL
    health = LoopHealth("presence heartbeat", base=interval, cap=interval, log=logger)
    stamp = heartbeat_stamp()
    answering = asyncio.ensure_future(presence_loop())
    try:
        while True:
            await asyncio.sleep(interval)
            try:
                intact = await stamp(kind=kind)
            except Exception as exc:
                health.failed(exc)
                continue
            health.ok()
            if not intact:
                await shutdown_local_connections()
    finally:
        answering.cancel()
        await asyncio.gather(answering, return_exceptions=True)


PRESENCE_REJOIN_EVERY = 10.0  # seconds between renewals of the presence group membership


async def presence_loop(*, process_id: str | None = None) -> None:
    """Answer every ``presence.ping`` sent to this process's presence group at once, with
    the asked channel names that are open connections of this process (a
    takeover checks the holder of a name this way, across hosts; no database query).

    ``process_id`` defaults to this process's (tests answer for another). Survives layer
    outages (the subscription joins its group again); a reply that cannot be sent is
    logged and the loop goes on.
    """
    from core.presence import current_process_id, local_channel_names, presence_group

    process_id = process_id or current_process_id()
    pings = Subscription(
        presence_group(process_id),
        receives=[PresencePingMessage],
        health=LoopHealth("presence pings", cap=PRESENCE_REJOIN_EVERY, log=logger),
        rejoin_every=PRESENCE_REJOIN_EVERY,
    )
    async with pings:
        while True:
            ping = await pings.wait()
            if not isinstance(ping, PresencePingMessage):
                continue
            local = set(local_channel_names())
            holding = [name for name in ping.channel_names if name in local]
            try:
                await layer_send(ping.reply_channel, PresencePingReply(process_id=process_id, holding=holding))
            except Exception as exc:
                logger.info("could not answer a presence ping: %s", exc)


async def revocation_loop() -> None:
    """Sweep for connections whose credential ended (``revocation.revocation_sweep_once``)
    every ``revocation.SWEEP_INTERVAL`` seconds, and at once when
    ``revocation.DOORBELL_GROUP`` rings. Runs in every process that holds connections
    (``serve``); after a failure it backs off up to ``revocation.MAX_BACKOFF`` and logs
    once per change of state (``LoopHealth``)."""
    from core import revocation

    health = LoopHealth("revocation sweep", base=revocation.SWEEP_INTERVAL, cap=revocation.MAX_BACKOFF, log=logger)
    doorbell = Subscription(
        revocation.DOORBELL_GROUP,
        receives=[CredentialsRingMessage],
        health=LoopHealth("revocation doorbell", cap=revocation.SWEEP_INTERVAL, log=logger),
        rejoin_every=revocation.SWEEP_INTERVAL,
    )
    async with doorbell:
        while True:
            try:
                await revocation.revocation_sweep_once()
            except Exception as exc:
                await health.pause(exc)
                continue
            health.ok()
            await doorbell.wait(revocation.SWEEP_INTERVAL)


TOKENS_CLEAR_INTERVAL = 900.0  # seconds between two sweeps of expired OAuth tokens by one process
_tokens_cleared_at = -TOKENS_CLEAR_INTERVAL


def reap_once() -> None:
    """Reap dead server processes, then fail the runs they were executing ("worker lost";
    never replayed: a replay could repeat a command on a machine); delete the command handles
    that ended over an hour ago (docs/live-operations.md#long-commands-handles) and the OAuth
    clients registered by strangers and never used (docs/mcp.md#oauth-clients), and every
    ``TOKENS_CLEAR_INTERVAL`` seconds the OAuth tokens that expired."""
    from oauth2_provider.models import clear_expired

    from agents.services import runs_fail_orphaned
    from core.selectors import alive_processes
    from machines.services.command_runs import command_runs_expired_delete
    from oauth.services import registered_clients_cleanup, used_codes_expired_delete

    services.server_process_reap()
    runs_fail_orphaned(alive_process_ids=alive_processes().values_list("pk", flat=True))
    command_runs_expired_delete()
    registered_clients_cleanup()
    used_codes_expired_delete()
    global _tokens_cleared_at
    if time.monotonic() - _tokens_cleared_at >= TOKENS_CLEAR_INTERVAL:
        _tokens_cleared_at = time.monotonic()
        clear_expired()  # django-oauth-toolkit's: expired OAuth tokens and codes, old revoked ones


async def reaper_loop() -> None:
    """Reap every ``DISPATCH_REAP_INTERVAL`` seconds (``reap_once``)."""
    interval = settings.REAP_INTERVAL
    health = LoopHealth("reaper", base=interval, cap=max(interval, settings.PROCESS_TTL), log=logger)
    while True:
        try:
            await _db(reap_once)()
        except Exception as exc:
            await health.pause(exc)
            continue
        health.ok()
        await asyncio.sleep(interval)


async def cli_supervisor_loop() -> None:
    """Supervise this host's CLI agents (docs/agents.md) while holding the host's lease.

    Runs ``cli.supervise_once`` every ``DISPATCH_CLI_SUPERVISE_INTERVAL`` seconds, sooner
    when the host's doorbell group (``messages.doorbell_group``) rings for a new message,
    and again after a short pause while messages still wait. Polling never stops: the
    doorbell is at-most-once. ``supervise_once`` blocks on tmux subprocesses and short
    sleeps, so it runs in a worker thread, never on the process's DB thread. On
    cancellation (clean shutdown) the lease is released so another process takes over.
    """
    from agents.messages import doorbell_group
    from agents.protocol import CliDoorbellMessage
    from agents.supervisor import supervise_once, supervisor_lease_release
    from core.presence import HOSTNAME, current_process_id

    if shutil.which("tmux") is None:
        # Nothing to supervise without tmux (and no CLI agent can be launched here).
        logger.info("tmux is not installed: CLI agents are unavailable on this host")
        return
    health = LoopHealth("CLI agent supervision", log=logger)
    interval = settings.CLI_SUPERVISE_INTERVAL
    doorbell = Subscription(
        doorbell_group(HOSTNAME),
        receives=[CliDoorbellMessage],
        health=LoopHealth("CLI supervisor doorbell", cap=interval, log=logger),
        rejoin_every=interval,
    )
    await doorbell.open()
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
            await doorbell.wait(BUSY_PAUSE if busy else settings.CLI_SUPERVISE_INTERVAL)
    finally:
        try:
            await asyncio.wait_for(_db(supervisor_lease_release)(holder=current_process_id()), 5)
        except (Exception, asyncio.CancelledError):
            logger.info("could not release the CLI supervisor lease; it expires by itself")
        await doorbell.close()


def background_services() -> list[Callable[[], Awaitable[None]]]:
    """The background services of this version, each an endless coroutine function."""
    from agents.executor import executor_loop
    from attention.worker import notification_delivery_loop
    from peers.mirror import mirror_loop
    from peers.outbox_drain import outbox_drain_loop

    return [reaper_loop, executor_loop, cli_supervisor_loop, mirror_loop, outbox_drain_loop, notification_delivery_loop]


async def run_background_services() -> None:
    """Run every background service until cancelled; a crashed service is restarted, one
    that returns (nothing to do on this host) is left ended."""

    async def supervise(service: Callable[[], Awaitable[None]]) -> None:
        health = LoopHealth(f"background service {service.__name__}", base=1.0, cap=60.0, log=logger)
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
