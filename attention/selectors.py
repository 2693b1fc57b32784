"""Reads of attention's rows, always for one user (docs/notifications.md)."""

from __future__ import annotations

import json
from datetime import datetime

from django.contrib.auth.models import User
from django.db.models import QuerySet
from django.utils import timezone

from attention.models import AgentViewing, Notification, NotificationSettings, PushSubscription
from core import secrets_at_rest


def notification_settings_for(*, user: User) -> NotificationSettings:
    """``user``'s settings; the defaults (every event, no quiet hours, no Apprise URL),
    unsaved, when they never saved any."""
    found = NotificationSettings.objects.filter(user=user).first()
    return found if found is not None else NotificationSettings(user=user)


def apprise_urls_of(choices: NotificationSettings) -> list[str]:
    """The Apprise URLs of ``choices``, decrypted (``core.secrets_at_rest``; raises its
    ``SecretUnreadable`` when the encryption keys changed without rotation)."""
    if not choices.apprise_urls_encrypted:
        return []
    urls = json.loads(secrets_at_rest.decrypt(choices.apprise_urls_encrypted))
    return [str(url) for url in urls]


def push_subscriptions_for(*, user: User) -> QuerySet[PushSubscription]:
    """``user``'s push subscriptions, oldest first."""
    return PushSubscription.objects.filter(user=user).order_by("created_at", "pk")


def is_viewing(*, user: User | int, agent_id: str, at: datetime | None = None) -> bool:
    """Whether one of ``user``'s tabs showed agent ``agent_id``'s page, visible, with a
    heartbeat still valid at ``at`` (default now)."""
    if not agent_id:
        return False
    user_id = user if isinstance(user, int) else user.pk
    moment = at or timezone.now()
    return AgentViewing.objects.filter(user_id=user_id, agent_id=agent_id, expires_at__gt=moment).exists()


def notifications_for(*, user: User, limit: int = 20) -> QuerySet[Notification]:
    """``user``'s newest notifications (``limit`` at most), newest first."""
    return Notification.objects.filter(user=user).prefetch_related("deliveries").order_by("-created_at", "-id")[:limit]
