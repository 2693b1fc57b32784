"""The shared limiter's counts (password failures, device codes) belong to one instance:
its keys start with ``DISPATCH_REDIS_PREFIX`` and a reset clears only its own
(core.services.rate_limiter; docs/operating.md#channel-layer)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from django.test import override_settings
from limits import parse

from core.services import password_throttle_reset, rate_limiter
from tests.backends import redis_url

pytestmark = pytest.mark.redis


@pytest.fixture(autouse=True)
def _fresh_limiter() -> Iterator[None]:
    # rate_limiter() is made once per process; each block below is another instance.
    rate_limiter.cache_clear()
    yield
    rate_limiter.cache_clear()


def test_a_reset_clears_this_instances_counts_and_keeps_another_instances_on_the_same_redis() -> None:
    limit = parse("5/minute")
    with redis_url() as url:
        mine, theirs = f"dispatch-test-{uuid.uuid4().hex[:8]}", f"dispatch-test-{uuid.uuid4().hex[:8]}"
        with override_settings(RATELIMIT_STORAGE_URL=url, REDIS_PREFIX=theirs):
            rate_limiter.cache_clear()
            limiter = rate_limiter()
            limiter.hit(limit, theirs, "password-failures", "user", "admin")
            keys = limiter.storage.storage.keys("*")  # type: ignore[attr-defined]
            assert keys and all(key.decode().startswith(f"{theirs}:limits:") for key in keys if theirs.encode() in key)
        rate_limiter.cache_clear()
        with override_settings(RATELIMIT_STORAGE_URL=url, REDIS_PREFIX=mine):
            rate_limiter().hit(limit, mine, "password-failures", "user", "admin")
            password_throttle_reset()
            assert rate_limiter().get_window_stats(limit, mine, "password-failures", "user", "admin").remaining == 5
        rate_limiter.cache_clear()
        with override_settings(RATELIMIT_STORAGE_URL=url, REDIS_PREFIX=theirs):
            assert rate_limiter().get_window_stats(limit, theirs, "password-failures", "user", "admin").remaining == 4
            password_throttle_reset()
