"""Every websocket route of the project, gathered from the apps."""

from __future__ import annotations

from remotes.routing import websocket_urlpatterns as remote_routes

websocket_urlpatterns = [*remote_routes]
