"""Admin for the core models (API tokens, server processes, the instance identity); actions go through services."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from core import services
from core.models import ApiToken, InstanceIdentity, ServerProcess


class ReadOnlyAdmin(admin.ModelAdmin):
    """Admin for rows that mirror live state or records: viewable, never edited by hand."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ["prefix", "name", "user", "created_at", "last_used_at", "expires_at", "revoked_at"]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter), "created_at"]
    search_fields = ["name", "prefix", "user__username"]
    readonly_fields = ["prefix", "digest", "created_at", "last_used_at", "revoked_at"]
    fields = ["user", "name", "expires_at", "prefix", "digest", "created_at", "last_used_at", "revoked_at"]
    actions = ["revoke"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        # Tokens are created where they can be shown once: Settings, the API, issue_token.
        return False

    @admin.action(description="Revoke selected tokens")
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiToken]) -> None:
        for token in queryset:
            services.api_token_revoke(user=token.user, token_id=token.pk)
        self.message_user(request, f"Revoked {queryset.count()} token(s).", messages.SUCCESS)


@admin.register(ServerProcess)
class ServerProcessAdmin(admin.ModelAdmin):
    list_display = ["id", "kind", "hostname", "pid", "started_at", "heartbeat_at"]
    list_filter = ["kind", "hostname"]
    readonly_fields = ["id", "kind", "hostname", "pid", "started_at", "heartbeat_at"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(InstanceIdentity)
class InstanceIdentityAdmin(admin.ModelAdmin):
    list_display = ["display_name", "instance_id", "created_at"]
    readonly_fields = ["instance_id", "created_at"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
