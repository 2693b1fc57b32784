"""The installable clients, ``dispatch-shim`` and ``dispatch-remote``, built by ``make dist``
and installed into fresh venvs without Django, against a real ``manage.py serve``.

Every client here runs from the venv it was installed into, from a folder outside the
clone, with an environment that names neither the clone nor the server's settings: what
works here works on another computer.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.infra import REPO, Instance, Process, Server, ShimProcess, instance, wait_until
from tests.integration.test_machines_real import approve_device
from tests.live_clients import MachineApi
from tests.packaging.conftest import SHIM_VERSION, Dist, Venv, client_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@dataclass
class Live:
    instance: Instance
    server: Server


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    with instance() as inst:
        yield Live(instance=inst, server=inst.serve())


def spawn(argv: list[str | Path], *, cwd: Path, name: str, live: Live, **env: str) -> Process:
    """Start a client in the background (output in a log file); ``live.instance.stop()``
    ends it with the server if the test does not."""
    log_path = cwd / f"{name}-{uuid.uuid4().hex[:6]}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [str(arg) for arg in argv], cwd=cwd, env=client_env(**env), stdout=log, stderr=subprocess.STDOUT, text=True
        )
    process = Process(proc=proc, log_path=log_path)
    live.instance.processes.append(process)
    return process


# --- what make dist builds ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("wheel", "package", "source"),
    [
        ("shim_wheel", "dispatch_shim", REPO / "machines" / "shim"),
        ("remote_wheel", "dispatch_remote", REPO / "remotes" / "client"),
    ],
    ids=["shim", "remote"],
)
def test_each_wheel_is_its_package_folder_of_the_repository_renamed(
    dist: Dist, wheel: str, package: str, source: Path
) -> None:
    with zipfile.ZipFile(getattr(dist, wheel)) as archive:
        shipped = {
            name.removeprefix(f"{package}/"): archive.read(name)
            for name in archive.namelist()
            if name.startswith(f"{package}/")
        }
        metadata = archive.read(f"{package}-{SHIM_VERSION}.dist-info/METADATA").decode()
        entry_points = archive.read(f"{package}-{SHIM_VERSION}.dist-info/entry_points.txt").decode()

    assert shipped == {path.name: path.read_bytes() for path in sorted(source.glob("*.py"))}
    assert f"Version: {SHIM_VERSION}" in metadata.splitlines()
    requirements = [
        line.split(":", 1)[1].strip().lower() for line in metadata.splitlines() if line.startswith("Requires-Dist:")
    ]
    assert requirements and not any(re.match(r"(django|channels|djangorestframework)\b", r) for r in requirements)
    command = package.replace("_", "-")
    assert f"{command} = {package}.cli:main" in entry_points


def test_each_sdist_holds_the_same_sources_and_its_build_configuration(dist: Dist) -> None:
    for sdist, source in (
        (dist.shim_sdist, REPO / "machines" / "shim"),
        (dist.remote_sdist, REPO / "remotes" / "client"),
    ):
        with tarfile.open(sdist) as archive:
            names = {Path(name).name for name in archive.getnames()}
        assert {path.name for path in source.glob("*.py")} | {"pyproject.toml", "PKG-INFO"} <= names, sdist.name


def test_the_clients_install_without_django_and_import_nothing_of_the_server(
    shim_venv: Venv, remote_venv: Venv, outside: Path
) -> None:
    for venv, package in ((shim_venv, "dispatch_shim"), (remote_venv, "dispatch_remote")):
        django = venv.run(venv.python, "-c", "import django", cwd=outside)
        assert django.returncode != 0 and "No module named 'django'" in django.stderr

        probe = (
            "import importlib, pkgutil, sys\n"
            f"import {package}\n"
            f"for module in pkgutil.iter_modules({package}.__path__):\n"
            "    if module.name != '__main__':\n"
            f"        importlib.import_module('{package}.' + module.name)\n"
            "loaded = {m.split('.')[0] for m in sys.modules}\n"
            "print(sorted(loaded & {'machines', 'remotes', 'core', 'dispatch', 'pydantic'}))"
        )
        imported = venv.run(venv.python, "-c", probe, cwd=outside)
        assert imported.returncode == 0, imported.stderr
        assert imported.stdout.strip() == ("[]" if package == "dispatch_shim" else "['pydantic']")


# --- dispatch-shim ------------------------------------------------------------------------


def test_the_installed_shim_logs_in_with_the_device_flow_and_answers_an_operation(
    live: Live, shim_venv: Venv, outside: Path, tmp_path: Path
) -> None:
    state_dir, root = tmp_path / "state", tmp_path / "root"
    root.mkdir()
    (root / "notes.txt").write_text("from the installed shim\n")
    session = f"pkg-{uuid.uuid4().hex[:8]}"

    version = shim_venv.run(shim_venv.bin("dispatch-shim"), "--version", cwd=outside)
    assert version.returncode == 0 and version.stdout.startswith(f"dispatch-shim {SHIM_VERSION} "), version

    login = spawn(
        [shim_venv.bin("dispatch-shim"), "login", "--server", live.server.url, "--state-dir", state_dir],
        cwd=outside,
        name="login",
        live=live,
    )
    code = wait_until(
        lambda: (found := re.search(r"enter the code ([A-Z]{4}-[A-Z]{4})", login.log())) and found.group(1),
        timeout=30,
        what="the login's user code",
        details=login.log,
    )
    approve_device(live.server, "admin", live.instance.admin_password, code)
    assert login.proc.wait(30) == 0, login.log()

    run = spawn(
        [shim_venv.bin("dispatch-shim"), "run", "--state-dir", state_dir, "--root", root,
         "--session", session, "--name", "pkg-shim"],
        cwd=outside,
        name="shim",
        live=live,
    )  # fmt: skip
    shim = ShimProcess(proc=run.proc, log_path=run.log_path, state_dir=state_dir, name="pkg-shim").wait_connected()
    api = MachineApi(live.server.url, live.instance.admin_token)
    try:
        answer = api.ok(session, "FILE_READ", {"path": "notes.txt"})
        command = api.run(session, ["pwd", "-P"])
    finally:
        api.client.close()
        assert run.stop() == 0, run.log()

    assert answer["machine_id"] == shim.machine_id
    assert answer["payload"]["content"] == "from the installed shim\n"
    assert command["payload"]["stdout"] == f"{root.resolve()}\n"


def test_pipx_installs_the_shim_wheel_as_a_command(dist: Dist, outside: Path, tmp_path: Path) -> None:
    pipx_home, bin_dir = tmp_path / "pipx-home", tmp_path / "pipx-bin"
    pipx_env = client_env(PIPX_HOME=str(pipx_home), PIPX_BIN_DIR=str(bin_dir), PIPX_MAN_DIR=str(tmp_path / "man"))
    installed = subprocess.run(
        [sys.executable, "-m", "pipx", "install", str(dist.shim_wheel)],
        cwd=outside,
        env=pipx_env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr

    command = bin_dir / "dispatch-shim"
    version = subprocess.run([command, "--version"], cwd=outside, env=client_env(), capture_output=True, text=True)
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith(f"dispatch-shim {SHIM_VERSION} ")

    # The unit names the command on PATH (pipx's link), which outlives upgrades of its venv.
    unit = subprocess.run(
        [command, "service", "install", "--dry-run", "--manager", "systemd",
         "--server", "http://dispatch.test", "--token", "t", "--state-dir", tmp_path / "state"],
        cwd=outside, env=client_env(), capture_output=True, text=True,
    )  # fmt: skip
    assert unit.returncode == 0, unit.stderr
    assert f"ExecStart={command} run " in unit.stdout


# --- dispatch-remote ----------------------------------------------------------------------


def test_the_installed_remote_client_serves_the_example_and_calls_it(
    live: Live, remote_venv: Venv, outside: Path
) -> None:
    token = live.instance.admin_token
    connection = ["--server", live.server.url, "--token", token]
    version = remote_venv.run(remote_venv.bin("dispatch-remote"), "--version", cwd=outside)
    assert version.stdout.strip() == f"dispatch-remote {SHIM_VERSION}", version

    serving = spawn(
        [remote_venv.bin("dispatch-remote"), "serve", REPO / "examples" / "weather_service.py:remote", *connection],
        cwd=outside,
        name="remote",
        live=live,
    )
    try:
        serving.wait_for_log(f"serving 'weather-service' (1 function) on {live.server.ws_url}\n")
        call = remote_venv.run(
            remote_venv.bin("dispatch-remote"), "call", "weather-service", "get_forecast", '{"city": "Rome"}',
            *connection, cwd=outside,
        )  # fmt: skip
        listed = remote_venv.run(remote_venv.bin("dispatch-remote"), "list", *connection, cwd=outside)
    finally:
        serving.stop()

    assert call.returncode == 0, call.stderr
    forecast = json.loads(call.stdout)
    assert forecast["city"] == "Rome" and forecast["forecast"] == "sunny"
    assert [entry["name"] for entry in json.loads(listed.stdout)] == ["get_forecast"]


def readme_remote_snippet() -> str:
    """The "write your own remote" code block of the README's "Serve and call a remote"."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Serve and call a remote", 1)[1].split("\n## ", 1)[0]
    blocks = [block for block in re.findall(r"```python\n(.*?)```", section, re.DOTALL) if "remote.run()" in block]
    assert len(blocks) == 1, "the README's remote snippet (```python … remote.run()```) is not found once"
    return blocks[0]


