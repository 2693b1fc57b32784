"""No push while the user looks at the agent (docs/notifications.md#notifications-in-open-tabs).

A real ``manage.py serve`` (its background worker delivers), Chromium with the
notifications permission granted, and an Apprise ``json://`` URL pointing at an HTTP
receiver of the test. With the agent's page open and visible, an approval of that agent
sends nothing to the receiver and the tab shows no notification of its own (the page
itself shows the approval); an approval of another agent is pushed and shown in the tab.
With the page closed, the next approval of the first agent reaches the receiver.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from tests.infra import Instance, Server, instance, manage

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.redis, pytest.mark.timeout(150)]

USERNAME = "nora"
PASSWORD = "browser-notify-pw-31"  # a throwaway instance's user

# Record every Notification the page constructs (the permission is granted in the context).
RECORD_NOTIFICATIONS = """
(() => {
  const Real = window.Notification;
  window.__shown = [];
  function Recording(title, options) {
    window.__shown.push({ title: title, tag: (options || {}).tag || null });
    return new Real(title, options);
  }
  Recording.permission = Real.permission;
  Recording.requestPermission = Real.requestPermission.bind(Real);
  window.Notification = Recording;
})();
"""


class Hook:
    """The Apprise target: an HTTP server on a free port recording each JSON body."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                hook.bodies.append(json.loads(self.rfile.read(length)))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook() -> Iterator[Hook]:
    receiver = Hook()
    try:
        yield receiver
    finally:
        receiver.close()


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[Instance, Server, str]]:
    # Redis as the channel layer: the approvals are made by another process (manage.py
    # shell), whose live frame must reach the server's event stream.
    with instance(redis=True) as site:
        site.create_user(USERNAME, PASSWORD)
        server = site.serve(DISPATCH_NOTIFY_POLL_INTERVAL="0.2", DISPATCH_NOTIFY_VIEWING_TTL="3")
        yield site, server, site.token(USERNAME)


def api(server: Server, token: str, method: str, path: str, body: Any = None) -> httpx.Response:
    return httpx.request(method, server.url + path, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=10)


def ask_approval(site: Instance, server: Server, agent_id: str, command: str) -> str:
    """The agent's CLI asks to run ``command`` (``agents.approvals.approval_request``, as
    its PermissionRequest hook does), from another process of the deployment (same
    public URL); the approval's id."""
    out = manage(
        {**site.env, "DISPATCH_PUBLIC_URL": server.url},
        "shell",
        "-c",
        "from agents.approvals import approval_request; from agents.models import Agent; "
        f"a = approval_request(agent=Agent.objects.get(pk={agent_id!r}), tool_name='Bash', "
        f"tool_input={{'command': {command!r}}}); print(a.pk)",
    ).stdout
    return out.strip().splitlines()[-1]


def notification_of(server: Server, token: str, approval_id: str, timeout: float = 15) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for item in api(server, token, "GET", "/api/v1/notifications").json()["results"]:
            if item["approval_id"] == approval_id:
                return dict(item)
        time.sleep(0.2)
    raise AssertionError(f"no notification for approval {approval_id}")


def wait_for(check: Any, timeout: float = 15) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError("timed out")


def test_no_push_while_the_agents_page_is_open_and_visible_then_pushed_once_it_is_closed(
    live: tuple[Instance, Server, str], context: Any, hook: Hook, tmp_path: Any
) -> None:
    from playwright.sync_api import expect

    site, server, token = live
    saved = api(
        server, token, "PUT", "/api/v1/notifications/settings", {"apprise_urls": [f"json://127.0.0.1:{hook.port}/n"]}
    )
    assert saved.status_code == 200, saved.text
    agents = []
    for name in ("watched", "elsewhere"):
        launched = api(server, token, "POST", "/api/v1/agents", {"type": "expert", "name": name, "cwd": str(tmp_path)})
        assert launched.status_code in (200, 201), launched.text
        agents.append(launched.json()["id"])
    watched, elsewhere = agents

    context.grant_permissions(["notifications"], origin=server.url)
    context.add_init_script(RECORD_NOTIFICATIONS)
    page = context.new_page()
    page.goto(f"{server.url}/login/")
    page.fill("input[name=username]", USERNAME)
    page.fill("input[name=password]", PASSWORD)
    page.click("#login-button")
    expect(page).to_have_url(f"{server.url}/")

    # Open tabs show notifications once the user says so (a click, never on its own).
    page.goto(f"{server.url}/settings/notifications/")
    page.click("[data-enable-tab-notifications]")
    expect(page.locator("[data-notify-state]")).to_contain_text("Open tabs show notifications.")

    with page.expect_response(lambda r: r.url.endswith("/api/v1/notifications/viewing") and r.ok):
        page.goto(f"{server.url}/agents/{watched}/")
    assert page.evaluate("document.visibilityState") == "visible"
    page.wait_for_function("document.readyState === 'complete'")

    held = ask_approval(site, server, watched, "rm -rf build")
    assert notification_of(server, token, held)["suppressed_reason"] == "viewing"

    # Another agent's approval is pushed, and the open tab shows it too.
    other = ask_approval(site, server, elsewhere, "make deploy")
    other_row = notification_of(server, token, other)
    assert other_row["status"] in ("pending", "sent")
    wait_for(lambda: hook.bodies)
    page.wait_for_function("window.__shown.length > 0", timeout=15_000)
    shown = page.evaluate("window.__shown")
    assert [entry["tag"] for entry in shown] == [other_row["id"]]  # nothing for the agent in view
    assert [body["title"] for body in hook.bodies] == ["elsewhere asks to use Bash"]

    # The page stays open longer than the heartbeat's time to live (3 s): it is renewed.
    time.sleep(4)
    renewed = ask_approval(site, server, watched, "rm -rf cache")
    assert notification_of(server, token, renewed)["suppressed_reason"] == "viewing"

    page.close()  # the page is gone: its heartbeat stops and expires within 3 s
    time.sleep(3.5)
    pushed = ask_approval(site, server, watched, "rm -rf dist")
    row = notification_of(server, token, pushed)
    assert row["suppressed_reason"] == ""
    wait_for(lambda: len(hook.bodies) == 2)
    assert hook.bodies[1]["title"] == "watched asks to use Bash"
    assert hook.bodies[1]["message"] == f"Bash: rm -rf dist\n\n{server.url}/approvals/{pushed}/"
