"""Which dependency of this process is down, said once per outage (docs/operating.md#health).

A frozen or dead Redis or database makes every request that needs it fail, each with a
503 ``TEMPORARILY_UNAVAILABLE`` (``core.errors.unavailable_error``). Logging each of them
would bury the one fact an operator needs, so the failures are noted here instead: the
first failure of a dependency logs one ``WARNING`` naming it and the error, later ones are
counted silently, and the first success after them logs one ``INFO`` saying it is back and
how many calls failed meanwhile. The state is this process's own (each process sees its
own connections fail); nothing here is shared or persisted.

Dependencies are named by the same words as the error's ``details.service``:
``"channel_layer"`` (Redis: the channel layer, the rate limiters, the router's cache) and
``"database"``.

``RetryAfterMiddleware`` gives every 503 answer a ``Retry-After`` (RFC 9110 §10.2.3), and
``OutageResponsesAtDebug`` keeps ``django.request``'s per-request "Service Unavailable"
line at ``DEBUG`` for these answers, so an outage is one WARNING, not one ERROR a request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.http import HttpRequest, HttpResponse

logger = logging.getLogger(__name__)

SERVICES = {"channel_layer": "the channel layer (Redis)", "database": "the database"}
"""The dependencies tracked, by ``details.service`` word, with how a log line names them."""

RETRY_AFTER_SECONDS = 5
"""``Retry-After`` of a 503 answer without one: a client retrying sooner meets the same outage."""


@dataclass
class _Outage:
    since: float  # time.monotonic() of the first failure
    failures: int


class OutageTracker:
    """Per dependency: up, or down since its first failure (``failed``) until a success
    (``ok``). Thread-safe: the database thread and the event loop both report."""

    def __init__(self, *, log: logging.Logger | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log or logger
        self.clock = clock
        self._down: dict[str, _Outage] = {}
        self._lock = threading.Lock()

    def failed(self, service: str, exc: BaseException | str) -> None:
        """Note a call to ``service`` (a ``SERVICES`` key) that failed with ``exc``: the first
        one of an outage logs a WARNING, the others are counted."""
        with self._lock:
            outage = self._down.get(service)
            if outage is not None:
                outage.failures += 1
                return
            self._down[service] = _Outage(since=self.clock(), failures=1)
        reason = exc if isinstance(exc, str) else f"{type(exc).__name__}: {str(exc)[:300]}"
        self.log.warning(
            "%s is unavailable (%s); requests that need it answer 503 until it is back, logged once when it is",
            SERVICES.get(service, service),
            reason,
        )

    def ok(self, service: str) -> None:
        """Note a call to ``service`` that worked: ends its outage with one INFO line."""
        if service not in self._down:  # the common case, without the lock
            return
        with self._lock:
            outage = self._down.pop(service, None)
        if outage is None:
            return
        self.log.info(
            "%s is back, %.1fs after its first failed call (%d failed calls)",
            SERVICES.get(service, service),
            self.clock() - outage.since,
            outage.failures,
        )

    def down(self, service: str) -> bool:
        """Whether ``service``'s last reported call failed."""
        return service in self._down


tracker = OutageTracker()
"""This process's tracker: the channel layer, the database checks and the error mapping report here."""


class RetryAfterMiddleware:
    """Every 503 answer carries ``Retry-After`` (``RETRY_AFTER_SECONDS`` unless the view set
    its own): the outage answers, ``SHIM_OVERLOADED``, ``SHUTTING_DOWN`` alike. Sync and
    async; outermost, so it sees the answers the other middlewares shape."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        from asgiref.sync import iscoroutinefunction, markcoroutinefunction

        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self._acall(request)
        return with_retry_after(self.get_response(request))

    async def _acall(self, request: HttpRequest) -> HttpResponse:
        return with_retry_after(await self.get_response(request))


def with_retry_after(response: HttpResponse) -> HttpResponse:
    """``response`` with ``Retry-After: RETRY_AFTER_SECONDS`` added when it is a 503 without one."""
    if response.status_code == 503 and not response.has_header("Retry-After"):
        response["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return response


class OutageResponsesAtDebug(logging.Filter):
    """On ``django.request``: the "Service Unavailable: <path>" record of a 503 answer is
    lowered to DEBUG and kept only when the logger is enabled for DEBUG — the outage was
    logged once by ``tracker``, a busy shim is the protocol working. Other records pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "status_code", None) != 503 or record.levelno <= logging.DEBUG:
            return True
        record.levelno = logging.DEBUG
        record.levelname = logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
