"""A person answers an agent's permission request in Chromium
(docs/agents.md#approvals-on-the-pages): the box appears on the agent page without a
reload, "Approve once" answers it as that person and the timeline says so; on a phone
(390x844) the Approvals page's buttons are visible, at least 44 px tall, and a long
command wraps instead of scrolling the page sideways.

The server is a real ``manage.py serve``. The first two tests make the request as the
CLI's hook would, through ``agents.approvals.approval_request`` in that instance's
database (``manage.py shell``, another process: the live event crosses Redis); the last
runs the real Claude Code (tests/clients) against the fake model
(tests/agents/fake_model.py): its ``Bash`` call asks, "Approve once" is clicked in
Chromium, and the command runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.agents.real_cli.conftest import fake_model, run  # noqa: F401 - fixtures of the real-CLI test
from tests.agents.real_cli.dispatch_fixtures import dispatch_serve  # noqa: F401 - a fixture
from tests.infra import Instance, Server, instance

pytestmark = [
    pytest.mark.browser,
    pytest.mark.integration,
    pytest.mark.redis,
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]

USERNAME = "gwen"
PASSWORD = "browser-test-pw-83"  # a throwaway instance's user
LIVE = 20_000  # ms
LONG_COMMAND = (
    "rsync -av --delete " + " ".join(f"/srv/releases/build-{n:04d}/artifacts/" for n in range(12)) + " /srv/www/"
)


@pytest.fixture(scope="module")
def site() -> Iterator[Instance]:
    # Redis: the approval is recorded by another process (manage.py shell, as a hook call in
    # another serve process would be), and its live event must reach this server's page.
    with instance(redis=True) as inst:
        inst.create_user(USERNAME, PASSWORD)
        yield inst


@pytest.fixture
def live(site: Instance) -> Iterator[tuple[Instance, Server]]:
    socket = f"dispatch-browser-{uuid.uuid4().hex[:10]}"
    server = site.serve(DISPATCH_TMUX_SOCKET=socket, DISPATCH_CLI_SUPERVISE_INTERVAL="0.5")
    try:
        yield site, server
    finally:
        server.stop()
        subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True, check=False)
        (Path(os.environ.get("TMUX_TMPDIR", "/tmp")) / f"tmux-{os.getuid()}" / socket).unlink(missing_ok=True)


def launch_shell(server: Server, token: str, cwd: str) -> str:
    response = httpx.post(
        f"{server.url}/api/v1/agents",
        json={"type": "shell", "name": "deployer", "cwd": cwd},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def request_approval(site: Instance, agent_id: str, command: str) -> str:
    """What the CLI's PermissionRequest hook records: a pending approval for ``Bash``; its id."""
    code = (
        "from agents import approvals; from agents.models import Agent; "
        f"agent = Agent.objects.get(pk={agent_id!r}); "
        "approval = approvals.approval_request(agent=agent, tool_name='Bash', "
        f"tool_input={{'command': {command!r}}}, suggestions=__import__('json').loads({json.dumps(SUGGESTIONS)!r})); "
        "print('APPROVAL', approval.pk)"
    )
    out = site.manage("shell", "-c", code).stdout
    match = re.search(r"APPROVAL (\S+)", out)
    assert match, out
    return match.group(1)


SUGGESTIONS = [
    {"type": "addRules", "rules": [{"toolName": "Bash", "ruleContent": "rsync:*"}], "behavior": "allow"},
]


def login(page: Any, server: Server) -> None:
    from playwright.sync_api import expect

    page.goto(f"{server.url}/")
    page.fill("input[name=username]", USERNAME)
    page.fill("input[name=password]", PASSWORD)
    page.click("#login-button")
    expect(page).to_have_url(f"{server.url}/")


