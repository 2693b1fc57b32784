"""Notifications under attack (docs/notifications.md): what another user, a forged push
subscription or a flood of them can and cannot do through ``/api/v1/notifications/…``.

Each refusal is checked with the state it must leave unchanged.
"""

from __future__ import annotations

from typing import Any

import pytest

from attention.models import AgentViewing, PushSubscription
from tests.attention.test_settings_api import SUBSCRIPTIONS, Api, browser_subscription

pytestmark = pytest.mark.django_db

VIEWING = "/api/v1/notifications/viewing"


@pytest.fixture
def api(owner_token: str) -> Api:
    return Api(owner_token)


@pytest.fixture
def outsider_api(outsider_token: str) -> Api:
    return Api(outsider_token)


def test_another_user_cannot_take_over_a_push_subscription_by_posting_its_endpoint(
    api: Api, outsider_api: Api, owner: Any
) -> None:
    mine = browser_subscription()
    assert api.send("post", SUBSCRIPTIONS, mine).status_code == 201
    forged = browser_subscription(mine["endpoint"])  # the same endpoint, the attacker's own keys
    response = outsider_api.send("post", SUBSCRIPTIONS, forged)
    assert response.status_code == 409, response.content
    kept = PushSubscription.objects.get(endpoint=mine["endpoint"])
    assert (kept.user_id, kept.p256dh, kept.auth) == (owner.pk, mine["keys"]["p256dh"], mine["keys"]["auth"])
    # and the endpoint alone does not delete it either
    assert outsider_api.send("delete", SUBSCRIPTIONS, {"endpoint": mine["endpoint"]}).status_code == 404
    assert PushSubscription.objects.filter(endpoint=mine["endpoint"], user=owner).exists()


def test_the_same_browser_subscription_moves_to_whoever_logs_in_on_it(
    api: Api, outsider_api: Api, outsider: Any
) -> None:
    # One browser has one subscription: another account logging in there presents the very
    # same endpoint and keys, and the pushes follow that account.
    shared = browser_subscription()
    assert api.send("post", SUBSCRIPTIONS, shared).status_code == 201
    assert outsider_api.send("post", SUBSCRIPTIONS, shared).status_code == 201
    assert PushSubscription.objects.get(endpoint=shared["endpoint"]).user_id == outsider.pk


@pytest.mark.parametrize(
    "endpoint",
    [
        "http://push.example.net/send/abc",  # browsers only give https push endpoints
        "http://127.0.0.1:8080/push",
        "https://127.0.0.1/push",
        "https://localhost/push",
        "https://169.254.169.254/latest/meta-data/",  # cloud metadata
        "https://10.0.0.7/push",
        "https://192.168.1.1/push",
        "https://[::1]/push",
        "https://[fd00::1]/push",
        "https://0.0.0.0/push",
        "https://0/push",  # inet_aton's short forms: 0.0.0.0, 127.0.0.1 and 127.0.0.1 again
        "https://2130706433/push",
        "https://127.1/push",
        "https://0x7f.1/push",
        "https://localhost./push",
        "file:///etc/passwd",
        "https://user:pw@push.example.net/send/abc",
    ],
)
def test_a_push_endpoint_must_be_an_https_address_of_a_public_host(api: Api, endpoint: str, settings: Any) -> None:
    settings.NOTIFY_PUSH_LOOPBACK_HTTP = False
    response = api.send("post", SUBSCRIPTIONS, browser_subscription(endpoint))
    assert response.status_code == 400, response.content
    assert response.json()["error"]["code"] == "INVALID_REQUEST"
    assert not PushSubscription.objects.exists()


def test_plain_http_on_loopback_is_only_for_a_local_push_service_the_setting_allows(api: Api, settings: Any) -> None:
    settings.NOTIFY_PUSH_LOOPBACK_HTTP = True
    assert api.send("post", SUBSCRIPTIONS, browser_subscription("http://127.0.0.1:8080/push")).status_code == 201
    # the setting opens loopback over http, nothing else
    for other in ("http://10.0.0.7/push", "https://169.254.169.254/x", "http://push.example.net/x"):
        assert api.send("post", SUBSCRIPTIONS, browser_subscription(other)).status_code == 400, other


