"""Request ids across two ``manage.py serve`` processes sharing PostgreSQL and Redis
(docs/ws-protocol.md#request-ids): a client that reconnects to the other process and sends
there the late answer of a call made through the first one must not answer a newer call.

The same case on one process and across a restart is in tests/dispatch/ws/test_request_ids.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.infra import instance
from tests.live_clients import LiveSession

pytestmark = [
    pytest.mark.integration,
    pytest.mark.multiprocess,
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.timeout(90),
]

DEMO = "remote-center/demo"
SLOW = [{"name": "slow", "parameters": {"type": "object", "properties": {"seconds": {"type": "number"}}}}]


def call_body(seconds: float) -> dict[str, Any]:
    return {"remotename": DEMO, "function": "slow", "args": {"seconds": seconds}}


def result_frame(request_id: str, seconds: float) -> dict[str, Any]:
    # The public Horde client's shape: the fields under ``body``.
    return {"action": "remote-call-result", "body": {"requestId": request_id, "result": {"slept": seconds}}}


async def serve_demo(session: LiveSession) -> None:
    reply = await session.request("remote-connect", {"remotename": DEMO, "functions": SLOW})
    assert reply["message"] == "remote connected", reply


async def test_a_late_result_of_a_call_through_one_process_does_not_answer_a_call_through_the_other() -> None:
    with instance(postgres=True, redis=True, database_prefix="dispatch_reqids_") as inst:
        a, b = inst.serve(wait=False), inst.serve(wait=False)  # both start at once
        a.wait_healthy()
        b.wait_healthy()
        async with LiveSession.open(b.ws_url, inst.admin_token) as caller:
            async with LiveSession.open(a.ws_url, inst.admin_token) as first_socket:
                await serve_demo(first_socket)
                old_nonce = await caller.send_request("remote-call", call_body(5))
                old = await first_socket.next_event()  # crossed Redis from B to A
            assert await caller.reply(old_nonce) == {"error": f"remote '{DEMO}' disconnected", "nonce": old_nonce}

            async with LiveSession.open(b.ws_url, inst.admin_token) as second_socket:
                await serve_demo(second_socket)
                nonce = await caller.send_request("remote-call", call_body(10))
                new = await second_socket.next_event()
                # The client's late answer to the old call comes first, on its new socket.
                await second_socket.send(result_frame(old["requestId"], 5))
                await second_socket.send(result_frame(new["requestId"], 10))
                assert await caller.reply(nonce) == {"result": {"slept": 10}, "nonce": nonce}
