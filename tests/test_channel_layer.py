"""The Redis channel layer's connection pool waits instead of failing (core/channel_layer.py).

redis-py 8's plain pool raises ``MaxConnectionsError`` past 100 connections: a process
with hundreds of sends in flight lost some. These run against a real Redis.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.asyncio import BlockingConnectionPool

from core.channel_layer import RedisChannelLayer
from tests.backends import redis_url

pytestmark = [pytest.mark.redis]


@pytest.fixture
def redis_base():
    with redis_url() as url:
        yield url


def layer_for(url: str, **host) -> RedisChannelLayer:
    return RedisChannelLayer(
        hosts=[{"address": url, **host}], prefix=f"test-layer-{uuid.uuid4().hex[:8]}", capacity=10_000
    )


async def test_the_pool_is_bounded_and_blocking(redis_base):
    layer = layer_for(redis_base, max_connections=7, pool_timeout=3)
    pool = layer.create_pool(0)
    assert isinstance(pool, BlockingConnectionPool)
    assert pool.max_connections == 7
    assert pool.timeout == 3
    await pool.disconnect()


async def test_many_concurrent_sends_over_a_small_pool_all_arrive(redis_base):
    # 300 sends at once through 5 connections: with a plain pool the 6th would raise.
    layer = layer_for(redis_base, max_connections=5, pool_timeout=10)
    try:
        channel = await layer.new_channel()
        await asyncio.gather(*(layer.send(channel, {"type": "t", "n": n}) for n in range(300)))
        got = sorted([(await layer.receive(channel))["n"] for _ in range(300)])
        assert got == list(range(300))
    finally:
        await layer.flush()
        await layer.close_pools()


async def test_a_send_that_cannot_get_a_connection_in_time_fails_clearly(redis_base):
    import redis.exceptions

    layer = layer_for(redis_base, max_connections=1, pool_timeout=0.2)
    try:
        connection = layer.connection(0)
        held = await connection.connection_pool.get_connection()
        try:
            with pytest.raises(redis.exceptions.ConnectionError, match="No connection available"):
                await layer.send("test.one", {"type": "t"})
        finally:
            await connection.connection_pool.release(held)
        await layer.send("test.one", {"type": "t"})  # the freed connection is used again
    finally:
        await layer.flush()
        await layer.close_pools()


def test_settings_use_the_blocking_layer_when_redis_is_configured(tmp_path):
    import json
    import subprocess
    import sys

    from tests.infra import base_env

    env = base_env(
        REDIS_URL="redis://127.0.0.1:6379/9",
        DISPATCH_CHANNEL_LAYER="list",
        DISPATCH_REDIS_MAX_CONNECTIONS="33",
        DISPATCH_DATA_DIR=str(tmp_path),
    )
    code = (
        "import django, json; django.setup(); from django.conf import settings; "
        "print(json.dumps(settings.CHANNEL_LAYERS['default']))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    layer = json.loads(out.stdout.strip().splitlines()[-1])
    assert layer["BACKEND"] == "core.channel_layer.RedisChannelLayer"
    assert layer["CONFIG"]["hosts"][0]["max_connections"] == 33
