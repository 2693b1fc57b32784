"""REST routes of notifications (docs/notifications.md), for the caller only.

- ``GET/PUT /api/v1/notifications/settings``: events, quiet hours, Apprise URLs (shown
  masked), the push subscriptions and the VAPID public key;
- ``POST/DELETE /api/v1/notifications/push-subscriptions``: a browser's ``PushSubscription``;
- ``POST /api/v1/notifications/viewing``: an open agent page's heartbeat;
- ``POST /api/v1/notifications/test``: a test notification to every target;
- ``GET /api/v1/notifications``: the newest notifications and what became of them.

Writes are a person's: an agent's token gets 403. Errors use the one error shape.
"""

from __future__ import annotations

import zoneinfo
from datetime import datetime, time
from typing import Annotated, Any

from django.conf import settings
from drf_spectacular.utils import OpenApiParameter, extend_schema
from pydantic import BaseModel, ConfigDict, Field, JsonValue, PlainValidator, StrictBool
from rest_framework import exceptions, status
from rest_framework.request import Request
from rest_framework.response import Response

from agents.tokens import agent_scope_forbid, calling_agent
from attention import selectors, services
from attention.models import NotificationSettings as SettingsRow
from attention.senders import apprise_url_masked
from attention.vapid import vapid_public_key
from core.api import DispatchAPIView
from core.authentication import authenticated_user
from core.errors import InvalidRequest, NotFound
from core.validation import BlankText, Model, Omittable, RequestSchema, Text, UtcDateTime, WireModel, parse_request

# --- bodies (docs/architecture.md#bodies) ----------------------------------------------

TIME_ZONES: list[JsonValue] = [*sorted(zoneinfo.available_timezones())]
HOUR_MINUTE = "^([01][0-9]|2[0-3]):[0-5][0-9]$"
_HOUR_MINUTE_WRONG = "Time has wrong format. Use one of these formats instead: hh:mm."


def _hour_minute(value: Any) -> time:
    # DRF's TimeField(input_formats=["%H:%M"]) read the time with strptime, and so does this.
    if isinstance(value, time):
        return value
    try:
        return datetime.strptime(value, "%H:%M").time()
    except (TypeError, ValueError):
        raise ValueError(_HOUR_MINUTE_WRONG) from None


# A time of day as "HH:MM" (a request's; the schema says the two-digit spelling).
HourMinute = Annotated[
    time, PlainValidator(_hour_minute, json_schema_input_type=str), RequestSchema(pattern=HOUR_MINUTE)
]


class Events(WireModel):
    """Which events notify (each left out stays as it is)."""

    approval: Omittable[StrictBool] = None
    finished: Omittable[StrictBool] = None
    failed: Omittable[StrictBool] = None


class QuietHours(WireModel):
    """Quiet hours: ``start`` and ``end`` ("HH:MM", both or neither: null for none) in an
    IANA ``timezone`` (``attention.services.notification_settings_update`` refuses the rest
    with its own sentence)."""

    # Both times or neither.
    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"start": {"type": "null"}}},
            "then": {"properties": {"end": {"type": "null"}}},
            "else": {"properties": {"end": {"type": "string"}}},
        }
    )

    start: HourMinute | None
    end: HourMinute | None
    timezone: Text = Field(default="UTC", max_length=64, json_schema_extra={"enum": TIME_ZONES})
    approvals_break: Omittable[StrictBool] = Field(default=None, description="approvals notify during quiet hours too")


class SettingsUpdate(WireModel):
    """``PUT /api/v1/notifications/settings``: what is left out stays."""

    events: Omittable[Events] = None
    quiet_hours: Omittable[QuietHours] = None
    # At most 20 (the service refuses more with its own sentence).
    apprise_urls: Omittable[list[Annotated[Text, Field(max_length=2000)]]] = Field(
        default=None, json_schema_extra={"maxItems": 20}
    )


class PushKeys(WireModel):
    """RFC 8291 keys in base64url: a 65-byte uncompressed P-256 point, a 16-byte secret."""

    p256dh: Text = Field(max_length=200, json_schema_extra={"pattern": "^B[A-Za-z0-9_-]{86}$"})
    auth: Text = Field(max_length=200, json_schema_extra={"pattern": "^[A-Za-z0-9_-]{22}$"})


# attention.services.push_endpoint_check: an https URL on a host name (its last label starts
# with a letter: no IP address).
PUSH_ENDPOINT = r"^[Hh][Tt][Tt][Pp][Ss]://([A-Za-z0-9-]+\.)*[A-Za-z][A-Za-z0-9-]*\.?(:[0-9]{1,5})?([/?#].*)?$"


class PushSubscription(WireModel):
    """A browser's ``PushSubscription.toJSON()``."""

    endpoint: Text = Field(max_length=2048, json_schema_extra={"pattern": PUSH_ENDPOINT})
    keys: PushKeys


