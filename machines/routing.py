"""WebSocket routes of the machines app."""

from __future__ import annotations

from django.urls import re_path

from machines.consumers import ShimConsumer

websocket_urlpatterns = [
    re_path(r"^ws/shim/?$", ShimConsumer.as_asgi()),
]
