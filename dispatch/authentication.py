"""DRF authentication by ``Authorization: Bearer <api token>`` (spec/overview.md "Credentials")."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from django.http import HttpRequest
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.request import Request

from dispatch.agents.tokens import agent_token_authenticate
from dispatch.models import Agent, ApiToken
from dispatch.services import AuthenticationFailed, api_token_authenticate


class BearerTokenAuthentication(BaseAuthentication):
    """Authenticate a request by a user API token or an agent token (its ``DISPATCH_MCP_TOKEN``).

    A user token gives ``(user, ApiToken)``; an agent token gives ``(owner, Agent)``, so
    ``request.auth`` is the calling agent (``calling_agent``). 401 with
    ``WWW-Authenticate: Bearer`` otherwise (spec/overview.md "Credentials").
    """

    keyword = "bearer"

    def authenticate(self, request: Request) -> tuple[Any, ApiToken | Agent] | None:
        header = get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword.encode():
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("invalid Authorization header: expected 'Bearer <token>'")
        raw = header[1].decode("latin-1")
        try:
            token = api_token_authenticate(raw)
        except AuthenticationFailed:
            agent = agent_token_authenticate(raw)
            if agent is None:
                raise exceptions.AuthenticationFailed("invalid, expired or revoked token") from None
            return agent.owner, agent
        return token.user, token

    def authenticate_header(self, request: Request) -> str:
        return "Bearer"


def authenticated_user(request: HttpRequest | Request) -> User:
    """The logged-in user of a request that passed authentication (login or token).

    Raises ``PermissionError`` if called for an anonymous request: a view that reaches
    it without authentication is a bug, never a fallback.
    """
    user = request.user
    if not isinstance(user, User) or not user.is_authenticated:
        raise PermissionError("authenticated_user() called for an anonymous request")
    return user


def calling_agent(request: Request) -> Agent | None:
    """The agent whose token authenticated ``request``, or ``None`` for a user's request."""
    return request.auth if isinstance(request.auth, Agent) else None
