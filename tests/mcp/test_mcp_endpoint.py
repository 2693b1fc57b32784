"""The MCP endpoint against a real ``manage.py serve``, driven by the SDK's own
streamable-HTTP client (docs/mcp.md).

One server for the module; ``admin`` has the ``weather-service`` remote (served by the
client library in a subprocess) and no machine; the machine tests use a user of their
own with real shims.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS, CallToolResult, TextContent

from examples.weather_service import get_forecast
from tests.infra import PYTHON, Instance, Server, instance, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MACHINE_TOOLS = {
    "list_machines",
    "local_pc_execute_command",
    "local_pc_file_read",
    "local_pc_file_write",
    "local_pc_file_list",
    "local_pc_file_stat",
    "local_pc_file_delete",
    "local_pc_file_move",
    "local_pc_file_copy",
    "local_pc_pipe",
    "local_pc_command_start",
    "local_pc_command_read",
    "local_pc_command_wait",
    "local_pc_command_cancel",
}
# The agent tools of a user token (dispatch_event is for agent tokens only).
AGENT_TOOLS = {
    "list_agents",
    "get_agent_history",
    "dispatch_launch_agent",
    "dispatch_send_message",
    "message_status",
    "list_approvals",  # docs/agents.md#approvals
    "answer_approval",
}
FORECAST_TOOL = "remote__weather-service__get_forecast"
# "legacy": the initialize handshake (2025-11-25); "auto": server/discover, 2026-07-28.
MODES = ["legacy", "auto"]


@dataclass
class Live:
    instance: Instance
    server: Server
    token: str  # ``admin``'s, whose weather-service remote is connected

    @property
    def mcp_url(self) -> str:
        return f"{self.server.url}/mcp"


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    with instance() as inst:
        server = inst.serve()
        token = inst.admin_token
        connection = ["--url", server.ws_url, "--token", token]
        serving = inst.spawn(
            [PYTHON, "-m", "remotes.client", "serve", "examples/weather_service.py:remote", *connection],
            name="weather-service",
        )
        wait_until(
            lambda: server.remote_names(token) == ["weather-service"],
            timeout=20,
            what="the weather-service remote to connect",
            details=serving.log,
        )
        yield Live(instance=inst, server=server, token=token)


@asynccontextmanager
async def mcp_client(url: str, token: str, mode: str = "legacy") -> AsyncIterator[Client]:
    """The SDK's ``Client`` over its streamable-HTTP transport, with a bearer token."""
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=30) as http:
        async with Client(streamable_http_client(url, http_client=http), mode=mode) as client:
            yield client


def text_of(result: CallToolResult) -> str:
    [block] = result.content
    assert isinstance(block, TextContent)
    return block.text


@pytest.mark.parametrize("mode", MODES)
async def test_it_lists_the_machine_tools_and_the_users_remote_functions(live: Live, mode: str) -> None:
    async with mcp_client(live.mcp_url, live.token, mode) as client:
        assert client.server_info is None or client.server_info.name == "dispatch"
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert MACHINE_TOOLS | AGENT_TOOLS <= set(tools)
    assert set(tools) - MACHINE_TOOLS - AGENT_TOOLS == {FORECAST_TOOL}
    assert list(tools)[-1] == FORECAST_TOOL  # native tools first
    forecast = tools[FORECAST_TOOL]
    assert forecast.input_schema["required"] == ["city"]
    assert "weather-service" in (forecast.description or "")
    assert "Retrieve weather forecast" in (forecast.description or "")
    assert "No machine is attached" in (tools["local_pc_execute_command"].description or "")


@pytest.mark.parametrize("mode", MODES)
async def test_it_calls_a_remote_function_and_returns_its_result(live: Live, mode: str) -> None:
    async with mcp_client(live.mcp_url, live.token, mode) as client:
        result = await client.call_tool(FORECAST_TOOL, {"city": "Rome"})
    assert not result.is_error, result
    assert json.loads(text_of(result)) == get_forecast("Rome")
    assert result.structured_content == get_forecast("Rome")


@pytest.mark.parametrize("mode", MODES)
async def test_a_machine_tool_without_a_machine_is_an_error_result_naming_the_code(live: Live, mode: str) -> None:
    async with mcp_client(live.mcp_url, live.token, mode) as client:
        result = await client.call_tool("local_pc_execute_command", {"argv": ["true"]})
    assert result.is_error
    assert text_of(result).startswith("MACHINE_NOT_ATTACHED: ")


@pytest.mark.parametrize("mode", MODES)
async def test_arguments_failing_the_schema_are_an_invalid_request_error_result(live: Live, mode: str) -> None:
    async with mcp_client(live.mcp_url, live.token, mode) as client:
        machine = await client.call_tool("local_pc_execute_command", {"argv": "not-a-list"})
        remote = await client.call_tool(FORECAST_TOOL, {"town": "Rome"})
    assert machine.is_error and text_of(machine).startswith("INVALID_REQUEST: "), machine
    assert "argv" in text_of(machine)
    assert remote.is_error and text_of(remote).startswith("INVALID_REQUEST: "), remote
    assert "'town' was unexpected" in text_of(remote)


