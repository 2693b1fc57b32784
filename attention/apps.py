from __future__ import annotations

from django.apps import AppConfig


class AttentionConfig(AppConfig):
    """Attention: notifications when an approval waits or an agent finishes or fails
    (open tabs, Web Push, Apprise; docs/notifications.md)."""

    name = "attention"
    verbose_name = "Notifications"

    def ready(self) -> None:
        from agents import signals
        from attention import receivers

        signals.approval_requested.connect(receivers.on_approval_requested, dispatch_uid="attention.approval")
        signals.agent_event_recorded.connect(receivers.on_agent_event_recorded, dispatch_uid="attention.event")
        signals.agent_status_changed.connect(receivers.on_agent_status_changed, dispatch_uid="attention.status")
