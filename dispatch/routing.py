"""Every websocket route of the project: the ``/ws`` session (an edge over the remotes and
agents apps, ``dispatch.ws``), the apps' own routes (``/ws/shim/``), then a catch-all that
refuses any other path at the upgrade (HTTP 403, logged at INFO, no traceback).

``token_routes`` are the routes whose clients authenticate by bearer token only (a shim
never sends a cookie): ``dispatch.asgi`` serves them without Channels' cookie, session and
user middleware. ``cookie_routes`` are the rest, behind that middleware unless the upgrade
carries an ``Authorization: Bearer`` header (``by_credential``): the header wins over a
cookie (docs/ws-protocol.md), so its lookups would be spent for nothing."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from django.urls import re_path

from core.http import scope_bearer_token
from dispatch.ws.consumer import SessionConsumer
from machines.routing import websocket_urlpatterns as machine_routes

logger = logging.getLogger("dispatch.routing")

Message = MutableMapping[str, Any]
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def by_credential(*, bearer: ASGIApp, cookie: ASGIApp) -> ASGIApp:
    """An ASGI app passing a connection to ``bearer`` when its upgrade carries an
    ``Authorization: Bearer`` header (``core.http.scope_bearer_token``), else to ``cookie`` (the same
    routes behind Channels' cookie, session and user middleware). A header connection thus
    skips the cookie parse, the session load and ``get_user`` (a database thread hop): the
    consumer authenticates it by its token whatever cookie it also sends, and refuses it
    when the token is bad (docs/ws-protocol.md)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        chosen = bearer if scope_bearer_token(scope) is not None else cookie
        await chosen(scope, receive, send)

    return app


async def refuse_unknown_path(scope: Scope, receive: Receive, send: Send) -> None:
    """ASGI app for a websocket path no route serves (e.g. ``/ws/ws``, a client whose base
    URL already ends in ``/ws``): close before ``accept``, which daphne answers with HTTP
    403 (it has no other refusal before accept). Without it Channels' ``URLRouter`` raises
    ``ValueError("No route found")``: an HTTP 500 and an ERROR traceback per attempt."""
    message = await receive()
    if message.get("type") != "websocket.connect":
        return
    logger.info("refused a websocket upgrade for unknown path %.200r (403)", scope.get("path", ""))
    await send({"type": "websocket.close", "code": 1000})


token_routes = [*machine_routes]

# Channels routes ASGI apps through Django's re_path, whose stubs expect a view.
cookie_routes = [
    re_path(r"^ws/?$", SessionConsumer.as_asgi()),
    re_path(r"", refuse_unknown_path),  # type: ignore[arg-type]
]

websocket_urlpatterns = [*cookie_routes[:-1], *token_routes, cookie_routes[-1]]
"""All of them, in the order they are tried (the catch-all last)."""
