"""Every client reaches Dispatch only through nginx (docs/deploy.md#nginx): a person in
Chromium uses the three-process topology over https (nginx, least connections, no sticky
sessions).

Log in (CSRF and the origin check behind the proxy: the scheme from ``X-Forwarded-Proto``,
the port kept by ``Host $http_host``), launch a ``shell`` agent, watch its pane live
through the tab's server-sent-event stream (nginx must not buffer it), message it and stop
it. Each request lands on whichever process nginx picks; the agent runs under the
worker's CLI supervisor.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import Cluster, shared_cluster

pytestmark = [
    pytest.mark.browser,
    pytest.mark.integration,
    pytest.mark.multiprocess,
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]

LIVE = 30_000  # ms: supervisor passes, pane captures once a second, on a busy machine


@pytest.fixture
def topo(request: pytest.FixtureRequest) -> Cluster:
    return shared_cluster(request.config, tls=True)


@pytest.fixture
def https_context(browser: Any) -> Iterator[Any]:
    """A fresh profile that accepts the topology's self-signed certificate."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 900}, ignore_https_errors=True)
    ctx.set_default_timeout(20_000)
    try:
        yield ctx
    finally:
        ctx.close()


def test_a_person_through_nginx_launches_watches_messages_and_stops_a_shell_agent(
    topo: Cluster, https_context: Any, artifacts: Path, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    url = topo.url
    assert url.startswith("https://")
    page = https_context.new_page()
    streams: list[str] = []
    page.on("request", lambda request: streams.append(request.url) if "/api/v1/events" in request.url else None)
    try:
        page.goto(f"{url}/")
        page.fill("input[name=username]", "admin")
        page.fill("input[name=password]", topo.instance.admin_password)
        page.click("#login-button")
        expect(page).to_have_url(f"{url}/")

        page.select_option("#launch-type", "shell")
        page.fill("#launch-form input[name=name]", "through-nginx")
        page.fill("#launch-form input[name=cwd]", str(tmp_path))
        page.fill("#launch-form textarea[name=prompt]", "echo hello-through-$((40+2))")
        page.click("#launch")
        expect(page).to_have_url(re.compile(rf"{re.escape(url)}/agents/agt_[0-9a-f]{{12}}/$"))
        expect(page.locator("#agent-status")).to_have_text("running", timeout=LIVE)

        pane = page.locator("#pane")
        expect(pane).to_have_text(re.compile(r"^hello-through-42$", re.MULTILINE), timeout=LIVE)

        page.fill("#message-form textarea[name=content]", "echo second-$((6*7))")
        page.click("#send-message")
        expect(pane).to_contain_text("second-42", timeout=LIVE)
        message_row = page.locator("#agent-messages tr", has_text="echo second-$((6*7))")
        expect(message_row.locator(".badge")).to_have_text("delivered", timeout=LIVE)

        page.click("#stop")
        expect(page.locator("#agent-status")).to_have_text("stopped", timeout=LIVE)
        expect(page.locator("#start")).to_be_visible()
        assert any(stream.startswith(f"{url}/api/v1/events") for stream in streams), streams
        page.screenshot(path=str(artifacts / "cluster-agent.png"), full_page=True)
    except BaseException:
        page.screenshot(path=str(artifacts / "cluster-agent-failure.png"), full_page=True)
        print(topo.details())
        raise
