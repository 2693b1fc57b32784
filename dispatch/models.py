"""The project app's one model: open MCP event streams (the ``/mcp`` edge, ``dispatch.mcp``)."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone
from oauth2_provider.settings import oauth2_settings

from agents.models import AgentToken
from core.models import ApiToken, ServerProcess


class McpStream(models.Model):
    """One open MCP event stream (docs/mcp.md#tool-list-changes): a ``GET /mcp`` stream (protocol
    2025-11-25) or a ``subscriptions/listen`` stream (2026-07-28).

    A row per stream, so the per-user limit holds across processes; it belongs to the
    process holding the stream (reaping a dead process deletes it by cascade) and to the
    credential that opened it — ``api_token``, ``agent_token`` or ``oauth_token``, exactly one — so the
    holder can see at a glance that the credential was revoked, expired or deleted.
    """

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="mcp_streams")
    server_process = models.ForeignKey(ServerProcess, on_delete=models.CASCADE, related_name="mcp_streams")
    api_token = models.ForeignKey(ApiToken, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    agent_token = models.ForeignKey(AgentToken, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    # On /mcp/oauth: revoking an OAuth access token deletes its row, and this one with it.
    oauth_token = models.ForeignKey(
        oauth2_settings.ACCESS_TOKEN_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    opened_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"MCP stream {self.pk} of user {self.user_id} on {self.server_process_id}"
