"""Admin for live connection rows (read-only: they mirror sockets)."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from core.admin import ReadOnlyAdmin
from core.errors import DispatchError
from remotes import services
from remotes.models import Remote, WsSession


@admin.register(WsSession)
class WsSessionAdmin(ReadOnlyAdmin):
    list_display = ["id", "user", "auth_method", "client_address", "server_process", "connected_at"]
    list_filter = ["auth_method", "server_process"]
    search_fields = ["id", "user__username", "channel_name"]


@admin.register(Remote)
class RemoteAdmin(ReadOnlyAdmin):
    list_display = ["name", "user", "function_count", "ws_session", "server_process", "connected_at"]
    list_filter = ["server_process"]
    search_fields = ["name", "user__username"]
    actions = ["disconnect"]

    @admin.action(description="Disconnect selected remotes (fails their pending calls)")
    def disconnect(self, request: HttpRequest, queryset: QuerySet[Remote]) -> None:
        for remote in queryset.select_related("user"):
            try:
                services.remote_disconnect(user=remote.user, remotename=remote.name)
            except DispatchError as exc:
                self.message_user(request, exc.message, messages.WARNING)
        self.message_user(request, "Disconnected the selected remotes.", messages.SUCCESS)

    @admin.display(description="functions")
    def function_count(self, remote: Remote) -> int:
        return len(remote.tools)
