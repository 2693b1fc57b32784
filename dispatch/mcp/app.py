"""The ASGI application for ``/mcp`` (spec/agents.md §6).

Each request: ``Host`` (and ``Origin``, when a browser sends one) checked against
``ALLOWED_HOSTS`` the way Django checks them; ``Authorization: Bearer <user API token or agent token>``
authenticated (401 with ``WWW-Authenticate: Bearer`` otherwise, in the REST error shape;
an agent token makes that agent the caller, ``dispatch.agents.tokens``);
then the SDK's ``StreamableHTTPSessionManager`` answers POSTs, **stateless** (any server
process can answer any request) with JSON responses; ``GET`` is the 2025-11-25 event
stream, answered by ``dispatch.mcp.events`` (the SDK serves none when stateless); other
methods get 405.

Daphne sends no ASGI lifespan events, so the session manager is started lazily by the
first request on an event loop (``ensure_started``), and runs until ``shutdown`` or the
end of the process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.http.request import split_domain_port, validate_host
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from dispatch.errors import DispatchError
from dispatch.http import NOT_AUTHENTICATED, bearer_caller, bearer_credentials
from dispatch.mcp.events import event_stream
from dispatch.mcp.server import CALLER_SCOPE_KEY, TOKEN_SCOPE_KEY, Caller, build_server

logger = logging.getLogger(__name__)

MCP_PATH = "/mcp"


class _Running:
    """The session manager of one event loop and the task holding its ``run()`` open."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        # Host and Origin are checked before the manager sees a request (``_refusal``),
        # with Django's own rules (wildcards included), so the SDK's copy stays off.
        self.manager = StreamableHTTPSessionManager(
            app=build_server(),
            stateless=True,
            json_response=True,
            security_settings=TransportSecuritySettings(enable_dns_rebinding_protection=False),
            # serve's body cap (DISPATCH_MAX_REQUEST_BYTES), not the SDK's 4 MiB: a 10 MiB
            # file write (base64 in JSON) must get through.
            max_request_body_size=settings.MAX_REQUEST_BYTES,
        )
        self.ready: asyncio.Future[None] = loop.create_future()
        self.task = loop.create_task(self._hold())

    async def _hold(self) -> None:
        try:
            async with self.manager.run():
                self.ready.set_result(None)
                await asyncio.Event().wait()  # until shutdown() cancels this task
        except BaseException as exc:
            if not self.ready.done():
                self.ready.set_exception(RuntimeError(f"the MCP session manager did not start: {exc!r}"))
            raise


_running: _Running | None = None


async def ensure_started() -> StreamableHTTPSessionManager:
    """The running session manager of the current event loop, started on first use.

    Idempotent and safe under concurrent first requests (no await between the check
    and the start). A new event loop (tests) gets a manager of its own: one manager
    runs only once and belongs to the loop it started on.
    """
    global _running
    loop = asyncio.get_running_loop()
    if _running is None or _running.loop is not loop or _running.task.done():
        _running = _Running(loop)
    running = _running
    await asyncio.shield(running.ready)
    return running.manager


async def shutdown() -> None:
    """Stop the session manager of the current loop, if one runs (for ``serve``'s shutdown)."""
    global _running
    running, _running = _running, None
    if running is not None and running.loop is asyncio.get_running_loop() and not running.task.done():
        running.task.cancel()
        await asyncio.gather(running.task, return_exceptions=True)


def _refusal(headers: Headers) -> Response | None:
    """421 for a ``Host`` outside ``ALLOWED_HOSTS``; 403 for a browser ``Origin`` outside it
    (DNS-rebinding protection, MCP "Streamable HTTP" security warning)."""
    domain, _port = split_domain_port(headers.get("host", ""))
    if not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
        return Response("Invalid Host header", status_code=421)
    origin = headers.get("origin")
    if origin is not None:
        hostname = urlsplit(origin).hostname or ""
        if ":" in hostname:
            hostname = f"[{hostname}]"
        if not hostname or not validate_host(hostname, settings.ALLOWED_HOSTS):
            return Response("Invalid Origin header", status_code=403)
    return None


async def authenticate(headers: Headers) -> Caller:
    """The caller of the request's ``Authorization: Bearer <token>``: a user API token
    gives ``Caller(user)``; an agent token (``DISPATCH_MCP_TOKEN``) gives
    ``Caller(agent.owner, agent)`` (spec/agents.md §6).

    Raises ``DispatchError`` ``NOT_AUTHENTICATED`` (no bearer token) or
    ``AUTHENTICATION_FAILED`` (unknown, revoked or expired token, inactive user, an agent
    that is not creating/running/stopping).
    """
    raw = bearer_credentials(headers.get("authorization", ""))
    if not raw:
        raise DispatchError("NOT_AUTHENTICATED", NOT_AUTHENTICATED)
    user, agent = await bearer_caller(raw)
    return Caller(user=user, agent=agent)


def _error_response(exc: DispatchError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if exc.http_status == 401 else None
    return JSONResponse(exc.as_dict(), status_code=exc.http_status, headers=headers)


async def mcp_app(scope: Scope, receive: Receive, send: Send) -> None:
    """ASGI app for ``/mcp``: checks, authentication, then the SDK's session manager."""
    if scope["type"] != "http":
        return
    if scope["path"] not in (MCP_PATH, MCP_PATH + "/"):
        await _error_response(DispatchError("NOT_FOUND", "not found"))(scope, receive, send)
        return
    headers = Headers(scope=scope)
    refusal = _refusal(headers)
    if refusal is not None:
        await refusal(scope, receive, send)
        return
    try:
        caller = await authenticate(headers)
    except DispatchError as exc:
        await _error_response(exc)(scope, receive, send)
        return
    raw_token = bearer_credentials(headers.get("authorization", "")) or ""
    if scope["method"] == "GET":
        await event_stream(scope, receive, send, caller=caller, raw_token=raw_token)
        return
    if scope["method"] != "POST":
        # Stateless: no session to resume or DELETE; the spec's answer is 405.
        await Response(status_code=405, headers={"Allow": "GET, POST"})(scope, receive, send)
        return
    manager = await ensure_started()
    await manager.handle_request({**scope, CALLER_SCOPE_KEY: caller, TOKEN_SCOPE_KEY: raw_token}, receive, send)


def with_mcp(django_app: Callable[..., Awaitable[None]]) -> ASGIApp:
    """``django_app`` with ``/mcp`` and ``/mcp/…`` answered by ``mcp_app`` instead."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        path: Any = scope.get("path", "")
        if path == MCP_PATH or path.startswith(MCP_PATH + "/"):
            await mcp_app(scope, receive, send)
        else:
            await django_app(scope, receive, send)

    return app
