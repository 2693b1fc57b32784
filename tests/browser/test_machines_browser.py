"""A person in Chromium connects a computer: the shim's device login is approved on
/machines/activate, then the Machines page follows the shim without being reloaded
(docs/shim-protocol.md#getting-a-token).

The server is a real ``manage.py serve``; the shim is a real ``python -m machines.shim``
(``login``, then ``run`` with the stored token). The Machines page polls every 2 s.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.infra import Instance, Server, instance

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.timeout(120)]

USERNAME = "erin"
PASSWORD = "browser-test-pw-93"  # a throwaway instance's user
LIVE_LIST = 15_000  # ms: several 2-second polls plus the shim's start-up


@pytest.fixture(scope="module")
def site() -> Iterator[Instance]:
    with instance() as inst:
        inst.create_user(USERNAME, PASSWORD)
        yield inst


@pytest.fixture
def live(site: Instance) -> Iterator[tuple[Instance, Server]]:
    server = site.serve()
    try:
        yield site, server
    finally:
        server.stop()


def shoot(page: Any, path: Path) -> None:
    page.screenshot(path=str(path), full_page=True)


def test_a_user_approves_a_shim_and_watches_it_connect_and_disconnect(live, context, artifacts, tmp_path):
    from playwright.sync_api import expect

    inst, server = live
    page = context.new_page()
    state_dir, root = tmp_path / "state", tmp_path / "root"
    root.mkdir()
    login = shim = None
    try:
        page.goto(f"{server.url}/machines/activate")
        expect(page).to_have_url(f"{server.url}/login/?next=/machines/activate")
        page.fill("input[name=username]", USERNAME)
        page.fill("input[name=password]", PASSWORD)
        page.click("#login-button")
        expect(page).to_have_url(f"{server.url}/machines/activate")

        login = inst.shim_login(server, state_dir=state_dir)
        code = login.user_code()
        page.fill("#user-code", code.lower().replace("-", " "))  # case, spaces and dashes are ignored
        page.click("#continue")
        expect(page.locator("#request-hostname")).to_have_text(socket.gethostname())
        machine_id = json.loads((state_dir / "state.json").read_text())["machine_id"]
        expect(page.locator("dl.facts")).to_contain_text(machine_id)
        shoot(page, artifacts / "activate.png")
        page.click("#approve")
        expect(page.locator("#activation-result")).to_contain_text("Approved.")
        assert login.proc.wait(20) == 0, login.log()

        # The Machines page, from here on never reloaded.
        page.goto(f"{server.url}/machines/")
        page.evaluate("window.sameDocument = true")
        row = page.locator(f'[data-machine="{machine_id}"]')
        expect(row).to_have_count(0)

        shim = inst.shim("erin-laptop", root, stored_login=True, state_dir=state_dir, wait=False)
        expect(row.locator(".machine-status")).to_have_text("connected", timeout=LIVE_LIST)
        expect(row).to_contain_text("erin-laptop")
        expect(row).to_contain_text(str(Path(root).resolve()))
        shoot(page, artifacts / "machines.png")

        shim.kill()
        expect(row.locator(".machine-status")).to_have_text("disconnected", timeout=LIVE_LIST)
        assert page.evaluate("window.sameDocument") is True, "the Machines page was reloaded"
        shoot(page, artifacts / "machines-disconnected.png")
    except BaseException:
        page.screenshot(path=str(artifacts / "failure.png"), full_page=True)
        print("--- server log ---\n" + server.log())
        for process in (login, shim):
            if process is not None:
                print(f"--- {process.log_path} ---\n" + process.log())
        raise
    finally:
        if shim is not None:
            shim.stop()
