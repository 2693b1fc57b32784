"""Attention's writes: settings, push subscriptions, viewing heartbeats, and the
notification outbox with its deliveries (docs/notifications.md).

``notify`` is what the signal receivers call: it writes a ``Notification`` and one
``Delivery`` per target in one transaction, and rings the user's open tabs; the sending
happens later, in the background worker (``attention.worker``), which claims due
deliveries with ``deliveries_claim`` and records each outcome with ``delivery_record``.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import secrets
from dataclasses import dataclass
from datetime import datetime, time, timedelta
from typing import Any
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cryptography.hazmat.primitives.asymmetric import ec
from django.conf import settings
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.utils import timezone

from agents.models import Approval
from agents.selectors import agent_get_for
from agents.services import publish_on_commit
from attention.models import AgentViewing, Delivery, Notification, NotificationSettings, PushSubscription
from attention.selectors import apprise_urls_of, is_viewing, notification_settings_for
from attention.senders import apprise_url_check, apprise_url_masked
from core import secrets_at_rest
from core.errors import DispatchError, InvalidRequest

MAX_APPRISE_URLS = 20
# Push subscriptions one user may hold: one per browser they enabled push in. Each
# notification is sent to every one, so an unbounded list is an amplifier.
MAX_PUSH_SUBSCRIPTIONS = 20
MAX_TITLE = 200
MAX_BODY = 1000
CLAIM_LEASE = timedelta(seconds=120)  # a claimed delivery whose worker died is taken again after this

# The live frame a user's open tabs receive for each notification (static/js/attention.js).
TAB_EVENT = "notification"


# --- settings ----------------------------------------------------------------------------


@dataclass(frozen=True)
class QuietHours:
    """Quiet hours as a person sets them: ``start``/``end`` wall-clock times (both or
    neither), ``timezone`` an IANA name such as ``Europe/Rome``."""

    start: time | None
    end: time | None
    timezone: str = "UTC"


def _valid_timezone(name: str) -> str:
    if not isinstance(name, str) or not name or len(name) > 64:
        raise InvalidRequest("quiet_hours.timezone must be an IANA time zone name such as Europe/Rome")
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidRequest(f"unknown time zone '{name}' (an IANA name such as Europe/Rome)") from None
    return name


@transaction.atomic
def notification_settings_update(
    *,
    user: User,
    on_approval: bool | None = None,
    on_finished: bool | None = None,
    on_failed: bool | None = None,
    quiet_hours: QuietHours | None = None,
    approvals_break_quiet_hours: bool | None = None,
    apprise_urls: list[str] | None = None,
) -> NotificationSettings:
    """Change ``user``'s notification settings; ``None`` leaves a field as it is.

    ``apprise_urls`` replaces the whole list (at most ``MAX_APPRISE_URLS``, duplicates
    dropped); each is loaded by apprise first and a URL it refuses raises
    ``InvalidRequest`` naming the URL's position and apprise's reason, with nothing saved.
    An entry equal to a stored URL's masked form (``senders.apprise_url_masked``, what the
    settings show) keeps that stored URL.
    The list is stored encrypted (``core.secrets_at_rest``). Quiet hours need both times
    or neither. Returns the saved settings.
    """
    choices = NotificationSettings.objects.select_for_update().filter(user=user).first()
    if choices is None:
        choices = notification_settings_for(user=user)
    for name, value in (
        ("on_approval", on_approval),
        ("on_finished", on_finished),
        ("on_failed", on_failed),
        ("approvals_break_quiet_hours", approvals_break_quiet_hours),
    ):
        if value is not None:
            if not isinstance(value, bool):
                raise InvalidRequest(f"{name} must be true or false")
            setattr(choices, name, value)
    if quiet_hours is not None:
        if (quiet_hours.start is None) != (quiet_hours.end is None):
            raise InvalidRequest("quiet hours need both a start and an end (or neither)")
        choices.quiet_start, choices.quiet_end = quiet_hours.start, quiet_hours.end
        choices.quiet_timezone = _valid_timezone(quiet_hours.timezone)
    if apprise_urls is not None:
        if not isinstance(apprise_urls, list) or len(apprise_urls) > MAX_APPRISE_URLS:
            raise InvalidRequest(f"apprise_urls must be a list of at most {MAX_APPRISE_URLS} URLs")
        # A URL sent back as the settings show it (masked) keeps the stored one it stands for;
        # URLs that mask alike (two topics starting "my") are taken back in their stored order.
        stored: dict[str, list[str]] = {}
        for url in apprise_urls_of(choices):
            stored.setdefault(apprise_url_masked(url), []).append(url)
        kept: list[str] = []
        for index, given in enumerate(apprise_urls):
            alike = stored.get(given) if isinstance(given, str) else None
            url = alike.pop(0) if alike else given
            try:
                apprise_url_check(url)
            except InvalidRequest as exc:
                raise InvalidRequest(f"Apprise URL #{index + 1}: {exc.message}", {"index": index, **exc.details})
            if url.strip() not in kept:
                kept.append(url.strip())
        choices.apprise_urls_encrypted = secrets_at_rest.encrypt(json.dumps(kept).encode()) if kept else ""
    choices.updated_at = timezone.now()
    choices.save()
    return choices


# --- push subscriptions -------------------------------------------------------------------


def _b64url(value: Any, what: str) -> bytes:
    if not isinstance(value, str) or not value or len(value) > 200:
        raise InvalidRequest(f"{what} must be base64url text")
    try:
        return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{what} is not base64url") from None


def _loopback(hostname: str) -> bool:
    address = _ip_of(hostname)
    return hostname == "localhost" or (address is not None and address.is_loopback)


def _ip_of(hostname: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(hostname)
    except ValueError:
        return None


def push_endpoint_check(endpoint: Any) -> str:
    """``endpoint`` when it is an address a browser's push service gives: ``https://`` on a
    host name or a global IP address, without user info, at most 2048 characters, no NUL.
    Browsers only hand out https push endpoints (the W3C Push API; RFC 8030 runs over
    HTTPS), so anything else — plain http, ``file:``, loopback, private, link-local (cloud
    metadata) or unspecified addresses — is refused: the server POSTs to it. With
    ``DISPATCH_NOTIFY_PUSH_LOOPBACK_HTTP`` a push service on this machine (``http://`` or
    ``https://`` on ``localhost``/``127.0.0.1``/``::1``) is taken too, for tests and local
    trials. Raises ``InvalidRequest``. A host name that resolves to an internal address
    is not looked up here (docs/notifications.md#web-push)."""
    if not isinstance(endpoint, str) or len(endpoint) > 2048 or "\x00" in endpoint:
        raise InvalidRequest("endpoint must be the push service's URL")
    try:
        parts = urlsplit(endpoint)
        hostname = parts.hostname or ""
    except ValueError:
        raise InvalidRequest("endpoint must be an https URL") from None
    if parts.scheme not in ("https", "http") or not hostname:
        raise InvalidRequest("endpoint must be an https URL")
    if parts.username is not None or parts.password is not None:
        raise InvalidRequest("endpoint must not carry a user name or password")
    if settings.NOTIFY_PUSH_LOOPBACK_HTTP and _loopback(hostname):
        return endpoint
    if parts.scheme != "https":
        raise InvalidRequest("endpoint must be an https URL (browsers only give https push endpoints)")
    name = hostname.rstrip(".")
    address = _ip_of(name)
    last_label = name.rsplit(".", 1)[-1]
    # "0", "2130706433", "127.1", "0x7f.1": no IP address to ipaddress, 127.0.0.1 to the resolver.
    numeric = address is None and (last_label.isdigit() or last_label.startswith("0x"))
    if name == "localhost" or name.endswith(".localhost") or numeric or (address is not None and not address.is_global):
        raise InvalidRequest("endpoint must be a push service on the internet, not a local or private address")
    return endpoint


@transaction.atomic
def push_subscription_save(
    *, user: User, endpoint: str, p256dh: str, auth: str, user_agent: str = ""
) -> PushSubscription:
    """Keep a browser's push subscription for ``user`` (``PushSubscription.toJSON()``'s
    ``endpoint``, ``keys.p256dh``, ``keys.auth``; RFC 8291 §3: a P-256 public point of 65
    bytes and a 16-byte auth secret, base64url). ``endpoint`` as ``push_endpoint_check``.

    The same endpoint saved again by ``user`` is updated. Saved by another user, it moves
    to them only with the very same keys — the same browser, where another account logged
    in; with other keys it is ``DispatchError("CONFLICT")`` (409) and stays as it is: the
    endpoint alone (which anyone who saw it knows) never takes a subscription away. At most
    ``MAX_PUSH_SUBSCRIPTIONS`` per user (``InvalidRequest`` beyond, nothing saved).
    ``InvalidRequest`` too for keys of the wrong shape."""
    push_endpoint_check(endpoint)
    point = _b64url(p256dh, "keys.p256dh")
    try:
        ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), point)
    except ValueError:
        raise InvalidRequest("keys.p256dh is not a P-256 public key (65 bytes, uncompressed)") from None
    if len(point) != 65:
        raise InvalidRequest("keys.p256dh is not a P-256 public key (65 bytes, uncompressed)")
    if len(_b64url(auth, "keys.auth")) != 16:
        raise InvalidRequest("keys.auth must be 16 bytes")
    existing = PushSubscription.objects.select_for_update().filter(endpoint=endpoint).first()
    if existing is not None and existing.user_id != user.pk and (existing.p256dh, existing.auth) != (p256dh, auth):
        raise DispatchError(
            "CONFLICT",
            "this push endpoint is subscribed with other keys: turn push off on that device and enable it again",
        )
    if existing is None or existing.user_id != user.pk:
        held = PushSubscription.objects.select_for_update().filter(user=user).count()
        if held >= MAX_PUSH_SUBSCRIPTIONS:
            raise InvalidRequest(
                f"at most {MAX_PUSH_SUBSCRIPTIONS} push subscriptions per user: turn push off on a device you no "
                "longer use first",
                {"limit": MAX_PUSH_SUBSCRIPTIONS},
            )
    subscription, _ = PushSubscription.objects.update_or_create(
        endpoint=endpoint,
        defaults={"user": user, "p256dh": p256dh, "auth": auth, "user_agent": (user_agent or "")[:300]},
    )
    return subscription


