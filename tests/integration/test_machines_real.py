"""Machines for real: ``manage.py serve`` (SQLite, in-memory channel layer) and real shim
subprocesses (``python -m machines.shim run``), driven through the REST API.

docs/shim-protocol.md: device login and revocation, the handshake (N = 1 / N = 2, takeover,
disconnect mid-operation), the path jail, routing and the cross-machine copy. Each shim has
its own ``--state-dir`` (so its own ``machine_id``) and ``--root`` under ``tmp_path``, and
attaches to the test's own session only (``--session``), so tests cannot see each other's
machines. Both shims of a test run on this computer, so they share its host name: they are
told apart by ``--name`` (display name) and ``machine_id``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import socket
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.infra import Instance, Server, ShimProcess, instance, wait_until
from tests.live_clients import InFlight, MachineApi, api_error, kill_quietly, wait_for_child

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MiB = 1024 * 1024
HOSTNAME = socket.gethostname()


@dataclass
class Live:
    instance: Instance
    server: Server
    api: MachineApi  # as ``admin``


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    with instance() as inst:
        server = inst.serve()
        api = MachineApi(server.url, inst.token("admin"))
        try:
            yield Live(instance=inst, server=server, api=api)
        finally:
            api.client.close()


@dataclass
class Rig:
    """One test's session and the shims it started (all stopped after the test)."""

    live: Live
    session: str
    tmp_path: Path
    shims: list[ShimProcess] = field(default_factory=list)

    @property
    def api(self) -> MachineApi:
        return self.live.api

    def root(self, name: str) -> Path:
        root = self.tmp_path / f"root-{name}"
        root.mkdir(exist_ok=True)
        return root

    def shim(
        self,
        name: str,
        *flags: str,
        state_dir: Path | None = None,
        session: str | None = None,
        wait: bool = True,
    ) -> ShimProcess:
        """A shim named ``name`` serving ``root-<name>``, attached to the test's session."""
        shim = self.live.instance.shim(
            name,
            self.root(name),
            "--session",
            session or self.session,
            *flags,
            state_dir=state_dir or self.tmp_path / f"state-{name}",
            wait=wait,
        )
        self.shims.append(shim)
        return shim


@pytest.fixture
def rig(live: Live, tmp_path: Path) -> Iterator[Rig]:
    rig = Rig(live=live, session=f"it-{uuid.uuid4().hex[:10]}", tmp_path=tmp_path)
    try:
        yield rig
    finally:
        for shim in rig.shims:
            shim.terminate()
        for shim in rig.shims:
            shim.stop()
        assert live.server.running, live.server.log()
        live.api.set_default(None)
        wait_until(
            lambda: all(m["status"]["connection"] != "connected" for m in live.api.my_machines().values()),
            timeout=10,
            what="the test's machines to disconnect",
        )


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


# --- N = 1, N = 2 -------------------------------------------------------------------------


def test_a_single_machine_runs_every_operation_without_being_named(live: Live, tmp_path: Path) -> None:
    """N = 1: a shim attached to every session (the default ``"*"``) serves ``demo``."""
    root = tmp_path / "root"
    root.mkdir()
    shim = live.instance.shim("solo", root, state_dir=tmp_path / "state")
    try:
        answer = live.api.run("demo", ["uname", "-a"])
        assert answer["machine_id"] == shim.machine_id
        assert answer["payload"]["stdout"].startswith("Linux ")
        assert HOSTNAME in answer["payload"]["stdout"]

        listed = live.api.machines("demo")
        assert list(listed) == [shim.machine_id]
        entry = listed[shim.machine_id]
        assert entry["display_name"] == "solo"
        assert entry["status"]["connection"] == "connected"
        assert entry["is_default"] is False
        assert "last_active_at" in entry and "last_active_ts" not in entry
        assert "MACHINE_LIST_REQUEST" not in shim.audited_ops()  # nothing to tell apart at N = 1
        assert "EXECUTE_COMMAND" in shim.audited_ops()
    finally:
        shim.stop()
    wait_until(lambda: live.api.machines("demo") == {}, timeout=10, what="the shim to detach")


def answered_machine_list(shim: ShimProcess) -> bool:
    return any(r["op"] == "MACHINE_LIST_REQUEST" and r["result"]["ok"] for r in shim.audit())


