"""Login everywhere, the throttled login page, and the pages' frame
(docs/ws-protocol.md#authentication)."""

from __future__ import annotations

import html
import re

import pytest
from django.urls import NoReverseMatch, reverse

from tests.conftest import PASSWORD

pytestmark = pytest.mark.django_db

THROTTLED = "too many failed attempts; try again later"


def text_of(response) -> str:
    return html.unescape(response.content.decode())


def log_in(client, username: str, password: str, address: str = "127.0.0.1"):
    return client.post("/login/", {"username": username, "password": password}, REMOTE_ADDR=address)


@pytest.mark.parametrize("path", ["/", "/settings/", "/remotes/", "/remotes/fragment"])
def test_it_sends_anonymous_visitors_to_the_login_page(client, path):
    response = client.get(path)
    assert response.status_code == 302
    assert response["Location"].startswith(f"/login/?next={path}")


def test_it_sends_an_anonymous_htmx_poll_to_the_login_page_with_hx_redirect(client):
    # A 302 would be followed by the XHR and the login form swapped into the list.
    response = client.get(
        "/remotes/fragment", headers={"HX-Request": "true", "HX-Current-URL": "http://testserver/remotes/"}
    )
    assert response.status_code == 200
    assert response["HX-Redirect"] == "/login/?next=%2Fremotes%2F"
    assert b"remote" not in response.content


def test_it_refuses_an_anonymous_call_form_post(client):
    response = client.post("/remotes/call", {"target": "weather-service/get_forecast", "args": "{}"})
    assert response.status_code == 302
    assert response["Location"].startswith("/login/?next=/remotes/call")


def test_it_serves_the_login_page_without_a_login(client):
    response = client.get("/login/")
    assert response.status_code == 200
    assert 'name="password"' in response.content.decode()


@pytest.mark.django_db(transaction=True)
def test_it_serves_healthz_without_a_login(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json()["status"] == "ok"


def test_it_logs_a_user_in_with_the_right_password(client, owner):
    response = log_in(client, "alice", PASSWORD)
    assert response.status_code == 302
    assert response["Location"] == "/"
    page = client.get("/")
    assert page.status_code == 200
    assert "alice" in text_of(page)
    assert "Log out" in text_of(page)


def test_it_returns_to_the_page_asked_for_after_login(client, owner):
    response = client.post("/login/", {"username": "alice", "password": PASSWORD, "next": "/remotes/"})
    assert response.status_code == 302
    assert response["Location"] == "/remotes/"


def test_it_refuses_a_wrong_password_with_a_message(client, owner):
    response = log_in(client, "alice", "wrong password")
    assert response.status_code == 200
    assert "Please enter a correct username and password" in text_of(response)
    assert client.get("/settings/").status_code == 302


def test_it_throttles_a_username_after_five_failures(client, owner):
    for _ in range(5):
        assert log_in(client, "alice", "wrong password").status_code == 200
    response = log_in(client, "alice", PASSWORD)
    assert response.status_code == 429
    assert THROTTLED in text_of(response)
    assert 'id="login-error"' in response.content.decode()
    assert client.get("/settings/").status_code == 302  # the right password did not log in


def test_it_throttles_the_username_from_another_address_too(client, owner):
    for number in range(5):
        log_in(client, "alice", "wrong password", address=f"10.0.0.{number + 1}")
    response = log_in(client, "alice", PASSWORD, address="10.0.0.99")
    assert response.status_code == 429
    assert THROTTLED in text_of(response)


def test_throttling_one_username_leaves_another_user_alone(client, owner, member):
    for number in range(5):
        log_in(client, "alice", "wrong password", address=f"10.0.0.{number + 1}")
    assert log_in(client, "bob", PASSWORD, address="10.0.1.1").status_code == 302


NAV = re.compile(r'<nav aria-label="Main">(.*?)</nav>', re.S)


def nav_of(client) -> str:
    match = NAV.search(client.get("/").content.decode())
    assert match, "the page has no main nav"
    return match.group(1)


def test_every_nav_link_leads_to_a_page(client, owner):
    client.force_login(owner)
    hrefs = re.findall(r'href="([^"]+)"', nav_of(client))
    assert {"/", "/remotes/", "/settings/"} <= set(hrefs)
    for href in hrefs:
        assert client.get(href).status_code == 200, f"the nav links to {href}, which is not a page"


@pytest.mark.parametrize(("label", "url_name"), [("Machines", "machines"), ("Linked instances", "peers")])
def test_a_section_of_a_later_release_is_marked_as_coming_until_its_page_exists(client, owner, label, url_name):
    client.force_login(owner)
    nav = nav_of(client)
    try:
        path = reverse(url_name)
    except NoReverseMatch:
        assert f'<span class="soon" title="{label} are not built yet' in nav
        assert f">{label}</a>" not in nav
    else:
        assert f'<a href="{path}"' in nav
        assert f"{label} <small>soon</small>" not in nav


def test_the_agents_page_has_an_empty_state_and_a_launch_form(client, owner):
    client.force_login(owner)
    response = client.get("/")
    assert "No agents yet" in text_of(response)
    assert 'id="launch-form"' in response.content.decode()


def test_an_unknown_page_gets_a_clear_not_found_page(client, owner):
    client.force_login(owner)
    response = client.get("/no-such-page/")
    assert response.status_code == 404
    assert "Page not found" in text_of(response)
    assert "/no-such-page/" in text_of(response)