@transaction.atomic
def push_subscription_delete(*, user: User, endpoint: str) -> bool:
    """Forget ``user``'s subscription at ``endpoint``; whether there was one."""
    deleted, _ = PushSubscription.objects.filter(user=user, endpoint=endpoint).delete()
    return bool(deleted)


# --- viewing ------------------------------------------------------------------------------


def _client_id(value: Any) -> str:
    if not isinstance(value, str) or not 8 <= len(value) <= 64 or not value.replace("-", "").isalnum():
        raise InvalidRequest("client_id must be 8-64 letters, digits or '-'")
    return value


@transaction.atomic
def viewing_beat(*, user: User, client_id: str, agent_id: str | None) -> AgentViewing | None:
    """One tab's heartbeat: it shows agent ``agent_id``'s page, visible, for the next
    ``DISPATCH_NOTIFY_VIEWING_TTL`` seconds; ``agent_id`` None or "": it stopped (hidden,
    closed, another page). ``client_id`` is the tab's random id. ``NotFound`` for an
    agent that is not ``user``'s. Returns the row, or ``None`` once stopped."""
    client = _client_id(client_id)
    if not agent_id:
        AgentViewing.objects.filter(user=user, client_id=client).delete()
        return None
    agent = agent_get_for(user=user, agent_id=agent_id)
    viewing, _ = AgentViewing.objects.update_or_create(
        user=user,
        client_id=client,
        defaults={"agent_id": agent.pk, "expires_at": timezone.now() + timedelta(seconds=settings.NOTIFY_VIEWING_TTL)},
    )
    return viewing


