"""Swagger UI (``/api/docs/``) and Redoc (``/api/redoc/``) render the API in Chromium with
every other host unreachable (a CDN-loaded Swagger UI was a blank page without internet).

The server is a real ``manage.py serve`` (static files through whitenoise's finders, as under
``make run``). Every request of the browser context whose host is not this computer is
aborted and recorded: the pages must list the operations, and the record must stay empty —
nothing from outside may even be attempted (a CDN script, a web font, a validator badge).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.infra import Instance, Server, instance

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.timeout(120)]

LOCAL_HOSTS = {"127.0.0.1", "localhost"}
# Redoc's sidebar always shows Redocly's logo from its CDN; templates/dispatch/redoc.html
# never lets the browser request it (and its Content-Security-Policy would refuse it).
REDOC_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"
# What the page's policy refused, as the page saw it (``securitypolicyviolation`` events).
RECORD_REFUSALS = """
window.refusedByPolicy = [];
document.addEventListener("securitypolicyviolation", (event) => {
  window.refusedByPolicy.push(event.blockedURI);
});
"""
OPERATION = "/api/v1/agents"  # an operation path both readers must show
RENDER = 20_000  # ms: the readers fetch and render the whole schema in the page


@pytest.fixture(scope="module")
def site() -> Iterator[tuple[Instance, Server]]:
    with instance() as inst:
        yield inst, inst.serve()


@pytest.fixture
def outside(context: Any) -> list[str]:
    """Every request of ``context`` to another host: aborted, and its URL recorded here."""
    attempted: list[str] = []

    def route(route: Any) -> None:
        url = route.request.url
        if urlsplit(url).hostname in LOCAL_HOSTS:
            route.continue_()
        else:
            attempted.append(url)
            route.abort()

    context.route("**/*", route)
    return attempted


def log_in(page: Any, server: Server, password: str) -> None:
    from playwright.sync_api import expect

    page.goto(f"{server.url}/login/")
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", password)
    page.click("#login-button")
    expect(page).to_have_url(f"{server.url}/")


def test_swagger_ui_lists_the_operations_with_nothing_loaded_from_outside(
    site: tuple[Instance, Server], context: Any, outside: list[str], artifacts: Path
) -> None:
    from playwright.sync_api import expect

    inst, server = site
    page = context.new_page()
    log_in(page, server, inst.admin_password)

    page.goto(f"{server.url}/api/docs/")

    summary = page.locator(".opblock-summary-path", has_text=OPERATION).first
    expect(summary).to_be_visible(timeout=RENDER)
    expect(page.locator(".opblock").first).to_be_visible()
    page.screenshot(path=str(artifacts / "api-docs-swagger.png"))
    assert outside == []


def test_redoc_lists_the_operations_with_nothing_loaded_from_outside(
    site: tuple[Instance, Server], context: Any, outside: list[str], artifacts: Path
) -> None:
    from playwright.sync_api import expect

    inst, server = site
    page = context.new_page()
    page.add_init_script(RECORD_REFUSALS)
    log_in(page, server, inst.admin_password)

    page.goto(f"{server.url}/api/redoc/")

    expect(page.get_by_text(OPERATION, exact=True).first).to_be_attached(timeout=RENDER)
    expect(page.locator("h1", has_text="Dispatch API").first).to_be_visible()
    expect(page.get_by_text("API docs by Redocly")).to_be_attached()  # the sidebar's end: all rendered
    page.screenshot(path=str(artifacts / "api-docs-redoc.png"))
    assert outside == []
    assert page.evaluate("window.refusedByPolicy") == []
