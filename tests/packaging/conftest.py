"""The installable clients as a user gets them: ``make dist`` builds the wheels once per
session, and each is installed into a fresh venv of its own, without Django, outside the
clone. pip may fetch the clients' dependencies (websockets, httpx, pydantic,
docstring-parser) and the build backend (hatchling) from the package index."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.backends import unavailable
from tests.infra import REPO

SHIM_VERSION = re.search(
    r'^SHIM_VERSION = "([^"]+)"', (REPO / "machines" / "shim" / "protocol.py").read_text(), re.MULTILINE
)[1]  # type: ignore[index]
"""The one version of both distributions (read as the build reads it)."""


@dataclass(frozen=True)
class Dist:
    """The artifacts ``make dist`` built (all four files exist)."""

    folder: Path
    shim_wheel: Path
    remote_wheel: Path
    shim_sdist: Path
    remote_sdist: Path


@dataclass(frozen=True)
class Venv:
    """A fresh venv with one client installed; ``bin(name)`` is one of its commands."""

    path: Path

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def bin(self, name: str) -> Path:
        return self.path / "bin" / name

    def run(self, *argv: str | Path, cwd: Path, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
        """Run a command of this venv to completion (text output captured)."""
        return subprocess.run(
            [str(arg) for arg in argv],
            cwd=cwd,
            env=client_env(**env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


def client_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would leak the clone or the test server's
    configuration into a client (``PYTHONPATH``, ``DJANGO_*``, ``DISPATCH_*``, the venv)."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTHON", "DJANGO_", "DISPATCH_", "VIRTUAL_ENV", "PIPX_"))
    }
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


@pytest.fixture(scope="session")
def outside() -> Iterator[Path]:
    """A scratch folder outside the clone: clients run from here."""
    folder = Path(tempfile.mkdtemp(prefix="dispatch-packaging-"))
    assert REPO not in folder.parents
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def dist(outside: Path) -> Dist:
    """``make dist`` into a scratch folder (the repository's own ``dist/`` is left alone)."""
    if shutil.which("make") is None:
        unavailable("no `make` to run `make dist` with")
    folder = outside / "dist"
    done = subprocess.run(
        ["make", "--no-print-directory", "dist", f"DIST={folder}", f"VENV={sys.prefix}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, f"make dist failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    built = Dist(
        folder=folder,
        shim_wheel=folder / f"dispatch_shim-{SHIM_VERSION}-py3-none-any.whl",
        remote_wheel=folder / f"dispatch_remote-{SHIM_VERSION}-py3-none-any.whl",
        shim_sdist=folder / f"dispatch_shim-{SHIM_VERSION}.tar.gz",
        remote_sdist=folder / f"dispatch_remote-{SHIM_VERSION}.tar.gz",
    )
    for artifact in (built.shim_wheel, built.remote_wheel, built.shim_sdist, built.remote_sdist):
        assert artifact.is_file(), f"{artifact.name} not built; dist/ has {sorted(os.listdir(folder))}"
    return built


def fresh_venv(path: Path, wheel: Path) -> Venv:
    """A new venv at ``path`` (no system site-packages) with ``wheel`` and its dependencies."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    venv = Venv(path)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv.python), "install", "-q", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, f"pip install {wheel.name} failed:\n{done.stderr[-3000:]}"
    return venv


@pytest.fixture(scope="session")
def shim_venv(dist: Dist, outside: Path) -> Venv:
    """A fresh venv with only the shim wheel installed."""
    return fresh_venv(outside / "shim-venv", dist.shim_wheel)


@pytest.fixture(scope="session")
def remote_venv(dist: Dist, outside: Path) -> Venv:
    """A fresh venv with only the remote client wheel installed."""
    return fresh_venv(outside / "remote-venv", dist.remote_wheel)
