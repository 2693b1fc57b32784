"""Helpers for async JSON views (the routes that wait, which cannot be DRF views).

They accept the same credentials as the DRF API: ``Authorization: Bearer <api token>``
or a logged-in session (with CSRF, like DRF's SessionAuthentication).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from channels.db import database_sync_to_async
from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse

from core import wire
from core.authentication import bearer_cache_get, bearer_credential
from core.errors import DispatchError, InvalidRequest, unavailable_error
from core.services import AuthenticationFailed

logger = logging.getLogger(__name__)


def adapt_to_chain(middleware: Any, get_response: Callable[[HttpRequest], Any]) -> bool:
    """Mark ``middleware`` a coroutine function when ``get_response`` is one (Django then
    awaits it) and return whether it is: the one way Dispatch's middlewares stay sync- and
    async-capable, since a sync-only middleware would push every async view onto the
    process's shared sync thread."""
    is_async = iscoroutinefunction(get_response)
    if is_async:
        markcoroutinefunction(middleware)
    return is_async


class AsyncCapableMiddleware:
    """Base of Dispatch's own middlewares: sync- and async-capable (``adapt_to_chain``);
    ``is_async`` says which kind of chain it sits in."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.is_async = adapt_to_chain(self, get_response)


class BearerCsrfExemptMiddleware(AsyncCapableMiddleware):
    """Requests carrying a bearer token skip CSRF (no cookie can forge them), as in DRF.

    Must come before ``CsrfViewMiddleware``.
    """

    def __call__(self, request: HttpRequest) -> Any:
        if request.headers.get("Authorization", "").lower().startswith("bearer "):
            request._dont_enforce_csrf_checks = True  # type: ignore[attr-defined]
        return self.get_response(request)


NOT_AUTHENTICATED = "authentication required: send 'Authorization: Bearer <token>'"


def bearer_credentials(authorization: str) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value (stripped, maybe
    empty), or ``None`` when the header is absent or of another scheme."""
    scheme, _, raw = authorization.partition(" ")
    return raw.strip() if scheme.lower() == "bearer" else None


