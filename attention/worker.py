"""The notification delivery worker: a background service of every process that runs
them (``dispatch.background``; ``serve`` or ``dispatch_worker``).

Each pass claims due deliveries (``services.deliveries_claim``: a conditional UPDATE per
row, so several processes share the work without sending twice), sends each with
apprise or pywebpush and records the outcome (``services.delivery_record``: retried with
backoff, an expired push subscription deleted). Sending blocks on the network, so a pass
runs in a worker thread with its own database connection, never on the event loop nor on
the process's shared thread for short queries (docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import logging

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections

from attention import services
from attention.models import Delivery
from attention.senders import DeliveryFailed, SubscriptionGone, apprise_send, webpush_send
from core.realtime import LoopHealth

logger = logging.getLogger(__name__)

BATCH = 20  # deliveries claimed per pass


def deliver(delivery: Delivery) -> Delivery:
    """Send one claimed delivery and record its outcome (never raises for a failed send:
    the failure is the delivery's ``last_error``). A notification of an approval answered
    meanwhile is not sent (``obsolete``): it would call a person to nothing."""
    notification = delivery.notification
    if notification.approval_id and not services.approval_still_waiting(notification.approval_id):
        return services.delivery_record(delivery=delivery, error="the approval was answered meanwhile", obsolete=True)
    try:
        if delivery.channel == Delivery.Channel.APPRISE:
            apprise_send(
                url=services.delivery_target(delivery),
                title=notification.title,
                body=notification.body,
                link=notification.url,
            )
        else:
            subscription = delivery.subscription
            if subscription is None:
                raise SubscriptionGone("the push subscription was removed")
            webpush_send(
                endpoint=subscription.endpoint,
                p256dh=subscription.p256dh,
                auth=subscription.auth,
                payload=notification.payload(),
                urgent=notification.kind == notification.Kind.APPROVAL,
            )
    except SubscriptionGone as exc:
        logger.info("notification %s: push subscription gone (%s)", notification.pk, exc)
        return services.delivery_record(delivery=delivery, error=str(exc), gone=True)
    except Exception as exc:
        reason = str(exc) if isinstance(exc, DeliveryFailed) else f"{type(exc).__name__}: {exc}"
        logger.info("notification %s: %s delivery failed: %s", notification.pk, delivery.channel, reason)
        return services.delivery_record(delivery=delivery, error=reason or "send failed")
    return services.delivery_record(delivery=delivery)


def deliver_due_once() -> int:
    """One pass: claim up to ``BATCH`` due deliveries, send and record each; how many were
    claimed."""
    claimed = services.deliveries_claim(limit=BATCH)
    for delivery in claimed:
        deliver(delivery)
    return len(claimed)


PRUNE_EVERY = 600.0  # seconds between two prunes of old notifications and expired heartbeats


def _pass_on_own_connection(prune: bool) -> int:
    close_old_connections()
    try:
        if prune:
            services.notifications_prune()
        return deliver_due_once()
    finally:
        close_old_connections()


async def notification_delivery_loop() -> None:
    """Deliver due notifications every ``DISPATCH_NOTIFY_POLL_INTERVAL`` seconds (at once
    again after a full batch), and prune old ones every ``PRUNE_EVERY``; after a failure
    it backs off and logs once per change of state (``LoopHealth``)."""
    health = LoopHealth("notification delivery", base=settings.NOTIFY_POLL_INTERVAL, log=logger)
    run_pass = sync_to_async(_pass_on_own_connection, thread_sensitive=False)
    loop = asyncio.get_running_loop()
    pruned_at = -PRUNE_EVERY
    while True:
        prune = loop.time() - pruned_at >= PRUNE_EVERY
        try:
            claimed = await run_pass(prune)
            if prune:
                pruned_at = loop.time()
        except Exception as exc:
            await health.pause(exc)
            continue
        health.ok()
        if claimed < BATCH:
            await asyncio.sleep(settings.NOTIFY_POLL_INTERVAL)
