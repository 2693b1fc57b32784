"""Every setting is read in ``dispatch/settings.py`` and listed in ``.env.example`` and the
README (docs/architecture.md#where-a-new-feature-goes, docs/operating.md#settings).

The server code reads no environment variable of its own: ``settings.py`` reads them all
through ``core.conf`` (strict parsing, ``ImproperlyConfigured`` naming the variable). The
Django-free clients (``machines/shim``, ``remotes/client``) run on other computers and have
their own options, and the agents' launcher hands a whole environment to a child process;
they are listed below as what they are, not settings.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVER_PACKAGES = ["core", "agents", "remotes", "machines", "peers", "dispatch"]
CLIENTS = [ROOT / "machines" / "shim", ROOT / "remotes" / "client"]
# (file, why) — environment reads that are not settings.
NOT_SETTINGS = {
    "agents/tmux.py": "passes the server's environment on to a tmux pane (agent_environment)",
    "agents/agent_exec.py": "the pane's first process: execs the agent with its environment",
    "agents/hook_client.py": "a CLI's hook command: reads the agent's DISPATCH_* variables the CLI passes on",
    "dispatch/asgi.py": "DJANGO_SETTINGS_MODULE, before settings exist",
    "manage.py": "DJANGO_SETTINGS_MODULE, before settings exist",
}


def settings_read(*, secret_files: bool = False) -> set[str]:
    """The variables ``dispatch/settings.py`` reads through ``core.conf``; with
    ``secret_files``, the ``NAME_FILE`` twins ``env_secret`` also reads."""
    tree = ast.parse((ROOT / "dispatch" / "settings.py").read_text())
    names: set[str] = set()
    files: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id.startswith("env_"):
            first = node.args[0]
            assert isinstance(first, ast.Constant) and isinstance(first.value, str), ast.dump(node)
            names.add(first.value)
            if node.func.id == "env_secret":
                files.add(first.value + "_FILE")
    return files if secret_files else names


def env_example_names() -> set[str]:
    text = (ROOT / ".env.example").read_text()
    return set(re.findall(r"(?m)^#? ?([A-Z][A-Z0-9_]+)=", text))


def readme_names() -> set[str]:
    """The variables named in the first cell of the README's settings tables (a row may
    name several: ``| `A` / `B` | …``)."""
    names: set[str] = set()
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("| `"):
            names |= set(re.findall(r"`([A-Z][A-Z0-9_]+)`", line.split("|")[1]))
    return names


def test_settings_py_reads_every_variable_listed_in_env_example_and_nothing_else():
    read, listed = settings_read() | settings_read(secret_files=True), env_example_names()
    missing = settings_read() - listed
    assert missing == set(), f"read by settings.py, missing from .env.example: {sorted(missing)}"
    assert listed - read == set(), f"in .env.example, never read by settings.py: {sorted(listed - read)}"
    text = (ROOT / ".env.example").read_text()
    unmentioned = {name for name in settings_read(secret_files=True) if name not in text}
    assert unmentioned == set(), f"secret-file variables .env.example does not mention: {sorted(unmentioned)}"


def test_the_readme_lists_every_setting():
    missing = settings_read() - readme_names()
    assert missing == set(), f"settings missing from the README's tables: {sorted(missing)}"


def _environment_reads(path: Path) -> list[int]:
    tree = ast.parse(path.read_text())
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            if any(alias.name in ("environ", "getenv") for alias in node.names):
                lines.append(node.lineno)
    return sorted(lines)


def test_no_server_module_reads_the_environment_outside_settings():
    found = []
    for package in SERVER_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if any(path.is_relative_to(client) for client in CLIENTS) or "/migrations/" in relative:
                continue
            if relative in ("dispatch/settings.py", "core/conf.py") or relative in NOT_SETTINGS:
                continue
            found += [f"{relative}:{line}" for line in _environment_reads(path)]
    assert found == [], f"environment read outside dispatch/settings.py (use a setting): {found}"


def test_the_checker_finds_an_environment_read(tmp_path):
    # The scan above is only worth something if it sees the forms code uses.
    sample = tmp_path / "sample.py"
    sample.write_text('import os\nfrom os import getenv\nx = os.environ.get("A")\ny = os.getenv("B")\n')
    assert _environment_reads(sample) == [2, 3, 4]
