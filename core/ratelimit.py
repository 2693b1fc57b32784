"""Per-connection request rate limit (docs/ws-protocol.md#limits).

A token bucket that lives with one websocket connection (it is that connection's own
state, not a registry): ``rate`` tokens per second refill a bucket of ``burst`` tokens.
Cross-process limits (passwords) use the ``limits`` library instead (core.services).
"""

from __future__ import annotations

import time


class TokenBucket:
    """Allow ``rate`` requests per second on average with bursts of up to ``burst``."""

    __slots__ = ("_stamp", "_tokens", "burst", "rate")

    def __init__(self, *, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = float(burst)
        self._tokens = float(burst)
        self._stamp = time.monotonic()

    def take(self) -> bool:
        """Spend one token; False (and nothing spent) when the bucket is empty."""
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True
