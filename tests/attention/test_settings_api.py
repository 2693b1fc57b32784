"""``/api/v1/notifications/…`` and ``/settings/notifications/``: settings per user (Apprise
URLs checked by apprise, kept encrypted, shown masked), push subscriptions, the viewing
heartbeat, the test button, ``/sw.js`` and the web manifest."""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from django.test import Client

from agents.models import Agent
from agents.tokens import agent_token_mint
from attention.models import AgentViewing, Notification, NotificationSettings, PushSubscription

pytestmark = pytest.mark.django_db

SETTINGS = "/api/v1/notifications/settings"
SUBSCRIPTIONS = "/api/v1/notifications/push-subscriptions"
SLACK_SECRET = "slack://T1JJ3T3L2/A1BRTD4JD/TIiajkdnlazkcOXrIdevi7FQ"


class Api:
    def __init__(self, token: str) -> None:
        self.client = Client()
        self.headers = {"authorization": f"Bearer {token}"}

    def get(self, path: str) -> Any:
        return self.client.get(path, headers=self.headers)

    def send(self, method: str, path: str, body: Any = None) -> Any:
        call = getattr(self.client, method)
        return call(path, json.dumps(body or {}), content_type="application/json", headers=self.headers)


@pytest.fixture
def api(owner_token: str) -> Api:
    return Api(owner_token)


def b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def browser_subscription(endpoint: str = "https://push.example.net/send/abc") -> dict[str, Any]:
    point = (
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)
    )
    return {"endpoint": endpoint, "keys": {"p256dh": b64url(point), "auth": b64url(os.urandom(16))}}


def test_the_defaults_notify_every_event_with_no_quiet_hours_and_give_the_vapid_key(api: Api) -> None:
    body = api.get(SETTINGS).json()
    assert body["events"] == {"approval": True, "finished": True, "failed": True}
    assert body["quiet_hours"] == {"start": None, "end": None, "timezone": "UTC", "approvals_break": False}
    assert body["apprise_urls"] == [] and body["push_subscriptions"] == []
    assert len(base64.urlsafe_b64decode(body["vapid_public_key"] + "=")) == 65