def viewings_reap(*, now: datetime | None = None) -> int:
    """Delete expired viewing rows; how many."""
    deleted, _ = AgentViewing.objects.filter(expires_at__lte=now or timezone.now()).delete()
    return deleted


NOTIFICATIONS_KEPT = timedelta(days=30)


def notifications_prune(*, now: datetime | None = None) -> int:
    """Delete notifications (and their deliveries) older than ``NOTIFICATIONS_KEPT`` that
    nothing will send any more, and expired viewing rows; how many notifications."""
    moment = now or timezone.now()
    viewings_reap(now=moment)
    open_ids = Delivery.objects.filter(status__in=[Delivery.Status.PENDING, Delivery.Status.SENDING]).values(
        "notification_id"
    )
    _, per_model = (
        Notification.objects.filter(created_at__lt=moment - NOTIFICATIONS_KEPT).exclude(pk__in=open_ids).delete()
    )
    return per_model.get(Notification._meta.label, 0)


# --- notifications ------------------------------------------------------------------------


def _cut(text: str, limit: int) -> str:
    text = " ".join(str(text).split()) if "\n" not in str(text) else str(text).strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


@transaction.atomic
def notify(
    *,
    user: User,
    kind: str,
    title: str,
    body: str,
    url: str,
    dedupe_key: str,
    agent_id: str = "",
    approval_id: str = "",
    at: datetime | None = None,
) -> Notification | None:
    """Record one notification for ``user`` and what to send where (docs/notifications.md).

    Nothing when ``user`` turned ``kind`` off, or when ``dedupe_key`` was already
    notified (returns ``None``). Otherwise the row is written with one pending
    ``Delivery`` per Apprise URL and push subscription, unless pushes are held back
    (status ``suppressed``): in quiet hours (approvals too, unless the user lets them
    break through), or while one of the user's tabs shows ``agent_id``'s page (a test
    notification is never held back). Open tabs get a ``notification`` live frame in every
    case (a tab showing that agent stays silent itself). ``url`` is absolute.
    """
    if kind not in Notification.Kind.values:
        raise InvalidRequest(f"unknown notification kind '{kind}'")
    choices = notification_settings_for(user=user)
    if not choices.wants(kind):
        return None
    moment = at or timezone.now()
    reason = ""
    if kind != Notification.Kind.TEST:
        breaks = kind == Notification.Kind.APPROVAL and choices.approvals_break_quiet_hours
        if choices.quiet_at(moment) and not breaks:
            reason = "quiet hours"
        elif is_viewing(user=user, agent_id=agent_id, at=moment):
            reason = "viewing"
    try:
        with transaction.atomic():
            notification = Notification.objects.create(
                user=user,
                kind=kind,
                agent_id=agent_id,
                approval_id=approval_id,
                title=_cut(title, MAX_TITLE),
                body=_cut(body, MAX_BODY),
                url=url,
                dedupe_key=dedupe_key[:200],
                created_at=moment,
            )
    except IntegrityError:
        return None
    if not reason:
        targets = [
            Delivery(
                notification=notification,
                channel=Delivery.Channel.APPRISE,
                target_encrypted=secrets_at_rest.encrypt(u.encode()),
            )
            for u in apprise_urls_of(choices)
        ]
        targets += [
            Delivery(notification=notification, channel=Delivery.Channel.WEBPUSH, subscription=subscription)
            for subscription in PushSubscription.objects.filter(user=user)
        ]
        Delivery.objects.bulk_create(targets)
        if not targets:
            reason = "no targets"
    if reason:
        notification.status = Notification.Status.SUPPRESSED
        notification.suppressed_reason = reason
        notification.save(update_fields=["status", "suppressed_reason"])
    publish_on_commit(user_id=user.pk, event=TAB_EVENT, data=notification.payload())
    return notification


