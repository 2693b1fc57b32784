"""The bench's baselines (bench/baseline.py) relay calls as Dispatch does: a caller's
``remote-call`` reaches the serving client and its result comes back, here through the
two-process Redis relay that B2's ``(B2'')`` row measures (bench/README.md#remote-calls-remote_callspy-b1-b2-b3)."""

from __future__ import annotations

import asyncio
import importlib
import sys
import uuid
from typing import Any

import pytest

from tests.backends import redis_url
from tests.infra import REPO

pytestmark = [pytest.mark.integration, pytest.mark.redis, pytest.mark.timeout(120)]


def test_the_two_process_redis_relay_carries_a_call_from_one_process_to_a_remote_on_the_other() -> None:
    saved = list(sys.path)
    try:  # bench/ on sys.path only while its modules are imported (their names are not the apps')
        sys.path.insert(0, str(REPO / "bench"))
        remote_calls = importlib.import_module("remote_calls")
        sequential_latencies = importlib.import_module("common").sequential_latencies
    finally:
        sys.path[:] = saved
    with redis_url() as url:
        options = ("--redis", url, "--prefix", f"bench-relay-test-{uuid.uuid4().hex[:8]}")
        with remote_calls.baseline_server("redis-relay", *options) as (url_a, pid_a):
            with remote_calls.baseline_server("redis-relay", *options) as (url_b, pid_b):
                target = remote_calls.Target("redis_relay", url_a, url_b, None, {"a": pid_a, "b": pid_b})

                async def calls() -> Any:
                    await remote_calls.open_target(target)
                    try:
                        assert target.caller is not None
                        return await sequential_latencies(target.caller, count=20, label="t")
                    finally:
                        await remote_calls.close_target(target)

                # sequential_latencies checks each result is its own call's id and payload
                assert len(asyncio.run(calls())) == 20
