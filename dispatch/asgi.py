"""The ASGI application: Django for HTTP (``/mcp`` excepted: the MCP endpoint,
``dispatch.mcp.app``), Channels for websockets.

No ``AllowedHostsOriginValidator``: shims, peers and scripts send no ``Origin``; the
``/ws`` consumer checks the origin itself for cookie-authenticated browsers
(docs/ws-protocol.md#authentication).
"""

from __future__ import annotations

import os
import sys

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dispatch.settings")
django_asgi_app = get_asgi_application()

from django.conf import settings  # noqa: E402  (configured by get_asgi_application)

if "daphne.server" in sys.modules:
    # Under daphne (``serve``), which reads a whole request body before the application
    # runs: the process's budget of bodies being read is kept there (dispatch.body_budget).
    from dispatch.body_budget import budget_request_bodies

    budget_request_bodies(settings.REQUEST_BODY_BUDGET, settings.MAX_REQUEST_BYTES)

from channels.auth import AuthMiddlewareStack  # noqa: E402  (needs the apps loaded)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import re_path  # noqa: E402

from dispatch.mcp.app import with_mcp  # noqa: E402
from dispatch.routing import by_credential, cookie_routes, token_routes  # noqa: E402
from dispatch.sse import unbuffered_event_streams  # noqa: E402

session_routes = URLRouter(cookie_routes)

application = ProtocolTypeRouter(
    {
        # Every server-sent-event response goes out unbuffered through a proxy (dispatch.sse).
        "http": unbuffered_event_streams(with_mcp(django_asgi_app)),
        # Token-authenticated routes (/ws/shim/) first, without the cookie, session and user
        # lookups a shim never uses (a database thread hop per connection); then the rest,
        # behind those lookups only when no bearer header makes them moot (by_credential).
        "websocket": URLRouter(
            [
                *token_routes,
                re_path(
                    r"",
                    by_credential(bearer=session_routes, cookie=AuthMiddlewareStack(session_routes)),  # type: ignore[arg-type]
                ),
            ]
        ),
    }
)