def notify_test(*, user: User) -> Notification:
    """A test notification to every target of ``user`` (the settings page's button;
    ``POST /api/v1/notifications/test``), never held back by quiet hours or viewing."""
    notification = notify(
        user=user,
        kind=Notification.Kind.TEST,
        title="Dispatch test notification",
        body="Notifications from Dispatch reach you here.",
        url=settings.PUBLIC_URL + "/settings/notifications/",
        dedupe_key="test:" + secrets.token_hex(8),
    )
    assert notification is not None  # a test is always wanted and its key is new
    return notification


# --- delivery (the worker's side) -------------------------------------------------------


def deliveries_claim(*, limit: int = 20, now: datetime | None = None) -> list[Delivery]:
    """Claim up to ``limit`` due deliveries for this worker: pending ones whose
    ``next_attempt_at`` has come, and ``sending`` ones whose claim expired (their worker
    died). Each is taken with a conditional UPDATE on its status and attempt count, so
    two workers never take the same one; the claimed rows come back with ``attempts``
    counted and ``claimed_until`` set ``CLAIM_LEASE`` ahead."""
    moment = now or timezone.now()
    due = (
        Delivery.objects.filter(
            Q(status=Delivery.Status.PENDING, next_attempt_at__lte=moment)
            | Q(status=Delivery.Status.SENDING, claimed_until__lt=moment)
        )
        .order_by("next_attempt_at", "pk")
        .values_list("pk", "status", "attempts")[:limit]
    )
    claimed_ids = []
    for pk, status, attempts in list(due):
        won = Delivery.objects.filter(pk=pk, status=status, attempts=attempts).update(
            status=Delivery.Status.SENDING, attempts=F("attempts") + 1, claimed_until=moment + CLAIM_LEASE
        )
        if won:
            claimed_ids.append(pk)
    return list(
        Delivery.objects.filter(pk__in=claimed_ids).select_related("notification", "subscription").order_by("pk")
    )


