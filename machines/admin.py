"""Admin for machines, machine tokens, live connections (read-only), the audit log and the
commands started behind a handle (read-only)."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from core.admin import ReadOnlyAdmin
from machines.models import (
    AuditRecord,
    CommandRun,
    DeviceAuthorization,
    Machine,
    MachineConnection,
    MachineToken,
)
from machines.services import connections, device


@admin.register(Machine)
class MachineAdmin(admin.ModelAdmin):
    list_display = ["name", "user", "platform", "arch", "connection_status", "health", "last_active_at", "revoked_at"]
    list_filter = ["connection_status", "health", "platform", ("revoked_at", admin.EmptyFieldListFilter)]
    search_fields = ["machine_id", "hostname", "display_name", "user__username"]
    readonly_fields = [f.name for f in Machine._meta.fields]
    actions = ["revoke"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.action(description="Revoke selected machines (closes their shims with 4401)")
    def revoke(self, request: HttpRequest, queryset: QuerySet[Machine]) -> None:
        for machine in queryset.select_related("user"):
            connections.machine_revoke(user=machine.user, machine_id=machine.machine_id)
        self.message_user(request, "Revoked the selected machines.", messages.SUCCESS)


@admin.register(MachineToken)
class MachineTokenAdmin(ReadOnlyAdmin):
    list_display = ["prefix", "machine_id", "user", "created_at", "last_used_at", "revoked_at"]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter)]
    search_fields = ["prefix", "machine_id", "user__username"]
    actions = ["revoke"]

    @admin.action(description="Revoke selected machine tokens")
    def revoke(self, request: HttpRequest, queryset: QuerySet[MachineToken]) -> None:
        device.machine_tokens_revoke(token_ids=list(queryset.values_list("pk", flat=True)))
        self.message_user(request, "Revoked the selected tokens.", messages.SUCCESS)


@admin.register(MachineConnection)
class MachineConnectionAdmin(ReadOnlyAdmin):
    list_display = ["connection_id", "machine", "user", "server_process", "connected_at", "last_seen_at"]
    list_filter = ["server_process"]
    search_fields = ["connection_id", "machine__machine_id", "user__username"]


@admin.register(DeviceAuthorization)
class DeviceAuthorizationAdmin(ReadOnlyAdmin):
    list_display = ["hostname", "machine_id", "status", "user", "created_at", "expires_at"]
    list_filter = ["status"]
    exclude = ["device_code_digest", "user_code_digest"]


@admin.register(AuditRecord)
class AuditRecordAdmin(ReadOnlyAdmin):
    list_display = ["ts", "user", "op", "machine_id", "session_id", "ok", "caller"]
    list_filter = ["op", "user", "session_id", "machine_id"]
    search_fields = ["session_id", "machine_id", "caller", "request_id"]
    date_hierarchy = "ts"

    @admin.display(boolean=True, description="ok")
    def ok(self, record: AuditRecord) -> bool:
        return bool(record.result.get("ok"))


@admin.register(CommandRun)
class CommandRunAdmin(ReadOnlyAdmin):
    list_display = ["id", "user", "machine_name", "summary", "status", "exit_code", "started_at", "finished_at"]
    list_filter = ["status"]
    search_fields = ["id", "user__username", "machine_id", "request_id"]
    # A command's output is the user's, as file contents are: the admin shows how much, not what.
    exclude = ["stdout", "stderr"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[CommandRun]:
        # Never shown, up to 2 MiB a row: the changelist would load them for every row.
        return super().get_queryset(request).defer("stdout", "stderr")
