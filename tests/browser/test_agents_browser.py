"""A person in Chromium launches a ``shell`` agent, watches its terminal live, messages it
and stops it (docs/agents.md, the Agents and Agent pages).

The server is a real ``manage.py serve`` on a private tmux server (``DISPATCH_TMUX_SOCKET``):
its background CLI supervisor pastes the prompt and the message into the pane; the page
shows the pane through the tab's one SSE stream (``/api/v1/events?pane=<id>``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.infra import Instance, Server, instance

pytestmark = [
    pytest.mark.browser,
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]

USERNAME = "fran"
PASSWORD = "browser-test-pw-57"  # a throwaway instance's user
LIVE = 20_000  # ms: supervisor passes, pane captures once a second


@pytest.fixture(scope="module")
def site() -> Iterator[Instance]:
    with instance() as inst:
        inst.create_user(USERNAME, PASSWORD)
        yield inst


@pytest.fixture
def live(site: Instance) -> Iterator[tuple[Instance, Server]]:
    socket = f"dispatch-browser-{uuid.uuid4().hex[:10]}"
    server = site.serve(
        DISPATCH_TMUX_SOCKET=socket, DISPATCH_CLI_SUPERVISE_INTERVAL="0.5", DISPATCH_AGENT_STOP_GRACE="1"
    )
    try:
        yield site, server
    finally:
        server.stop()
        subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True, check=False)
        (Path(os.environ.get("TMUX_TMPDIR", "/tmp")) / f"tmux-{os.getuid()}" / socket).unlink(missing_ok=True)


def shoot(page: Any, path: Path) -> None:
    page.screenshot(path=str(path), full_page=True)


def test_a_user_launches_a_shell_agent_watches_its_pane_messages_it_and_stops_it(live, context, artifacts, tmp_path):
    from playwright.sync_api import expect

    _, server = live
    page = context.new_page()
    try:
        page.goto(f"{server.url}/")
        page.fill("input[name=username]", USERNAME)
        page.fill("input[name=password]", PASSWORD)
        page.click("#login-button")
        expect(page).to_have_url(f"{server.url}/")
        expect(page.locator("#agent-list")).to_contain_text("No agents yet")

        # Every configured type is offered; one whose program is missing is disabled.
        shell = page.locator('#launch-type option[value="shell"]')
        expect(shell).to_be_enabled()
        if shutil.which("claude") is None:
            claude = page.locator('#launch-type option[value="claude"]')
            expect(claude).to_have_text("claude (not installed here: claude not on PATH)")
            expect(claude).to_be_disabled()

        page.select_option("#launch-type", "shell")
        page.fill("#launch-form input[name=name]", "greeter")
        page.fill("#launch-form input[name=cwd]", str(tmp_path))
        page.fill("#launch-form textarea[name=prompt]", "echo hello-from-dispatch")
        page.click("#launch")
        expect(page).to_have_url(re.compile(rf"{re.escape(server.url)}/agents/agt_[0-9a-f]{{12}}/$"))
        expect(page.locator("#agent-status")).to_have_text("running", timeout=LIVE)

        pane = page.locator("#pane")
        # The output line, not the typed command: a line that is exactly the echoed text.
        expect(pane).to_have_text(re.compile(r"^hello-from-dispatch$", re.MULTILINE), timeout=LIVE)
        shoot(page, artifacts / "agent-pane.png")

        page.fill("#message-form textarea[name=content]", "echo second-$((6*7))")
        page.click("#send-message")
        expect(pane).to_contain_text("second-42", timeout=LIVE)
        message_row = page.locator("#agent-messages tr", has_text="echo second-$((6*7))")
        expect(message_row.locator(".badge")).to_have_text("delivered", timeout=LIVE)
        shoot(page, artifacts / "agent-message.png")

        page.evaluate("window.sameDocument = true")
        page.click("#stop")
        expect(page.locator("#agent-status")).to_have_text("stopped", timeout=LIVE)
        expect(page.locator("#start")).to_be_visible()
        shoot(page, artifacts / "agent-stopped.png")
    except BaseException:
        page.screenshot(path=str(artifacts / "agents-failure.png"), full_page=True)
        print("--- server log ---\n" + server.log())
        raise
