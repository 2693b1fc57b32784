"""What a new user meets first with ``dispatch-shim``: which roots it serves, help texts
that say only what the user can act on, and hints that name ``--state-dir``."""

from __future__ import annotations

import argparse
import asyncio
import os
import pwd
import socket
import sys
import tempfile
from pathlib import Path

import pytest

from machines.shim.cli import _parser, main
from tests.machines.shim.test_shim_cli import REPO


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def first_stderr_line(home: Path, *args: str) -> str:
    """The first line ``python -m machines.shim run …`` prints, with ``HOME=home``."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("DISPATCH_SHIM_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "machines.shim", "run", "--server", f"http://127.0.0.1:{unused_port()}",
        "--token", "t", "--state-dir", str(home / "state"), *args,
        cwd=REPO,
        env={**environment, "HOME": str(home), "DISPATCH_SHIM_BACKOFF_SCALE": "0.01"},
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stderr is not None
        return (await asyncio.wait_for(process.stderr.readline(), 20)).decode()
    finally:
        process.kill()
        await process.wait()


async def test_run_says_it_serves_the_whole_home_when_no_root_is_given(tmp_path: Path) -> None:
    line = await first_stderr_line(tmp_path)

    assert line == f"serving roots: {tmp_path.resolve()} (default: no --root given)\n"


async def test_run_names_the_roots_given(tmp_path: Path) -> None:
    root = tmp_path / "src"
    root.mkdir()

    line = await first_stderr_line(tmp_path, "--root", str(root))

    assert line == f"serving roots: {root.resolve()}\n"


def help_texts() -> dict[str, str]:
    """``--help`` of the command and of every subcommand, nested ones included."""
    texts: dict[str, str] = {}

    def collect(name: str, parser: argparse.ArgumentParser) -> None:
        texts[name] = parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child, subparser in action.choices.items():
                    collect(f"{name} {child}", subparser)

    collect("dispatch-shim", _parser())
    return texts


def test_the_help_is_plain_text_without_references_the_user_cannot_follow() -> None:
    texts = help_texts()

    assert {"dispatch-shim service install", "dispatch-shim service status"} <= set(texts)
    for name, text in texts.items():
        # A section sign or a path into a specification: references the user cannot follow.
        for marker in ("\N{SECTION SIGN}", "``", ":mod:", ":func:", ":data:", "spec" + "/", "`"):
            assert marker not in text, f"{name} --help shows {marker!r}"
    assert "docs/shim-protocol.md" in texts["dispatch-shim"]
    assert "whole home directory" in " ".join(texts["dispatch-shim run"].split())


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "home"
    directory.mkdir()
    monkeypatch.setenv("HOME", str(directory))
    for name in ("XDG_CONFIG_HOME", "DISPATCH_SHIM_STATE_DIR", "DISPATCH_SHIM_TOKEN", "SUDO_USER"):
        monkeypatch.delenv(name, raising=False)
    return directory


def logged_in(state_dir: Path) -> Path:
    state_dir.mkdir(parents=True, mode=0o700)
    (state_dir / "state.json").write_text('{"machine_id": "m-1", "server": "http://dispatch.test", "token": "s"}')
    (state_dir / "state.json").chmod(0o600)
    return state_dir


@pytest.mark.parametrize("action", ["status", "uninstall"])
def test_service_status_and_uninstall_accept_the_state_dir_install_takes(
    home: Path, action: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["service", action, "--manager", "systemd", "--state-dir", str(home / "elsewhere")])

    printed = capsys.readouterr()
    assert "unrecognized arguments" not in printed.err
    assert code == (1 if action == "status" else 0)  # nothing installed
    assert "not installed" in printed.out or "Nothing to uninstall" in printed.out


def test_install_without_a_login_hints_at_the_state_dir(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["service", "install", "--manager", "systemd", "--dry-run"]) == 2
    assert "if you logged in with --state-dir DIR, pass the same --state-dir" in capsys.readouterr().err

    state_dir = home / "other"
    assert main(["service", "install", "--manager", "systemd", "--dry-run", "--state-dir", str(state_dir)]) == 2
    assert f"login --server URL --state-dir {state_dir}" in capsys.readouterr().err


def test_run_without_a_server_hints_at_the_state_dir(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--token", "t", "--root", str(home)]) == 2
    assert "if you logged in with --state-dir DIR, pass the same --state-dir" in capsys.readouterr().err


def test_install_warns_that_no_root_means_the_whole_home(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state_dir = logged_in(home / "state")
    base = ["service", "install", "--manager", "systemd", "--dry-run", "--state-dir", str(state_dir)]

    assert main(base) == 0
    assert f"warning: no --root given: the service will allow file operations anywhere under {home}" in (
        capsys.readouterr().err
    )

    assert main([*base, "--root", str(home)]) == 0
    assert "no --root given" not in capsys.readouterr().err


def test_a_system_service_warns_when_its_account_cannot_read_the_state_dir(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state_dir = logged_in(home / "state")
    home.chmod(0o700)
    base = ["service", "install", "--manager", "systemd", "--system", "--dry-run", "--state-dir", str(state_dir)]

    assert main([*base, "--run-as", "nobody", "--root", str(home)]) == 0
    assert f"warning: nobody cannot read {state_dir / 'state.json'}" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() != 0, reason="giving the state directory to another account needs root")
def test_a_system_service_does_not_warn_when_its_account_owns_the_state_dir(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nobody = pwd.getpwnam("nobody")
    with tempfile.TemporaryDirectory() as shared:  # pytest's own tmp folders are 0700
        Path(shared).chmod(0o755)
        state_dir = logged_in(Path(shared) / "state")  # state.json is kept 0600: only its owner reads it
        for owned in (state_dir, state_dir / "state.json"):
            os.chown(owned, nobody.pw_uid, nobody.pw_gid)

        code = main(["service", "install", "--manager", "systemd", "--system", "--dry-run",
                     "--state-dir", str(state_dir), "--run-as", "nobody", "--root", str(home)])  # fmt: skip

    assert code == 0
    assert "cannot read" not in capsys.readouterr().err


def test_a_user_unit_for_root_warns_that_it_is_not_a_system_service(
    home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    state_dir = logged_in(home / "state")
    monkeypatch.setattr(os, "geteuid", lambda: 0)

    code = main(["service", "install", "--manager", "systemd", "--dry-run", "--state-dir", str(state_dir),
                 "--root", str(home)])  # fmt: skip

    assert code == 0
    error = capsys.readouterr().err
    assert "warning: running as root without --system: this installs a user unit for root" in error
    assert str(home / ".config" / "systemd" / "user" / "dispatch-shim.service") in error
