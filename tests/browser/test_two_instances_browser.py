"""Two Dispatch instances on one host, used side by side in ONE browser profile: cookies
ignore the port, so with Django's default ``sessionid`` and ``csrftoken`` logging in to the
second logged the first out, and the first's forms failed their CSRF check.

Each instance is a real ``manage.py serve`` on 127.0.0.1 with its own data dir and SQLite
database, on its own port. One Chromium context logs in to A, loads A's settings form, logs
in to B, then submits A's form (a CSRF-checked POST) and B's: both work, both stay logged in,
and each instance's cookies carry its own names (``dispatch_<hash>_…``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.infra import Instance, Server, instance

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.timeout(150)]


@pytest.fixture
def sites() -> Iterator[tuple[Instance, Server, Instance, Server]]:
    with instance() as a, instance() as b:
        server_a, server_b = a.serve(wait=False), b.serve(wait=False)
        yield a, server_a.wait_healthy(), b, server_b.wait_healthy()


def log_in(page: Any, server: Server, password: str) -> None:
    from playwright.sync_api import expect

    page.goto(f"{server.url}/login/")
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", password)
    page.click("#login-button")
    expect(page).to_have_url(f"{server.url}/")


def create_token(page: Any, name: str) -> None:
    """Submit the settings page's (already loaded) token form and see the new token."""
    from playwright.sync_api import expect

    page.fill("#token-form input[name=name]", name)
    page.click("#create-token")
    expect(page.locator(".issued")).to_contain_text(f"New token “{name}”")
    expect(page.locator("#new-token")).not_to_be_empty()


def test_two_instances_on_one_host_stay_logged_in_in_one_browser(
    sites: tuple[Instance, Server, Instance, Server], context: Any, artifacts: Path
) -> None:
    from playwright.sync_api import expect

    a, server_a, b, server_b = sites
    assert server_a.port != server_b.port
    page_a, page_b = context.new_page(), context.new_page()
    try:
        log_in(page_a, server_a, a.admin_password)
        page_a.goto(f"{server_a.url}/settings/")  # A's form, with A's CSRF token, loaded now

        log_in(page_b, server_b, b.admin_password)

        # A's form, loaded before B's login, still passes A's CSRF check and A's login holds.
        create_token(page_a, "from-a")
        expect(page_a).to_have_url(f"{server_a.url}/settings/")
        # … and B works too, in the same browser profile.
        page_b.goto(f"{server_b.url}/settings/")
        create_token(page_b, "from-b")
        expect(page_b).to_have_url(f"{server_b.url}/settings/")

        # Back and forth: a fresh page of A is still logged in, and so is B's.
        page_a.goto(f"{server_a.url}/settings/")
        expect(page_a).to_have_url(f"{server_a.url}/settings/")
        expect(page_a.locator("#token-list")).to_contain_text("from-a")
        expect(page_a.locator("#token-list")).not_to_contain_text("from-b")
        create_token(page_a, "again-a")
        page_b.reload()
        expect(page_b).to_have_url(f"{server_b.url}/settings/")
        expect(page_b.locator("#token-list")).to_contain_text("from-b")
        page_a.screenshot(path=str(artifacts / "two-instances-a.png"), full_page=True)

        names = sorted(cookie["name"] for cookie in context.cookies())
        assert "sessionid" not in names and "csrftoken" not in names, names
        sessions = [name for name in names if name.endswith("_sessionid")]
        csrf = [name for name in names if name.endswith("_csrftoken")]
        assert len(set(sessions)) == len(set(csrf)) == 2, names  # one of each per instance
        assert all(name.startswith("dispatch_") for name in names), names
    except BaseException:
        print(f"--- A log ---\n{server_a.log()[-4000:]}\n--- B log ---\n{server_b.log()[-4000:]}")
        raise
