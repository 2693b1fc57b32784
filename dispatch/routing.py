"""Every websocket route of the project, gathered from the apps."""

from __future__ import annotations

from machines.routing import websocket_urlpatterns as machine_routes
from remotes.routing import websocket_urlpatterns as remote_routes

websocket_urlpatterns = [*remote_routes, *machine_routes]
