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

from datetime import time
from typing import Any

from django.conf import settings
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from agents.api import StrictBooleanField, StrictCharField
from agents.tokens import agent_scope_forbid, calling_agent
from attention import selectors, services
from attention.models import NotificationSettings
from attention.senders import apprise_url_masked
from attention.vapid import vapid_public_key
from core.api import DispatchAPIView
from core.authentication import authenticated_user
from core.errors import InvalidRequest, NotFound


class EventsSerializer(serializers.Serializer):
    approval = StrictBooleanField(required=False)
    finished = StrictBooleanField(required=False)
    failed = StrictBooleanField(required=False)


class QuietHoursSerializer(serializers.Serializer):
    start = serializers.TimeField(allow_null=True, format="%H:%M", input_formats=["%H:%M"])
    end = serializers.TimeField(allow_null=True, format="%H:%M", input_formats=["%H:%M"])
    timezone = StrictCharField(max_length=64, default="UTC")
    approvals_break = StrictBooleanField(required=False)


class SettingsUpdateSerializer(serializers.Serializer):
    events = EventsSerializer(required=False)
    quiet_hours = QuietHoursSerializer(required=False)
    apprise_urls = serializers.ListField(child=StrictCharField(max_length=2000, trim_whitespace=True), required=False)


def _valid(serializer: serializers.Serializer) -> dict[str, Any]:
    if not serializer.is_valid():
        raise InvalidRequest("invalid notification settings", {"fields": serializer.errors})
    return dict(serializer.validated_data)


def _clock(value: time | None) -> str | None:
    return value.strftime("%H:%M") if value is not None else None


def settings_data(choices: NotificationSettings) -> dict[str, Any]:
    """The settings as the API shows them (Apprise URLs masked, never in full)."""
    subscriptions = selectors.push_subscriptions_for(user=choices.user)
    return {
        "events": {"approval": choices.on_approval, "finished": choices.on_finished, "failed": choices.on_failed},
        "quiet_hours": {
            "start": _clock(choices.quiet_start),
            "end": _clock(choices.quiet_end),
            "timezone": choices.quiet_timezone,
            "approvals_break": choices.approvals_break_quiet_hours,
        },
        "apprise_urls": [apprise_url_masked(url) for url in selectors.apprise_urls_of(choices)],
        "push_subscriptions": [
            {
                "id": subscription.pk,
                "user_agent": subscription.user_agent,
                "created_at": subscription.created_at,
                "last_sent_at": subscription.last_sent_at,
            }
            for subscription in subscriptions
        ],
        "vapid_public_key": vapid_public_key(),
    }


SETTINGS_SHAPE = inline_serializer(
    "NotificationSettings",
    {
        "events": EventsSerializer(),
        "quiet_hours": QuietHoursSerializer(),
        "apprise_urls": serializers.ListField(child=serializers.CharField()),
        "push_subscriptions": serializers.ListField(child=serializers.DictField()),
        "vapid_public_key": serializers.CharField(),
    },
)


class NotificationSettingsView(DispatchAPIView):
    """``GET /api/v1/notifications/settings`` and ``PUT`` (any of ``events``,
    ``quiet_hours``, ``apprise_urls``; what is left out stays). An Apprise URL apprise
    refuses is 400 with apprise's reason and nothing is saved."""

    @extend_schema(responses={200: SETTINGS_SHAPE})
    def get(self, request: Request) -> Response:
        user = authenticated_user(request)
        # A person's configuration (where their phone is reached): not an agent's to read.
        agent_scope_forbid(calling_agent(request), "read notification settings")
        return Response(settings_data(selectors.notification_settings_for(user=user)))

    @extend_schema(request=SettingsUpdateSerializer, responses={200: SETTINGS_SHAPE})
    def put(self, request: Request) -> Response:
        user = authenticated_user(request)
        agent_scope_forbid(calling_agent(request), "change notification settings")
        body = _valid(SettingsUpdateSerializer(data=request.data))
        events = body.get("events") or {}
        quiet = body.get("quiet_hours")
        saved = services.notification_settings_update(
            user=user,
            on_approval=events.get("approval"),
            on_finished=events.get("finished"),
            on_failed=events.get("failed"),
            quiet_hours=services.QuietHours(quiet["start"], quiet["end"], quiet["timezone"]) if quiet else None,
            approvals_break_quiet_hours=quiet.get("approvals_break") if quiet else None,
            apprise_urls=body.get("apprise_urls"),
        )
        return Response(settings_data(saved))


class PushKeysSerializer(serializers.Serializer):
    p256dh = StrictCharField(max_length=200)
    auth = StrictCharField(max_length=200)


class PushSubscriptionSerializer(serializers.Serializer):
    endpoint = StrictCharField(max_length=2048)
    keys = PushKeysSerializer()


class PushEndpointSerializer(serializers.Serializer):
    endpoint = StrictCharField(max_length=2048)