def scope_bearer_token(scope: Mapping[str, Any]) -> str | None:
    """The token of an ASGI scope's first ``Authorization`` header when it is of the
    ``Bearer`` scheme (``bearer_credentials``: stripped, maybe empty), else ``None``: how a
    websocket upgrade is routed (``dispatch.routing.by_credential``) and authenticated
    (``DispatchConsumer.bearer_token``), so both agree."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            return bearer_credentials(value.decode("latin-1"))
    return None


async def bearer_caller(raw_token: str) -> tuple[User, Any]:
    """Who a bearer token is (``core.authentication.bearer_credential``, cached for a second):
    ``(user, ApiToken)`` for a user
    API token, ``(owner, Agent)`` for an agent token (its ``DISPATCH_MCP_TOKEN``;
    docs/agents.md#agent-tokens) — the same pair DRF's ``BearerTokenAuthentication``
    gives as ``(request.user, request.auth)``.

    Raises ``DispatchError`` ``AUTHENTICATION_FAILED`` (401) for an unknown, revoked or
    expired token, an inactive user, an agent that is not creating/running/stopping.
    """
    cached = bearer_cache_get(raw_token)  # a token just seen costs no database thread hop
    if cached is not None:
        return cached
    try:
        return await database_sync_to_async(bearer_credential)(raw_token)
    except AuthenticationFailed:
        raise DispatchError("AUTHENTICATION_FAILED", "invalid, expired or revoked token") from None


async def request_user(request: HttpRequest) -> User:
    """The caller of an async API view: bearer token (a user's or an agent's) first, then
    the session. For a bearer token, ``request.auth`` is set to its credential (the
    ``ApiToken``, or the calling ``Agent``), as DRF does, so
    ``agents.tokens.calling_agent`` reads it for both kinds of view.

    Raises ``DispatchError`` ``NOT_AUTHENTICATED`` / ``AUTHENTICATION_FAILED`` (401).
    """
    raw = bearer_credentials(request.headers.get("Authorization", ""))
    if raw is not None:
        caller, credential = await bearer_caller(raw)
        request.auth = credential  # type: ignore[attr-defined]
        return caller
    user = await request.auser()
    if isinstance(user, User) and user.is_authenticated:
        return user
    raise DispatchError("NOT_AUTHENTICATED", NOT_AUTHENTICATED)


def json_object(request: HttpRequest) -> dict[str, Any]:
    """The request body as a JSON object, or ``InvalidRequest`` saying what is wrong."""
    try:
        body = wire.loads(request.body or b"{}")
    except ValueError as exc:
        raise InvalidRequest(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("body must be a JSON object")
    return body


class OutageMiddleware(AsyncCapableMiddleware):
    """A view that fails because the database or the channel layer cannot be reached
    answers 503 ``TEMPORARILY_UNAVAILABLE``, never 500 (docs/operating.md#health).

    ``process_exception`` only: it sees what a view raised (DRF views and ``json_api``
    map these themselves, through the same ``unavailable_error``). Under ``/api/`` and
    ``/mcp`` the answer is the JSON error shape, elsewhere a short text page.
    """

    def __call__(self, request: HttpRequest) -> Any:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        mapped = unavailable_error(exception)
        if mapped is None:
            return None
        # The outage itself was logged once by core.outage.tracker (unavailable_error).
        logger.debug("%s %s: %s (%s)", request.method, request.path, mapped.message, exception)
        if request.path.startswith(("/api/", "/mcp")):
            return error_response(mapped)
        return HttpResponse(mapped.message, status=503, content_type="text/plain; charset=utf-8")


# The error code of a bare status under /api/ (ApiErrorShapeMiddleware).
_STATUS_CODES = {
    400: "INVALID_REQUEST",
    401: "NOT_AUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    405: "METHOD_NOT_ALLOWED",
    413: "REQUEST_TOO_LARGE",
    429: "RATE_LIMITED",
    503: "TEMPORARILY_UNAVAILABLE",
}


class ApiErrorShapeMiddleware(AsyncCapableMiddleware):
    """Every error under ``/api/`` is the JSON error shape (docs/architecture.md#errors).

    Views and handlers answer in it themselves; this catches the rest: an error response
    that is not JSON (Django's bare 405 from ``require_http_methods``, any HTML page) is
    replaced by ``{"error": {code, message, details}}`` with the same status and headers
    such as ``Allow``. The schema and docs pages keep their own formats.
    """

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self._acall(request)
        return self._shape(request, self.get_response(request))

    async def _acall(self, request: HttpRequest) -> HttpResponse:
        return self._shape(request, await self.get_response(request))

    @staticmethod
    def _shape(request: HttpRequest, response: HttpResponse) -> HttpResponse:
        if (
            response.status_code < 400
            or not request.path.startswith("/api/")
            or request.path.startswith(("/api/schema/", "/api/docs/"))
            or response.get("Content-Type", "").startswith("application/json")
            or response.streaming
        ):
            return response
        status = response.status_code
        code = _STATUS_CODES.get(status, "INTERNAL_ERROR" if status >= 500 else "INVALID_REQUEST")
        message = response.reason_phrase or "error"
        if status == 405 and response.has_header("Allow"):
            message = f"method {request.method} not allowed; allowed: {response['Allow']}"
        shaped = JsonResponse({"error": {"code": code, "message": message, "details": {}}}, status=status)
        for header in ("Allow", "WWW-Authenticate", "Retry-After"):
            if response.has_header(header):
                shaped[header] = response[header]
        return shaped


def error_response(exc: DispatchError) -> JsonResponse:
    """``{"error": {code, message, details}}`` with the code's status (401 adds WWW-Authenticate)."""
    response = JsonResponse(exc.as_dict(), status=exc.http_status)
    if exc.http_status == 401:
        response["WWW-Authenticate"] = "Bearer"
    return response


def json_api(view: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
    """Wrap an async view ``view(request, user, **kwargs) -> JSON value`` with auth and errors."""

    async def wrapper(request: HttpRequest, **kwargs: Any) -> HttpResponseBase:
        try:
            user = await request_user(request)
            result = await view(request, user, **kwargs)
        except DispatchError as exc:
            return error_response(exc)
        except Exception as exc:  # the database or the channel layer unreachable: 503
            mapped = unavailable_error(exc)
            if mapped is None:
                raise
            return error_response(mapped)
        if isinstance(result, HttpResponseBase):  # a response of its own (an event stream too)
            return result
        # ASCII escapes: a lone surrogate from a shim or remote must not make this a 500.
        return JsonResponse(result, safe=False)

    wrapper.__name__ = view.__name__
    wrapper.__doc__ = view.__doc__
    wrapper.login_required = False  # type: ignore[attr-defined]  # answers 401 itself
    return wrapper


class WireJSONParser:
    """DRF's JSON parser through :func:`core.wire.loads`, so REST refuses what the
    channel layer cannot carry (integers outside 64 bits, NaN, lone surrogates, nesting
    over 64) with 400 naming the field, like every other edge."""

    media_type = "application/json"
    renderer_class = None

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        """Parse the request body; raises DRF's ``ParseError`` (400) saying what is wrong."""
        from rest_framework.exceptions import ParseError

        try:
            return wire.loads(stream.read())
        except (ValueError, UnicodeDecodeError) as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