class PushEndpoint(WireModel):
    endpoint: Text = Field(max_length=2048)


class Viewing(WireModel):
    """An open agent page's heartbeat; ``agent_id`` null or "": the page stopped showing one."""

    # attention.services._client_id: 8-64 letters, digits or '-', not dashes only.
    client_id: Text = Field(
        max_length=64, json_schema_extra={"pattern": "^[A-Za-z0-9-]*[A-Za-z0-9][A-Za-z0-9-]*$", "minLength": 8}
    )
    agent_id: BlankText | None = Field(default=None, max_length=64)


# --- answers ------------------------------------------------------------------------------


class EventSettings(BaseModel):
    approval: bool
    finished: bool
    failed: bool


class QuietHoursSettings(BaseModel):
    start: str | None = Field(description='"HH:MM"; null: no quiet hours')
    end: str | None = Field(description='"HH:MM"; null: no quiet hours')
    timezone: str
    approvals_break: bool


class PushSubscriptionShown(BaseModel):
    id: int
    user_agent: str
    created_at: UtcDateTime
    last_sent_at: UtcDateTime | None


class NotificationSettings(BaseModel):
    """The caller's notification settings; Apprise URLs masked, never in full."""

    events: EventSettings
    quiet_hours: QuietHoursSettings
    apprise_urls: list[str]
    push_subscriptions: list[PushSubscriptionShown]
    vapid_public_key: str = Field(description="the VAPID public key a browser subscribes with (base64url)")


class PushSubscriptionSaved(BaseModel):
    id: int


class ViewingAnswer(BaseModel):
    agent_id: str | None
    expires_at: UtcDateTime | None
    renew_after: float = Field(description="seconds")


class NotificationQueued(BaseModel):
    id: str
    status: str


class DeliveryShown(BaseModel):
    channel: str
    status: str
    attempts: int
    last_error: str


class NotificationShown(BaseModel):
    id: str
    kind: str
    title: str
    body: str
    url: str
    agent_id: str
    approval_id: str
    status: str
    suppressed_reason: str
    created_at: UtcDateTime
    deliveries: list[DeliveryShown]


class NotificationList(BaseModel):
    results: list[NotificationShown]


def _valid(model: type[Model], data: Any) -> Model:
    # These routes answered a refused body as INVALID_REQUEST with the fields' errors
    # under details.fields; they still do.
    try:
        return parse_request(model, data)
    except exceptions.ValidationError as refused:
        raise InvalidRequest("invalid notification settings", {"fields": refused.detail}) from None


def _clock(value: time | None) -> str | None:
    return value.strftime("%H:%M") if value is not None else None


def settings_data(choices: SettingsRow) -> dict[str, Any]:
    """The settings as the API shows them (``NotificationSettings``; Apprise URLs masked,
    never in full)."""
    subscriptions = selectors.push_subscriptions_for(user=choices.user)
    shown = NotificationSettings(
        events=EventSettings(approval=choices.on_approval, finished=choices.on_finished, failed=choices.on_failed),
        quiet_hours=QuietHoursSettings(
            start=_clock(choices.quiet_start),
            end=_clock(choices.quiet_end),
            timezone=choices.quiet_timezone,
            approvals_break=choices.approvals_break_quiet_hours,
        ),
        apprise_urls=[apprise_url_masked(url) for url in selectors.apprise_urls_of(choices)],
        push_subscriptions=[
            PushSubscriptionShown(
                id=subscription.pk,
                user_agent=subscription.user_agent,
                created_at=subscription.created_at,
                last_sent_at=subscription.last_sent_at,
            )
            for subscription in subscriptions
        ],
        vapid_public_key=vapid_public_key(),
    )
    return shown.model_dump(mode="json")


class NotificationSettingsView(DispatchAPIView):
    """``GET /api/v1/notifications/settings`` and ``PUT`` (any of ``events``,
    ``quiet_hours``, ``apprise_urls``; what is left out stays). An Apprise URL apprise
    refuses is 400 with apprise's reason and nothing is saved."""

    @extend_schema(responses={200: NotificationSettings})
    def get(self, request: Request) -> Response:
        user = authenticated_user(request)
        # A person's configuration (where their phone is reached): not an agent's to read.
        agent_scope_forbid(calling_agent(request), "read notification settings")
        return Response(settings_data(selectors.notification_settings_for(user=user)))

    @extend_schema(request=SettingsUpdate, responses={200: NotificationSettings})
    def put(self, request: Request) -> Response:
        user = authenticated_user(request)
        agent_scope_forbid(calling_agent(request), "change notification settings")
        body = _valid(SettingsUpdate, request.data)
        events = body.events or Events()
        quiet = body.quiet_hours
        saved = services.notification_settings_update(
            user=user,
            on_approval=events.approval,
            on_finished=events.finished,
            on_failed=events.failed,
            quiet_hours=services.QuietHours(quiet.start, quiet.end, quiet.timezone) if quiet else None,
            approvals_break_quiet_hours=quiet.approvals_break if quiet else None,
            apprise_urls=body.apprise_urls,
        )
        return Response(settings_data(saved))