def test_a_user_holds_a_bounded_number_of_push_subscriptions(api: Api, owner: Any) -> None:
    from attention.services import MAX_PUSH_SUBSCRIPTIONS

    for n in range(MAX_PUSH_SUBSCRIPTIONS):
        assert (
            api.send("post", SUBSCRIPTIONS, browser_subscription(f"https://push.example.net/s/{n}")).status_code == 201
        )
    over = api.send("post", SUBSCRIPTIONS, browser_subscription("https://push.example.net/s/one-more"))
    assert over.status_code == 400, over.content
    assert str(MAX_PUSH_SUBSCRIPTIONS) in over.json()["error"]["message"]
    assert PushSubscription.objects.filter(user=owner).count() == MAX_PUSH_SUBSCRIPTIONS
    # a browser already subscribed may still renew its own
    again = browser_subscription("https://push.example.net/s/0")
    assert api.send("post", SUBSCRIPTIONS, again).status_code == 201


def test_a_viewing_heartbeat_for_another_users_agent_is_404_and_holds_nothing_back(
    outsider_api: Api, cli_agent: Any
) -> None:
    response = outsider_api.send("post", VIEWING, {"client_id": "tab-12345678", "agent_id": cli_agent.pk})
    assert response.status_code == 404 and response.json()["error"]["code"] == "NOT_FOUND"
    assert not AgentViewing.objects.exists()


def test_an_agent_token_cannot_forget_its_owners_push_subscription(api: Api, cli_agent: Any, owner: Any) -> None:
    from agents.tokens import agent_token_mint

    mine = browser_subscription()
    assert api.send("post", SUBSCRIPTIONS, mine).status_code == 201
    agent_api = Api(agent_token_mint(agent=cli_agent))
    response = agent_api.send("delete", SUBSCRIPTIONS, {"endpoint": mine["endpoint"]})
    assert response.status_code == 403, response.content
    assert PushSubscription.objects.filter(endpoint=mine["endpoint"], user=owner).exists()


def test_saving_the_masked_list_back_keeps_two_urls_that_mask_alike(api: Api) -> None:
    # The settings page shows each URL masked and a masked line left as it is keeps its URL;
    # two topics with the same first letters mask alike and must both survive a save.
    SETTINGS = "/api/v1/notifications/settings"
    urls = ["ntfys://ntfy.sh/mytopic-one", "ntfys://ntfy.sh/mytopic-two"]
    assert api.send("put", SETTINGS, {"apprise_urls": urls}).status_code == 200
    masked = api.get(SETTINGS).json()["apprise_urls"]
    assert masked[0] == masked[1]  # the premise: they look alike
    assert api.send("put", SETTINGS, {"apprise_urls": masked}).status_code == 200
    from django.contrib.auth.models import User

    from attention.selectors import apprise_urls_of, notification_settings_for

    owner = User.objects.get(username="alice")
    assert apprise_urls_of(notification_settings_for(user=owner)) == urls


def test_a_push_service_that_redirects_is_not_followed(receiver: Any) -> None:
    # An https endpoint on a public host passes the check; its answer must not then send the
    # server's POST (or a GET) on to an internal address.
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from attention.senders import DeliveryFailed, webpush_send

    class Redirect(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.send_response(307)
            self.send_header("Location", f"{receiver.origin}/internal")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        keys = browser_subscription()["keys"]
        with pytest.raises(DeliveryFailed):
            webpush_send(
                endpoint=f"http://127.0.0.1:{server.server_address[1]}/push",
                p256dh=keys["p256dh"],
                auth=keys["auth"],
                payload={"title": "t"},
            )
    finally:
        server.shutdown()
        server.server_close()
    assert receiver.requests == []


@pytest.mark.parametrize("limit", ["²", "0", "101", "x", "-1"])
def test_a_notification_list_limit_that_is_not_1_to_100_is_a_400(api: Api, limit: str) -> None:
    """'²'.isdigit() is true, and int('²') raised: a 500."""
    response = api.get(f"/api/v1/notifications?limit={limit}")
    assert response.status_code == 400, response.content
    assert response.json()["error"]["message"] == "limit must be a number from 1 to 100"
