"""The ASGI application for ``/mcp`` and ``/mcp/oauth`` (docs/mcp.md#transport).

Both serve the same MCP server; they differ in credentials. ``/mcp`` takes header tokens
(API and agent tokens) and never advertises OAuth; ``/mcp/oauth`` takes OAuth access tokens
issued for it (``authenticate_oauth``), whose scopes limit the tools, and answers 401 with
the challenge that starts an MCP client's OAuth sign-in (docs/mcp.md#oauth).

Each request: ``Host`` (and ``Origin``, when a browser sends one) checked against
``ALLOWED_HOSTS`` the way Django checks them; ``Authorization: Bearer <user API token or agent token>``
authenticated (401 otherwise, in the REST error shape, with ``WWW-Authenticate: Bearer``,
``Bearer error="invalid_token"`` for a bad token, RFC 6750 §3.1; an agent token makes that
agent the caller, ``agents.tokens``); an ``MCP-Protocol-Version`` header naming a version
the SDK does not speak refused (400); an ``Mcp-Session-Id`` header verified
(``dispatch.mcp.sessions``: 404 unless it was issued for this token;
docs/mcp.md#sessions); then the SDK's ``StreamableHTTPSessionManager`` answers POSTs, **stateless**
(any server process can answer any request; ``initialize`` gets a signed session id added
to its answer); ``GET`` is the 2025-11-25 event stream, answered by
``dispatch.mcp.events`` (the SDK serves none when stateless); ``DELETE`` of a session is
204 (nothing to free); other methods get 405.

A ``tools/call`` whose client accepts ``text/event-stream`` (as MCP asks every client to)
is answered as server-sent events by a second manager (``json_response=False``): the
JSON-response mode has no wire for request-scoped notifications, and a long tool call sends
``notifications/progress`` there (docs/live-operations.md#mcp-progress-and-cancellation).
Everything else — initialize, tools/list, a client that accepts only JSON — keeps its JSON
answer.

A client that closes a tool call's event stream before its answer cancels the call's
operations the same way. A ``notifications/cancelled`` POST (stateless: it may reach any
process, never the one running the call) is answered here, 202: the call it names is
found by its ``call_key`` (``dispatch.mcp.server.call_key``: the bearer token's hash, the
session's tag when the client sent an ``Mcp-Session-Id``, and the JSON-RPC id), and the
operations it started are cancelled wherever they run
(``machines.services.live.cancel_calls``). Two clients sharing a token, sending no
session id and reusing a request id cannot be told apart: both calls are cancelled.

Daphne sends no ASGI lifespan events, so the session manager is started lazily by the
first request on an event loop (``ensure_started``), and runs until ``shutdown`` or the
end of the process.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import pydantic_core
from channels.db import database_sync_to_async
from django.conf import settings
from django.http.request import split_domain_port, validate_host
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from mcp_types import INVALID_PARAMS, INVALID_REQUEST, UNSUPPORTED_PROTOCOL_VERSION
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, MODERN_PROTOCOL_VERSIONS
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agents.models import Agent
from core import wire
from core.errors import DispatchError, unavailable_error
from core.http import NOT_AUTHENTICATED, bearer_caller, bearer_credentials
from core.outage import RETRY_AFTER_SECONDS
from dispatch.mcp.events import accepts_event_stream, event_stream
from dispatch.mcp.server import (
    CALLER_SCOPE_KEY,
    SESSION_SCOPE_KEY,
    TOKEN_SCOPE_KEY,
    Caller,
    build_server,
    call_key,
    error_result,
    uncarriable,
)
from dispatch.mcp.sessions import SESSION_HEADER, session_issue, session_valid
from machines.services.live import cancel_calls
from oauth.resource import challenge as oauth_challenge
from oauth.resource import oauth_bearer

logger = logging.getLogger(__name__)

MCP_PATH = "/mcp"
PROTOCOL_VERSION_HEADER = "mcp-protocol-version"
SUPPORTED_VERSIONS = (*HANDSHAKE_PROTOCOL_VERSIONS, *MODERN_PROTOCOL_VERSIONS)
# The handshake versions whose transport (Streamable HTTP) has sessions: not 2024-11-05's HTTP+SSE.
SESSION_VERSIONS = tuple(version for version in HANDSHAKE_PROTOCOL_VERSIONS if version >= "2025-03-26")
INVALID_TOKEN_CHALLENGE = 'Bearer error="invalid_token"'
ALLOW = "GET, POST, DELETE"


def _manager(*, json_response: bool) -> StreamableHTTPSessionManager:
    # Host and Origin are checked before a manager sees a request (``_refusal``), with
    # Django's own rules (wildcards included), so the SDK's copy stays off.
    return StreamableHTTPSessionManager(
        app=build_server(),
        stateless=True,
        json_response=json_response,
        security_settings=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        # serve's body cap (DISPATCH_MAX_REQUEST_BYTES), not the SDK's 4 MiB: a 10 MiB
        # file write (base64 in JSON) must get through.
        max_request_body_size=settings.MAX_REQUEST_BYTES,
    )


class _Running:
    """The session managers of one event loop — ``manager`` answering JSON, ``streaming``
    answering tool calls as server-sent events — and the task holding their ``run()`` open."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.manager = _manager(json_response=True)
        self.streaming = _manager(json_response=False)
        self.ready: asyncio.Future[None] = loop.create_future()
        self.task = loop.create_task(self._hold())

    async def _hold(self) -> None:
        try:
            async with self.manager.run(), self.streaming.run():
                self.ready.set_result(None)
                await asyncio.Event().wait()  # until shutdown() cancels this task
        except BaseException as exc:
            if not self.ready.done():
                self.ready.set_exception(RuntimeError(f"the MCP session manager did not start: {exc!r}"))
            raise


