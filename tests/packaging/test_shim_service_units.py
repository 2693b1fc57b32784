"""The units ``dispatch-shim service install --dry-run`` prints, from the installed shim.

The systemd unit is checked by ``systemd-analyze --user verify`` (its syntax, its
settings, and that ``ExecStart`` is an executable), the launchd plist with ``plistlib``.
Enabling and starting them is not tested: PID 1 on this machine (and CI's) is not
systemd and there is no launchd; tests/machines/shim/test_shim_service.py covers the
``systemctl``/``loginctl``/``launchctl`` steps with those commands replaced.
"""

from __future__ import annotations

import json
import plistlib
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.backends import unavailable
from tests.packaging.conftest import Venv, client_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def dry_run(shim_venv: Venv, outside: Path, tmp_path: Path, *options: str) -> str:
    """The unit ``service install --dry-run`` prints for a shim serving ``<tmp>/my src``.

    A user service is given ``--token`` (which a dry run must not store); a ``--system``
    one uses the stored login of its state directory, as it would for real.
    """
    root = tmp_path / "my src"  # a space, to be quoted
    root.mkdir(exist_ok=True)
    state_dir = tmp_path / "state"
    login: list[str | Path] = ["--token", "not-in-the-unit"]
    if "--system" in options:
        state_dir.mkdir(mode=0o700)
        (state_dir / "state.json").write_text(json.dumps({"server": "http://127.0.0.1:8000", "token": "stored"}))
        login = []
    done = shim_venv.run(
        shim_venv.bin("dispatch-shim"), "service", "install", "--dry-run",
        "--server", "http://127.0.0.1:8000", *login, "--state-dir", state_dir,
        "--root", root, "--name", "build box", "--session", "demo", *options,
        cwd=outside,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "not-in-the-unit" not in done.stdout and "stored" not in done.stdout
    assert "--system" in options or not state_dir.exists()  # a dry run stores nothing
    return done.stdout


@pytest.mark.parametrize("system", [False, True], ids=["user", "system"])
def test_the_systemd_unit_is_one_systemd_accepts(shim_venv: Venv, outside: Path, tmp_path: Path, system: bool) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        unavailable("systemd-analyze is not installed (Debian: apt-get install systemd)")
    options = ["--manager", "systemd", *(["--system", "--run-as", "root"] if system else [])]
    unit = dry_run(shim_venv, outside, tmp_path, *options)
    unit_file = tmp_path / "units" / "dispatch-shim.service"
    unit_file.parent.mkdir()
    unit_file.write_text(unit)
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)

    verified = subprocess.run(
        [analyze, *([] if system else ["--user"]), "verify", str(unit_file)],
        env=client_env(XDG_RUNTIME_DIR=str(runtime)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert verified.returncode == 0, verified.stderr
    assert "dispatch-shim.service" not in verified.stdout + verified.stderr  # no warning about it either
    [exec_start] = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    assert exec_start.startswith(f"ExecStart={shim_venv.bin('dispatch-shim')} run --state-dir ")
    assert f'--root "{tmp_path / "my src"}"' in exec_start and '--name "build box"' in exec_start
    assert "Restart=on-failure" in unit.splitlines()
    assert ("User=root" in unit.splitlines()) is system


def test_the_launchd_plist_runs_the_installed_shim_at_load_and_keeps_it_alive(
    shim_venv: Venv, outside: Path, tmp_path: Path
) -> None:
    job = plistlib.loads(dry_run(shim_venv, outside, tmp_path, "--manager", "launchd").encode())

    assert job["Label"] == "dev.dispatch.shim"
    assert job["ProgramArguments"][:4] == [
        str(shim_venv.bin("dispatch-shim")),
        "run",
        "--state-dir",
        str(tmp_path / "state"),
    ]
    assert job["ProgramArguments"][4:] == [
        "--server", "http://127.0.0.1:8000", "--root", str(tmp_path / "my src"),
        "--session", "demo", "--name", "build box",
    ]  # fmt: skip
    assert job["RunAtLoad"] is True
    assert job["KeepAlive"] == {"SuccessfulExit": False}
