"""Hostile parameter schemas cannot reach the network or stall the server (remotes.schemas)."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest

from remotes.services import RemoteError, RemoteRoute, check_arguments

pytestmark = pytest.mark.django_db(transaction=True)


def tools_with(parameters: dict) -> list[dict]:
    return [{"name": "f", "description": "", "parameters": parameters}]


async def test_it_refuses_a_schema_with_a_remote_ref(ws_connect, owner_token):
    async with ws_connect(token=owner_token) as ws:
        for ref in ("http://127.0.0.1:1/secret", "file:///etc/passwd", "other.json#/x"):
            schema = {"type": "object", "properties": {"a": {"$defs": {"x": {"$ref": ref}}}}}
            reply = await ws.request("remote-connect", {"remotename": "ssrf", "tools": tools_with(schema)})
            assert reply["error"].startswith("invalid tools[0].parameters: only local $ref"), reply


async def test_local_refs_still_work(ws_connect, owner_token):
    schema = {
        "type": "object",
        "$defs": {"city": {"type": "string", "minLength": 2}},
        "properties": {"city": {"$ref": "#/$defs/city"}},
        "required": ["city"],
    }
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        assert (await server.request("remote-connect", {"remotename": "r", "tools": tools_with(schema)}))["message"]
        reply = await caller.request("remote-call", {"remotename": "r", "function": "f", "args": {"city": "R"}})
        assert "too short" in reply["error"]


def test_validation_never_fetches_a_url(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the validator tried to fetch a URL")

    monkeypatch.setattr(urllib.request, "urlopen", forbidden)
    route = RemoteRoute(
        remote_id=987654,
        channel_name="x",
        server_process_id="p",
        tools=tools_with({"type": "object", "properties": {"a": {"$ref": "http://127.0.0.1:1/secret"}}}),
    )
    with pytest.raises(RemoteError) as refused:
        check_arguments(route, "ssrf", "f", {"a": "zzz"})
    assert refused.value.code == "INVALID_REQUEST"


async def test_a_catastrophic_pattern_fails_the_call_without_freezing_the_server(ws_connect, owner_token):
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a+)+$"}}}
    async with ws_connect(token=owner_token) as server, ws_connect(token=owner_token) as caller:
        await server.request("remote-connect", {"remotename": "redos", "tools": tools_with(schema)})
        started = time.monotonic()
        await caller.send(
            {
                "action": "remote-call",
                "nonce": "slow",
                "body": {"remotename": "redos", "function": "f", "args": {"a": "a" * 40 + "!"}},
            }
        )
        # The server keeps answering while the pattern is being tried.
        pong = await caller.request("ping")
        assert pong["pong"] is True
        reply = await caller.reply("slow", timeout=5)
        assert "does not match" in reply["error"] or "took too long" in reply["error"]
        assert time.monotonic() - started < 3
        assert await server.nothing_received()  # the call never reached the remote
        await asyncio.sleep(0)
