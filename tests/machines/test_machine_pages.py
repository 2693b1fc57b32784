"""The Machines page and its forms (docs/live-operations.md#the-machines-page,
docs/shim-protocol.md#getting-a-token)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client

from machines.models import AuditRecord, DefaultMachine, Machine, MachineToken
from machines.selectors import recent_operations_for
from machines.services.device import machine_token_create
from machines.services.inflight import pipe_command_ids

pytestmark = pytest.mark.django_db


def machine(user: Any, machine_id: str, **fields: Any) -> Machine:
    defaults: dict[str, Any] = {
        "hostname": machine_id + "-host",
        "platform": "linux",
        "arch": "x86_64",
        "granted_capabilities": ["files", "shell"],
        "allowed_roots": ["/home/" + user.username],
        "connection_status": Machine.Connection.CONNECTED,
        "status_reason": "connected",
    }
    defaults.update(fields)
    return Machine.objects.create(user=user, machine_id=machine_id, **defaults)


@pytest.fixture
def browser(owner: Any) -> Client:
    client = Client()
    client.force_login(owner)
    return client


def test_the_page_needs_a_login(client):
    for path in ("/machines/", "/machines/fragment"):
        response = client.get(path)
        assert response.status_code == 302
        assert response["Location"].startswith("/login/")


def test_the_page_lists_the_users_machines_with_their_status(browser, owner, member):
    machine(owner, "m-laptop", display_name="Work laptop")
    machine(
        owner,
        "m-nas",
        hostname="nas",
        connection_status=Machine.Connection.DISCONNECTED,
        status_reason="the shim disconnected",
        health=Machine.Health.ERROR,
    )
    machine(member, "m-bob", hostname="bobs-secret-box")
    page = browser.get("/machines/").content.decode()
    assert 'data-machine="m-laptop"' in page and "Work laptop" in page
    assert 'data-machine="m-nas"' in page
    assert '<span class="machine-status">connected</span>' in page
    assert '<span class="machine-status">disconnected</span>' in page
    assert "the shim disconnected" in page and " · error" in page
    assert "m-bob" not in page and "bobs-secret-box" not in page


def test_revoked_machines_are_not_listed(browser, owner):
    from django.utils import timezone

    machine(owner, "m-old", revoked_at=timezone.now())
    assert "m-old" not in browser.get("/machines/").content.decode()


def test_the_fragment_is_the_list_without_the_layout(browser, owner):
    machine(owner, "m-laptop")
    response = browser.get("/machines/fragment")
    assert response.status_code == 200
    fragment = response.content.decode()
    assert 'data-machine="m-laptop"' in fragment
    assert "<html" not in fragment.lower()


def test_the_page_shows_the_users_recent_operations_only(browser, owner, member):
    AuditRecord.objects.create(
        user=owner,
        session_id="agt_1",
        machine_id="m1",
        request_id="r1",
        op="FILE_READ",
        details={"path": "/home/alice/plan.txt"},
        result={"ok": True, "duration_ms": 3},
        caller="agt_1",
    )
    AuditRecord.objects.create(
        user=member,
        session_id="s",
        machine_id="m2",
        request_id="r2",
        op="FILE_DELETE",
        details={"path": "/home/bob/private.txt"},
        result={"ok": True},
        caller="api",
    )
    page = browser.get("/machines/").content.decode()
    assert "/home/alice/plan.txt" in page
    assert "/home/bob/private.txt" not in page


def test_a_command_that_exited_non_zero_is_shown_as_its_exit_status_not_ok(browser, owner):
    for request_id, code in (("r-fail", 3), ("r-pass", 0)):
        AuditRecord.objects.create(
            user=owner,
            session_id="default",
            machine_id="m1",
            request_id=request_id,
            op="EXECUTE_COMMAND",
            details={"command": f"exit {code}"},
            result={"ok": True, "exit_code": code, "duration_ms": 5},
            caller="mcp",
        )
    page = browser.get("/machines/").content.decode()
    rows = page[page.index('id="recent-operations"') :].split("<tr>")
    failed = next(row for row in rows if "command=exit 3" in row)
    passed = next(row for row in rows if "command=exit 0" in row)
    assert '<span class="error-text">exit 3</span>' in failed
    assert "error-text" not in passed and "ok" in passed


def _pipe(owner, pipe_id, source_result, destination_result):
    for request_id, result in zip(pipe_command_ids(pipe_id), (source_result, destination_result), strict=True):
        AuditRecord.objects.create(
            user=owner,
            session_id="default",
            machine_id="m1",
            request_id=request_id,
            operation_id=pipe_id,
            op="EXECUTE_COMMAND",
            details={"command": "x"},
            result={"ok": True, "duration_ms": 5, **result},
            caller="api",
        )


@pytest.mark.parametrize(
    ("source", "destination", "shown"),
    [
        ({"exit_code": 1}, {"exit_code": -15, "cancelled": True}, "cancelled"),  # the user cancelled it
        ({"exit_code": -15, "cancelled": True}, {"exit_code": 0}, "ok"),  # the destination ended first
        ({"exit_code": 0}, {"exit_code": 2}, "exit 2"),
        ({"exit_code": -1, "timed_out": True}, {"exit_code": 0}, "timed out"),
        ({"exit_code": 0}, {"exit_code": 0}, "ok"),
    ],
)
def test_a_pipes_outcome_reads_cancelled_before_an_ends_exit_status(owner, source, destination, shown):
    _pipe(owner, "5fa87ef9-c181-496f-a50e-d9ec4bc701a5", source, destination)
    (row,) = recent_operations_for(user=owner)
    assert (row.kind, row.outcome) == ("pipe", shown)


def test_a_command_its_shim_stopped_at_its_timeout_reads_timed_out_not_its_exit_status(owner):
    AuditRecord.objects.create(
        user=owner,
        session_id="default",
        machine_id="m1",
        request_id="r-slow",
        op="EXECUTE_COMMAND",
        details={"command": "sleep 99"},
        result={"ok": True, "exit_code": -1, "timed_out": True},
        caller="api",
    )
    (row,) = recent_operations_for(user=owner)
    assert row.outcome == "timed out" and row.failed


def test_the_revoke_form_revokes_the_machine_and_its_tokens(browser, owner):
    machine(owner, "m-laptop")
    machine_token_create(user=owner, machine_id="m-laptop")
    response = browser.post("/machines/m-laptop/revoke", follow=True)
    assert response.redirect_chain[-1][0] == "/machines/"
    assert "revoked" in response.content.decode()
    assert Machine.objects.get(machine_id="m-laptop").revoked_at is not None
    assert not MachineToken.objects.filter(revoked_at__isnull=True).exists()
    assert 'data-machine="m-laptop"' not in response.content.decode()


def test_the_revoke_form_cannot_touch_another_users_machine(browser, member):
    machine(member, "m-bob")
    token = machine_token_create(user=member, machine_id="m-bob")
    response = browser.post("/machines/m-bob/revoke", follow=True)
    assert response.status_code == 200
    assert "no machine" in response.content.decode()
    assert Machine.objects.get(machine_id="m-bob").revoked_at is None
    assert MachineToken.objects.get(pk=token.token.pk).revoked_at is None


def test_the_revoke_form_only_accepts_post(browser, owner):
    machine(owner, "m-laptop")
    assert browser.get("/machines/m-laptop/revoke").status_code == 405
    assert Machine.objects.get(machine_id="m-laptop").revoked_at is None


def test_the_default_form_sets_the_default_machine(browser, owner):
    machine(owner, "m-laptop")
    machine(owner, "m-nas")
    response = browser.post("/machines/default", {"machine_id": "m-nas"}, follow=True)
    assert response.redirect_chain[-1][0] == "/machines/"
    assert DefaultMachine.objects.get(user=owner).machine_id == "m-nas"
    page = response.content.decode()
    row = page[page.index('data-machine="m-nas"') :]
    row = row[: row.index("</tr>")]
    assert '<span class="badge">default</span>' in row


def test_the_default_form_refuses_another_users_machine(browser, owner, member):
    machine(member, "m-bob")
    response = browser.post("/machines/default", {"machine_id": "m-bob"}, follow=True)
    assert "no machine" in response.content.decode()
    assert not DefaultMachine.objects.filter(user=owner).exists()


def test_the_fragment_answers_204_when_nothing_changed(browser, owner):
    machine(owner, "m1")
    first = browser.get("/machines/fragment")
    version = first.context["version"]
    assert browser.get("/machines/fragment", {"version": version}).status_code == 204
    Machine.objects.filter(machine_id="m1").update(connection_status=Machine.Connection.DISCONNECTED)
    changed = browser.get("/machines/fragment", {"version": version})
    assert changed.status_code == 200
    assert "disconnected" in changed.content.decode()


def test_the_capabilities_form_narrows_the_grant_at_once(browser, owner):
    from core.services import server_process_ensure
    from machines.models import MachineConnection

    shim = machine(owner, "m1")
    MachineConnection.objects.create(
        machine=shim,
        user=owner,
        connection_id="conn_1",
        channel_name="chan-1",
        server_process_id=server_process_ensure(),
        sessions=["*"],
        granted_capabilities=["files", "shell"],
        protocol_version="2.0",
    )
    response = browser.post("/machines/m1/capabilities", {"capability": ["files"]})
    assert response.status_code == 302
    shim.refresh_from_db()
    assert (shim.allowed_capabilities, shim.granted_capabilities) == (["files"], ["files"])
    assert MachineConnection.objects.get(connection_id="conn_1").granted_capabilities == ["files"]


def test_the_capabilities_form_refuses_another_users_machine_and_unknown_capabilities(browser, owner, member):
    machine(member, "theirs")
    machine(owner, "mine")
    browser.post("/machines/theirs/capabilities", {"capability": ["files"]})
    assert Machine.objects.get(machine_id="theirs").allowed_capabilities == ["files", "shell"]
    response = browser.post("/machines/mine/capabilities", {"capability": ["files", "root"]}, follow=True)
    assert "unknown capability" in response.content.decode()
    assert Machine.objects.get(machine_id="mine").allowed_capabilities == ["files", "shell"]


# --- connecting a machine, shim versions, names in the audit ---------------------------


def wheel(folder: Any, version: str, project: str = "dispatch_shim") -> str:
    """Put a (fake) wheel in the dist folder; return its file name."""
    name = f"{project}-{version}-py3-none-any.whl"
    (folder / name).write_bytes(b"PK fake wheel " + version.encode())
    return name


@pytest.fixture
def dist(settings: Any, tmp_path: Any) -> Any:
    folder = tmp_path / "dist"
    folder.mkdir()
    settings.DIST_DIR = folder
    settings.PUBLIC_URL = "https://dispatch.example.org"
    return folder


def row_of(page: str, machine_id: str) -> str:
    row = page[page.index(f'data-machine="{machine_id}"') :]
    return row[: row.index("</tr>")]


def test_the_connect_panel_shows_this_instances_commands_for_the_newest_wheel(browser, dist):
    wheel(dist, "0.9.0")
    wheel(dist, "0.10.0")  # newer than 0.9.0, though it sorts before it as text
    wheel(dist, "1.0.0", project="dispatch_remote")
    (dist / "dispatch_shim-0.10.0.tar.gz").write_bytes(b"an sdist")
    page = browser.get("/machines/").content.decode()
    panel = page[page.index('id="connect-machine"') :]
    commands = [
        "pipx install https://dispatch.example.org/downloads/dispatch_shim-0.10.0-py3-none-any.whl",
        "dispatch-shim login --server https://dispatch.example.org",
        "dispatch-shim run --root ~/src",
        "dispatch-shim service install --root ~/src",
    ]
    for element, command in zip(("install", "login", "run", "service"), commands, strict=True):
        assert f'<code id="{element}-command" class="command">{command}</code>' in panel
        assert f'data-copy="#{element}-command"' in panel
    assert "make dist" not in panel


def test_without_a_shim_wheel_the_panel_says_to_run_make_dist_first(browser, dist):
    wheel(dist, "1.0.0", project="dispatch_remote")
    page = browser.get("/machines/").content.decode()
    assert 'id="no-shim-wheel"' in page and "<code>make dist</code>" in page
    assert "pipx install" not in page
    assert "dispatch-shim login --server https://dispatch.example.org" in page


def test_the_list_shows_each_shims_version_and_flags_the_older_ones(browser, owner, dist):
    wheel(dist, "0.9.0")
    wheel(dist, "0.10.0")
    machine(owner, "m-old", shim_version="0.9.1")
    machine(owner, "m-current", shim_version="0.10.0")
    machine(owner, "m-newer", shim_version="0.11.0.dev1")
    machine(owner, "m-unknown", shim_version="")
    machine(owner, "m-odd", shim_version="not a version")
    for path in ("/machines/", "/machines/fragment"):
        page = browser.get(path).content.decode()
        assert '<span class="version">0.9.1</span>' in row_of(page, "m-old")
        assert "older than 0.10.0" in row_of(page, "m-old")
        assert '<span class="version">0.10.0</span>' in row_of(page, "m-current")
        assert '<span class="version">—</span>' in row_of(page, "m-unknown")
        for current in ("m-current", "m-newer", "m-unknown", "m-odd"):
            assert "older than" not in row_of(page, current), current


def test_no_shim_is_flagged_when_no_wheel_is_served(browser, owner, dist):
    machine(owner, "m-old", shim_version="0.0.1")
    page = browser.get("/machines/").content.decode()
    assert '<span class="version">0.0.1</span>' in row_of(page, "m-old")
    assert "older than" not in page


def test_the_fragment_changes_when_a_newer_wheel_is_served(browser, owner, dist):
    machine(owner, "m1", shim_version="0.1.0")
    version = browser.get("/machines/fragment").context["version"]
    assert browser.get("/machines/fragment", {"version": version}).status_code == 204
    wheel(dist, "0.2.0")
    changed = browser.get("/machines/fragment", {"version": version})
    assert changed.status_code == 200
    assert "older than 0.2.0" in changed.content.decode()


def test_recent_operations_name_the_machine(browser, owner, member):
    from django.utils import timezone

    machine(owner, "66ccea40-1111-4000-8000-000000000001", display_name="Work laptop")
    machine(owner, "66ccea40-2222-4000-8000-000000000002", hostname="nas")
    machine(owner, "66ccea40-3333-4000-8000-000000000003", hostname="old-box", revoked_at=timezone.now())
    machine(member, "66ccea40-4444-4000-8000-000000000004", hostname="bobs-secret-box")
    for index, machine_id in enumerate(
        [
            "66ccea40-1111-4000-8000-000000000001",
            "66ccea40-2222-4000-8000-000000000002",
            "66ccea40-3333-4000-8000-000000000003",
            "66ccea40-4444-4000-8000-000000000004",  # another user's id: not named
            "",  # refused before a machine was chosen
        ]
    ):
        AuditRecord.objects.create(
            user=owner,
            session_id="s1",
            machine_id=machine_id,
            request_id=f"r{index}",
            op="FILE_STAT",
            details={"path": f"/p{index}"},
            result={"ok": True, "duration_ms": 1},
            caller="api",
        )
    page = browser.get("/machines/").content.decode()
    audit = page[page.index("Recent operations") :]
    rows = audit.split("<tr>")[2:]  # after the header row
    assert len(rows) == 5
    by_path = {
        re.search(r"path=(/p\d)", row)[1]: row.split('<td class="audit-machine">')[1].split("</td>")[0] for row in rows
    }
    assert by_path["/p0"] == '<span title="66ccea40-1111-4000-8000-000000000001">Work laptop</span>'
    assert by_path["/p1"] == '<span title="66ccea40-2222-4000-8000-000000000002">nas</span>'
    assert by_path["/p2"] == '<span title="66ccea40-3333-4000-8000-000000000003">old-box</span>'
    assert "bobs-secret-box" not in page
    assert by_path["/p3"].startswith("<code") and "66ccea40" in by_path["/p3"]
    assert by_path["/p4"] == "—"
