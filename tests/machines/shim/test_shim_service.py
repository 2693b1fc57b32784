"""``dispatch-shim service install|uninstall|status`` (machines/shim/service.py): the unit
or plist it writes in a temporary HOME, and the service-manager commands it runs.

``systemctl``, ``loginctl`` and ``launchctl`` are replaced by :class:`FakeManager` here
(and only here): this machine's PID 1 is not systemd, and it has no launchd. The unit's
syntax is checked by ``systemd-analyze verify`` in tests/packaging.
"""

from __future__ import annotations

import json
import os
import plistlib
import pwd
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from machines.shim import service as service_module
from machines.shim.cli import main

REPO = Path(__file__).resolve().parents[3]


class FakeManager:
    """Answers the service-manager commands and records them.

    ``failing`` maps a command prefix (``"systemctl --user"``, ``"loginctl enable-linger"``)
    to the stderr it fails with; ``lingering`` is what ``loginctl show-user`` reports and
    becomes ``yes`` on a successful ``enable-linger``.
    """

    def __init__(self, *, lingering: str = "no", failing: dict[str, str] | None = None) -> None:
        self.lingering = lingering
        self.failing = failing or {}
        self.commands: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        argv = list(argv)
        self.commands.append(argv)
        line = " ".join(argv)
        for prefix, stderr in self.failing.items():
            if line.startswith(prefix):
                return subprocess.CompletedProcess(argv, 1, "", stderr)
        if argv[:2] == ["loginctl", "show-user"]:
            return subprocess.CompletedProcess(argv, 0, f"{self.lingering}\n", "")
        if argv[:2] == ["loginctl", "enable-linger"]:
            self.lingering = "yes"
        if argv[-2:-1] == ["is-enabled"]:
            return subprocess.CompletedProcess(argv, 0, "enabled\n", "")
        if argv[-2:-1] == ["is-active"]:
            return subprocess.CompletedProcess(argv, 0, "active\n", "")
        return subprocess.CompletedProcess(argv, 0, "", "")

    def ran(self, *prefix: str) -> bool:
        return any(command[: len(prefix)] == list(prefix) for command in self.commands)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary HOME with nothing configured in the environment."""
    directory = tmp_path / "home"
    directory.mkdir()
    monkeypatch.setenv("HOME", str(directory))
    for name in ("XDG_CONFIG_HOME", "DISPATCH_SHIM_STATE_DIR", "DISPATCH_SHIM_TOKEN", "SUDO_USER"):
        monkeypatch.delenv(name, raising=False)
    return directory


@pytest.fixture
def state_dir(home: Path) -> Path:
    """The default state directory, with a stored login (as ``dispatch-shim login`` leaves it)."""
    directory = home / ".config" / "dispatch-shim"
    directory.mkdir(parents=True, mode=0o700)
    login = {"machine_id": "m-1", "server": "http://dispatch.test:8000", "token": "stored-secret"}
    (directory / "state.json").write_text(json.dumps(login))
    (directory / "state.json").chmod(0o600)
    return directory


@pytest.fixture
def manager(monkeypatch: pytest.MonkeyPatch) -> FakeManager:
    fake = FakeManager()
    monkeypatch.setattr(service_module, "run_manager_command", fake)
    return fake


def unit_path(home: Path) -> Path:
    return home / ".config" / "systemd" / "user" / "dispatch-shim.service"


def exec_start(unit: str) -> str:
    [line] = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    return line.removeprefix("ExecStart=")


def test_install_writes_a_user_unit_running_the_shim_with_the_given_options(
    home: Path, state_dir: Path, manager: FakeManager, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "src"
    root.mkdir()

    code = main(["service", "install", "--root", str(root), "--name", "laptop", "--session", "demo", "--no-shell"])

    unit = unit_path(home).read_text()
    assert code == 0, capsys.readouterr()
    assert exec_start(unit) == (
        f"{sys.executable} -m machines.shim run --state-dir {state_dir} --root {root} "
        "--session demo --name laptop --no-shell"
    )
    assert f"WorkingDirectory={REPO}" in unit.splitlines()  # a clone: `python -m machines.shim` runs from it
    for setting in ("Restart=on-failure", "RestartSec=10", "RestartPreventExitStatus=2", "WantedBy=default.target"):
        assert setting in unit.splitlines()
    assert "Description=Dispatch shim for http://dispatch.test:8000" in unit
    assert "User=" not in unit  # a user unit runs as its user
    assert "stored-secret" not in unit
    assert oct(unit_path(home).stat().st_mode & 0o777) == "0o644"
    assert manager.commands == [
        ["loginctl", "show-user", os_user(), "--property=Linger", "--value"],
        ["loginctl", "enable-linger", os_user()],
        ["loginctl", "show-user", os_user(), "--property=Linger", "--value"],
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", "dispatch-shim.service"],
        ["systemctl", "--user", "restart", "dispatch-shim.service"],
    ]
    out = capsys.readouterr().out
    assert f"Wrote {unit_path(home)}" in out
    assert "Enabled lingering" in out


def test_install_says_why_the_shim_will_not_start_at_boot_when_lingering_is_refused(
    home: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    refused = FakeManager(failing={"loginctl enable-linger": "Access denied"})
    monkeypatch.setattr(service_module, "run_manager_command", refused)

    code = main(["service", "install"])

    out = capsys.readouterr().out
    assert code == 1
    assert unit_path(home).exists()
    assert refused.ran("systemctl", "--user", "restart", "dispatch-shim.service")  # it runs now, all the same
    assert "Could not enable lingering" in out and "Access denied" in out
    assert "starts when" in out and "not at boot" in out
    assert f"sudo loginctl enable-linger {os_user()}" in out


def test_install_keeps_the_unit_and_says_what_to_run_when_no_user_manager_answers(
    home: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    no_bus = FakeManager(lingering="yes", failing={"systemctl --user": "Failed to connect to bus: No medium found"})
    monkeypatch.setattr(service_module, "run_manager_command", no_bus)

    code = main(["service", "install"])

    out = capsys.readouterr().out
    assert code == 1
    assert unit_path(home).exists()
    assert "Failed to connect to bus" in out
    assert "systemctl --user daemon-reload && systemctl --user enable --now dispatch-shim.service" in out


def test_uninstall_disables_and_removes_the_unit_and_status_reports_it(
    home: Path, state_dir: Path, manager: FakeManager, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["service", "install", "--name", "laptop"]) == 0
    capsys.readouterr()

    assert main(["service", "status"]) == 0
    status = capsys.readouterr().out
    assert f"file:     {unit_path(home)}\n" in status
    assert f"runs:     {sys.executable} -m machines.shim run --state-dir {state_dir} --name laptop" in status
    assert "enabled:  enabled" in status and "active:   active" in status and "linger:   yes" in status

    assert main(["service", "uninstall"]) == 0
    assert not unit_path(home).exists()
    assert manager.commands[-2:] == [
        ["systemctl", "--user", "disable", "--now", "dispatch-shim.service"],
        ["systemctl", "--user", "daemon-reload"],
    ]
    capsys.readouterr()

    assert main(["service", "status"]) == 1
    assert "(not installed)" in capsys.readouterr().out
    assert main(["service", "uninstall"]) == 0
    assert "Nothing to uninstall" in capsys.readouterr().out


@pytest.mark.parametrize("odd", ["\r[Service]\rExecStartPre=/bin/false", "two\nlines", "bell\x07"])
@pytest.mark.parametrize("manager", list(service_module.Manager))
def test_a_control_character_in_any_value_is_refused_not_written(
    tmp_path: Path, odd: str, manager: service_module.Manager
) -> None:
    for place in ("command", "description"):
        values: dict[str, object] = {"command": ("/bin/dispatch-shim", "run")}
        values[place] = ("/bin/dispatch-shim", "run", "--root", f"/srv/{odd}") if place == "command" else odd
        with pytest.raises(service_module.ServiceError, match="control character"):
            service_module.Service(
                name="dispatch-shim", manager=manager, system=False, account="me", uid=1000, home=tmp_path, **values
            )


def test_install_with_a_control_character_in_the_server_says_so_and_writes_nothing(
    home: Path, state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["service", "install", "--dry-run", "--server", "http://127.0.0.1:8000/\r[Service]"])

    assert code != 0
    assert "control character" in capsys.readouterr().err
    assert not (home / ".config" / "systemd").exists()


def test_dry_run_prints_the_unit_and_changes_nothing(
    home: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_commands(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        raise AssertionError(f"a dry run ran {argv}")

    monkeypatch.setattr(service_module, "run_manager_command", no_commands)
    before = (state_dir / "state.json").read_text()

    code = main(["service", "install", "--dry-run", "--token", "new-secret", "--server", "http://other.test"])

    printed = capsys.readouterr()
    assert code == 0
    assert exec_start(printed.out).endswith(f"run --state-dir {state_dir} --server http://other.test")
    assert "new-secret" not in printed.out
    assert f"without --dry-run this goes to {unit_path(home)}" in printed.err
    assert not (home / ".config" / "systemd").exists()
    assert (state_dir / "state.json").read_text() == before


def test_a_token_given_to_install_goes_to_the_state_file_not_the_unit(
    home: Path, manager: FakeManager, tmp_path: Path
) -> None:
    state_dir = tmp_path / "elsewhere"

    code = main(
        ["service", "install", "--server", "http://dispatch.test", "--token", "tok-1", "--state-dir", str(state_dir)]
    )

    assert code == 0
    stored = json.loads((state_dir / "state.json").read_text())
    assert (stored["server"], stored["token"]) == ("http://dispatch.test", "tok-1")
    assert stored["machine_id"]
    assert oct((state_dir / "state.json").stat().st_mode & 0o777) == "0o600"
    assert "tok-1" not in unit_path(home).read_text()


def test_install_refuses_without_a_login_since_the_service_could_only_fail(
    home: Path, manager: FakeManager, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["service", "install", "--server", "http://dispatch.test"])

    assert code == 2
    assert "no stored login" in capsys.readouterr().err
    assert not unit_path(home).exists()
    assert manager.commands == []


def test_install_checks_the_run_options_as_run_would(
    home: Path, state_dir: Path, manager: FakeManager, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["service", "install", "--root", str(tmp_path / "missing")]) == 2
    assert "not an existing directory" in capsys.readouterr().err
    assert main(["service", "install", "--session", "bad id"]) == 2
    assert "not a session id" in capsys.readouterr().err
    assert not unit_path(home).exists()


def test_install_honours_xdg_config_home(
    home: Path, state_dir: Path, manager: FakeManager, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))

    assert main(["service", "install", "--state-dir", str(state_dir)]) == 0

    assert (tmp_path / "xdg" / "systemd" / "user" / "dispatch-shim.service").exists()
    assert not unit_path(home).exists()


def test_a_system_unit_runs_as_the_named_user_after_the_network(
    home: Path, state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["service", "install", "--system", "--dry-run"]) == 2
    assert "--system needs --run-as USER" in capsys.readouterr().err

    code = main(["service", "install", "--system", "--run-as", os_user(), "--state-dir", str(state_dir), "--dry-run"])

    printed = capsys.readouterr()
    assert code == 0
    lines = printed.out.splitlines()
    assert f"User={os_user()}" in lines
    assert "After=network-online.target" in lines and "Wants=network-online.target" in lines
    assert "WantedBy=multi-user.target" in lines
    assert "/etc/systemd/system/dispatch-shim.service" in printed.err


def test_several_shims_get_several_units(home: Path, state_dir: Path, manager: FakeManager, tmp_path: Path) -> None:
    second = tmp_path / "second-state"
    second.mkdir()
    (second / "state.json").write_text(json.dumps({"server": "http://b.test", "token": "t2"}))

    assert main(["service", "install"]) == 0
    assert main(["service", "install", "--service-name", "dispatch-shim-b", "--state-dir", str(second)]) == 0

    other = unit_path(home).with_name("dispatch-shim-b.service")
    assert f"--state-dir {second}" in other.read_text()
    assert f"--state-dir {state_dir}" in unit_path(home).read_text()


def test_odd_characters_are_quoted_for_systemd(tmp_path: Path) -> None:
    service = service_module.Service(
        name="dispatch-shim",
        manager=service_module.Manager.SYSTEMD,
        system=False,
        account="me",
        uid=1000,
        home=tmp_path,
        command=("/opt/dispatch shim/bin/dispatch-shim", "run", "--root", '/srv/50% "$HOME"\\x', "--name", "plain"),
    )

    assert exec_start(service.render()) == (
        '"/opt/dispatch shim/bin/dispatch-shim" run --root "/srv/50%% \\"$$HOME\\"\\\\x" --name plain'
    )


def test_the_installed_command_is_the_dispatch_shim_script_that_runs(
    home: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "bin" / "dispatch-shim"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setattr(sys, "argv", [str(script), "service", "install", "--dry-run"])

    assert main() == 0

    unit = capsys.readouterr().out
    assert exec_start(unit) == f"{script} run --state-dir {state_dir}"
    assert "WorkingDirectory" not in unit


def test_a_launchd_agent_is_written_loaded_and_removed(
    home: Path, state_dir: Path, manager: FakeManager, capsys: pytest.CaptureFixture[str]
) -> None:
    plist_path = home / "Library" / "LaunchAgents" / "dev.dispatch.shim.plist"

    assert main(["service", "install", "--manager", "launchd", "--name", "laptop"]) == 0

    with plist_path.open("rb") as file:
        job = plistlib.load(file)
    assert job["Label"] == "dev.dispatch.shim"
    assert job["ProgramArguments"] == [
        sys.executable, "-m", "machines.shim", "run", "--state-dir", str(state_dir), "--name", "laptop",
    ]  # fmt: skip
    assert job["RunAtLoad"] is True
    assert job["KeepAlive"] == {"SuccessfulExit": False}  # started again when it fails
    assert job["StandardErrorPath"] == str(home / "Library" / "Logs" / "dispatch-shim.log")
    assert "UserName" not in job
    domain = f"gui/{os.getuid()}"
    assert ["launchctl", "bootstrap", domain, str(plist_path)] in manager.commands

    capsys.readouterr()
    assert main(["service", "status", "--manager", "launchd"]) == 0
    assert "launchd:  loaded" in capsys.readouterr().out

    assert main(["service", "uninstall", "--manager", "launchd"]) == 0
    assert ["launchctl", "bootout", f"{domain}/dev.dispatch.shim"] in manager.commands
    assert not plist_path.exists()


def test_a_launchd_daemon_names_its_user(home: Path, state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["service", "install", "--manager", "launchd", "--system", "--run-as", os_user(),
         "--state-dir", str(state_dir), "--dry-run"]
    )  # fmt: skip

    printed = capsys.readouterr()
    job = plistlib.loads(printed.out.encode())
    assert code == 0
    assert job["UserName"] == os_user()
    assert "/Library/LaunchDaemons/dev.dispatch.shim.plist" in printed.err


def os_user() -> str:
    return pwd.getpwuid(os.geteuid()).pw_name