class PushSubscriptionsView(DispatchAPIView):
    """``POST /api/v1/notifications/push-subscriptions`` with ``PushSubscription.toJSON()``
    (``endpoint``, ``keys.p256dh``, ``keys.auth``): 201; ``DELETE`` with ``{"endpoint"}``:
    204 (404 when it is not the caller's). Both are a person's: 403 for an agent token."""

    @extend_schema(request=PushSubscription, responses={201: PushSubscriptionSaved})
    def post(self, request: Request) -> Response:
        user = authenticated_user(request)
        agent_scope_forbid(calling_agent(request), "subscribe to push notifications")
        body = _valid(PushSubscription, request.data)
        saved = services.push_subscription_save(
            user=user,
            endpoint=body.endpoint,
            p256dh=body.keys.p256dh,
            auth=body.keys.auth,
            user_agent=request.headers.get("User-Agent", ""),
        )
        return Response(PushSubscriptionSaved(id=saved.pk).model_dump(mode="json"), status=status.HTTP_201_CREATED)

    @extend_schema(request=PushEndpoint, responses={204: None})
    def delete(self, request: Request) -> Response:
        user = authenticated_user(request)
        agent_scope_forbid(calling_agent(request), "unsubscribe from push notifications")
        body = _valid(PushEndpoint, request.data)
        if not services.push_subscription_delete(user=user, endpoint=body.endpoint):
            raise NotFound("no such push subscription")
        return Response(status=status.HTTP_204_NO_CONTENT)


class ViewingView(DispatchAPIView):
    """``POST /api/v1/notifications/viewing`` ``{"client_id", "agent_id"}``: this tab shows
    that agent's page, visible; ``agent_id`` null: it stopped. Answers ``{agent_id,
    expires_at, renew_after}`` (seconds: a third of ``DISPATCH_NOTIFY_VIEWING_TTL``). While
    a heartbeat is valid, pushes and Apprise messages about that agent are held back."""

    @extend_schema(request=Viewing, responses={200: ViewingAnswer})
    def post(self, request: Request) -> Response:
        user = authenticated_user(request)
        agent_scope_forbid(calling_agent(request), "report a viewed page")
        body = _valid(Viewing, request.data)
        viewing = services.viewing_beat(user=user, client_id=body.client_id, agent_id=body.agent_id)
        # The page renews three times per time to live, so one lost beat does not end it.
        renew_after = max(settings.NOTIFY_VIEWING_TTL / 3, 1.0)
        answer = ViewingAnswer(
            agent_id=viewing.agent_id if viewing else None,
            expires_at=viewing.expires_at if viewing else None,
            renew_after=renew_after,
        )
        return Response(answer.model_dump(mode="json"))


class NotificationTestView(DispatchAPIView):
    """``POST /api/v1/notifications/test``: one test notification to each Apprise URL and
    push subscription of the caller (202; the worker sends it)."""

    @extend_schema(request=None, responses={202: NotificationQueued})
    def post(self, request: Request) -> Response:
        user = authenticated_user(request)
        agent_scope_forbid(calling_agent(request), "send a test notification")
        notification = services.notify_test(user=user)
        queued = NotificationQueued(id=notification.pk, status=notification.status)
        return Response(queued.model_dump(mode="json"), status=status.HTTP_202_ACCEPTED)


class NotificationListView(DispatchAPIView):
    """``GET /api/v1/notifications?limit=20``: the caller's newest notifications (at most
    100), newest first, each ``{id, kind, title, body, url, agent_id, approval_id, status,
    suppressed_reason, created_at, deliveries: [{channel, status, attempts, last_error}]}``."""

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "limit",
                {"type": "integer", "minimum": 1, "maximum": 100},
                required=False,
                description="how many, 1 to 100 (default 20)",
            ),
        ],
        responses={200: NotificationList},
    )
    def get(self, request: Request) -> Response:
        user = authenticated_user(request)
        raw = request.query_params.get("limit", "20")
        if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= 100:  # '²'.isdigit() too
            raise InvalidRequest("limit must be a number from 1 to 100")
        results = [
            NotificationShown(
                **notification.payload(),
                approval_id=notification.approval_id,
                status=notification.status,
                suppressed_reason=notification.suppressed_reason,
                created_at=notification.created_at,
                deliveries=[
                    DeliveryShown(
                        channel=delivery.channel,
                        status=delivery.status,
                        attempts=delivery.attempts,
                        last_error=delivery.last_error,
                    )
                    for delivery in notification.deliveries.all()
                ],
            )
            for notification in selectors.notifications_for(user=user, limit=int(raw))
        ]
        return Response(NotificationList(results=results).model_dump(mode="json"))