def test_a_second_machine_makes_the_platform_ask_both_for_their_snapshots(rig: Rig, live: Live) -> None:
    alpha = rig.shim("alpha")
    assert rig.api.run(rig.session, ["true"])["machine_id"] == alpha.machine_id
    beta = rig.shim("beta", "--no-shell")

    # MACHINE_LIST_REQUEST went to both shims (each audits it) and both answered.
    for shim in (alpha, beta):
        wait_until(
            lambda shim=shim: answered_machine_list(shim),  # type: ignore[misc]
            timeout=10,
            what=f"{shim.name} to answer MACHINE_LIST_REQUEST",
        )
    assert alpha.connections() == 1  # the first shim noticed nothing but the request

    cached = json.loads(
        live.instance.manage(
            "shell",
            "-c",
            "import json; from machines.models import Machine; "
            f"print(json.dumps({{m.machine_id: m.snapshot for m in Machine.objects.filter("
            f"machine_id__in=[{alpha.machine_id!r}, {beta.machine_id!r}])}}))",
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    assert cached[alpha.machine_id]["display_name"] == "alpha"
    assert cached[beta.machine_id]["capabilities"] == ["files"]

    listed = rig.api.machines(rig.session)
    assert set(listed) == {alpha.machine_id, beta.machine_id}
    for shim, capabilities in ((alpha, ["files", "shell"]), (beta, ["files"])):
        entry = listed[shim.machine_id]
        assert entry["display_name"] == shim.name
        assert entry["hostname"] == HOSTNAME
        assert entry["platform"] == "linux"
        assert entry["capabilities"] == capabilities
        assert entry["status"] == {"connection": "connected", "health": "ok", "reason": "connected"}
        assert entry["is_default"] is False
    wait_until(
        lambda: rig.api.machines(rig.session)[alpha.machine_id]["last_active_at"] is not None,
        timeout=5,
        what="alpha's last activity to be recorded",
    )


def test_later_machines_do_not_make_the_platform_ask_the_first_one_again(rig: Rig) -> None:
    first = rig.shim("first")
    later = [rig.shim(name) for name in ("second", "third", "fourth")]
    for shim in later:
        wait_until(lambda shim=shim: answered_machine_list(shim), timeout=10, what=f"{shim.name}'s snapshot")  # type: ignore[misc]
    time.sleep(0.5)  # let any request still in flight arrive
    assert first.audited_ops().count("MACHINE_LIST_REQUEST") == 1


# --- explicit targets -------------------------------------------------------------------------


def test_an_explicit_target_is_found_by_id_display_name_or_unique_prefix(rig: Rig) -> None:
    alpha, beta = rig.shim("alpha"), rig.shim("beta")
    for shim in (alpha, beta):
        names = [shim.machine_id, shim.name, str(shim.name).upper(), str(shim.name)[:2], shim.machine_id[:8]]
        for target in names:
            answer = rig.api.run(rig.session, ["pwd"], target=target)
            assert answer["machine_id"] == shim.machine_id, target
            assert answer["payload"]["stdout"].strip() == os.path.realpath(rig.root(str(shim.name)))


def test_a_target_matching_several_machines_is_refused_with_the_candidates(rig: Rig) -> None:
    first, second = rig.shim("build-1"), rig.shim("build-2")
    ids = {first.machine_id, second.machine_id}
    for target in ("build", HOSTNAME):  # a shared display-name prefix; the shared host name
        response = rig.api.op(rig.session, "EXECUTE_COMMAND", {"argv": ["true"]}, target=target)
        assert response.status_code == 409
        error = api_error(response)
        assert error["code"] == "MACHINE_AMBIGUOUS"
        assert {c["machine_id"] for c in error["details"]["candidates"]} == ids
        assert "build-1" in error["message"] and "build-2" in error["message"]
    assert "EXECUTE_COMMAND" not in first.audited_ops() + second.audited_ops()


def test_a_target_that_is_not_attached_is_refused_never_replaced(rig: Rig) -> None:
    alpha = rig.shim("alpha")
    elsewhere = rig.shim("elsewhere", session=f"{rig.session}-other")
    for target in ("nope", elsewhere.machine_id, "elsewhere"):
        response = rig.api.op(rig.session, "EXECUTE_COMMAND", {"argv": ["true"]}, target=target)
        assert response.status_code == 404, target
        error = api_error(response)
        assert error["code"] == "MACHINE_NOT_ATTACHED"
        assert [m["machine_id"] for m in error["details"]["attached"]] == [alpha.machine_id]
    assert "EXECUTE_COMMAND" not in alpha.audited_ops() + elsewhere.audited_ops()


# --- the router's choice without a target ---------------------------------------------------


def test_a_machine_without_the_shell_capability_never_gets_a_command(rig: Rig) -> None:
    shell, files_only = rig.shim("shell"), rig.shim("files-only", "--no-shell")
    served = Counter(rig.api.run(rig.session, ["true"])["machine_id"] for _ in range(6))
    assert served == {shell.machine_id: 6}

    response = rig.api.op(rig.session, "EXECUTE_COMMAND", {"argv": ["true"]}, target="files-only")
    assert response.status_code == 403
    assert api_error(response)["code"] == "CAPABILITY_NOT_GRANTED"
    assert "EXECUTE_COMMAND" not in files_only.audited_ops()

    # Its files are still reachable.
    (rig.root("files-only") / "note.txt").write_text("hi")
    stat = rig.api.ok(rig.session, "FILE_STAT", {"path": str(rig.root("files-only") / "note.txt")}, "files-only")
    assert stat["machine_id"] == files_only.machine_id
    assert stat["payload"]["size_bytes"] == 2


def test_a_file_operation_goes_to_the_machine_whose_root_holds_the_path(rig: Rig) -> None:
    shims = {"left": rig.shim("left"), "right": rig.shim("right")}
    for index in range(3):
        for name, shim in shims.items():
            path = rig.root(name) / f"file-{index}.txt"
            written = rig.api.ok(rig.session, "FILE_WRITE", {"path": str(path), "content": f"{name} {index}"})
            assert written["machine_id"] == shim.machine_id
            assert path.read_text() == f"{name} {index}"
            read = rig.api.ok(rig.session, "FILE_READ", {"path": str(path)})
            assert (read["machine_id"], read["payload"]["content"]) == (shim.machine_id, f"{name} {index}")


def test_untargeted_operations_go_to_the_default_machine(rig: Rig) -> None:
    alpha, beta = rig.shim("alpha"), rig.shim("beta")
    response = rig.api.set_default(beta.machine_id)
    assert response.status_code == 200
    assert response.json() == {"machine_id": beta.machine_id}
    listed = rig.api.machines(rig.session)
    assert (listed[alpha.machine_id]["is_default"], listed[beta.machine_id]["is_default"]) == (False, True)

    served = Counter(rig.api.run(rig.session, ["true"])["machine_id"] for _ in range(4))
    assert served == {beta.machine_id: 4}

    assert rig.api.set_default(None).json() == {"machine_id": None}
    served = Counter(rig.api.run(rig.session, ["true"])["machine_id"] for _ in range(4))
    assert served == {alpha.machine_id: 2, beta.machine_id: 2}


def test_untargeted_operations_take_turns_without_a_default(rig: Rig) -> None:
    shims = {shim.machine_id: shim for shim in (rig.shim("alpha"), rig.shim("beta"))}
    served = []
    for _ in range(6):
        answer = rig.api.run(rig.session, ["pwd"])  # no path: neither root is "closer"
        shim = shims[answer["machine_id"]]
        assert answer["payload"]["stdout"].strip() == os.path.realpath(rig.root(str(shim.name)))
        served.append(shim.name)
    assert Counter(served) == {"alpha": 3, "beta": 3}
    assert all(one != two for one, two in itertools.pairwise(served)), served


# --- failures and takeover ------------------------------------------------------------------


def test_a_machine_killed_mid_command_fails_the_operation_at_once(rig: Rig) -> None:
    shim = rig.shim("doomed")
    pending = InFlight(rig.api, rig.session, "EXECUTE_COMMAND", {"argv": ["sleep", "30"], "timeout_seconds": 60})
    sleeper = wait_for_child(shim.pid, "sleep")
    try:
        killed_at = time.monotonic()
        shim.kill()
        response = pending.result(timeout=10)
        assert pending.answered_at - killed_at < 2.0
        assert response.status_code == 502
        assert api_error(response)["code"] == "MACHINE_UNREACHABLE"
    finally:
        kill_quietly(sleeper)
    wait_until(
        lambda: rig.api.my_machines()[shim.machine_id]["status"]["connection"] == "disconnected",
        timeout=5,
        what="the machine to show disconnected",
    )
    response = rig.api.op(rig.session, "EXECUTE_COMMAND", {"argv": ["true"]})
    assert response.status_code == 404
    assert api_error(response)["code"] == "MACHINE_NOT_ATTACHED"


def test_the_same_machine_reconnecting_takes_over_and_the_old_shim_stops(rig: Rig) -> None:
    state_dir = rig.tmp_path / "state-laptop"
    old = rig.shim("laptop", state_dir=state_dir)
    assert rig.api.run(rig.session, ["sh", "-c", "echo $PPID"])["payload"]["stdout"].strip() == str(old.pid)
    pending = InFlight(rig.api, rig.session, "EXECUTE_COMMAND", {"argv": ["sleep", "30"], "timeout_seconds": 60})
    sleeper = wait_for_child(old.pid, "sleep")

    new = rig.shim("laptop", state_dir=state_dir)
    try:
        assert new.machine_id == old.machine_id
        response = pending.result(timeout=10)
        assert response.status_code == 502
        assert api_error(response)["code"] == "MACHINE_UNREACHABLE"
        assert old.proc.wait(10) == 1
        assert "4427" in old.log() and "reconnected" in old.log()
        assert old.connections() == 1  # it did not come back
    finally:
        kill_quietly(sleeper)

    answer = rig.api.run(rig.session, ["sh", "-c", "echo $PPID"])
    assert answer["machine_id"] == new.machine_id
    assert answer["payload"]["stdout"].strip() == str(new.pid)
    assert list(rig.api.machines(rig.session)) == [new.machine_id]
    assert new.running and new.connections() == 1


# --- cross-machine copy -------------------------------------------------------------------


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(MiB), b""):
            digest.update(block)
    return digest.hexdigest()


def partial_files(*roots: Path) -> list[Path]:
    return [path for root in roots for path in root.rglob("*.dispatch-partial")]


def test_a_50_mib_file_is_copied_between_machines_in_constant_memory(rig: Rig, live: Live) -> None:
    rig.shim("source"), rig.shim("sink")
    source = rig.root("source") / "data.bin"
    with source.open("wb") as stream:
        for _ in range(50):
            stream.write(os.urandom(MiB))
    destination = rig.root("sink") / "incoming" / "data.bin"

    rss_before = rss_bytes(live.server.pid)
    response = rig.api.copy(
        rig.session,
        source_machine="source",
        source_path=str(source),
        destination_machine="sink",
        destination_path=str(destination),
        overwrite=False,
    )
    rss_after = rss_bytes(live.server.pid)

    assert response.status_code == 200, response.text
    expected = sha256_of(source)
    assert response.json() == {"size_bytes": 50 * MiB, "sha256": expected}
    assert destination.stat().st_size == 50 * MiB
    assert sha256_of(destination) == expected
    assert partial_files(rig.root("source"), rig.root("sink")) == []
    growth = rss_after - rss_before
    assert growth < 32 * MiB, f"the server's RSS grew by {growth / MiB:.1f} MiB copying 50 MiB"


def test_a_failed_copy_says_why_and_leaves_no_partial_file(rig: Rig) -> None:
    rig.shim("source"), rig.shim("sink")
    source = rig.root("source") / "data.bin"
    source.write_bytes(os.urandom(3 * MiB + 5))
    taken = rig.root("sink") / "taken.bin"
    taken.write_bytes(b"keep me")

    def copy(source_path: Path, destination: Path, **extra: Any) -> httpx.Response:
        return rig.api.copy(
            rig.session,
            source_machine="source",
            source_path=str(source_path),
            destination_machine="sink",
            destination_path=str(destination),
            **extra,
        )

    exists = copy(source, taken)
    assert (exists.status_code, api_error(exists)["code"]) == (400, "PATH_EXISTS")
    assert taken.read_bytes() == b"keep me"

    missing = copy(rig.root("source") / "missing.bin", rig.root("sink") / "new.bin")
    assert (missing.status_code, api_error(missing)["code"]) == (404, "PATH_NOT_FOUND")
    assert not (rig.root("sink") / "new.bin").exists()

    outside = copy(source, rig.tmp_path / "escaped.bin")
    assert (outside.status_code, api_error(outside)["code"]) == (400, "PATH_OUTSIDE_ALLOWED_ROOT")
    assert not (rig.tmp_path / "escaped.bin").exists()

    assert partial_files(rig.tmp_path) == []

    replaced = copy(source, taken, overwrite=True)
    assert replaced.status_code == 200, replaced.text
    assert taken.read_bytes() == source.read_bytes()
    assert partial_files(rig.tmp_path) == []


# --- the path jail ------------------------------------------------------------------------------


def test_the_path_jail_holds_through_the_platform(rig: Rig) -> None:
    rig.shim("jailed")
    root = rig.root("jailed")
    secret = rig.tmp_path / "secret.txt"
    secret.write_text("not yours")
    (root / "link").symlink_to(secret)
    attempts: list[tuple[str, dict[str, Any]]] = [
        ("FILE_READ", {"path": f"{root}/../secret.txt"}),
        ("FILE_READ", {"path": str(root / "link")}),
        ("FILE_WRITE", {"path": f"{root}/../planted.txt", "content": "x"}),
        ("FILE_LIST", {"path": f"{root}/.."}),
        ("FILE_DELETE", {"path": f"{root}/../secret.txt"}),
        ("EXECUTE_COMMAND", {"argv": ["cat", "secret.txt"], "cwd": f"{root}/.."}),
    ]
    for op, payload in attempts:
        response = rig.api.op(rig.session, op, payload, target="jailed")
        assert response.status_code == 400, (op, response.text)
        assert api_error(response)["code"] == "PATH_OUTSIDE_ALLOWED_ROOT", op
    assert secret.read_text() == "not yours"
    assert not (rig.tmp_path / "planted.txt").exists()


# --- device login and revocation ------------------------------------------------------------


def approve_device(server: Server, username: str, password: str, user_code: str) -> str:
    """Log in to the web UI as ``username`` and approve ``user_code`` on /machines/activate.

    Returns the host name the activation page showed.
    """
    with httpx.Client(base_url=server.url, timeout=10, follow_redirects=True) as browser:

        def csrf(page: httpx.Response) -> str:
            found = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
            assert found, page.text
            return found.group(1)

        login_page = browser.get("/login/")
        logged_in = browser.post(
            "/login/",
            data={
                "username": username,
                "password": password,
                "next": "/machines/",
                "csrfmiddlewaretoken": csrf(login_page),
            },
        )
        assert logged_in.status_code == 200 and str(logged_in.url).endswith("/machines/"), logged_in.text
        activate = browser.get("/machines/activate")
        found = browser.post(
            "/machines/activate", data={"user_code": user_code.lower(), "csrfmiddlewaretoken": csrf(activate)}
        )
        assert found.status_code == 200, found.text
        hostname = re.search(r'<dd id="request-hostname">([^<]+)</dd>', found.text)
        assert hostname, found.text
        approved = browser.post(
            "/machines/activate",
            data={"user_code": user_code, "decision": "approve", "csrfmiddlewaretoken": csrf(found)},
        )
        assert approved.status_code == 200 and "Approved." in approved.text, approved.text
        return hostname.group(1)


def test_a_machine_logs_in_with_the_device_flow_and_stops_when_revoked(live: Live, tmp_path: Path) -> None:
    username, password = f"dana{uuid.uuid4().hex[:6]}", "device-flow-pw-77"
    live.instance.create_user(username, password)
    state_dir = tmp_path / "state"

    login = live.instance.shim_login(live.server, state_dir=state_dir)
    code = login.user_code()
    assert re.fullmatch(r"[BCDFGHJKLMNPQRSTVWXZ]{4}-[BCDFGHJKLMNPQRSTVWXZ]{4}", code)
    assert approve_device(live.server, username, password, code) == HOSTNAME
    assert login.proc.wait(20) == 0, login.log()
    state = json.loads((state_dir / "state.json").read_text())
    assert state["server"] == live.server.url and state["token"]

    root = tmp_path / "root"
    root.mkdir()
    shim = live.instance.shim("dana-laptop", root, stored_login=True, state_dir=state_dir)
    assert shim.machine_id == state["machine_id"]
    dana = MachineApi(live.server.url, live.instance.token(username))
    try:
        answer = dana.run("work", ["pwd"])
        assert answer["machine_id"] == shim.machine_id
        assert dana.my_machines()[shim.machine_id]["status"]["connection"] == "connected"
        # A machine serves one user: admin's sessions do not have it.
        refused = live.api.op("work", "EXECUTE_COMMAND", {"argv": ["true"]}, target=shim.machine_id)
        assert (refused.status_code, api_error(refused)["code"]) == (404, "MACHINE_NOT_ATTACHED")

        revoked = dana.client.delete(f"/api/v1/machines/{shim.machine_id}")
        assert revoked.status_code == 200, revoked.text
        assert shim.proc.wait(10) == 1
        assert "4401" in shim.log()
        assert shim.connections() == 1  # no reconnect after 4401
        assert shim.machine_id not in dana.my_machines()
        gone = dana.op("work", "EXECUTE_COMMAND", {"argv": ["true"]})
        assert (gone.status_code, api_error(gone)["code"]) == (404, "MACHINE_NOT_ATTACHED")
    finally:
        shim.stop()
        dana.client.close()