@pytest.mark.parametrize("mode", MODES)
async def test_an_unknown_tool_is_a_json_rpc_invalid_params_error(live: Live, mode: str) -> None:
    async with mcp_client(live.mcp_url, live.token, mode) as client:
        with pytest.raises(MCPError) as raised:
            await client.call_tool("remote__no-such-remote__get_forecast", {"city": "Rome"})
    assert raised.value.code == INVALID_PARAMS
    assert "no-such-remote" in raised.value.message


async def test_another_users_remote_is_not_among_their_tools(live: Live) -> None:
    live.instance.create_user("erin")
    async with mcp_client(live.mcp_url, live.instance.token("erin")) as client:
        names = {tool.name for tool in (await client.list_tools()).tools}
        with pytest.raises(MCPError) as raised:
            await client.call_tool(FORECAST_TOOL, {"city": "Rome"})
    assert names == MACHINE_TOOLS | AGENT_TOOLS
    assert raised.value.code == INVALID_PARAMS


INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
}


INVALID_TOKEN = 'Bearer error="invalid_token"'


@pytest.mark.parametrize(
    ("authorization", "code", "challenge"),
    [
        (None, "NOT_AUTHENTICATED", "Bearer"),
        ("Bearer not-a-real-token", "AUTHENTICATION_FAILED", INVALID_TOKEN),
        ("Basic YWRtaW46cHc=", "NOT_AUTHENTICATED", "Bearer"),
        ("Bearer", "NOT_AUTHENTICATED", "Bearer"),
    ],
)
def test_it_refuses_a_request_without_a_valid_token_with_401_and_the_rfc_6750_challenge(
    live: Live, authorization: str | None, code: str, challenge: str
) -> None:
    """RFC 6750 §3.1: ``invalid_token`` for a bad token, no error code when none was sent;
    never ``resource_metadata`` (no OAuth discovery on ``/mcp``)."""
    headers = {"Accept": "application/json, text/event-stream"}
    if authorization is not None:
        headers["Authorization"] = authorization
    response = httpx.post(live.mcp_url, json=INITIALIZE, headers=headers, timeout=10)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == challenge
    assert response.json()["error"]["code"] == code


def test_a_revoked_token_is_refused(live: Live) -> None:
    token = live.instance.token("admin")
    headers = {"Accept": "application/json, text/event-stream", "Authorization": f"Bearer {token}"}
    assert httpx.post(live.mcp_url, json=INITIALIZE, headers=headers, timeout=10).status_code == 200
    live.instance.manage(
        "shell", "-c", f"from core.models import ApiToken; ApiToken.objects.filter(prefix={token[:8]!r}).delete()"
    )
    refused = httpx.post(live.mcp_url, json=INITIALIZE, headers=headers, timeout=10)
    assert refused.status_code == 401
    assert refused.headers["WWW-Authenticate"] == INVALID_TOKEN


def test_a_browser_origin_outside_allowed_hosts_is_refused(live: Live) -> None:
    headers = {
        "Accept": "application/json, text/event-stream",
        "Authorization": f"Bearer {live.token}",
        "Origin": "http://evil.example",
    }
    assert httpx.post(live.mcp_url, json=INITIALIZE, headers=headers, timeout=10).status_code == 403
    headers["Origin"] = live.server.url
    assert httpx.post(live.mcp_url, json=INITIALIZE, headers=headers, timeout=10).status_code == 200


def test_a_host_outside_allowed_hosts_is_refused(live: Live) -> None:
    headers = {
        "Accept": "application/json, text/event-stream",
        "Authorization": f"Bearer {live.token}",
        "Host": "rebound.example",
    }
    assert httpx.post(live.mcp_url, json=INITIALIZE, headers=headers, timeout=10).status_code == 421


def test_the_rest_of_the_site_is_still_django(live: Live) -> None:
    assert live.server.get("/healthz").status_code == 200
    assert live.server.get("/mcpx").status_code == 404
    assert live.server.get("/api/v1/remotes", live.token).json()["remotes"][0]["remotename"] == "weather-service"


# --- machines ---------------------------------------------------------------------------


def tool_descriptions(tools: Any) -> dict[str, str]:
    return {tool.name: tool.description or "" for tool in tools.tools}


