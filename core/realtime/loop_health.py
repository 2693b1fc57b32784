"""How a background loop is doing (``LoopHealth``): its backoff after errors and its
once-per-change-of-state log (docs/operating.md#health).

Apart from the layer code because every background loop uses it, with or without a
doorbell; ``Subscription`` reports a doorbell's layer outages to it, and the rings ask
``_outage`` whether a failed send is an outage (logged once) or a bug (logged each time).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

from core import metrics
from core.errors import channel_layer_unavailable, database_unavailable

logger = logging.getLogger("core.realtime")  # the package's one logger, as before its split into modules

BACKOFF_JITTER = 0.2  # ± this fraction of a backoff delay, drawn at random


def _outage(exc: BaseException) -> bool:
    return channel_layer_unavailable(exc) or database_unavailable(exc)


class LoopHealth:
    """How one background loop is doing: the delay after an error, and its log.

    Every background loop reports each pass: ``ok()`` after one that worked, ``failed(exc)``
    after one that raised, which returns the seconds to wait before the next pass: ``base``
    × 2^(failures − 1), capped at ``cap``, ±20 % jitter (so a loop whose Redis or database
    is down neither spins nor retries in step with every other process). It logs one line
    per change of state — the first failure, with its error (and the traceback when it is
    not an outage), and "recovered" when a pass works again — never one per pass
    (docs/operating.md#health). Each failure is also counted in
    ``dispatch_background_loop_errors_total{loop=metric_name}`` (default: ``name``; give a
    fixed ``metric_name`` when ``name`` carries an id).
    """

    def __init__(
        self,
        name: str,
        *,
        base: float = 1.0,
        cap: float = 30.0,
        log: logging.Logger | None = None,
        rand: Callable[[], float] = random.random,
        metric_name: str | None = None,
    ) -> None:
        self.name = name
        self.metric_name = metric_name or name
        self.base = base
        self.cap = max(cap, base)
        self.log = log or logger
        self.rand = rand
        self.failures = 0  # consecutive failed passes

    def failed(self, exc: BaseException) -> float:
        """Record a failed pass; return the seconds to wait before the next one."""
        self.failures += 1
        metrics.loop_error_counted(self.metric_name)
        delay = min(self.cap, self.base * 2 ** min(self.failures - 1, 30))
        delay *= 1 - BACKOFF_JITTER + 2 * BACKOFF_JITTER * self.rand()
        if self.failures == 1:
            self.log.warning(
                "%s failing: %s: %s; retrying with backoff (up to %gs), logged again when it recovers",
                self.name,
                type(exc).__name__,
                str(exc)[:300],
                self.cap,
                exc_info=None if _outage(exc) else exc,
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