def test_an_approval_appears_live_on_the_agent_page_and_approve_once_answers_it(live, context, artifacts, tmp_path):
    from playwright.sync_api import expect

    site, server = live
    agent_id = launch_shell(server, site.token(USERNAME), str(tmp_path))
    page = context.new_page()
    try:
        login(page, server)
        page.goto(f"{server.url}/agents/{agent_id}/")
        expect(page.locator("#agent-status")).to_have_text("running", timeout=LIVE)
        expect(page.locator(".approval-box")).to_have_count(0)
        page.evaluate("window.sameDocument = true")  # a reload would drop it

        approval_id = request_approval(site, agent_id, "echo approved > proof.txt")
        box = page.locator(f'[data-approval="{approval_id}"].approval-box')
        expect(box).to_be_visible(timeout=LIVE)
        expect(box.locator("pre.approval-input").first).to_have_text("echo approved > proof.txt")
        expect(box).to_contain_text("allow Bash(rsync:*)")
        expect(page.locator("#nav-approvals")).to_contain_text("Approvals")
        assert page.evaluate("window.sameDocument") is True
        page.screenshot(path=str(artifacts / "approval-agent-page.png"), full_page=True)

        box.locator('button[data-decision="allow_once"]').click()
        expect(page.locator(".messages")).to_contain_text("Bash: approved once")
        expect(page.locator(".approval-box")).to_have_count(0)
        expect(page.locator("ol.timeline")).to_contain_text(f"approved once by {USERNAME}")
        expect(page.locator("#agent-decisions")).to_contain_text(USERNAME)

        # A second answer (another tab, a replay) is told who answered first.
        page.goto(f"{server.url}/approvals/{approval_id}/")
        expect(page.locator("#approval-decided-by")).to_contain_text(f"approved once by {USERNAME}")
    except BaseException:
        page.screenshot(path=str(artifacts / "approvals-failure.png"), full_page=True)
        print("--- server log ---\n" + server.log())
        raise


def test_on_a_phone_the_buttons_are_large_and_a_long_command_wraps(live, browser, artifacts, tmp_path):
    from playwright.sync_api import expect

    site, server = live
    agent_id = launch_shell(server, site.token(USERNAME), str(tmp_path))
    approval_id = request_approval(site, agent_id, LONG_COMMAND)
    phone = browser.new_context(
        viewport={"width": 390, "height": 844}, device_scale_factor=3, is_mobile=True, has_touch=True
    )
    phone.set_default_timeout(15_000)
    page = phone.new_page()
    try:
        login(page, server)
        for path in ("/approvals/", f"/approvals/{approval_id}/", f"/agents/{agent_id}/"):
            page.goto(f"{server.url}{path}")
            box = page.locator(f'[data-approval="{approval_id}"].approval-box')
            expect(box).to_be_visible()
            for decision in ("allow_once", "allow_always", "deny"):
                button = box.locator(f'button[data-decision="{decision}"]')
                expect(button).to_be_visible()
                height = button.bounding_box()["height"]
                assert height >= 44, f"{decision} on {path}: {height}px"
                assert button.bounding_box()["x"] + button.bounding_box()["width"] <= 390 + 0.5
            widths = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
            assert widths[0] <= widths[1], f"{path} scrolls sideways: {widths}"
            summary = box.locator("pre.approval-input").first
            assert summary.bounding_box()["width"] <= 390
            assert summary.bounding_box()["height"] > 60  # the command wrapped over several lines
        # The agents list and the rule form fit a phone too: one column, nothing sideways.
        page.goto(f"{server.url}/agents/")
        widths = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
        assert widths[0] <= widths[1], f"/agents/ scrolls sideways: {widths}"
        page.goto(f"{server.url}/approvals/")
        fields = page.locator("#rule-form label")
        lefts = {round(fields.nth(index).bounding_box()["x"]) for index in range(fields.count())}
        assert len(lefts) == 1, f"the rule form is not one column on a phone: {lefts}"
        page.screenshot(path=str(artifacts / "approvals-phone.png"), full_page=True)

        page.locator(f'[data-approval="{approval_id}"] textarea[name=message]').fill("not during business hours")
        page.locator(f'[data-approval="{approval_id}"] button[data-decision="deny"]').click()
        expect(page.locator(".messages")).to_contain_text("Bash: denied")
        expect(page.locator("#recent-decisions")).to_contain_text("not during business hours")
    except BaseException:
        page.screenshot(path=str(artifacts / "approvals-phone-failure.png"), full_page=True)
        print("--- server log ---\n" + server.log())
        raise
    finally:
        phone.close()


