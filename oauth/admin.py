"""The OAuth policy in the Django admin (django-oauth-toolkit registers its own models:
applications, tokens, grants). The settings page holds the same switches
(docs/mcp.md#oauth-admin)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from oauth.models import OAuthPolicy
from oauth.services import policy_update


@admin.register(OAuthPolicy)
class OAuthPolicyAdmin(admin.ModelAdmin):
    """The one policy row: edited, never added twice nor deleted; saved through
    ``oauth.services.policy_update`` so ``updated_by``/``updated_at`` are always set."""

    list_display = ("__str__", "cimd_private_addresses", "updated_at", "updated_by")
    fields = ("dcr_enabled", "cimd_enabled", "cimd_private_addresses", "updated_at", "updated_by")
    readonly_fields = ("updated_at", "updated_by")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return not OAuthPolicy.objects.exists()

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: OAuthPolicy, form: Any, change: bool) -> None:
        OAuthPolicy.current()  # the row is pk=1, whatever the form was for
        policy = policy_update(
            actor=request.user,  # type: ignore[arg-type]
            dcr_enabled=obj.dcr_enabled,
            cimd_enabled=obj.cimd_enabled,
            cimd_private_addresses=obj.cimd_private_addresses,
        )
        obj.pk = policy.pk
