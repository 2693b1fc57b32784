"""The Redoc page (``/api/redoc/``) asks no other host for anything, not even in vain: every
request the page makes goes to the server it came from, and its Content-Security-Policy
has nothing to refuse (the Redocly logo its bundle always shows, from cdn.redoc.ly, used
to be requested and then refused by the policy). Every page also has an icon:
``/favicon.ico`` answers ``static/favicon.svg`` instead of a 404 (``dispatch/favicon.py``).

The server is a real ``manage.py serve``; the browser is Debian's Chromium, every request
of its context recorded (``page.on("request")`` sees even those a policy then blocks) and
every one to another host aborted.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.test import Client

from tests.infra import Instance, Server, instance

REDOC_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"
# What the page's policy refused, as the page saw it (``securitypolicyviolation`` events).
RECORD_REFUSALS = """
window.refusedByPolicy = [];
document.addEventListener("securitypolicyviolation", (event) => {
  window.refusedByPolicy.push(event.blockedURI);
});
"""
OPERATION = "/api/v1/agents"  # an operation path Redoc must show once it has rendered
RENDER = 20_000  # ms: Redoc fetches and renders the whole schema in the page


@pytest.fixture(scope="module")
def site() -> Iterator[tuple[Instance, Server]]:
    with instance() as inst:
        yield inst, inst.serve()


def log_in(page: Any, server: Server, password: str) -> None:
    from playwright.sync_api import expect

    page.goto(f"{server.url}/login/")
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", password)
    page.click("#login-button")
    expect(page).to_have_url(f"{server.url}/")


def origin(url: str) -> tuple[str, str | None, int | None]:
    parts = urlsplit(url)
    return parts.scheme, parts.hostname, parts.port


@pytest.mark.browser
@pytest.mark.integration
@pytest.mark.timeout(120)
def test_redoc_makes_every_request_to_its_own_server_and_none_is_refused(
    site: tuple[Instance, Server], context: Any, artifacts: Path
) -> None:
    from playwright.sync_api import expect

    inst, server = site
    requested: list[str] = []
    context.on("request", lambda request: requested.append(request.url))

    def only_this_server(route: Any) -> None:
        if origin(route.request.url) == origin(server.url):
            route.continue_()
        else:
            route.abort()

    context.route("**/*", only_this_server)
    page = context.new_page()
    page.add_init_script(RECORD_REFUSALS)
    log_in(page, server, inst.admin_password)
    requested.clear()

    page.goto(f"{server.url}/api/redoc/")

    expect(page.get_by_text(OPERATION, exact=True).first).to_be_attached(timeout=RENDER)
    expect(page.locator("h1", has_text="Dispatch API").first).to_be_visible()
    expect(page.get_by_text("API docs by Redocly")).to_be_attached()  # the sidebar's end: all rendered
    page.wait_for_load_state("networkidle")
    page.screenshot(path=str(artifacts / "api-docs-redoc-offline.png"))
    elsewhere = [url for url in requested if not url.startswith(("data:", "blob:"))]
    assert [url for url in elsewhere if origin(url) != origin(server.url)] == []
    assert any(url.endswith("/redoc.standalone.js") for url in elsewhere)  # the record works
    assert page.evaluate("window.refusedByPolicy") == []


# --- the icon --------------------------------------------------------------------------


@pytest.mark.django_db
def test_favicon_ico_is_the_svg_icon_without_a_login() -> None:
    response = Client().get("/favicon.ico")

    assert response.status_code == 200
    assert response["Content-Type"] == "image/svg+xml"
    assert "max-age=" in response["Cache-Control"]
    icon = (Path(__file__).resolve().parents[2] / "static" / "favicon.svg").read_bytes()
    assert response.content == icon and icon.startswith(b"<svg ")
    assert Client().post("/favicon.ico").status_code == 405
