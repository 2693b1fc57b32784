"""WebSocket routes of the remotes app."""

from __future__ import annotations

from django.urls import re_path

from dispatch.ws.consumer import SessionConsumer

websocket_urlpatterns = [
    re_path(r"^ws/?$", SessionConsumer.as_asgi()),
]