# --- with the real Claude Code ----------------------------------------------------------------------


@pytest.fixture
def claude_asking(
    fake_model: Any,  # noqa: F811 - the fixture imported above
    run: Any,  # noqa: F811 - the fixture imported above
    dispatch_serve: Callable[[dict[str, Any]], Any],  # noqa: F811 - the fixture imported above
) -> Any:
    """Dispatch with the pinned Claude Code as type ``claude-ask`` (``--permission-mode
    default``: it asks before Bash), against the fake model (tests/agents/real_cli)."""
    from agents.types import DEFAULT_AGENT_TYPES
    from tests.agents.real_cli.conftest import API_KEY, cli_or_skip

    program = cli_or_skip("claude")
    default = DEFAULT_AGENT_TYPES["claude"]
    env = {"HOME": str(run.home), "ANTHROPIC_BASE_URL": fake_model.url, "ANTHROPIC_API_KEY": API_KEY}
    spec = {
        **default,
        "argv": [program, *default["argv"][1:]],  # the default argv: manual mode
        "full_access_argv": [program, *default["full_access_argv"][1:]],
        "env": env,
        "hooks": "claude",
    }
    return dispatch_serve({"claude-ask": spec})


def test_the_real_claude_code_asks_approve_once_in_chromium_and_the_command_runs(
    claude_asking,
    fake_model,  # noqa: F811 - the fixture imported above
    run,  # noqa: F811 - the fixture imported above
    context,
    artifacts,
):
    from playwright.sync_api import expect

    from tests.agents.fake_model import call, say

    dispatch = claude_asking
    fake_model.queue(call("Bash", {"command": "echo approved > proof.txt", "description": "write the proof"}))
    fake_model.queue(say("wrote the proof"))
    launched = dispatch.launch(
        type="claude-ask", name="cc", cwd=str(run.workdir), prompt="write the proof file", trust_folder=True
    )
    assert launched.status_code == 201, launched.text
    agent_id = launched.json()["id"]
    dispatch.wait_running(agent_id)
    server = dispatch.server
    page = context.new_page()
    try:
        page.goto(f"{server.url}/")
        page.fill("input[name=username]", "admin")
        page.fill("input[name=password]", dispatch.inst.admin_password)
        page.click("#login-button")
        expect(page).to_have_url(f"{server.url}/")
        page.goto(f"{server.url}/agents/{agent_id}/")

        box = page.locator(".approval-box")
        expect(box).to_be_visible(timeout=45_000)
        expect(box.locator("pre.approval-input").first).to_have_text("echo approved > proof.txt")
        assert not (run.workdir / "proof.txt").exists()
        page.screenshot(path=str(artifacts / "approval-real-claude.png"), full_page=True)
        box.locator('button[data-decision="allow_once"]').click()

        expect(page.locator("ol.timeline")).to_contain_text("approved once by admin", timeout=LIVE)
        deadline = time.monotonic() + 30
        while not (run.workdir / "proof.txt").exists():
            assert time.monotonic() < deadline, f"the command never ran; pane:\n{dispatch.pane(agent_id)}"
            time.sleep(0.2)
        assert (run.workdir / "proof.txt").read_text().strip() == "approved"
    except BaseException:
        page.screenshot(path=str(artifacts / "approvals-real-claude-failure.png"), full_page=True)
        print("--- pane ---\n" + dispatch.pane(agent_id))
        print("--- server log ---\n" + server.log())
        raise
