"""The ``/mcp`` ASGI app in process: routing, the lazy start of the session manager,
refusals before the SDK is reached (docs/mcp.md#endpoint-and-authentication)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from dispatch.mcp import app as mcp_app


async def asgi_post(application: Any, path: str, headers: list[tuple[bytes, bytes]] | None = None) -> dict[str, Any]:
    """Run one ``POST path`` through ``application``; returns ``{status, headers, body}``."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "query_string": b"",
        "headers": [(b"host", b"127.0.0.1:8000"), *(headers or [])],
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await application(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return {"status": start["status"], "headers": dict(start["headers"]), "body": body}


async def test_concurrent_first_requests_start_one_session_manager() -> None:
    try:
        managers = await asyncio.gather(*(mcp_app.ensure_started() for _ in range(5)))
        assert len({id(manager) for manager in managers}) == 1
        assert managers[0]._task_group is not None  # its run() is entered
        assert await mcp_app.ensure_started() is managers[0]
    finally:
        await mcp_app.shutdown()
    assert managers[0]._task_group is None  # run() has exited


async def test_only_mcp_paths_reach_the_mcp_app() -> None:
    seen: list[str] = []

    async def django(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    routed = mcp_app.with_mcp(django)
    for path in ("/", "/mcpx", "/api/v1/mcp", "/healthz"):
        assert (await asgi_post(routed, path))["status"] == 204
    assert seen == ["/", "/mcpx", "/api/v1/mcp", "/healthz"]
    for path in ("/mcp", "/mcp/"):
        assert (await asgi_post(routed, path))["status"] == 401  # no token
    assert (await asgi_post(routed, "/mcp/other"))["status"] == 404
    assert seen == ["/", "/mcpx", "/api/v1/mcp", "/healthz"]


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ([], 401),
        ([(b"authorization", b"Token abc")], 401),
        ([(b"origin", b"https://evil.example")], 403),
        ([(b"origin", b"null")], 403),
        ([(b"origin", b"http://localhost:3000")], 401),
    ],
)
async def test_it_refuses_before_the_sdk_sees_the_request(headers: list[tuple[bytes, bytes]], status: int) -> None:
    answer = await asgi_post(mcp_app.mcp_app, "/mcp", headers)
    assert answer["status"] == status
    if status == 401:
        assert answer["headers"][b"www-authenticate"] == b"Bearer"
        assert b'"NOT_AUTHENTICATED"' in answer["body"]