@pytest.mark.parametrize("way", ["script", "serve"])
def test_the_readme_remote_snippet_runs_as_a_script_and_by_serve_outside_the_clone(
    live: Live, remote_venv: Venv, tmp_path: Path, way: str
) -> None:
    """``DISPATCH_URL=<base URL> python weather.py`` (the URL Dispatch gives its agents),
    and ``dispatch-remote serve weather.py:remote --server URL --token T``."""
    token = live.instance.admin_token
    script = tmp_path / "weather.py"
    script.write_text(readme_remote_snippet())

    if way == "script":
        argv: list[str | Path] = [remote_venv.python, script]
        env = {"DISPATCH_URL": live.server.url, "DISPATCH_TOKEN": token}
    else:
        argv = [remote_venv.bin("dispatch-remote"), "serve", "weather.py:remote", "--server", live.server.url]
        argv += ["--token", token]
        env = {}
    serving = spawn(argv, cwd=tmp_path, name="snippet", live=live, **env)
    try:
        serving.wait_for_log(f"serving 'weather-service' (1 function) on {live.server.ws_url}\n")
        answer = httpx.post(
            f"{live.server.url}/api/v1/remotes/weather-service/call",
            headers={"Authorization": f"Bearer {token}"},
            json={"function": "get_forecast", "args": {"city": "Rome"}},
            timeout=30,
        )
    finally:
        serving.stop()

    assert answer.status_code == 200, answer.text
    assert answer.json()["result"] == {"city": "Rome", "forecast": "sunny"}
