"""The instance's OAuth policy: the switches an admin turns on the settings page
(docs/mcp.md#oauth-admin)."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone
from oauth2_provider.settings import oauth2_settings


class OAuthPolicy(models.Model):
    """One row (``pk=1``): whether open Dynamic Client Registration (RFC 7591) and Client
    ID Metadata Documents are accepted, and whether a metadata document may be fetched
    from a private address (loopback, RFC 1918, link-local: refused by default, since the
    fetch goes wherever a stranger's ``client_id`` URL points). Read on every registration,
    so a change holds at once in every process."""

    dcr_enabled = models.BooleanField(default=True)
    cimd_enabled = models.BooleanField(default=True)
    cimd_private_addresses = models.BooleanField(default=False)
    updated_at = models.DateTimeField(default=timezone.now)
    updated_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        verbose_name = "OAuth policy"
        verbose_name_plural = "OAuth policy"

    def __str__(self) -> str:
        return f"OAuth policy (DCR {'on' if self.dcr_enabled else 'off'}, CIMD {'on' if self.cimd_enabled else 'off'})"

    @classmethod
    def current(cls) -> OAuthPolicy:
        """The policy row, created with the defaults the first time it is read."""
        policy, _created = cls.objects.get_or_create(pk=1)
        return policy


class UsedCode(models.Model):
    """An authorization code that was exchanged (RFC 6749 §4.1.2): its SHA-256 and the token
    family it started. django-oauth-toolkit deletes a code once used, so a second exchange
    would look like any unknown code; this row lets that replay revoke what the first use
    issued, as the RFC asks. Kept ``USED_CODE_SECONDS`` (a code lives 60 s; replays come soon)."""

    code_checksum = models.CharField(max_length=64, db_index=True)
    application = models.ForeignKey(oauth2_settings.APPLICATION_MODEL, on_delete=models.CASCADE, related_name="+")
    token_family = models.UUIDField(null=True, blank=True)
    used_at = models.DateTimeField(default=timezone.now, db_index=True)

    def __str__(self) -> str:
        return f"used code {self.code_checksum[:8]}… of application {self.application_id}"


USED_CODE_SECONDS = 600
