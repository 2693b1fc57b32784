"""Core REST API: token issuance and the one error shape (docs/architecture.md#errors)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.decorators import login_not_required
from drf_spectacular.utils import extend_schema
from pydantic import BaseModel, Field
from rest_framework import exceptions, status
from rest_framework.permissions import AllowAny, BasePermission, IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView
from rest_framework.views import exception_handler as drf_exception_handler

from core import selectors, services
from core.authentication import authenticated_user, by_user_credential
from core.errors import DispatchError
from core.http import unavailable_error
from core.models import ApiToken
from core.validation import BlankText, DateTime, RawText, Text, UtcDateTime, WireModel, parse_request

_DRF_CODES = {
    exceptions.ValidationError: "VALIDATION_ERROR",
    exceptions.ParseError: "INVALID_REQUEST",
    exceptions.NotAuthenticated: "NOT_AUTHENTICATED",
    exceptions.AuthenticationFailed: "AUTHENTICATION_FAILED",
    exceptions.PermissionDenied: "PERMISSION_DENIED",
    exceptions.NotFound: "NOT_FOUND",
    exceptions.MethodNotAllowed: "METHOD_NOT_ALLOWED",
    exceptions.UnsupportedMediaType: "INVALID_REQUEST",
    exceptions.Throttled: "RATE_LIMITED",
}


def _first_message(detail: Any) -> str:
    if isinstance(detail, dict):
        field, value = next(iter(detail.items()), ("", ""))
        inner = _first_message(value)
        return inner if field in ("non_field_errors", "detail") else f"{field}: {inner}"
    if isinstance(detail, list):
        return _first_message(detail[0]) if detail else "invalid input"
    return str(detail)


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """Render every API error as ``{"error": {"code", "message", "details"}}``."""
    if isinstance(exc, RecursionError):  # a JSON body nested too deeply for the parser
        exc = DispatchError("INVALID_REQUEST", "body is not valid JSON: nested too deeply")
    exc = unavailable_error(exc) or exc
    if isinstance(exc, DispatchError):
        response = Response(exc.as_dict(), status=exc.http_status)
        if exc.http_status == 401:
            response["WWW-Authenticate"] = "Bearer"
        return response
    handled = drf_exception_handler(exc, context)
    if handled is None or not isinstance(exc, exceptions.APIException):
        return handled
    response = handled
    code = next((code for cls, code in _DRF_CODES.items() if isinstance(exc, cls)), "INVALID_REQUEST")
    details = exc.detail if isinstance(exc, exceptions.ValidationError) else {}
    response.data = {"error": {"code": code, "message": _first_message(exc.detail), "details": details}}
    return response


class DispatchAPIView(APIView):
    """Base API view: its own authentication answers (401), not the login redirect."""

    @classmethod
    def as_view(cls, **initkwargs: Any) -> Any:
        return login_not_required(super().as_view(**initkwargs))


class Token(BaseModel):
    """An API token as the API shows it: its 8-character ``prefix``, never the secret;
    date-times in UTC (``…Z``), ``null`` when not set."""

    id: int
    name: str = Field(max_length=100)
    prefix: str = Field(max_length=8)
    created_at: UtcDateTime
    last_used_at: UtcDateTime | None
    expires_at: UtcDateTime | None
    revoked_at: UtcDateTime | None

    @classmethod
    def of(cls, token: ApiToken) -> Token:
        return cls.model_validate(token, from_attributes=True)


class Secret(BaseModel):
    token: str = Field(description="the token itself, shown this once")


# pydantic lists the fields of the last base first: token, then Token's, as DRF answered.
class IssuedToken(Token, Secret):
    """A new token: ``token``, the secret, shown this once, then the token's fields."""

    @classmethod
    def issued(cls, raw: str, token: ApiToken) -> dict[str, Any]:
        """The JSON answer."""
        shown = Token.of(token)
        return cls(token=raw, **dict(shown)).model_dump(mode="json")


class TokenList(BaseModel):
    tokens: list[Token]


class TokenCredentials(WireModel):
    """A username and password (not trimmed), and the new token's name and expiry."""

    # A username or password sent as a number is read as its text, as DRF's CharField did.
    username: Text = Field(max_length=150, coerce_numbers_to_str=True)
    password: RawText = Field(max_length=4096, coerce_numbers_to_str=True)
    name: BlankText = Field(default="", max_length=100, coerce_numbers_to_str=True)
    expires_at: DateTime | None = Field(default=None, description="when the token stops working; null: never")


def client_address(request: Request) -> str:
    """The peer address of an HTTP request (for throttling)."""
    return str(request.META.get("REMOTE_ADDR") or "")


class TokenObtainView(DispatchAPIView):
    """``POST /api/v1/auth/token``: username + password → a new API token (shown once).

    Throttled like every password check: 429 after 5 failures per username or address in
    10 minutes (docs/ws-protocol.md#authentication); 401 for bad credentials.
    """

    authentication_classes: list[Any] = []
    permission_classes = [AllowAny]
    rate_limited = True  # its own throttle: the schema lists a 429 (core.openapi)

    @extend_schema(request=TokenCredentials, responses={201: IssuedToken})
    def post(self, request: Request) -> Response:
        incoming = parse_request(TokenCredentials, request.data)
        user = services.password_authenticate(
            username=incoming.username, password=incoming.password, client_address=client_address(request)
        )
        issued = services.api_token_create(user=user, name=incoming.name, expires_at=incoming.expires_at)
        return Response(IssuedToken.issued(issued.raw, issued.token), status=status.HTTP_201_CREATED)


class NotAnAgent(BasePermission):
    """Refuses requests made with an agent token: an agent acts for its user but may not
    manage the user's credentials (a prompt-injected agent could lock its user out)."""

    message = "agent tokens cannot list or revoke API tokens; use a user token or the Settings page"

    def has_permission(self, request: Request, view: Any) -> bool:
        return by_user_credential(request)


class TokenListView(DispatchAPIView):
    """``GET /api/v1/auth/tokens``: the caller's tokens (prefixes only, never the secret).
    A user's own token or session only (403 for an agent token)."""

    permission_classes = [IsAuthenticated, NotAnAgent]

    @extend_schema(responses={200: TokenList})
    def get(self, request: Request) -> Response:
        tokens = selectors.api_tokens_for(user=authenticated_user(request))
        return Response(TokenList(tokens=[Token.of(token) for token in tokens]).model_dump(mode="json"))


class TokenRevokeView(DispatchAPIView):
    """``DELETE /api/v1/auth/tokens/{id}``: revoke one of the caller's tokens (403 for an
    agent token)."""

    permission_classes = [IsAuthenticated, NotAnAgent]

    @extend_schema(responses={200: Token})
    def delete(self, request: Request, token_id: int) -> Response:
        token = services.api_token_revoke(user=authenticated_user(request), token_id=token_id)
        return Response(Token.of(token).model_dump(mode="json"))
