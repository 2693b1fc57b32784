"""The generated secret key (docs/operating.md#settings): made once, mode 0600, the same for
every process that starts at once, never read half-written."""

from __future__ import annotations

import stat
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from core.conf import secret_key


def test_a_key_is_made_once_private_and_reused(tmp_path: Path) -> None:
    key, generated = secret_key(None, tmp_path)
    assert generated and len(key) > 40
    assert stat.S_IMODE((tmp_path / "secret_key").stat().st_mode) == 0o600
    assert secret_key(None, tmp_path) == (key, True)
    assert [path.name for path in tmp_path.iterdir()] == ["secret_key"]  # no partial file left
    assert secret_key("given", tmp_path) == ("given", False)


def _start(directory: str) -> str:
    return secret_key(None, Path(directory))[0]


def test_processes_starting_together_all_get_one_key(tmp_path: Path) -> None:
    with ProcessPoolExecutor(max_workers=6) as pool:
        for round_ in range(5):
            directory = tmp_path / str(round_)
            directory.mkdir()
            keys = set(pool.map(_start, [str(directory)] * 12))
            assert len(keys) == 1 and "" not in keys
            assert [path.name for path in directory.iterdir()] == ["secret_key"]
