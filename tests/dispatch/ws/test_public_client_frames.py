"""What the public Horde remote client (hordelab/remote-center, Node) sends, in raw frames,
against the real consumer through the real router (docs/ws-protocol.md)."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.smoke]

DEMO = "remote-center/demo"
SPECS = [
    {
        "name": name,
        "description": f"{name} in the space",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
    for name in ["list-dir", "read-file", "write-file", "delete-file", "search", "stat"]
]


async def login(ws, token: str) -> None:
    await ws.send({"token": token})
    reply = await ws.recv()
    assert reply == {"ok": True, "user": "alice"}  # no action: the client's login step takes it


def call(nonce: str, function: str = "list-dir", remotename: str = DEMO) -> dict[str, Any]:
    return {
        "action": "remote-call",
        "nonce": nonce,
        "body": {"remotename": remotename, "function": function, "args": {"path": ""}},
    }


async def test_the_public_clients_frames(ws_connect, owner_token):
    async with ws_connect() as client, ws_connect(token=owner_token) as caller:
        await login(client, owner_token)
        await client.send({"action": "remote-connect", "nonce": 0, "body": {"remotename": DEMO, "functions": SPECS}})
        assert await client.reply(0) == {"message": "remote connected", "remotename": DEMO, "nonce": 0}
        await client.send({"action": "ping", "nonce": 4, "body": {}})
        assert await client.reply(4) == {"pong": True, "nonce": 4}

        await caller.send(call("c0"))
        event = await client.next_event()
        request_id = event.pop("requestId")
        assert request_id.startswith(f"{DEMO}#")  # opaque, never issued twice (docs/ws-protocol.md#request-ids)
        assert event == {"action": "remote-call", "remotename": DEMO, "function": "list-dir", "args": {"path": ""}}
        await client.send({"action": "remote-call-result", "body": {"requestId": request_id, "result": {"items": []}}})
        assert await caller.reply("c0") == {"result": {"items": []}, "nonce": "c0"}

        # A function file changes: disconnect (nonce 8) then connect (nonce 9), a call in flight.
        await caller.send(call("old"))
        old = await client.next_event()
        await client.send({"action": "remote-disconnect", "nonce": 8, "body": {"remotename": DEMO}})
        assert (await client.reply(8))["message"] == "remote disconnected"
        assert await caller.reply("old") == {"error": f"remote '{DEMO}' disconnected", "nonce": "old"}
        await client.send({"action": "remote-connect", "nonce": 9, "body": {"remotename": DEMO, "functions": SPECS}})
        assert (await client.reply(9))["message"] == "remote connected"
        await caller.send(call("new"))
        new = await client.next_event()
        assert len({request_id, old["requestId"], new["requestId"]}) == 3
        await client.send(
            {"action": "remote-call-result", "body": {"requestId": old["requestId"], "result": {"items": ["stale"]}}}
        )
        await client.send(
            {"action": "remote-call-result", "body": {"requestId": new["requestId"], "result": {"items": ["fresh"]}}}
        )
        assert await caller.reply("new") == {"result": {"items": ["fresh"]}, "nonce": "new"}

        # create_space: an empty remote.
        await client.send(
            {"action": "remote-connect", "nonce": 5, "body": {"remotename": "remote-center/fresh", "functions": []}}
        )
        assert (await client.reply(5))["message"] == "remote connected"
        listed = (await caller.request("remote-list"))["remotes"]
        assert {entry["remotename"] for entry in listed} == {DEMO}


async def test_two_copies_with_the_same_names(ws_connect, owner_token):
    async with ws_connect() as first, ws_connect() as second:
        await login(first, owner_token)
        await login(second, owner_token)
        await first.send({"action": "remote-connect", "nonce": 0, "body": {"remotename": DEMO, "functions": SPECS}})
        assert (await first.reply(0))["message"] == "remote connected"
        await second.send({"action": "remote-connect", "nonce": 0, "body": {"remotename": DEMO, "functions": SPECS}})
        assert "already connected" in (await second.reply(0))["error"]
        # The second copy's file-change disconnect removes the first copy's name; the holder hears of it.
        await second.send({"action": "remote-disconnect", "nonce": 8, "body": {"remotename": DEMO}})
        assert (await second.reply(8))["message"] == "remote disconnected"
        event = await first.next_event(timeout=5)
        assert event["action"] == "remote-disconnected" and event["remotename"] == DEMO and event["reason"]
