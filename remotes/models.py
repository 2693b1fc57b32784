"""Live connection rows for ws sessions and the remotes they serve.

Both rows belong to the ``ServerProcess`` holding the socket (``on_delete=CASCADE``), so
reaping a dead process forgets its sessions and remotes
(docs/architecture.md#which-way-data-flows).
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone

from core.models import ApiToken, ServerProcess


def new_ws_session_id() -> str:
    """A ws session id: 32 lowercase hex characters."""
    return uuid.uuid4().hex


class WsSession(models.Model):
    """One authenticated websocket connection to ``/ws`` (a *ws session*)."""

    class AuthMethod(models.TextChoices):
        HEADER = "header"
        COOKIE = "cookie"
        TOKEN = "token"
        PASSWORD = "password"

    id = models.CharField(primary_key=True, max_length=32, default=new_ws_session_id)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="ws_sessions")
    channel_name = models.CharField(max_length=200, unique=True)
    server_process = models.ForeignKey(ServerProcess, on_delete=models.CASCADE, related_name="ws_sessions")
    auth_method = models.CharField(max_length=10, choices=AuthMethod.choices)
    # The credential the session stands on, so revoking it closes the socket
    # (core.revocation): the API token of a header/token login (null once the token row
    # is deleted — the session then counts as revoked), the Django session of a cookie login.
    api_token = models.ForeignKey(ApiToken, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    session_key = models.CharField(max_length=40, blank=True)
    client_address = models.CharField(max_length=64, blank=True)
    connected_at = models.DateTimeField(default=timezone.now)

    class Meta:
        verbose_name = "ws session"

    def __str__(self) -> str:
        return f"ws session {self.id[:8]} ({self.auth_method})"


class Remote(models.Model):
    """A connected remote: a named set of functions served by one ws session.

    ``tools`` is the validated list of function specs ``{name, description, parameters}``.
    ``channel_name`` and ``server_process`` are copied from the serving session so a call
    needs one row to find its way.
    """

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="remotes")
    name = models.CharField(max_length=64)
    ws_session = models.ForeignKey(WsSession, on_delete=models.CASCADE, related_name="remotes")
    channel_name = models.CharField(max_length=200)
    server_process = models.ForeignKey(ServerProcess, on_delete=models.CASCADE, related_name="remotes")
    tools = models.JSONField()
    connected_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "name"], name="remote_unique_name_per_user")]
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name
