"""Tool arguments the channel layer cannot carry are refused at the MCP edge
(docs/mcp.md#results-and-errors): integers outside signed 64 bits, NaN/Infinity, lone
surrogates, nesting over 64 levels. The SDK's JSON parsers let them through, and on Redis a
big integer then failed inside msgpack and the caller waited the full timeout. Each is an
``isError`` result naming the field, at once, and the remote never sees a call.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from dispatch.mcp.server import uncarriable
from tests.infra import Instance, Server, instance
from tests.live_clients import LiveSession
from tests.mcp.test_mcp_endpoint import answer_of, text_of

pytestmark = [pytest.mark.integration, pytest.mark.redis, pytest.mark.timeout(120)]

ANYTHING = [{"name": "echo", "description": "echo", "parameters": {"type": "object"}}]
TOOL = "remote__anything__echo"
DEEP = "[" * 70 + "]" * 70

# (case, the JSON text of the arguments, the field the error must name)
BAD_ARGUMENTS = [
    ("an integer over 2**63-1", '{"n": 9223372036854775808}', "arguments.n: integer 9223372036854775808"),
    ("an integer under -2**63", '{"a": [1, -9223372036854775809]}', "arguments.a[1]: integer"),
    ("NaN", '{"x": {"y": NaN}}', "arguments.x.y: nan is not a finite number"),
    ("Infinity", '{"x": Infinity}', "arguments.x: inf is not a finite number"),
    ("1e400", '{"x": -1e400}', "arguments.x: -inf is not a finite number"),
    ("nesting over 64 levels", '{"deep": ' + DEEP + "}", "nested too deeply (more than 64 levels)"),
]


@dataclass
class Live:
    instance: Instance
    server: Server


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    with instance(redis=True) as inst:
        yield Live(instance=inst, server=inst.serve())


def test_the_edge_check_names_the_field() -> None:
    assert uncarriable({"n": 2**63 - 1, "m": -(2**63), "f": 1.5, "s": "é", "t": True}) is None
    assert uncarriable({"k": {"\ud800": 1}}) == (
        "arguments.k: a key holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text"
    )
    assert uncarriable({"s": ["ok", "\udfff"]}) == (
        "arguments.s[1]: a string holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text"
    )


@pytest.mark.parametrize(("case", "arguments", "named"), BAD_ARGUMENTS, ids=[case[0] for case in BAD_ARGUMENTS])
async def test_a_tool_call_with_an_uncarriable_argument_is_an_error_result_naming_the_field(
    live: Live, case: str, arguments: str, named: str
) -> None:
    token = live.instance.admin_token
    async with LiveSession.open(live.server.ws_url, token) as remote:
        reply = await remote.request("remote-connect", {"remotename": "anything", "functions": ANYTHING})
        assert "error" not in reply, reply
        envelope = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": TOOL, "arguments": "ARGS"}}
        body = json.dumps(envelope).replace('"ARGS"', arguments)
        headers = {
            "Accept": "application/json, text/event-stream",
            "Content-Type": "application/json",
            "Authorization": f"Bearer {token}",
        }
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=30) as http:
            response = await http.post(f"{live.server.url}/mcp", content=body, headers=headers)
        assert time.monotonic() - started < 3
        assert response.status_code == 200, response.text
        result = answer_of(response)["result"]
        assert result["isError"] is True
        text = result["content"][0]["text"]
        assert text.startswith("INVALID_REQUEST: ") and named in text, text
        await asyncio.sleep(0.2)
        assert not [frame for frame in remote.frames if frame.get("action") == "remote-call"]
        await remote.request("remote-disconnect", {"remotename": "anything"})


async def test_a_lone_surrogate_outside_the_arguments_is_a_json_rpc_error_naming_it(live: Live) -> None:
    body = '{"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "x\\ud800", "arguments": {}}}'
    headers = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {live.instance.admin_token}",
        "MCP-Protocol-Version": "2025-11-25",
    }
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(f"{live.server.url}/mcp", content=body, headers=headers)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["id"] == 3 and error["error"]["code"] == -32602
    assert error["error"]["message"].startswith("Invalid request: params.name: a string holds a lone surrogate")


class LoneSurrogate(httpx2.AsyncBaseTransport):
    """Rewrites ``MARK`` in request bodies into the JSON escape ``\\ud800`` (no client sends one)."""

    MARK = "@@lone-surrogate@@"

    def __init__(self) -> None:
        self.inner = httpx2.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        body = await request.aread()
        if self.MARK.encode() in body:
            body = body.replace(self.MARK.encode(), b"\\ud800")
            headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
            request = httpx2.Request(request.method, request.url, headers=headers, content=body)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_a_lone_surrogate_argument_is_refused_at_both_protocol_versions(live: Live, mode: str) -> None:
    token = live.instance.admin_token
    async with LiveSession.open(live.server.ws_url, token) as remote:
        await remote.request("remote-connect", {"remotename": "anything", "functions": ANYTHING})
        headers = {"Authorization": f"Bearer {token}"}
        async with (
            httpx2.AsyncClient(transport=LoneSurrogate(), headers=headers, timeout=30) as http,
            Client(streamable_http_client(f"{live.server.url}/mcp", http_client=http), mode=mode) as client,
        ):
            # At 2025-11-25 the SDK's own parser used to refuse it first, as a bare -32700
            # "unexpected end of hex escape"; Dispatch's edge now names the field there too.
            result = await client.call_tool(TOOL, {"text": f"a{LoneSurrogate.MARK}b"})
            assert result.is_error, result
            assert text_of(result).startswith("INVALID_REQUEST: arguments.text: a string holds a lone")
        await asyncio.sleep(0.2)
        assert not [frame for frame in remote.frames if frame.get("action") == "remote-call"]
        await remote.request("remote-disconnect", {"remotename": "anything"})