async def test_descriptions_follow_the_machines_attached_at_each_request(live: Live, tmp_path: Path) -> None:
    live.instance.create_user("dana")
    token = live.instance.token("dana")
    roots = {name: tmp_path / f"root-{name}" for name in ("alpha", "beta")}
    for root in roots.values():
        root.mkdir()

    def start(name: str) -> Any:
        return live.instance.shim(name, roots[name], "--session", "default", token=token, state_dir=tmp_path / name)

    async with mcp_client(live.mcp_url, token) as client:
        alpha = start("alpha")
        try:
            one = tool_descriptions(await client.list_tools())
            assert "Attached machine: alpha." in one["local_pc_execute_command"]

            listed = await client.call_tool("list_machines", {})
            assert not listed.is_error, listed
            assert [m["machine_id"] for m in json.loads(text_of(listed))] == [alpha.machine_id]

            ran = await client.call_tool("local_pc_execute_command", {"argv": ["pwd"]})
            assert not ran.is_error, ran
            assert ran.structured_content is not None
            assert ran.structured_content["machine_id"] == alpha.machine_id
            assert ran.structured_content["stdout"].strip() == str(roots["alpha"].resolve())

            beta = start("beta")
            try:
                two = tool_descriptions(await client.list_tools())
                described = two["local_pc_execute_command"]
                assert "Attached machines: alpha" in described and "beta" in described
                assert described != one["local_pc_execute_command"]
            finally:
                beta.stop()
        finally:
            alpha.stop()


# --- bad input: every entry point says what was wrong --------------------------------


