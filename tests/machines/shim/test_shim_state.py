"""The state file (mode 0600, machine_id kept) and config.toml (docs/shim-protocol.md#the-shim-program)."""

from __future__ import annotations

import json
import stat
import uuid
from pathlib import Path

import pytest

from machines.shim import Limits, StateStore, load_config
from machines.shim.state import STATE_DIR_ENV, ConfigError, ShimState, StateError, default_state_dir


def test_it_creates_a_machine_id_once_and_keeps_it(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    first = store.ensure_machine_id().machine_id
    assert first is not None and uuid.UUID(first).version == 4
    assert StateStore(tmp_path / "state").ensure_machine_id().machine_id == first
    assert StateStore(tmp_path / "other").ensure_machine_id().machine_id != first


def test_it_writes_the_state_file_private(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    store.save(ShimState(machine_id="m", server="http://h", token="secret-token"))
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.state_dir.stat().st_mode) == 0o700
    assert json.loads(store.path.read_text()) == {"machine_id": "m", "server": "http://h", "token": "secret-token"}
    assert [path.name for path in store.state_dir.iterdir()] == ["state.json"]  # no temporary left over


def test_it_tightens_a_state_file_readable_by_others(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.path.write_text(json.dumps({"machine_id": "m", "token": "t"}))
    store.path.chmod(0o644)
    assert store.load().token == "t"
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600


def test_it_refuses_a_malformed_state_file(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.path.write_text("{not json")
    with pytest.raises(StateError):
        store.load()
    store.path.write_text(json.dumps({"token": 5}))
    with pytest.raises(StateError, match="token"):
        store.load()


def test_it_finds_the_state_dir_in_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "from-env"))
    assert default_state_dir() == tmp_path / "from-env"
    assert StateStore().path == tmp_path / "from-env" / "state.json"
    monkeypatch.delenv(STATE_DIR_ENV)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_state_dir() == tmp_path / ".config" / "dispatch-shim"


def test_it_reads_the_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "config.toml"
    path.write_text(
        'allowed_roots = ["~/src", "/srv"]\ncapabilities = ["files"]\n'
        "[limits]\nmax_file_size_bytes = 2048\nmax_concurrent = 2\n"
    )
    config = load_config(path)
    assert config.allowed_roots == (str(tmp_path / "src"), "/srv")
    assert config.capabilities == ("files",)
    assert config.limits == Limits(max_file_size_bytes=2048, max_concurrent=2)


def test_it_uses_defaults_without_a_config_file(tmp_path: Path) -> None:
    config = load_config(tmp_path / "missing.toml")
    assert config.allowed_roots is None and config.capabilities is None and config.limits == Limits()


@pytest.mark.parametrize(
    "text",
    [
        "allowed_root = ['/tmp']",
        "capabilities = ['gpu']",
        "allowed_roots = '/tmp'",
        "[limits]\nmax_concurrent = 0",
        "[limits]\nmax_file_size_bytes = 104857600",
        "[limits]\ntimeout = 3",
        "not toml at all [",
    ],
)
def test_it_refuses_a_malformed_config_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(ConfigError):
        load_config(path)