def test_an_apprise_url_apprise_refuses_is_400_with_its_reason_and_nothing_changes(api: Api, owner: Any) -> None:
    api.send("put", SETTINGS, {"apprise_urls": ["json://127.0.0.1:9/ok"]})
    response = api.send("put", SETTINGS, {"apprise_urls": ["json://127.0.0.1:9/ok", "slack://bad"]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "INVALID_REQUEST"
    assert "Apprise URL #2" in error["message"] and "Slack" in error["message"]
    assert api.get(SETTINGS).json()["apprise_urls"] == ["json://127.0.0.1:9/ok"]
    unknown = api.send("put", SETTINGS, {"apprise_urls": ["https://example.com/hook"]})
    assert unknown.status_code == 400 and "Unparseable URL" in unknown.json()["error"]["message"]


def test_apprise_urls_are_encrypted_at_rest_shown_masked_and_kept_when_sent_back_masked(api: Api, owner: Any) -> None:
    saved = api.send("put", SETTINGS, {"apprise_urls": [SLACK_SECRET]})
    assert saved.status_code == 200
    stored = NotificationSettings.objects.get(user=owner).apprise_urls_encrypted
    assert "TIiajkdnlazkcOXrIdevi7FQ" not in stored and "slack" not in stored
    shown = saved.json()["apprise_urls"]
    assert len(shown) == 1 and "TIiajkdnlazkcOXrIdevi7FQ" not in shown[0] and shown[0].startswith("slack://")
    # A client that sends back what it was shown, plus one more, keeps the stored secret.
    again = api.send("put", SETTINGS, {"apprise_urls": [*shown, "ntfys://ntfy.sh/dispatch-alerts"]})
    assert again.status_code == 200
    from attention.selectors import apprise_urls_of

    assert apprise_urls_of(NotificationSettings.objects.get(user=owner)) == [
        SLACK_SECRET,
        "ntfys://ntfy.sh/dispatch-alerts",
    ]


def test_events_and_quiet_hours_are_saved_and_bad_ones_refused(api: Api) -> None:
    ok = api.send(
        "put",
        SETTINGS,
        {
            "events": {"finished": False},
            "quiet_hours": {"start": "22:30", "end": "07:00", "timezone": "Europe/Rome", "approvals_break": True},
        },
    )
    assert ok.status_code == 200, ok.json()
    body = ok.json()
    assert body["events"] == {"approval": True, "finished": False, "failed": True}
    assert body["quiet_hours"] == {"start": "22:30", "end": "07:00", "timezone": "Europe/Rome", "approvals_break": True}
    for bad in (
        {"quiet_hours": {"start": "22:30", "end": None, "timezone": "UTC"}},
        {"quiet_hours": {"start": "22:30", "end": "07:00", "timezone": "Mars/Olympus"}},
        {"quiet_hours": {"start": "25:00", "end": "07:00", "timezone": "UTC"}},
        {"events": {"approval": "yes"}},
        {"apprise_urls": "json://127.0.0.1:9/x"},
    ):
        refused = api.send("put", SETTINGS, bad)
        assert refused.status_code == 400, bad
    assert api.get(SETTINGS).json() == body


def test_settings_are_per_user_and_an_agent_token_cannot_change_them(api: Api, owner: Any, outsider_token: str) -> None:
    api.send("put", SETTINGS, {"apprise_urls": ["json://127.0.0.1:9/mine"]})
    assert Api(outsider_token).get(SETTINGS).json()["apprise_urls"] == []
    agent = Agent.objects.create(owner=owner, name="a", type="claude", status=Agent.Status.RUNNING, cwd="/tmp")
    as_agent = Api(agent_token_mint(agent=agent))
    refused = as_agent.send("put", SETTINGS, {"apprise_urls": []})
    assert refused.status_code == 403
    assert api.get(SETTINGS).json()["apprise_urls"] == ["json://127.0.0.1:9/mine"]
    assert as_agent.send("post", SUBSCRIPTIONS, browser_subscription()).status_code == 403


def test_a_push_subscription_is_saved_listed_and_deleted_and_bad_keys_are_refused(api: Api, owner: Any) -> None:
    subscription = browser_subscription()
    assert api.send("post", SUBSCRIPTIONS, subscription).status_code == 201
    assert api.send("post", SUBSCRIPTIONS, subscription).status_code == 201  # again: the same row
    assert PushSubscription.objects.filter(user=owner).count() == 1
    assert len(api.get(SETTINGS).json()["push_subscriptions"]) == 1

    for broken in (
        {**subscription, "endpoint": "ftp://push.example.net/x"},
        {**subscription, "keys": {**subscription["keys"], "p256dh": b64url(b"\x04" + b"\x01" * 64)}},
        {**subscription, "keys": {**subscription["keys"], "auth": b64url(b"short")}},
        {"endpoint": subscription["endpoint"]},
    ):
        response = api.send("post", SUBSCRIPTIONS, {**broken, "endpoint": broken["endpoint"] + "2"})
        assert response.status_code == 400, broken
    assert PushSubscription.objects.count() == 1

    assert api.send("delete", SUBSCRIPTIONS, {"endpoint": subscription["endpoint"]}).status_code == 204
    assert api.send("delete", SUBSCRIPTIONS, {"endpoint": subscription["endpoint"]}).status_code == 404
    assert not PushSubscription.objects.exists()


def test_the_viewing_heartbeat_needs_the_users_own_agent(api: Api, owner: Any, outsider: Any) -> None:
    mine = Agent.objects.create(owner=owner, name="a", type="claude", status=Agent.Status.RUNNING, cwd="/tmp")
    theirs = Agent.objects.create(owner=outsider, name="b", type="claude", status=Agent.Status.RUNNING, cwd="/tmp")
    beat = api.send("post", "/api/v1/notifications/viewing", {"client_id": "tab-12345678", "agent_id": mine.pk})
    assert beat.status_code == 200 and beat.json()["agent_id"] == mine.pk
    other = api.send("post", "/api/v1/notifications/viewing", {"client_id": "tab-87654321", "agent_id": theirs.pk})
    assert other.status_code == 404
    assert list(AgentViewing.objects.values_list("agent_id", flat=True)) == [mine.pk]
    ended = api.send("post", "/api/v1/notifications/viewing", {"client_id": "tab-12345678", "agent_id": None})
    assert ended.json()["agent_id"] is None and not AgentViewing.objects.exists()


def test_the_test_route_queues_a_test_notification(api: Api, owner: Any) -> None:
    api.send("put", SETTINGS, {"apprise_urls": ["json://127.0.0.1:9/x"]})
    response = api.send("post", "/api/v1/notifications/test")
    assert response.status_code == 202
    notification = Notification.objects.get(pk=response.json()["id"])
    assert notification.kind == "test" and notification.deliveries.count() == 1
    listed = api.get("/api/v1/notifications").json()["results"]
    assert [(item["id"], item["status"]) for item in listed] == [(notification.pk, "pending")]
    assert listed[0]["deliveries"] == [{"channel": "apprise", "status": "pending", "attempts": 0, "last_error": ""}]
    assert api.get("/api/v1/notifications?limit=0").status_code == 400


def test_the_settings_page_saves_refuses_with_apprises_reason_and_links_from_settings(client: Any, owner: Any) -> None:
    client.force_login(owner)
    assert 'href="/settings/notifications/"' in client.get("/settings/").content.decode()
    page = client.get("/settings/notifications/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "data-enable-push" in html and "send-test-notification" in html
    form = {"on_approval": "on", "on_failed": "on", "quiet_timezone": "UTC", "apprise_urls": "slack://bad"}
    refused = client.post("/settings/notifications/", form)
    assert refused.status_code == 400 and "Slack" in refused.content.decode()
    assert not NotificationSettings.objects.filter(user=owner).exists()
    saved = client.post("/settings/notifications/", {**form, "apprise_urls": "json://127.0.0.1:9/x"})
    assert saved.status_code == 302
    choices = NotificationSettings.objects.get(user=owner)
    assert (choices.on_approval, choices.on_finished, choices.on_failed) == (True, False, True)
    tested = client.post("/settings/notifications/test")
    assert tested.status_code == 302 and Notification.objects.filter(kind="test").count() == 1


def test_the_service_worker_is_served_at_the_root_scope_and_the_manifest_makes_the_pages_installable(
    client: Any, owner: Any
) -> None:
    worker = client.get("/sw.js")  # no login: browsers fetch it themselves
    assert worker.status_code == 200
    assert worker["Content-Type"].startswith("text/javascript")
    assert worker["Service-Worker-Allowed"] == "/"
    source = worker.content.decode()
    assert "showNotification" in source and "notificationclick" in source and "openWindow" in source
    manifest = client.get("/manifest.webmanifest")
    assert manifest["Content-Type"] == "application/manifest+json"
    body = json.loads(manifest.content)
    assert body["display"] == "standalone" and body["start_url"] == "/"
    assert body["icons"][0]["src"].endswith("favicon.svg")
    assert {icon["sizes"] for icon in body["icons"]} >= {"192x192", "512x512"}  # what Android and iOS install
    for icon in body["icons"]:
        assert client.get(icon["src"]).status_code == 200, icon
    client.force_login(owner)
    html = client.get("/").content.decode()
    assert '<link rel="manifest" href="/manifest.webmanifest">' in html
    assert "js/attention.js" in html


@pytest.mark.parametrize(
    ("method", "path", "body", "fields"),
    [
        ("put", SETTINGS, {"events": None}, {"events": ["This field may not be null."]}),
        ("put", SETTINGS, {"events": {"approval": "yes"}}, {"events": {"approval": ["Must be a valid boolean."]}}),
        (
            "put",
            SETTINGS,
            {"events": "x"},
            {"events": {"non_field_errors": ["Invalid data. Expected a dictionary, but got str."]}},
        ),
        (
            "put",
            SETTINGS,
            {"quiet_hours": {"start": "22:00:00", "end": 7}},
            {
                "quiet_hours": {
                    "start": ["Time has wrong format. Use one of these formats instead: hh:mm."],
                    "end": ["Time has wrong format. Use one of these formats instead: hh:mm."],
                }
            },
        ),
        ("put", SETTINGS, {"quiet_hours": {"start": "22:00"}}, {"quiet_hours": {"end": ["This field is required."]}}),
        (
            "put",
            SETTINGS,
            {"apprise_urls": ["ok", 5, "  "]},
            {"apprise_urls": {"1": ["Not a valid string."], "2": ["This field may not be blank."]}},
        ),
        ("put", SETTINGS, [], {"non_field_errors": ["Invalid data. Expected a dictionary, but got list."]}),
        (
            "post",
            SUBSCRIPTIONS,
            {"endpoint": ""},
            {"endpoint": ["This field may not be blank."], "keys": ["This field is required."]},
        ),
        (
            "post",
            SUBSCRIPTIONS,
            {"endpoint": "https://push.example.net/x", "keys": {"p256dh": "x" * 201}},
            {
                "keys": {
                    "p256dh": ["Ensure this field has no more than 200 characters."],
                    "auth": ["This field is required."],
                }
            },
        ),
        ("delete", SUBSCRIPTIONS, {"endpoint": 3}, {"endpoint": ["Not a valid string."]}),
        ("post", "/api/v1/notifications/viewing", {"client_id": None}, {"client_id": ["This field may not be null."]}),
        (
            "post",
            "/api/v1/notifications/viewing",
            {"client_id": "abcdefgh", "agent_id": 5},
            {"agent_id": ["Not a valid string."]},
        ),
    ],
)
def test_a_refused_body_answers_each_fields_reason_under_details_fields(
    api: Api, method: str, path: str, body: Any, fields: dict[str, Any]
) -> None:
    # As sent: Api.send would turn the empty list into {}.
    response = api.client.generic(
        method.upper(), path, json.dumps(body), content_type="application/json", headers=api.headers
    )
    assert response.status_code == 400
    assert response.json() == {
        "error": {"code": "INVALID_REQUEST", "message": "invalid notification settings", "details": {"fields": fields}}
    }