_running: _Running | None = None


async def _started() -> _Running:
    global _running
    loop = asyncio.get_running_loop()
    if _running is None or _running.loop is not loop or _running.task.done():
        _running = _Running(loop)
    running = _running
    await asyncio.shield(running.ready)
    return running


async def ensure_started(*, streaming: bool = False) -> StreamableHTTPSessionManager:
    """The running session manager of the current event loop (``streaming``: the one
    answering server-sent events), both started on first use.

    Idempotent and safe under concurrent first requests (no await between the check
    and the start). A new event loop (tests) gets managers of its own: one manager
    runs only once and belongs to the loop it started on.
    """
    running = await _started()
    return running.streaming if streaming else running.manager


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
    ``Caller(agent.owner, agent)`` (docs/mcp.md#endpoint-and-authentication).

    Raises ``DispatchError`` ``NOT_AUTHENTICATED`` (no bearer token) or
    ``AUTHENTICATION_FAILED`` (unknown, revoked or expired token, inactive user, an agent
    that is not creating/running/stopping).
    """
    raw = bearer_credentials(headers.get("authorization", ""))
    if not raw:
        raise DispatchError("NOT_AUTHENTICATED", NOT_AUTHENTICATED)
    user, credential = await bearer_caller(raw)
    return Caller(user=user, agent=credential if isinstance(credential, Agent) else None)


async def authenticate_oauth(headers: Headers) -> Caller:
    """The caller of an OAuth access token on ``/mcp/oauth`` (docs/mcp.md#oauth):
    ``Caller(user, scopes=…, oauth_token_id=…)``. API and agent tokens are refused here,
    as OAuth tokens are on ``/mcp`` and the REST API: each resource takes its own tokens.

    Raises ``DispatchError`` ``NOT_AUTHENTICATED`` (no bearer token) or
    ``AUTHENTICATION_FAILED`` (``oauth.resource.oauth_bearer``).
    """
    raw = bearer_credentials(headers.get("authorization", ""))
    if not raw:
        raise DispatchError("NOT_AUTHENTICATED", NOT_AUTHENTICATED)
    bearer = await database_sync_to_async(oauth_bearer)(raw)
    return Caller(
        user=bearer.user,
        scopes=bearer.scopes,
        oauth_token_id=bearer.token_id,
        oauth_application_id=bearer.application_id,
        oauth_application_name=bearer.application_name,
    )


def oauth_identity(caller: Caller) -> str:
    """What an OAuth caller's MCP sessions and call keys are bound to in place of the raw
    token: its user and its application, the same across refreshes."""
    return f"oauth:{caller.user.pk}:{caller.oauth_application_id}"


def _error_response(exc: DispatchError, *, oauth: bool = False) -> Response:
    headers = None
    if exc.http_status == 401 and oauth:
        # RFC 9728 §5.1: the challenge names the resource's metadata, where the client
        # finds its authorization server (docs/mcp.md#oauth).
        sent = exc.code != "NOT_AUTHENTICATED"
        challenge = oauth_challenge("invalid_token", exc.message) if sent else oauth_challenge()
        headers = {"WWW-Authenticate": challenge}
    elif exc.http_status == 401:
        # RFC 6750 §3.1: a bad token is "invalid_token"; a request that sent none gets the
        # bare challenge. No resource_metadata: clients configured with a header token drop it
        # once they see OAuth discovery; /mcp/oauth is the OAuth resource.
        challenge = "Bearer" if exc.code == "NOT_AUTHENTICATED" else INVALID_TOKEN_CHALLENGE
        headers = {"WWW-Authenticate": challenge}
    elif exc.http_status == 503:  # as every 503 of the site (core.outage.RetryAfterMiddleware)
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
    return JSONResponse(exc.as_dict(), status_code=exc.http_status, headers=headers)


def _jsonrpc_error(status: int, request_id: str | int | None, code: int, message: str, data: Any = None) -> Response:
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return JSONResponse({"jsonrpc": "2.0", "id": request_id, "error": error}, status_code=status)


def unsupported_version(version: str, request_id: str | int | None) -> Response:
    """400 for an ``MCP-Protocol-Version`` header naming a version this server does not
    speak (MCP 2025-11-25 "Protocol Version Header"): JSON-RPC error ``-32022`` whose
    message names the header and the supported versions, ``data: {supported, requested}``
    (the shape 2026-07-28 clients negotiate from)."""
    shown = version if len(version) <= 100 else version[:100] + "…"
    message = f"Unsupported MCP-Protocol-Version header {shown!r}: this server supports {', '.join(SUPPORTED_VERSIONS)}"
    data = {"supported": list(SUPPORTED_VERSIONS), "requested": version}
    return _jsonrpc_error(400, request_id, UNSUPPORTED_PROTOCOL_VERSION, message, data)


def session_not_found(request_id: str | int | None) -> Response:
    """404 for an ``Mcp-Session-Id`` this server did not issue for the request's token
    (tampered, of another token, signed with a retired ``SECRET_KEY``): MCP 2025-11-25
    "Session Management" — the client then initializes a new session."""
    message = "Session not found: this Mcp-Session-Id was not issued for this token; initialize again without it"
    return _jsonrpc_error(404, request_id, INVALID_REQUEST, message)


async def mcp_app(scope: Scope, receive: Receive, send: Send) -> None:
    """ASGI app for ``/mcp``: checks, authentication, then the SDK's session manager."""
    if scope["type"] != "http":
        return
    oauth = scope["path"] in (settings.MCP_OAUTH_PATH, settings.MCP_OAUTH_PATH + "/")
    if not oauth and scope["path"] not in (MCP_PATH, MCP_PATH + "/"):
        await _error_response(DispatchError("NOT_FOUND", "not found"))(scope, receive, send)
        return
    headers = Headers(scope=scope)
    refusal = _refusal(headers)
    if refusal is not None:
        await refusal(scope, receive, send)
        return
    try:
        caller = await (authenticate_oauth(headers) if oauth else authenticate(headers))
    except DispatchError as exc:
        await _error_response(exc, oauth=oauth)(scope, receive, send)
        return
    except Exception as exc:  # the database down or frozen while looking the token up: 503
        mapped = unavailable_error(exc)
        if mapped is None:
            raise
        await _error_response(mapped)(scope, receive, send)
        return
    raw_token = bearer_credentials(headers.get("authorization", "")) or ""
    if caller.oauth_token_id is not None:
        # Sessions and call keys outlive one access token: a refresh must neither end the
        # client's session nor orphan the calls it may cancel (docs/mcp.md#oauth).
        raw_token = oauth_identity(caller)
    body = await _request_body(receive) if scope["method"] == "POST" else b""
    message = _message(body)
    version = headers.get(PROTOCOL_VERSION_HEADER)
    if version is not None and version not in SUPPORTED_VERSIONS:
        await unsupported_version(version, _readable_id(message.get("id")))(scope, receive, send)
        return
    session_id = headers.get(SESSION_HEADER)
    if session_id is not None and not session_valid(session_id, raw_token):
        await session_not_found(_readable_id(message.get("id")))(scope, receive, send)
        return
    if scope["method"] == "GET":
        await event_stream(scope, receive, send, caller=caller, raw_token=raw_token)
        return
    if scope["method"] == "DELETE" and session_id is not None:
        # Nothing is kept per session, so there is nothing to free (docs/mcp.md#sessions).
        await Response(status_code=204)(scope, receive, send)
        return
    if scope["method"] != "POST":
        await Response(status_code=405, headers={"Allow": ALLOW})(scope, receive, send)
        return
    edge = refused_at_the_edge(body, protocol_version=version or "")
    if edge is not None:
        await JSONResponse(edge[1], status_code=edge[0])(scope, receive, send)
        return
    if message.get("method") == "notifications/cancelled" and "id" not in message:
        answer = await _cancelled(message, caller=caller, raw_token=raw_token, session_id=session_id)
        await answer(scope, receive, send)
        return
    if _opens_session(message, version):
        send = _with_session_header(send, session_issue(raw_token))
    streaming = message.get("method") == "tools/call" and accepts_event_stream(headers)
    manager = await ensure_started(streaming=streaming)
    scope = {**scope, CALLER_SCOPE_KEY: caller, TOKEN_SCOPE_KEY: raw_token, SESSION_SCOPE_KEY: session_id}
    if not streaming:
        await manager.handle_request(scope, _replay(body, receive), send)
        return
    answered = False

    async def watched(sent: Message) -> None:
        nonlocal answered
        if sent["type"] == "http.response.body" and not sent.get("more_body", False):
            answered = True
        await send(sent)

    try:
        await manager.handle_request(scope, _replay(body, receive), watched)
    finally:
        request_id = _readable_id(message.get("id"))
        if not answered and request_id is not None:
            # The client went away before the answer (its stream closed): the SDK's
            # stateless 2025-11-25 path lets the handler run on, so its operations are
            # cancelled the way a notifications/cancelled would.
            await _cancel_quietly(caller, call_key(raw_token, request_id, session_id))


def _opens_session(message: dict[str, Any], version: str | None) -> bool:
    """Whether ``message`` is an ``initialize`` request of a protocol version whose
    transport has sessions (Streamable HTTP: 2025-03-26 to 2025-11-25; the SDK answers a
    version it does not know with the latest of those)."""
    if message.get("method") != "initialize" or "id" not in message:
        return False
    if version is not None and version not in HANDSHAKE_PROTOCOL_VERSIONS:
        return False  # a 2026-07-28 request: no handshake, no sessions
    params = message.get("params")
    requested = params.get("protocolVersion") if isinstance(params, dict) else None
    return requested in SESSION_VERSIONS or requested not in HANDSHAKE_PROTOCOL_VERSIONS


def _with_session_header(send: Send, session_id: str) -> Send:
    """``send`` adding ``Mcp-Session-Id: session_id`` to a successful response."""

    async def sending(sent: Message) -> None:
        if sent["type"] == "http.response.start" and sent["status"] == 200:
            sent = {**sent, "headers": [*sent.get("headers", []), (SESSION_HEADER.encode(), session_id.encode())]}
        await send(sent)

    return sending


def _message(body: bytes) -> dict[str, Any]:
    """The JSON-RPC message of a POST body, or ``{}`` when it is not one JSON object (the
    SDK answers those itself)."""
    try:
        message = json.loads(body)
    except (ValueError, RecursionError):
        return {}
    return message if isinstance(message, dict) else {}


async def _cancelled(message: dict[str, Any], *, caller: Caller, raw_token: str, session_id: str | None) -> Response:
    """Answer a ``notifications/cancelled`` POST: 202, after cancelling the operations of
    the call it names (``params.requestId``, a string or an integer) under the caller's
    token and MCP session (``session_id``, verified; ``None`` without one), in any
    process. A malformed one is acknowledged and ignored (a notification gets no error,
    MCP 2025-11-25 "Cancellation"); an outage answers 503."""
    params = message.get("params")
    request_id = _readable_id(params.get("requestId")) if isinstance(params, dict) else None
    if request_id is None:
        return Response(status_code=202)
    key = call_key(raw_token, request_id, session_id)
    try:
        cancelled = await cancel_calls(user=caller.user, call_key=key)
    except DispatchError as exc:
        return _error_response(exc)
    except Exception as exc:
        mapped = unavailable_error(exc)
        if mapped is None:
            raise
        return _error_response(mapped)
    logger.info("MCP notifications/cancelled for request %s: %d operation(s) cancelled", request_id, cancelled)
    return Response(status_code=202)


async def _cancel_quietly(caller: Caller, key: str) -> None:
    """``cancel_calls`` for a call whose client went away; a failure is logged, never raised
    (nobody is left to tell)."""
    try:
        cancelled = await asyncio.shield(cancel_calls(user=caller.user, call_key=key))
    except Exception:
        logger.warning("cancelling the operations of an abandoned MCP call failed", exc_info=True)
        return
    if cancelled:
        logger.info("MCP client went away mid-call: %d operation(s) of %s cancelled", cancelled, key)


async def _request_body(receive: Receive) -> bytes:
    """The whole request body (``serve`` caps it at ``DISPATCH_MAX_REQUEST_BYTES`` before
    the app runs, and the SDK reads it whole too)."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands ``body`` over once, then waits on the real one (for the
    client's disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def _readable_id(value: Any) -> str | int | None:
    """A JSON-RPC request id as MCP allows it (a string or an integer, never null; one the
    channel layer and strict parsers accept), else ``None``."""
    if isinstance(value, bool) or not isinstance(value, str | int) or wire.problem(value) is not None:
        return None
    return value


def refused_at_the_edge(body: bytes, *, protocol_version: str = "") -> tuple[int, dict[str, Any]] | None:
    """The answer to a JSON-RPC message the SDK would mishandle, as ``(status, body)``;
    ``None``: let the SDK answer.

    - A request whose ``id`` MCP does not allow (null, a fraction, an object, NaN, an
      integer outside 64 bits): the SDK took it for a notification and answered 202 with
      nothing, so its client waited for ever. ``(400, -32600)`` with ``id: null``.
    - JSON the SDK's own parser refuses as a bare ``-32700`` — a lone surrogate
      (``"\\ud800"``), "unexpected end of hex escape" at 2025-11-25 — so that it names the
      field like every other value the channel layer cannot carry (docs/mcp.md#results-and-errors): a
      ``tools/call`` whose ``arguments`` hold it gets ``(200, result)`` with an ``isError``
      result ``INVALID_REQUEST: arguments.<field>: …``; anything else ``(400, error)``
      with ``-32602`` (in ``params``) or ``-32600``. The result carries ``resultType``
      only for ``protocol_version`` 2026-07-28 and later (older clients may reject keys
      they do not know).
    """
    strict = True
    try:
        message = pydantic_core.from_json(body)
    except ValueError:
        strict = False
        try:
            message = json.loads(body)
        except (ValueError, RecursionError):
            return None  # not JSON at all: the SDK's own parse error says so
    if not isinstance(message, dict):
        return None
    request_id = _readable_id(message.get("id"))
    if "method" in message and "id" in message and request_id is None:
        error = {"code": INVALID_REQUEST, "message": "Invalid request: id must be a string or an integer (64-bit)"}
        return 400, {"jsonrpc": "2.0", "id": None, "error": error}
    if strict:
        return None
    params = message.get("params")
    arguments = params.get("arguments") if isinstance(params, dict) else None
    if message.get("method") == "tools/call" and isinstance(arguments, dict) and request_id is not None:
        found = uncarriable(arguments)
        if found is not None:
            result = error_result("INVALID_REQUEST", found).model_dump(by_alias=True, exclude_none=True)
            if protocol_version < "2026-07-28":
                result.pop("resultType", None)
            return 200, {"jsonrpc": "2.0", "id": request_id, "result": result}
    problem = wire.problem(message)
    if problem is None:
        return None
    code = INVALID_PARAMS if problem.startswith("params") else INVALID_REQUEST
    error = {"code": code, "message": f"Invalid request: {problem}"}
    return 400, {"jsonrpc": "2.0", "id": request_id, "error": error}


def with_mcp(django_app: Callable[..., Awaitable[None]]) -> ASGIApp:
    """``django_app`` with ``/mcp`` and ``/mcp/…`` (``/mcp/oauth``) answered by ``mcp_app`` instead."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        path: Any = scope.get("path", "")
        if path == MCP_PATH or path.startswith(MCP_PATH + "/"):
            await mcp_app(scope, receive, send)
        else:
            await django_app(scope, receive, send)

    return app
