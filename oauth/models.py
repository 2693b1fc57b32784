"""The instance's OAuth policy: the switches an admin turns on the settings page
(docs/mcp.md#oauth-admin)."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


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
