"""Admin for notifications: read-only views of the outbox, for finding why one did not arrive."""

from __future__ import annotations

from django.contrib import admin

from attention.models import Delivery, Notification, PushSubscription


class DeliveryInline(admin.TabularInline):
    model = Delivery
    fields = ["channel", "status", "attempts", "next_attempt_at", "sent_at", "last_error"]
    readonly_fields = ["channel", "status", "attempts", "next_attempt_at", "sent_at", "last_error"]
    extra = 0
    can_delete = False


@admin.register(Notification)
class NotificationAdmin(admin.ModelAdmin):
    list_display = ["id", "user", "kind", "title", "status", "suppressed_reason", "created_at"]
    list_filter = ["kind", "status"]
    readonly_fields = [field.name for field in Notification._meta.fields]
    inlines = [DeliveryInline]

    def has_add_permission(self, request: object) -> bool:
        return False


@admin.register(PushSubscription)
class PushSubscriptionAdmin(admin.ModelAdmin):
    list_display = ["id", "user", "user_agent", "created_at", "last_sent_at"]
    readonly_fields = ["user", "endpoint", "user_agent", "created_at", "last_sent_at"]
    exclude = ["p256dh", "auth"]

    def has_add_permission(self, request: object) -> bool:
        return False