def retry_delay(attempts: int) -> timedelta:
    """The wait before attempt ``attempts + 1``: ``DISPATCH_NOTIFY_RETRY_BASE`` seconds,
    four times longer after each failure (10 s, 40 s, 160 s, 640 s by default)."""
    return timedelta(seconds=settings.NOTIFY_RETRY_BASE * 4 ** max(attempts - 1, 0))


@transaction.atomic
def delivery_record(
    *, delivery: Delivery, error: str = "", gone: bool = False, obsolete: bool = False, now: datetime | None = None
) -> Delivery:
    """Record the outcome of one claimed send: success (no ``error``), a failure
    (``error``: retried after ``retry_delay`` until ``DISPATCH_NOTIFY_MAX_ATTEMPTS``, then
    ``failed``), an expired push subscription (``gone``: the subscription is deleted), or a
    send that is no longer wanted (``obsolete``: the approval was answered meanwhile).
    The notification's status follows: ``sent`` once any target got it, ``failed`` when
    none can any more. Returns the delivery as stored."""
    moment = now or timezone.now()
    fields: dict[str, Any] = {"claimed_until": None}
    if obsolete:
        fields.update(status=Delivery.Status.OBSOLETE, last_error=error[:2000])
    elif gone:
        fields.update(status=Delivery.Status.GONE, last_error=error[:2000])
        if delivery.subscription_id is not None:
            PushSubscription.objects.filter(pk=delivery.subscription_id).delete()
    elif error:
        final = delivery.attempts >= settings.NOTIFY_MAX_ATTEMPTS
        fields.update(
            status=Delivery.Status.FAILED if final else Delivery.Status.PENDING,
            last_error=error[:2000],
            next_attempt_at=moment + retry_delay(delivery.attempts),
        )
    else:
        fields.update(status=Delivery.Status.SENT, sent_at=moment, last_error="")
        if delivery.subscription_id is not None:
            PushSubscription.objects.filter(pk=delivery.subscription_id).update(last_sent_at=moment)
    Delivery.objects.filter(pk=delivery.pk, status=Delivery.Status.SENDING).update(**fields)
    delivery.refresh_from_db()
    statuses = set(Delivery.objects.filter(notification_id=delivery.notification_id).values_list("status", flat=True))
    if Delivery.Status.SENT in statuses:
        outcome = Notification.Status.SENT
    elif statuses <= {Delivery.Status.OBSOLETE}:
        outcome = Notification.Status.SUPPRESSED
    elif statuses <= {Delivery.Status.FAILED, Delivery.Status.GONE, Delivery.Status.OBSOLETE}:
        outcome = Notification.Status.FAILED
    else:
        outcome = Notification.Status.PENDING
    changes: dict[str, Any] = {"status": outcome}
    if outcome == Notification.Status.SUPPRESSED:
        changes["suppressed_reason"] = "answered"
    Notification.objects.filter(pk=delivery.notification_id).update(**changes)
    return delivery


def approval_still_waiting(approval_id: str) -> bool:
    """Whether the approval ``approval_id`` is still pending (a notification about one that
    was answered meanwhile is not sent any more)."""
    return Approval.objects.filter(pk=approval_id, status=Approval.Status.PENDING).exists()


def delivery_target(delivery: Delivery) -> str:
    """The Apprise URL of an Apprise delivery, decrypted."""
    return secrets_at_rest.decrypt(delivery.target_encrypted).decode()
