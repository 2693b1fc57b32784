"""A person in Chromium: log in, create a token, serve a remote with it, watch and call it.

The server is a real ``manage.py serve``; the remote is a real ``python -m remotes.client
serve`` subprocess. The Remotes page is never reloaded: the remote appears and disappears
through the page's own 2-second poll.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.infra import PYTHON, Instance, Server, instance

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.timeout(120)]

USERNAME = "alice"
PASSWORD = "browser-test-pw-81"  # a throwaway instance's user
WEATHER = "weather-service"
LIVE_LIST = 15_000  # ms: several 2-second polls plus the client's start-up


@pytest.fixture(scope="module")
def site() -> Iterator[Instance]:
    """One migrated instance with the user, shared by the module's tests."""
    with instance() as inst:
        inst.create_user(USERNAME, PASSWORD)
        yield inst


@pytest.fixture
def live(site: Instance) -> Iterator[tuple[Instance, Server]]:
    """A server of its own for each test (a test may stop it)."""
    server = site.serve()
    try:
        yield site, server
    finally:
        server.stop()


def shoot(page: Any, path: Path) -> None:
    page.screenshot(path=str(path), full_page=True)


def test_a_user_serves_a_remote_with_a_new_token_and_calls_it_from_the_page(live, context, artifacts):
    from playwright.sync_api import expect

    inst, server = live
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
    page = context.new_page()
    remote = None
    try:
        # Log in: asking for Settings leads to the login form and back.
        page.goto(f"{server.url}/settings/")
        expect(page).to_have_url(f"{server.url}/login/?next=/settings/")
        shoot(page, artifacts / "login.png")
        page.fill("input[name=username]", USERNAME)
        page.fill("input[name=password]", PASSWORD)
        page.click("#login-button")
        expect(page).to_have_url(f"{server.url}/settings/")
        expect(page.locator("#no-tokens")).to_be_visible()

        # Create a token: shown once, with a working copy button.
        page.fill("input[name=name]", "browser remote")
        page.click("#create-token")
        token = page.locator("#new-token").inner_text().strip()
        assert len(token) == 43
        page.click("#copy-token")
        expect(page.locator("#copy-token")).to_have_text("Copied")
        assert page.evaluate("navigator.clipboard.readText()") == token
        expect(page.locator("#token-list")).to_contain_text("browser remote")
        shoot(page, artifacts / "settings.png")

        # The empty Remotes page; from here on it is never reloaded.
        page.goto(f"{server.url}/remotes/")
        expect(page.locator("#no-remotes")).to_be_visible()
        expect(page.locator("#serve-command")).to_contain_text("dispatch-remote serve weather.py:remote --server http")
        shoot(page, artifacts / "remotes-empty.png")
        page.evaluate("window.sameDocument = true")

        remote = inst.spawn(
            [
                PYTHON,
                "-m",
                "remotes.client",
                "serve",
                "examples/weather_service.py:remote",
                "--url",
                server.ws_url,
                "--token",
                token,
            ],
            name="browser-remote",
        )
        row = page.locator(f'[data-remote="{WEATHER}"] [data-function="get_forecast"]')
        expect(row).to_be_visible(timeout=LIVE_LIST)
        expect(row).to_contain_text("Retrieve weather forecast for a location.")
        expect(page.locator("#no-remotes")).to_have_count(0)

        # Choose the function; the next polls leave the choice alone.
        page.select_option("#call-target", f"{WEATHER}/get_forecast")
        for _ in range(2):
            with page.expect_response(lambda response: "/remotes/fragment" in response.url):
                pass
        expect(page.locator("#call-target")).to_have_value(f"{WEATHER}/get_forecast")

        # A bad argument shows an error; a good call shows the result.
        page.fill("#call-args", "{city: Rome")
        page.click("#call-button")
        expect(page.locator("#call-error")).to_contain_text("args is not valid JSON")
        page.fill("#call-args", '{"city": "Rome"}')
        page.click("#call-button")
        output = page.locator("#call-output pre.result")
        expect(output).to_contain_text("Rome")
        result = json.loads(output.inner_text())
        assert result["city"] == "Rome"
        assert result["forecast"] == "sunny"
        expect(page.locator("#call-target")).to_have_value(f"{WEATHER}/get_forecast")
        shoot(page, artifacts / "remotes.png")

        phone = context.browser.new_context(
            viewport={"width": 390, "height": 844}, storage_state=context.storage_state()
        )
        try:
            phone_page = phone.new_page()
            phone_page.goto(f"{server.url}/remotes/")
            expect(phone_page.locator(f'[data-remote="{WEATHER}"]')).to_be_visible()
            assert phone_page.evaluate("document.documentElement.scrollWidth") <= 390, (
                "the page scrolls sideways on a phone"
            )
            shoot(phone_page, artifacts / "remotes-phone.png")
            phone_page.goto(f"{server.url}/settings/")
            expect(phone_page.locator("#token-list")).to_contain_text("browser remote")
            assert phone_page.evaluate("document.documentElement.scrollWidth") <= 390, (
                "the page scrolls sideways on a phone"
            )
            shoot(phone_page, artifacts / "settings-phone.png")
        finally:
            phone.close()

        # The remote's process dies: the list and the form's choices empty themselves.
        remote.kill()
        expect(page.locator(f'[data-remote="{WEATHER}"]')).to_have_count(0, timeout=LIVE_LIST)
        expect(page.locator("#no-remotes")).to_be_visible()
        expect(page.locator(f'#call-target option[value="{WEATHER}/get_forecast"]')).to_have_count(0)
        expect(page.locator("#list-unreachable")).to_be_hidden()
        assert page.evaluate("window.sameDocument") is True, "the Remotes page was reloaded"
        shoot(page, artifacts / "remotes-after-disconnect.png")
    except BaseException:
        page.screenshot(path=str(artifacts / "failure.png"), full_page=True)
        print("--- server log ---\n" + server.log())
        if remote is not None:
            print("--- remote log ---\n" + remote.log())
        raise


def test_the_remotes_page_says_when_it_cannot_reach_the_server(live, context, artifacts):
    from playwright.sync_api import expect

    _, server = live
    page = context.new_page()
    page.goto(f"{server.url}/login/")
    page.fill("input[name=username]", USERNAME)
    page.fill("input[name=password]", PASSWORD)
    page.click("#login-button")
    page.goto(f"{server.url}/remotes/")
    expect(page.locator("#list-unreachable")).to_be_hidden()
    server.stop()
    expect(page.locator("#list-unreachable")).to_be_visible(timeout=LIVE_LIST)
    expect(page.locator("#list-unreachable")).to_contain_text("Cannot reach the server")
    shoot(page, artifacts / "remotes-unreachable.png")
