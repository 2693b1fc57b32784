"""``GET /metrics``: this process's metrics in Prometheus' text format (docs/metrics.md).

The counters and histograms are ``core.metrics``'s, kept in this process's memory. The
gauges of what the process holds (``/ws`` sessions, remotes, shim connections) and of the
outbox are computed at each scrape from the rows — the rows say which ``ServerProcess``
holds each connection, so a consumer whose ``disconnect`` never ran cannot leave a gauge
wrong for longer than its row lives. Those reads run through ``database_sync_to_async``
(a few ``COUNT`` queries); rendering the text is CPU work only.

Access: a client whose address (the TCP peer) is in ``DISPATCH_METRICS_ALLOW`` (default:
loopback), or ``Authorization: Bearer <API token>`` of a staff user. Anyone else gets the
API's error shape: 401 without a valid token, 403 with another user's token or an agent
token.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from channels.db import database_sync_to_async
from django.conf import settings
from django.contrib.auth.decorators import login_not_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from core import metrics
from core.errors import DispatchError, unavailable_error
from core.http import NOT_AUTHENTICATED, bearer_caller, bearer_credentials, error_response
from core.models import ApiToken
from core.presence import HOSTNAME, current_process_id
from machines.selectors import shim_connections_held_by
from peers.selectors import OutboxBacklog, outbox_backlog
from remotes.selectors import connections_held_by

logger = logging.getLogger(__name__)

STAFF_ONLY = "metrics are readable with a staff user's API token, or from an address in DISPATCH_METRICS_ALLOW"


@dataclass(frozen=True)
class HeldRows:
    """What the rows say at one scrape: this process's connections and every peer's outbox."""

    ws_sessions: int
    remotes: int
    shims: int
    outbox: list[OutboxBacklog]


def held_rows() -> HeldRows:
    """Read ``HeldRows`` for this process (sync: a handful of short queries)."""
    process_id = current_process_id()
    ws_sessions, remotes = connections_held_by(server_process_id=process_id)
    return HeldRows(
        ws_sessions=ws_sessions,
        remotes=remotes,
        shims=shim_connections_held_by(server_process_id=process_id),
        outbox=outbox_backlog(),
    )


class Scrape(Collector):
    """One scrape: ``core.metrics.REGISTRY``'s families, this process's identity, and the
    gauges of ``rows`` (``None``: the database could not be read; they are left out and
    ``dispatch_metrics_database_up`` is 0)."""

    def __init__(self, rows: HeldRows | None) -> None:
        self.rows = rows

    def collect(self) -> Iterator[Metric]:
        yield from metrics.REGISTRY.collect()
        info = GaugeMetricFamily(
            "dispatch_server_process_info",
            "This server process (its ServerProcess id, the one /healthz shows); always 1.",
            labels=["process_id", "hostname"],
        )
        info.add_metric([current_process_id(), HOSTNAME], 1)
        yield info
        yield GaugeMetricFamily(
            "dispatch_metrics_database_up",
            "1 when this scrape read the rows (connections, outbox); 0 when the database could not be read.",
            value=0 if self.rows is None else 1,
        )
        if self.rows is None:
            return
        rows = self.rows
        yield GaugeMetricFamily(
            "dispatch_ws_sessions", "Live /ws sessions held by this process.", value=rows.ws_sessions
        )
        yield GaugeMetricFamily(
            "dispatch_remotes_served", "Remotes served by the /ws sessions of this process.", value=rows.remotes
        )
        yield GaugeMetricFamily("dispatch_shims_connected", "Shim connections held by this process.", value=rows.shims)
        labels = ["peer_id", "peer"]
        depth = GaugeMetricFamily(
            "dispatch_outbox_depth",
            "Queued outbox rows per linked instance (the whole instance's rows).",
            labels=labels,
        )
        age = GaugeMetricFamily(
            "dispatch_outbox_oldest_age_seconds",
            "Age of the oldest queued outbox row per linked instance, seconds (0 when none waits).",
            labels=labels,
        )
        dead = GaugeMetricFamily(
            "dispatch_outbox_dead", "Dead-lettered outbox rows per linked instance.", labels=labels
        )
        for backlog in rows.outbox:
            peer = [str(backlog.peer_id), backlog.label]
            depth.add_metric(peer, backlog.depth)
            age.add_metric(peer, backlog.oldest_age_seconds)
            dead.add_metric(peer, backlog.dead)
        yield from (depth, age, dead)


async def scrape_allowed(request: HttpRequest) -> None:
    """Let the request read ``/metrics`` or raise: its client address is in
    ``DISPATCH_METRICS_ALLOW`` (checked first, without the database), or it carries a user
    API token (not an agent token) of an active staff user.

    Raises ``DispatchError`` ``NOT_AUTHENTICATED`` (401, no token), ``AUTHENTICATION_FAILED``
    (401, an unknown, revoked or expired token) or ``PERMISSION_DENIED`` (403, a token of a
    user who is not staff, or an agent token); an outage's exception while checking a token.
    """
    if metrics.address_allowed(str(request.META.get("REMOTE_ADDR") or ""), settings.METRICS_ALLOW):
        return
    raw = bearer_credentials(request.headers.get("Authorization", ""))
    if raw is None:
        raise DispatchError("NOT_AUTHENTICATED", f"{NOT_AUTHENTICATED} ({STAFF_ONLY})")
    user, credential = await bearer_caller(raw)
    if not isinstance(credential, ApiToken) or not user.is_staff:
        raise DispatchError("PERMISSION_DENIED", STAFF_ONLY)


async def _read_rows() -> HeldRows | None:
    try:
        return await database_sync_to_async(held_rows)()
    except Exception as exc:
        if unavailable_error(exc) is None:
            raise
        logger.warning("/metrics: the rows could not be read: %s", exc)
        return None


@login_not_required  # answers 401/403 itself
async def metrics_view(request: HttpRequest) -> HttpResponse:
    """``GET /metrics`` (and ``HEAD``): Prometheus' text exposition format 0.0.4 (OpenMetrics
    1.0 when ``Accept`` asks for ``application/openmetrics-text``), or the API's error
    shape (401, 403, 405; 503 when a token cannot be checked in an outage)."""
    if request.method not in ("GET", "HEAD"):
        refused = JsonResponse(
            {"error": {"code": "METHOD_NOT_ALLOWED", "message": f"method {request.method} not allowed", "details": {}}},
            status=405,
        )
        refused["Allow"] = "GET, HEAD"
        return refused
    try:
        await scrape_allowed(request)
    except DispatchError as exc:
        return error_response(exc)
    except Exception as exc:
        mapped = unavailable_error(exc)
        if mapped is None:
            raise
        return error_response(mapped)
    # The text format 0.0.4, or OpenMetrics when the scraper's Accept asks for it.
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))
    response = HttpResponse(encode(Scrape(await _read_rows())), content_type=content_type)
    response["Cache-Control"] = "no-store"
    return response