def call(name: Any, arguments: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": name, "arguments": arguments}}


def answer_of(response: httpx.Response) -> Any:
    """The JSON-RPC answer of a POST: the JSON body, or — a tool call answered as server-sent
    events — the last ``data:`` message of the stream."""
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        return response.json()
    messages = [json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data:") and line[5:]]
    return messages[-1]


BAD_BODIES: list[tuple[str, bytes, int, int | None]] = [
    # (case, body, HTTP status, JSON-RPC error code)
    ("invalid JSON", b"{not json", 400, -32700),
    # a lone surrogate in the arguments: an isError result naming the field (below)
    ("a lone surrogate", json.dumps(call("list_machines", {"session_id": "\ud800"})).encode(), 200, None),
    ("a batch", json.dumps([INITIALIZE, INITIALIZE]).encode(), 400, -32602),
    ("a bare string", b'"tools/list"', 400, -32602),
    ("an unknown method", b'{"jsonrpc": "2.0", "id": 2, "method": "no/such"}', 200, -32601),
    ("arguments that are not an object", json.dumps(call("list_machines", [1])).encode(), 200, -32602),
    ("a tool name that is not a string", json.dumps(call(5, {})).encode(), 200, -32602),
    ("a huge unknown tool name", json.dumps(call("x" * 100_000, {})).encode(), 200, -32602),
    # ids MCP does not allow: the SDK took these for notifications (202, no answer)
    ("a fractional id", b'{"jsonrpc": "2.0", "id": 1.5, "method": "tools/list"}', 400, -32600),
    ("an object id", b'{"jsonrpc": "2.0", "id": {"x": 1}, "method": "tools/list"}', 400, -32600),
    ("a NaN id", b'{"jsonrpc": "2.0", "id": NaN, "method": "tools/list"}', 400, -32600),
    ("a null id", b'{"jsonrpc": "2.0", "id": null, "method": "tools/list"}', 400, -32600),
    ("an id over 64 bits", b'{"jsonrpc": "2.0", "id": 99999999999999999999999, "method": "tools/list"}', 400, -32600),
    # serve's cap (DISPATCH_MAX_REQUEST_BYTES, 16 MiB) refuses it before MCP sees it.
    ("a body over 16 MiB", b"[" + b"1," * (8 * 1024 * 1024) + b"1]", 413, None),
]


@pytest.mark.parametrize(("case", "body", "status", "code"), BAD_BODIES, ids=[case[0] for case in BAD_BODIES])
def test_it_answers_bad_input_with_a_clear_error_and_keeps_serving(
    live: Live, case: str, body: bytes, status: int, code: int | None
) -> None:
    headers = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {live.token}",
    }
    response = httpx.post(live.mcp_url, content=body, headers=headers, timeout=30)
    assert response.status_code == status, response.text
    if code is not None:
        error = answer_of(response)["error"]
        assert error["code"] == code
        assert len(error["message"]) < 2000
    if case == "a lone surrogate":
        result = answer_of(response)["result"]
        assert result["isError"] is True
        assert result["content"][0]["text"].startswith("INVALID_REQUEST: arguments.session_id: a string holds a")
    assert live.server.running, live.server.log()
    assert live.server.remote_names(live.token) == ["weather-service"]


def test_it_refuses_a_body_that_is_not_json_by_content_type(live: Live) -> None:
    headers = {"Accept": "application/json", "Content-Type": "text/plain", "Authorization": f"Bearer {live.token}"}
    assert httpx.post(live.mcp_url, json=INITIALIZE, headers=headers, timeout=10).status_code == 400


@pytest.mark.parametrize("method", ["DELETE", "PUT"])
def test_it_answers_405_to_a_put_and_to_a_delete_without_a_session(live: Live, method: str) -> None:
    headers = {"Accept": "text/event-stream", "Authorization": f"Bearer {live.token}"}
    response = httpx.request(method, live.mcp_url, headers=headers, timeout=10)
    assert response.status_code == 405
    assert response.headers["Allow"] == "GET, POST, DELETE"


def initialize(url: str, token: str, protocol_version: str = "2025-11-25") -> httpx.Response:
    params = {"protocolVersion": protocol_version, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
    body = {**INITIALIZE, "params": params}
    headers = {"Accept": "application/json, text/event-stream", "Authorization": f"Bearer {token}"}
    response = httpx.post(url, json=body, headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    return response


def test_initialize_issues_a_session_id_that_works_with_its_own_token_only(live: Live) -> None:
    session = initialize(live.mcp_url, live.token).headers["Mcp-Session-Id"]
    assert session.isascii() and session.isprintable() and " " not in session
    assert initialize(live.mcp_url, live.token).headers["Mcp-Session-Id"] != session  # one per initialize
    assert initialize(live.mcp_url, live.token, "2025-03-26").headers.get("Mcp-Session-Id")
    assert "Mcp-Session-Id" not in initialize(live.mcp_url, live.token, "2024-11-05").headers  # HTTP+SSE era

    def post(token: str, session_id: str) -> httpx.Response:
        headers = {
            "Accept": "application/json, text/event-stream",
            "Authorization": f"Bearer {token}",
            "MCP-Protocol-Version": "2025-11-25",
            "Mcp-Session-Id": session_id,
        }
        body = {"jsonrpc": "2.0", "id": 7, "method": "tools/list"}
        return httpx.post(live.mcp_url, json=body, headers=headers, timeout=10)

    assert post(live.token, session).status_code == 200
    other_token = live.instance.token("admin")  # the same user, another credential
    nonce, _, signature = session.partition(":")
    for refused in (
        post(other_token, session),
        post(live.token, f"{nonce}x:{signature}"),
        post(live.token, f"{nonce}:{signature[:-2]}"),
        post(live.token, "not-a-session"),
    ):
        assert refused.status_code == 404, refused.text
        assert refused.json()["id"] == 7
        assert refused.json()["error"]["message"].startswith("Session not found")
    # Any process could have issued it: nothing is kept, so a DELETE frees nothing and says so.
    delete_headers = {"Authorization": f"Bearer {live.token}", "Mcp-Session-Id": session}
    assert httpx.delete(live.mcp_url, headers=delete_headers, timeout=10).status_code == 204
    assert httpx.delete(live.mcp_url, headers={**delete_headers, "Mcp-Session-Id": "x"}, timeout=10).status_code == 404
    stream_headers = {**delete_headers, "Accept": "text/event-stream", "Mcp-Session-Id": f"{nonce}:x"}
    assert httpx.get(live.mcp_url, headers=stream_headers, timeout=10).status_code == 404
    # The token is checked first: a revoked token's session gets 401, not 404.
    live.instance.manage(
        "shell", "-c", f"from core.models import ApiToken; ApiToken.objects.filter(prefix={other_token[:8]!r}).delete()"
    )
    other_session = initialize(live.mcp_url, live.token).headers["Mcp-Session-Id"]
    assert post(other_token, other_session).status_code == 401


@pytest.mark.parametrize("method", ["POST", "GET"])
def test_an_unsupported_protocol_version_header_is_a_400_naming_the_header_and_the_supported_versions(
    live: Live, method: str
) -> None:
    headers = {
        "Accept": "application/json, text/event-stream",
        "Authorization": f"Bearer {live.token}",
        "MCP-Protocol-Version": "2099-01-01",
    }
    body = {"jsonrpc": "2.0", "id": 3, "method": "tools/list"}
    response = httpx.request(method, live.mcp_url, json=body if method == "POST" else None, headers=headers, timeout=10)
    assert response.status_code == 400
    error = response.json()["error"]
    assert response.json()["id"] == (3 if method == "POST" else None)
    assert error["message"].startswith("Unsupported MCP-Protocol-Version header '2099-01-01'")
    for version in ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25", "2026-07-28"):
        assert version in error["message"]
    assert error["data"] == {
        "supported": ["2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25", "2026-07-28"],
        "requested": "2099-01-01",
    }


async def test_an_invalid_session_id_is_an_invalid_request_error_result(live: Live) -> None:
    async with mcp_client(live.mcp_url, live.token) as client:
        result = await client.call_tool("list_machines", {"session_id": "not a session!"})
    assert result.is_error
    assert text_of(result).startswith("INVALID_REQUEST: session_id must be")