class PushSubscriptionsView(DispatchAPIView):
    """``POST /api/v1/notifications/push-subscriptions`` with ``PushSubscription.toJSON()``
    (``endpoint``, ``keys.p256dh``, ``keys.auth``): 201; ``DELETE`` with ``{"endpoint"}``:
    204 (404 when it is not the caller's). Both are a person's: 403 for an agent token."""

    @extend_schema(
        request=PushSubscriptionSerializer,
        responses={201: inline_serializer("PushSubscriptionSaved", {"id": serializers.IntegerField()})},
    )
    def post(self, request: Request) -> Response:
        user = authenticated_user(request)
        agent_scope_forbid(calling_agent(request), "subscribe to push notifications")
        body = _valid(PushSubscriptionSerializer(data=request.data))
        saved = services.push_subscription_save(
            user=user,
            endpoint=body["endpoint"],
            p256dh=body["keys"]["p256dh"],
            auth=body["keys"]["auth"],
            user_agent=request.headers.get("User-Agent", ""),
        )
        return Response({"id": saved.pk}, status=status.HTTP_201_CREATED)

    @extend_schema(request=PushEndpointSerializer, responses={204: None})
    def delete(self, request: Request) -> Response:
        user = authenticated_user(request)
        agent_scope_forbid(calling_agent(request), "unsubscribe from push notifications")
        body = _valid(PushEndpointSerializer(data=request.data))
        if not services.push_subscription_delete(user=user, endpoint=body["endpoint"]):
            raise NotFound("no such push subscription")
        return Response(status=status.HTTP_204_NO_CONTENT)


class ViewingSerializer(serializers.Serializer):
    client_id = StrictCharField(max_length=64)
    agent_id = StrictCharField(max_length=64, allow_null=True, allow_blank=True, required=False, default=None)


class ViewingView(DispatchAPIView):
    """``POST /api/v1/notifications/viewing`` ``{"client_id", "agent_id"}``: this tab shows
    that agent's page, visible; ``agent_id`` null: it stopped. Answers ``{agent_id,
    expires_at, renew_after}`` (seconds: a third of ``DISPATCH_NOTIFY_VIEWING_TTL``). While
    a heartbeat is valid, pushes and Apprise messages about that agent are held back."""

    @extend_schema(
        request=ViewingSerializer,
        responses={
            200: inline_serializer(
                "ViewingAnswer",  # not "Viewing": that is the request's component (ViewingSerializer)
                {
                    "agent_id": serializers.CharField(allow_null=True),
                    "expires_at": serializers.DateTimeField(allow_null=True),
                    "renew_after": serializers.FloatField(help_text="seconds"),
                },
            )
        },
    )
    def post(self, request: Request) -> Response:
        user = authenticated_user(request)
        agent_scope_forbid(calling_agent(request), "report a viewed page")
        body = _valid(ViewingSerializer(data=request.data))
        viewing = services.viewing_beat(user=user, client_id=body["client_id"], agent_id=body.get("agent_id"))
        # The page renews three times per time to live, so one lost beat does not end it.
        renew_after = max(settings.NOTIFY_VIEWING_TTL / 3, 1.0)
        return Response(
            {
                "agent_id": viewing.agent_id if viewing else None,
                "expires_at": viewing.expires_at if viewing else None,
                "renew_after": renew_after,
            }
        )


class NotificationTestView(DispatchAPIView):
    """``POST /api/v1/notifications/test``: one test notification to each Apprise URL and
    push subscription of the caller (202; the worker sends it)."""

    @extend_schema(
        request=None,
        responses={202: inline_serializer("NotificationQueued", {"id": serializers.CharField()})},
    )
    def post(self, request: Request) -> Response:
        user = authenticated_user(request)
        agent_scope_forbid(calling_agent(request), "send a test notification")
        notification = services.notify_test(user=user)
        return Response({"id": notification.pk, "status": notification.status}, status=status.HTTP_202_ACCEPTED)


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
        responses={200: inline_serializer("NotificationList", {"results": serializers.ListField()})},
    )
    def get(self, request: Request) -> Response:
        user = authenticated_user(request)
        raw = request.query_params.get("limit", "20")
        if not raw.isdigit() or not 1 <= int(raw) <= 100:
            raise InvalidRequest("limit must be a number from 1 to 100")
        results = [
            {
                **notification.payload(),
                "approval_id": notification.approval_id,
                "status": notification.status,
                "suppressed_reason": notification.suppressed_reason,
                "created_at": notification.created_at,
                "deliveries": [
                    {
                        "channel": delivery.channel,
                        "status": delivery.status,
                        "attempts": delivery.attempts,
                        "last_error": delivery.last_error,
                    }
                    for delivery in notification.deliveries.all()
                ],
            }
            for notification in selectors.notifications_for(user=user, limit=int(raw))
        ]
        return Response({"results": results})
