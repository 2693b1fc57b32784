"""Request ids are never issued twice for a user, and a result is matched only against the
calls pending on the socket that carries it (docs/ws-protocol.md#request-ids).

The public Horde remote client (hordelab/remote-center) reconnects on a new socket and
then sends the late ``remote-call-result`` of a call made on the old one: these tests
replay that in raw frames, through the real router and across a real ``serve`` restart.
The same case across two processes on PostgreSQL + Redis is in
tests/integration/test_request_ids_multiprocess.py.
"""

from __future__ import annotations

import asyncio
import logging
import re
import subprocess
from typing import Any

import pytest

from remotes.protocol import new_request_id
from tests.infra import PYTHON, REPO, base_env, instance
from tests.live_clients import LiveSession

DEMO = "remote-center/demo"
SLOW = [
    {
        "name": "slow",
        "description": "sleep, then say how long",
        "parameters": {"type": "object", "properties": {"seconds": {"type": "number"}}},
    }
]
CONSUMER_LOGGER = "dispatch.ws.consumer"


def call_body(seconds: float) -> dict[str, Any]:
    return {"remotename": DEMO, "function": "slow", "args": {"seconds": seconds}}


def call_frame(nonce: str, seconds: float) -> dict[str, Any]:
    return {"action": "remote-call", "nonce": nonce, "body": call_body(seconds)}


def result_frame(request_id: str, seconds: float) -> dict[str, Any]:
    # The Horde client's shape: the fields under ``body``.
    return {"action": "remote-call-result", "body": {"requestId": request_id, "result": {"slept": seconds}}}


async def serve_demo(ws: Any) -> None:
    reply = await ws.request("remote-connect", {"remotename": DEMO, "functions": SLOW})
    assert reply["message"] == "remote connected", reply


# --- through the real router ---------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
async def test_a_late_result_sent_on_the_new_socket_does_not_answer_a_newer_call(
    ws_connect: Any, owner_token: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=CONSUMER_LOGGER)
    async with ws_connect(token=owner_token) as caller:
        async with ws_connect(token=owner_token) as first_socket:
            await serve_demo(first_socket)
            await caller.send(call_frame("old-slow5", 5))
            old = await first_socket.next_event()
        # The first socket dropped with the call in flight: its caller is told at once.
        assert await caller.reply("old-slow5") == {"error": f"remote '{DEMO}' disconnected", "nonce": "old-slow5"}

        async with ws_connect(token=owner_token) as second_socket:
            await serve_demo(second_socket)
            await caller.send(call_frame("new-slow10", 10))
            new = await second_socket.next_event()
            # The client's late answer to the old call comes first, on the new socket.
            await second_socket.send(result_frame(old["requestId"], 5))
            await second_socket.send(result_frame(new["requestId"], 10))
            assert await caller.reply("new-slow10") == {"result": {"slept": 10}, "nonce": "new-slow10"}
    assert f"ignoring remote-call-result for unknown requestId {old['requestId']!r}" in caplog.text


@pytest.mark.django_db(transaction=True)
async def test_a_result_for_a_call_pending_on_another_socket_of_the_user_is_ignored(
    ws_connect: Any, owner_token: str, weather_tools: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=CONSUMER_LOGGER)
    async with (
        ws_connect(token=owner_token) as serving,
        ws_connect(token=owner_token) as other,
        ws_connect(token=owner_token) as caller,
    ):
        await serve_demo(serving)
        connected = await other.request("remote-connect", {"remotename": "weather", "tools": weather_tools})
        assert connected["message"] == "remote connected"
        await caller.send(call_frame("c1", 1))
        event = await serving.next_event()
        await other.send(result_frame(event["requestId"], 99))
        # A reply on ``other`` means its consumer has handled the result sent before it.
        assert (await other.request("ping"))["pong"] is True
        assert f"ignoring remote-call-result for unknown requestId {event['requestId']!r}" in caplog.text
        await serving.send(result_frame(event["requestId"], 1))
        assert await caller.reply("c1") == {"result": {"slept": 1}, "nonce": "c1"}


@pytest.mark.django_db(transaction=True)
async def test_no_id_repeats_across_sessions_and_names_of_a_process(ws_connect: Any, owner_token: str) -> None:
    seen: list[str] = []
    async with ws_connect(token=owner_token) as caller:
        for _ in range(3):
            async with ws_connect(token=owner_token) as serving:
                for remotename in (DEMO, "remote-center/other"):
                    await serving.request("remote-connect", {"remotename": remotename, "functions": SLOW})
                    await caller.send(
                        {
                            "action": "remote-call",
                            "nonce": remotename,
                            "body": {**call_body(0), "remotename": remotename},
                        }
                    )
                    event = await serving.next_event()
                    seen.append(event["requestId"])
                    await serving.send(result_frame(event["requestId"], 0))
                    assert await caller.reply(remotename) == {"result": {"slept": 0}, "nonce": remotename}
    assert len(set(seen)) == len(seen) == 6, seen


def test_ids_are_opaque_decimal_and_below_2_to_the_53() -> None:
    first, second = new_request_id(DEMO), new_request_id(DEMO)
    assert first != second
    for request_id in (first, second):
        assert re.fullmatch(r"remote-center/demo#[0-9]+", request_id)
        assert int(request_id.rsplit("#", 1)[1]) < 2**53


def test_two_processes_do_not_start_from_the_same_number() -> None:
    def first_id() -> str:
        done = subprocess.run(
            [PYTHON, "-c", "from remotes.protocol import new_request_id; print(new_request_id('x'))"],
            env=base_env(),
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        return done.stdout.strip()

    assert first_id() != first_id() != "x#0"


FORK_AND_DRAW = """
import os
from remotes.protocol import new_request_id
read_end, write_end = os.pipe()
if os.fork() == 0:
    os.write(write_end, new_request_id("x").encode())
    os._exit(0)
os.wait()
print(os.read(read_end, 100).decode(), new_request_id("x"))
"""


def test_a_forked_process_draws_its_own_base() -> None:
    done = subprocess.run(
        [PYTHON, "-c", FORK_AND_DRAW], env=base_env(), cwd=REPO, capture_output=True, text=True, check=True, timeout=60
    )
    child, parent = done.stdout.split()
    assert child != parent


# --- across a real ``serve`` restart ---------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(90)
async def test_a_late_result_of_the_old_process_does_not_answer_a_call_on_the_restarted_one() -> None:
    with instance() as inst:
        before = inst.serve()
        async with LiveSession.open(before.ws_url, inst.admin_token) as serving:
            await serve_demo(serving)
            async with LiveSession.open(before.ws_url, inst.admin_token) as caller:
                await caller.send_request("remote-call", call_body(5))
                old = await serving.next_event()
                await asyncio.to_thread(before.stop)
                assert await serving.closed() == 1012

        after = inst.serve()
        async with (
            LiveSession.open(after.ws_url, inst.admin_token) as serving,
            LiveSession.open(after.ws_url, inst.admin_token) as caller,
        ):
            await serve_demo(serving)
            nonce = await caller.send_request("remote-call", call_body(10))
            new = await serving.next_event()
            await serving.send(result_frame(old["requestId"], 5))
            await serving.send(result_frame(new["requestId"], 10))
            assert await caller.reply(nonce) == {"result": {"slept": 10}, "nonce": nonce}
