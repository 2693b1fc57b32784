"""The Machines page's live panels (docs/live-operations.md#the-machines-page): the "Run" panel over the machines
attached to the session ``default``, the operations in flight, the copy form — their
markup, who sees which machine, and that the page's script never writes server text as
HTML. The panels' behaviour against a real server and shim is the browser test
(``tests/browser/test_machines_run_browser.py``).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client

from core.services import server_process_ensure
from machines.models import DefaultMachine, Machine, MachineConnection
from tests.infra import REPO

pytestmark = pytest.mark.django_db

SCRIPT = REPO / "static" / "js" / "machines-run.js"


def attached(
    user: Any,
    machine_id: str,
    *,
    sessions: list[str] | None = None,
    capabilities: list[str] | None = None,
    protocol: str = "2.1",
    **fields: Any,
) -> Machine:
    """A connected machine of ``user`` whose shim attaches to ``sessions`` (default: all)."""
    granted = ["files", "shell"] if capabilities is None else capabilities
    machine = Machine.objects.create(
        user=user,
        machine_id=machine_id,
        hostname=fields.pop("hostname", machine_id + "-host"),
        platform="linux",
        arch="x86_64",
        granted_capabilities=granted,
        allowed_roots=["/srv"],
        connection_status=Machine.Connection.CONNECTED,
        status_reason="connected",
        **fields,
    )
    MachineConnection.objects.create(
        machine=machine,
        user=user,
        connection_id="conn-" + machine_id,
        channel_name="chan-" + machine_id,
        server_process_id=server_process_ensure(),
        sessions=["*"] if sessions is None else sessions,
        granted_capabilities=granted,
        protocol_version=protocol,
    )
    return machine


@pytest.fixture
def browser(owner: Any) -> Client:
    client = Client()
    client.force_login(owner)
    return client


def panel(page: str) -> str:
    start = page.index('<div id="live-operations"')
    return page[start : page.index("</section>\n</div>", start)]


def run_targets(page: str) -> dict[str, str]:
    """machine id → its label's HTML, for each machine the Run panel offers."""
    return dict(re.findall(r'<label class="check run-target" data-target="([^"]+)">(.*?)</label>', page, re.S))


def test_the_panels_need_a_login(client):
    response = client.get("/machines/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")


def test_the_run_panel_offers_the_machines_attached_to_the_default_session(browser, owner, member):
    attached(owner, "m-build", display_name="build-box")
    attached(owner, "m-laptop", display_name="laptop", sessions=["default", "other"])
    attached(owner, "m-elsewhere", display_name="elsewhere", sessions=["other"])
    attached(member, "m-theirs", display_name="their-box")

    whole = browser.get("/machines/").content.decode()
    page = panel(whole)

    targets = run_targets(page)
    assert list(targets) == ["m-build", "m-laptop"]  # by name; not another session's, not another user's
    assert "build-box" in targets["m-build"] and "laptop" in targets["m-laptop"]
    assert "elsewhere" not in page and "their-box" not in page
    assert 'data-ops-url="/api/v1/sessions/default/ops"' in page
    assert 'data-copy-url="/api/v1/sessions/default/copy"' in page
    assert 'data-machines-url="/api/v1/sessions/default/machines"' in page
    assert re.search(r'<input type="hidden" name="csrfmiddlewaretoken" value="[^"]+">', page)
    assert '<input type="checkbox" id="run-all" value="*">' in page
    assert 'id="run-command"' in page and 'id="run-cancel"' in page
    assert 'role="log"' in page  # the output pane is announced as a log
    assert 'id="ops-in-flight"' in page and 'id="copy-progress"' in page
    assert re.search(r'<script src="/static/js/machines-run\.js" defer>', whole)


def test_the_default_machine_is_chosen_first_else_the_first_with_a_shell(browser, owner):
    attached(owner, "m-a", display_name="alpha", capabilities=["files"])
    attached(owner, "m-b", display_name="bravo")
    attached(owner, "m-c", display_name="charlie")

    targets = run_targets(panel(browser.get("/machines/").content.decode()))
    assert [machine for machine, label in targets.items() if " checked" in label] == ["m-b"]

    DefaultMachine.objects.create(user=owner, machine_id="m-c")
    targets = run_targets(panel(browser.get("/machines/").content.decode()))
    assert [machine for machine, label in targets.items() if " checked" in label] == ["m-c"]
    assert '<span class="badge">default</span>' in targets["m-c"]


def test_a_machine_without_a_shell_cannot_be_chosen_and_an_old_shim_is_flagged(browser, owner):
    attached(owner, "m-files", display_name="files-only", capabilities=["files"])
    attached(owner, "m-old", display_name="old-shim", protocol="2.0")

    page = panel(browser.get("/machines/").content.decode())

    targets = run_targets(page)
    assert " disabled" in targets["m-files"] and "(no shell)" in targets["m-files"]
    assert " disabled" not in targets["m-old"]
    assert "shim protocol 2.0: no live output" in targets["m-old"]
    copy_sources = re.search(r'<select id="copy-source-machine".*?</select>', page, re.S)
    assert copy_sources is not None
    assert 'value="m-files"' in copy_sources.group(0) and 'value="m-old"' in copy_sources.group(0)


def test_a_machine_without_files_is_no_end_of_a_copy(browser, owner):
    attached(owner, "m-shell", display_name="shell-only", capabilities=["shell"])
    attached(owner, "m-both", display_name="both")

    page = panel(browser.get("/machines/").content.decode())

    for select in ("copy-source-machine", "copy-destination-machine"):
        options = re.search(rf'<select id="{select}".*?</select>', page, re.S)
        assert options is not None
        assert 'value="m-both"' in options.group(0) and "m-shell" not in options.group(0)


def test_without_machines_the_panel_says_how_to_attach_one(browser):
    page = panel(browser.get("/machines/").content.decode())
    assert run_targets(page) == {}
    assert re.search(r'<p class="empty" id="run-no-machines">No machine is attached', page)
    assert re.search(r'<label class="check" id="run-all-label" hidden>', page)


def test_machine_names_are_escaped_in_the_panels(browser, owner):
    attached(owner, "m-x", display_name='<img src=x onerror="alert(1)">')

    page = panel(browser.get("/machines/").content.decode())

    assert "<img" not in page
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in page


def test_the_panels_have_no_inline_handlers_and_the_script_writes_text_only():
    template = (REPO / "templates" / "machines" / "_live_panels.html").read_text()
    assert not re.search(r"\son[a-z]+=", template)
    script = SCRIPT.read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script, f"machines-run.js uses {sink}: server text must only be set as textContent"
    assert '"X-CSRFToken": CSRF' in script  # every POST carries the page's CSRF token
