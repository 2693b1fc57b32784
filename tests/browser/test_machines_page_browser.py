"""The Machines page tells a person how to connect a computer to *this* instance, which
shims are out of date, and which machine ran each operation; ``/downloads/`` serves the
wheels to anyone.

A real ``manage.py serve`` with its own dist folder (``DISPATCH_DIST_DIR``) and public URL
(``DISPATCH_PUBLIC_URL``), a real shim (``python -m machines.shim run``), Chromium.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from machines.shim.protocol import SHIM_VERSION
from tests.infra import Instance, Server, instance
from tests.live_clients import MachineApi

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.timeout(120)]

PUBLIC_URL = "http://dispatch.example.test:8123"  # what the commands must name (not the address served)
LIVE_LIST = 15_000  # ms: several 2-second polls


def wheel_name(version: str, project: str = "dispatch_shim") -> str:
    return f"{project}-{version}-py3-none-any.whl"


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="module")
def site(dist: Path) -> Iterator[Instance]:
    with instance(DISPATCH_DIST_DIR=str(dist), DISPATCH_PUBLIC_URL=PUBLIC_URL) as inst:
        yield inst


@pytest.fixture
def live(site: Instance) -> Iterator[Server]:
    server = site.serve()
    try:
        yield server
    finally:
        server.stop()


def log_in(page: Any, server: Server, site: Instance) -> None:
    page.goto(f"{server.url}/login/?next=/machines/")
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", site.admin_password)
    page.click("#login-button")


def test_the_machines_page_connects_flags_and_names_machines(live, site, dist, context, artifacts, tmp_path):
    from playwright.sync_api import expect

    server = live
    (dist / wheel_name(SHIM_VERSION)).write_bytes(b"PK the wheel the shim came from")
    (dist / wheel_name("1.0.0", "dispatch_remote")).write_bytes(b"PK the remote client")
    root = tmp_path / "root"
    root.mkdir()
    shim = site.shim("build-box", root)
    page = context.new_page()
    try:
        context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
        log_in(page, server, site)
        expect(page).to_have_url(f"{server.url}/machines/")
        page.evaluate("window.sameDocument = true")

        # Item 2: this instance's commands, each copyable.
        panel = page.locator("#connect-machine")
        install = f"pipx install {PUBLIC_URL}/downloads/{wheel_name(SHIM_VERSION)}"
        expect(panel.locator("#install-command")).to_have_text(install)
        expect(panel.locator("#login-command")).to_have_text(f"dispatch-shim login --server {PUBLIC_URL}")
        expect(panel.locator("#run-command")).to_have_text("dispatch-shim run --root ~/src")
        expect(panel.locator("#service-command")).to_have_text("dispatch-shim service install --root ~/src")
        for element, command in (("install", install), ("service", "dispatch-shim service install --root ~/src")):
            button = panel.locator(f'button[data-copy="#{element}-command"]')
            button.click()
            expect(button).to_have_text("Copied")
            assert page.evaluate("navigator.clipboard.readText()") == command

        # Item 3: the shim's version, not flagged while it is the newest served...
        row = page.locator(f'[data-machine="{shim.machine_id}"]')
        expect(row.locator(".shim-version .version")).to_have_text(SHIM_VERSION)
        expect(row.locator(".badge.outdated")).to_have_count(0)
        # ... and flagged, without a reload, once a newer wheel is served.
        (dist / wheel_name("999.0.0")).write_bytes(b"PK a newer shim")
        expect(row.locator(".badge.outdated")).to_have_text("older than 999.0.0", timeout=LIVE_LIST)

        # Item 4: an operation shows under the machine's name, not its id.
        api = MachineApi(server.url, site.admin_token)
        api.ok("demo", "FILE_STAT", {"path": str(root)})
        audit = page.locator("td.audit-machine")
        expect(audit.first).to_have_text("build-box", timeout=LIVE_LIST)
        expect(audit.first.locator("span")).to_have_attribute("title", shim.machine_id)
        assert page.evaluate("window.sameDocument") is True, "the Machines page was reloaded"
        page.screenshot(path=str(artifacts / "machines-connect.png"), full_page=True)

        page.reload()
        expect(panel.locator("#install-command")).to_have_text(
            f"pipx install {PUBLIC_URL}/downloads/{wheel_name('999.0.0')}"
        )
    except BaseException:
        page.screenshot(path=str(artifacts / "machines-connect-failure.png"), full_page=True)
        print("--- server log ---\n" + server.log() + f"\n--- shim log ---\n{shim.log()}")
        raise
    finally:
        shim.stop()


def test_anyone_downloads_a_wheel_and_without_wheels_the_pages_say_make_dist(live, site, dist, browser, artifacts):
    from playwright.sync_api import expect

    server = live
    for old in dist.iterdir():
        old.unlink()
    (dist / wheel_name("2.0.0")).write_bytes(b"PK the shim wheel")
    anonymous = browser.new_context(accept_downloads=True)
    try:
        page = anonymous.new_page()
        page.goto(f"{server.url}/downloads/")
        row = page.locator(f'[data-download="{wheel_name("2.0.0")}"]')
        expect(row).to_contain_text("2.0.0")
        with page.expect_download() as started:
            row.locator("a").click()
        download = started.value
        assert download.suggested_filename == wheel_name("2.0.0")
        assert Path(download.path()).read_bytes() == b"PK the shim wheel"

        (dist / wheel_name("2.0.0")).unlink()
        page.reload()
        expect(page.locator("#no-downloads")).to_contain_text("make dist")
        page.screenshot(path=str(artifacts / "downloads-empty.png"), full_page=True)
        page.goto(f"{server.url}/machines/")
        expect(page).to_have_url(f"{server.url}/login/?next=/machines/")  # only /downloads/ is open
        log_in(page, server, site)
        expect(page.locator("#no-shim-wheel")).to_contain_text("make dist")
        expect(page.locator("#install-command")).to_have_count(0)
    finally:
        anonymous.close()
