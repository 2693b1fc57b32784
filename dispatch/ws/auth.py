"""The ``/ws`` session's way in (docs/ws-protocol.md#authentication): a session
authenticates by a bearer header, a cookie from the site's own origin, or a first frame
with a token or a username and password, within ``WS_AUTH_TIMEOUT``; a refusal is an error
frame and a close code. ``dispatch.ws.consumer.SessionConsumer`` is this consumer plus the
action envelope."""

from __future__ import annotations

import asyncio
import logging

from channels.db import database_sync_to_async
from django.conf import settings
from django.contrib.auth.models import User
from django.db import IntegrityError

from agents.services import user_events_group
from core import wire
from core.authentication import api_token_cached, api_token_credential, websocket_origin_allowed
from core.consumers import DispatchConsumer
from core.errors import RateLimited
from core.models import ApiToken
from core.services import AuthenticationFailed, password_authenticate
from core.wire import encode
from dispatch.ws.frames import AuthOk, EncodedFrame, ErrorReply, Frame
from remotes import services

# The session's edge logs as one logger (operators and tests filter on it).
logger = logging.getLogger("dispatch.ws.consumer")

CLOSE_UNAUTHENTICATED = 4401
CLOSE_AUTH_TIMEOUT = 4408
CLOSE_ORIGIN_REFUSED = 4403
CLOSE_TOO_BIG = 1009
CLOSE_SERVICE_RESTART = 1012

AUTH_FAILED = "authentication failed"


class AuthenticatingConsumer(DispatchConsumer):
    """A ``/ws`` session consumer up to its authentication: the session row opened on the
    credential (ending the credential closes the socket: ``core.revocation``), the user's
    events group joined, and every frame sent through ``_send``."""

    user: User | None
    ws_session_id: str | None
    events_group: str | None
    auth_deadline: asyncio.Task[None] | None
    closing: bool

    async def _first_frame(self, text_data: str | None) -> None:
        """Authenticate from the first frame: ``{"token"}`` or ``{"username", "password"}``."""
        try:
            message = wire.loads(text_data) if text_data is not None else None
        except ValueError:
            message = None
        if not isinstance(message, dict) or not ("token" in message or "username" in message):
            await self._send(ErrorReply(error="not authenticated"))
            await self._close(CLOSE_UNAUTHENTICATED)
            return
        api_token_id: int | None = None
        try:
            if "token" in message:
                if not isinstance(message["token"], str):
                    raise AuthenticationFailed()
                token = await api_token_of(message["token"])
                user, method, api_token_id = token.user, "token", token.pk
            else:
                username, password = message.get("username"), message.get("password")
                if not isinstance(username, str) or not isinstance(password, str):
                    raise AuthenticationFailed()
                user = await database_sync_to_async(password_authenticate)(
                    username=username, password=password, client_address=self._client_address()
                )
                method = "password"
        except (AuthenticationFailed, RateLimited) as exc:
            await self._refuse(exc.message)
            return
        if not await self._authenticated(user, method, api_token_id=api_token_id):
            return
        # The auth reply carries no ``action`` (docs/ws-protocol.md).
        await self._send(AuthOk(ok=True, user=user.get_username()))

    async def _authenticated(
        self, user: User, method: str, *, api_token_id: int | None = None, session_key: str = ""
    ) -> bool:
        """Record the session on its credential; ``False`` (the socket refused, closed 4401)
        when that credential's rows were deleted since it was looked up (within the bearer
        cache's second): the session's foreign keys fail."""
        if self.auth_deadline is not None:
            self.auth_deadline.cancel()
            self.auth_deadline = None
        # The credential goes on the row: ending it closes this socket (core.revocation).
        try:
            session = await database_sync_to_async(services.ws_session_open)(
                user=user,
                channel_name=self.channel_name,
                auth_method=method,
                client_address=self._client_address(),
                api_token_id=api_token_id,
                session_key=session_key,
            )
        except IntegrityError:
            logger.info("ws session refused: its user or token was deleted meanwhile")
            await self._refuse(AUTH_FAILED)
            return False
        self.user = user
        self.ws_session_id = session.pk
        # Agent progress reaches every ws session of the user (docs/ws-protocol.md#agent-event).
        self.events_group = user_events_group(user.pk)
        await self.channel_layer.group_add(self.events_group, self.channel_name)
        return True

    async def _refuse(self, error: str, code: int = CLOSE_UNAUTHENTICATED) -> None:
        await self._send(ErrorReply(error=error))
        await self._close(code)

    async def _expire_auth(self) -> None:
        await asyncio.sleep(settings.WS_AUTH_TIMEOUT)
        if self.user is None and not self.closing:
            await self._send(ErrorReply(error="authentication timed out"))
            await self._close(CLOSE_AUTH_TIMEOUT)

    async def _close(self, code: int) -> None:
        self.closing = True
        await self.close(code=code)

    async def _send(self, frame: Frame | EncodedFrame) -> None:
        """Send one frame (``dispatch.ws.frames``): every frame this session sends goes
        through here, as compact JSON (``core.wire.encode``) unless it was encoded already."""
        await self.send(text_data=frame if isinstance(frame, str) else encode(frame))

    def _origin_allowed(self) -> bool:
        """Cookie-authenticated browsers only: ``Origin`` is the site's own, scheme, host
        and port, as Django's CSRF check decides it (docs/ws-protocol.md#authentication;
        ``websocket_origin_allowed``)."""
        return websocket_origin_allowed(self.scope)

    def _client_address(self) -> str:
        client = self.scope.get("client")
        return str(client[0]) if client else ""


async def api_token_of(raw_token: str) -> ApiToken:
    """The user API token ``raw_token`` stands for: from the process's bearer cache on the
    event loop when it is there (``core.authentication.api_token_cached``), else looked up
    on the database thread (``api_token_credential``, which fills the cache). Raises
    ``AuthenticationFailed``."""
    cached = api_token_cached(raw_token)
    if cached is not None:
        return cached
    token: ApiToken = await database_sync_to_async(api_token_credential)(raw_token)
    return token
