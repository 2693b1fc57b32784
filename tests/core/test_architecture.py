"""The dependency order of docs/architecture.md#the-layers holds: the import-linter
contracts in ``pyproject.toml`` are kept, and they are sharp enough to catch a wrong import.

``make lint`` runs the same check; this test makes ``make test`` (CI) hold it too.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["core", "remotes", "machines", "agents", "peers", "attention", "oauth", "dispatch"]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    if not LINT_IMPORTS.exists():
        pytest.fail(f"import-linter is not installed beside {sys.executable}: make dev")
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_every_contract_is_kept():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "BROKEN" not in result.stdout
    assert " kept, 0 broken." in result.stdout


def _copy_tree(tmp_path: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("core/errors.py", "import agents.models", "core is the kernel: it imports no Dispatch app"),
        ("agents/services.py", "import peers.models", "agents' domain code imports neither peers nor the project"),
        ("machines/shim/protocol.py", "import django", "the shim and the remote client import nothing from Django"),
        ("remotes/models.py", "def _late():\n    import remotes.services", "no import circle"),
        ("agents/views.py", "import attention.services", "attention (notifications) sits above agents and peers"),
    ],
)
def test_a_wrong_import_breaks_its_contract(tmp_path, module, line, contract):
    tree = _copy_tree(tmp_path)
    with open(tree / module, "a") as handle:
        handle.write(f"\n\n{line}\n")
    result = lint_imports(tree)
    assert result.returncode != 0, result.stdout[-3000:]
    broken = [row for row in result.stdout.splitlines() if row.endswith(" BROKEN")]
    assert any(row.startswith(contract) for row in broken), result.stdout[-3000:]
