"""Attention's models: per-user notification settings, browser push subscriptions, the
"viewing" heartbeats of open pages, and the notification outbox (docs/notifications.md).

A notification is a row first (``Notification``, one per event and user) and one
``Delivery`` per target (an Apprise URL, a push subscription); the background worker
(``attention.worker``) claims deliveries with a conditional UPDATE, so several processes
never send one twice.
"""

from __future__ import annotations

import secrets
from datetime import datetime, time

from django.conf import settings
from django.db import models
from django.utils import timezone


class NotificationSettings(models.Model):
    """One user's choices (docs/notifications.md#settings).

    ``on_*``: which events notify. Quiet hours run from ``quiet_start`` to ``quiet_end``
    (wall-clock times in ``quiet_timezone``, an IANA name; ``quiet_start > quiet_end``
    spans midnight; both ``None``: no quiet hours). During them nothing is pushed (Web
    Push, Apprise) unless ``approvals_break_quiet_hours`` and the event is an approval.
    ``apprise_urls_encrypted``: the Apprise URLs as a JSON list of strings, Fernet-encrypted
    (``core.secrets_at_rest``): they hold webhook secrets and passwords.
    """

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="notification_settings"
    )
    on_approval = models.BooleanField(default=True)
    on_finished = models.BooleanField(default=True)
    on_failed = models.BooleanField(default=True)
    quiet_start = models.TimeField(null=True, blank=True)
    quiet_end = models.TimeField(null=True, blank=True)
    quiet_timezone = models.CharField(max_length=64, default="UTC")
    approvals_break_quiet_hours = models.BooleanField(default=False)
    apprise_urls_encrypted = models.TextField(blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"notification settings of user {self.user_id}"

    def wants(self, kind: str) -> bool:
        """Whether events of ``kind`` (a ``Notification.Kind``) notify this user."""
        wanted: dict[str, bool] = {
            Notification.Kind.APPROVAL: self.on_approval,
            Notification.Kind.FINISHED: self.on_finished,
            Notification.Kind.FAILED: self.on_failed,
            Notification.Kind.TEST: True,
        }
        return wanted.get(kind, False)

    def quiet_at(self, moment: datetime) -> bool:
        """Whether ``moment`` (aware) falls in the quiet hours, read in ``quiet_timezone``.
        The start is inside, the end outside; equal start and end: no quiet hours."""
        if self.quiet_start is None or self.quiet_end is None or self.quiet_start == self.quiet_end:
            return False
        from zoneinfo import ZoneInfo

        local: time = moment.astimezone(ZoneInfo(self.quiet_timezone)).time()
        if self.quiet_start < self.quiet_end:
            return self.quiet_start <= local < self.quiet_end
        return local >= self.quiet_start or local < self.quiet_end


class PushSubscription(models.Model):
    """A browser's Web Push subscription (``PushSubscription.toJSON()``: ``endpoint`` and
    ``keys.p256dh`` / ``keys.auth``, base64url; RFC 8291). Deleted when its push service
    answers 404 or 410 (RFC 8030 §7.3: the subscription is gone)."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="push_subscriptions")
    endpoint = models.URLField(max_length=2048, unique=True)
    p256dh = models.CharField(max_length=128)
    auth = models.CharField(max_length=64)
    user_agent = models.CharField(max_length=300, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    last_sent_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"push subscription {self.pk} of user {self.user_id}"


class AgentViewing(models.Model):
    """An open, visible page of one agent in one browser tab (``client_id``, random per
    tab): pushes for that agent are held back until ``expires_at``. Renewed by the page's
    heartbeat (``static/js/attention.js``); a row, not process memory, so every process sees it."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="agent_viewings")
    client_id = models.CharField(max_length=64)
    agent_id = models.CharField(max_length=64)
    expires_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "client_id"], name="agentviewing_user_client")]
        indexes = [models.Index(fields=["user", "agent_id", "expires_at"], name="agentviewing_lookup")]

    def __str__(self) -> str:
        return f"user {self.user_id} viewing {self.agent_id} until {self.expires_at:%H:%M:%S}"


def new_notification_id() -> str:
    """``ntf_`` + 12 lowercase hex."""
    return "ntf_" + secrets.token_hex(6)


class Notification(models.Model):
    """One event for one user (docs/notifications.md#events).

    ``status``: ``pending`` while deliveries are open, ``sent`` when at least one target
    got it, ``failed`` when every target failed for good, ``suppressed`` when nothing was
    to be pushed (``suppressed_reason``: ``quiet hours``, ``viewing``, ``no targets``).
    ``dedupe_key`` makes a repeated event (a replayed signal, two processes) one row.
    """

    class Kind(models.TextChoices):
        APPROVAL = "approval"
        FINISHED = "finished"
        FAILED = "failed"
        TEST = "test"

    class Status(models.TextChoices):
        PENDING = "pending"
        SENT = "sent"
        FAILED = "failed"
        SUPPRESSED = "suppressed"

    id = models.CharField(primary_key=True, max_length=16, default=new_notification_id, editable=False)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="notifications")
    kind = models.CharField(max_length=10, choices=Kind.choices)
    agent_id = models.CharField(max_length=64, blank=True)
    approval_id = models.CharField(max_length=64, blank=True)
    title = models.CharField(max_length=200)
    body = models.TextField(blank=True)
    url = models.URLField(max_length=2048)
    dedupe_key = models.CharField(max_length=200)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    suppressed_reason = models.CharField(max_length=40, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "dedupe_key"], name="notification_user_dedupe")]
        indexes = [models.Index(fields=["user", "-created_at"], name="notification_user_created")]

    def __str__(self) -> str:
        return f"{self.id} {self.kind} for user {self.user_id} ({self.status})"

    def payload(self) -> dict[str, str]:
        """What a push carries and a tab shows: ``{id, kind, title, body, url, agent_id}``."""
        return {
            "id": self.id,
            "kind": self.kind,
            "title": self.title,
            "body": self.body,
            "url": self.url,
            "agent_id": self.agent_id,
        }


class Delivery(models.Model):
    """One notification to one target: an Apprise URL (copied, encrypted, into
    ``target_encrypted`` when the notification was made) or a push subscription.

    ``status``: ``pending`` (due at ``next_attempt_at``), ``sending`` (claimed by a worker
    until ``claimed_until``; an expired claim is taken again), ``sent``, ``failed`` (gave
    up after ``DISPATCH_NOTIFY_MAX_ATTEMPTS``; ``last_error`` says why), ``gone`` (the push
    subscription expired and was deleted), ``obsolete`` (not sent: the approval it announced
    was answered before it went out).
    """

    class Channel(models.TextChoices):
        APPRISE = "apprise"
        WEBPUSH = "webpush"

    class Status(models.TextChoices):
        PENDING = "pending"
        SENDING = "sending"
        SENT = "sent"
        FAILED = "failed"
        GONE = "gone"
        OBSOLETE = "obsolete"

    notification = models.ForeignKey(Notification, on_delete=models.CASCADE, related_name="deliveries")
    channel = models.CharField(max_length=10, choices=Channel.choices)
    target_encrypted = models.TextField(blank=True)
    subscription = models.ForeignKey(
        PushSubscription, null=True, blank=True, on_delete=models.SET_NULL, related_name="deliveries"
    )
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(default=timezone.now)
    claimed_until = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["status", "next_attempt_at"], name="delivery_due")]

    def __str__(self) -> str:
        return f"{self.channel} delivery {self.pk} of {self.notification_id} ({self.status})"
